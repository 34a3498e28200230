"""Id -> slot maps of a device cache: a dense array, a hash table, or sorted ids searched in O(log n).

The dense map costs 4 bytes per row of the *whole* table, which at small budgets can cost
more than the cached rows themselves (1.6% of a 64-wide float table); a sparse map costs
bytes per *resident* row: 16 hashed (tables of int32 ids), 15 sorted (tables of 2**31 rows or more).
`slot_map_kind` picks the cheaper of dense and sparse in bytes; the planner counts the bytes
of the sparse map the cache's device uses (`sparse_map_bytes_per_resident`), never less than
what the chosen map holds, so the budget is honest. That is where the directory is the
device's memory (on the CPU). Where the rows are on an accelerator, the directory is host
memory outside the device budget, and the map is dense: 4 bytes a table row is at most
1/(dim + 1) of the host store's bytes for the same rows, and a lookup is one indexed read
per id where the hash table's is a probe sequence, so it is the faster, however many rows
are resident (`benchmarks/slot_map.py`; benchmarks/README.md).

The hash table (`HashedSlotMap`) keeps every resident id, a lookup one probe sequence per id
and a fetch one insert. Ids past int32 do not fit its packed cells: those tables keep sorted
ids. The sorted map keeps the static ids (fixed for the whole run, the slot being the
position) apart from the dynamic ones (id and int32 slot). Dynamic ids
are two sorted runs, as in a log-structured merge tree: every fetch merges its new ids into
a small recent run, and only when the runs (with the evicted ids they still hold) outgrow
their room, or the recent run the size that keeps the two kinds of merge cheapest, are both
merged into one. Merging the whole cache on every fetch would cost O(cache slots) per step,
which would dominate a split-budget step.

Int32 ids take the hash table rather than sorted runs: a step's map work is one probe
sequence per id instead of binary searches and merges, and so is smaller at every budget
(benchmarks/README.md; see `HashedSlotMap` for why the table is written here).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import Tensor

from lightning_hotcache.cache import directory
from lightning_hotcache.cache.host_arrays import new_array
from lightning_hotcache._ops.compiled import prefetch, without_gil
from lightning_hotcache._ops.host_rows import on_cpu

SlotMapKind = Literal["dense", "hashed", "sorted"]
DENSE_BYTES_PER_ROW = 4  # int32 slot per table row
SORTED_BYTES_PER_ENTRY = 12  # a dynamic int64 id + int32 slot (a static id, its slot its position, takes 8)
# The dynamic runs may hold this many entries per dynamic slot (evicted ids wait for the next
# merge as tombstones): more room, fewer whole-cache merges, more bytes.
RUN_ROOM = 1.25
INT32_IDS_BELOW = 2**31
# The hash table's cells (int64: id and slot) per slot: at most half of them are in use, and
# a probe meets an empty cell within ~2.5 cells on average (linear probing at load 0.5).
HASH_ROOM = 2.0
HASH_CELL_BYTES = 8
HASH_BYTES_PER_SLOT = int(HASH_CELL_BYTES * HASH_ROOM)


def sparse_map_bytes_per_resident(num_embeddings: int) -> int:
    """Bytes per resident row of the sparse map a cache of ``num_embeddings`` rows uses (hashed
    for int32 ids, else sorted): what the planner counts."""
    if num_embeddings < INT32_IDS_BELOW:
        return HASH_BYTES_PER_SLOT
    return int(SORTED_BYTES_PER_ENTRY * RUN_ROOM)


def slot_map_kind(num_embeddings: int, num_resident: int) -> SlotMapKind:
    if num_embeddings * DENSE_BYTES_PER_ROW <= num_resident * sparse_map_bytes_per_resident(num_embeddings):
        return "dense"
    return "hashed" if num_embeddings < INT32_IDS_BELOW else "sorted"


class DenseSlotMap:
    """``slot_of_id[id]``: one compiled pass per lookup (see `directory`). A `DeviceCache`
    keeps it inside the directory's steps instead (`directory.look_up_and_split_hits`,
    ``install`` and ``vacate`` given ``slot_of_id``); the methods serve everyone else."""

    def __init__(self, num_embeddings: int, static_ids: Tensor, num_slots: int, device: torch.device) -> None:
        # Written at random every batch: on the CPU kept from forked workers (`host_arrays`).
        self.slot_of_id = new_array((num_embeddings,), device, torch.int32, fill=-1)
        self.slot_of_id[static_ids] = torch.arange(len(static_ids), dtype=torch.int32, device=device)

    def tensors(self) -> list[Tensor]:
        return [self.slot_of_id]

    def lookup(self, ids: Tensor) -> Tensor:
        return directory.slots_of(self.slot_of_id, ids)

    def assign(self, ids: Tensor, slots: Tensor, ascending: bool = False) -> None:  # any order will do
        directory.scatter(self.slot_of_id, ids, slots)

    def remove(self, ids: Tensor) -> None:
        directory.scatter(self.slot_of_id, ids, -1)


class SortedSlotMap:
    """Static ids sorted (slot = position) plus dynamic ids in two sorted runs with their slots:
    the map of tables whose ids do not fit the hash table's 32 bits (`make_slot_map`)."""

    def __init__(self, num_embeddings: int, static_ids: Tensor, num_slots: int, device: torch.device) -> None:
        self.static_ids = static_ids.to(device)  # sorted by the cache
        self.max_entries = int((num_slots - len(static_ids)) * RUN_ROOM)
        # [whole run, recent run], each (sorted ids, their slots; -1 where evicted).
        self.runs = [self._empty_run(device), self._empty_run(device)]

    def _empty_run(self, device: torch.device) -> tuple[Tensor, Tensor]:
        return torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.int32, device=device)

    def tensors(self) -> list[Tensor]:
        return [self.static_ids, *(t for run in self.runs for t in run)]

    @staticmethod
    def _find(sorted_ids: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        pos = torch.searchsorted(sorted_ids, ids).clamp_(max=len(sorted_ids) - 1)
        return pos, sorted_ids[pos] == ids

    def lookup(self, ids: Tensor) -> Tensor:
        slots = torch.full_like(ids, -1)
        if len(self.static_ids):
            pos, found = self._find(self.static_ids, ids)
            slots = torch.where(found, pos, slots)
        for run_ids, run_slots in self.runs:
            if len(run_ids):
                pos, found = self._find(run_ids, ids)
                slot = run_slots[pos].long()
                slots = torch.where(found & (slot >= 0), slot, slots)  # an evicted entry hides nothing
        return slots

    def assign(self, ids: Tensor, slots: Tensor, ascending: bool = False) -> None:
        """Add ``ids`` (none present; ``ascending`` when sorted already) at ``slots``: merged
        into the recent run (dropping its evicted entries), or, when the runs would outgrow
        their room or the recent run its `_recent_room`, both runs into one."""
        ids = ids.long()
        if not ascending:
            ids, order = ids.sort()
            slots = slots[order]
        merged = _merge(*_live(*self.runs[1]), ids, slots.int())
        whole = self.runs[0]
        if len(whole[0]) + len(merged[0]) > self.max_entries or len(merged[0]) > self._recent_room(len(ids)):
            self.runs = [_merge(*_live(*whole), *merged), self._empty_run(ids.device)]
        else:
            self.runs[1] = merged

    def _recent_room(self, inserted: int) -> int:
        """Size at which the recent run is merged into the whole one. Adding ``inserted`` ids a
        step to a recent run of room R costs R/2 a step on average, and merging the whole run W
        every R/inserted steps W x inserted/R a step: the sum is least at R = sqrt(2 W inserted),
        which costs less a step than a fixed room such as a quarter of W."""
        return min(self.max_entries // 4, int((2 * self.max_entries * inserted) ** 0.5))

    def remove(self, ids: Tensor) -> None:
        """Drop ``ids`` (all present as dynamic ids, any order). They stay in their run with
        slot -1, which `lookup` reports as absent, until that run is next merged."""
        for run_ids, run_slots in self.runs:
            if len(run_ids):
                pos, found = self._find(run_ids, ids.long())
                run_slots[pos[found]] = -1


class HashedSlotMap:
    """Every resident id (static and dynamic) in an open-addressing hash table: cells of
    (id << 32 | slot) in int64, -1 where empty, an id's probe starting at its Fibonacci hash
    and moving on cell by cell (linear probing). A removal shifts the entries behind it back
    (backward-shift deletion), so the table never holds an evicted id and never needs a
    rebuild, and every lookup is one probe sequence.

    Written by hand: FBGEMM's CPU hash table (`pruned_hashmap_insert` / `_lookup`, made for
    pruned inference tables) has no removal, so with it every lookup would have to check the
    cache's slot -> id array for stale entries, and the table be rebuilt from the resident ids
    every few dozen steps. These compiled loops need neither, and their lookup is faster than
    FBGEMM's alone (benchmarks/README.md)."""

    def __init__(self, num_embeddings: int, static_ids: Tensor, num_slots: int, device: torch.device) -> None:
        if num_embeddings >= INT32_IDS_BELOW:
            raise ValueError(f"The hash table packs an id in 32 bits; {num_embeddings} rows need a sorted map.")
        # Never full (a probe ends at an empty cell): more cells than slots.
        self.cells = new_array((max(num_slots + 1, int(num_slots * HASH_ROOM)),), device, torch.int64, fill=-1)
        self.num_slots = num_slots
        self.resident = 0
        self.assign(static_ids, torch.arange(len(static_ids)))

    def tensors(self) -> list[Tensor]:
        return [self.cells]

    def lookup(self, ids: Tensor) -> Tensor:
        return torch.from_numpy(_hashed_lookup(self.cells.numpy(), on_cpu(ids, torch.int64).numpy()))

    def assign(self, ids: Tensor, slots: Tensor, ascending: bool = False) -> None:  # any order will do
        """Add ``ids`` (none resident) at ``slots``."""
        if self.resident + len(ids) > self.num_slots:
            raise RuntimeError(f"The hash table holds {self.resident} of {self.num_slots} ids; {len(ids)} more do not fit.")
        self.resident += len(ids) - _hashed_insert(self.cells.numpy(), on_cpu(ids, torch.int64).numpy(), on_cpu(slots, torch.int64).numpy())

    def remove(self, ids: Tensor) -> None:
        """Drop ``ids`` (any order; an id not held is passed over)."""
        self.resident -= _hashed_remove(self.cells.numpy(), on_cpu(ids, torch.int64).numpy())


_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: spreads ids that differ in any bit
# Ids ahead whose home cell is prefetched: each id's probe is a cache miss of its own (the
# table is tens of MB, cold after the dense step), and misses in flight side by side cost
# about one. 16 ahead is where lookups stop gaining (fewer leave misses serial, more gain
# nothing), and removals gain too; inserts about break even (benchmarks/README.md).
# Written into each loop: behind a helper function the prefetch does not pay, and lookups get
# slower, not faster.
_AHEAD = 16


@without_gil
def _home(key, num_cells):  # type: ignore[no-untyped-def]
    """The cell an id's probe starts at: the high 32 bits of its Fibonacci hash, scaled to the
    table (a multiply, not a modulo)."""
    mixed = (np.uint64(key) * _FIBONACCI) >> np.uint64(32)
    return np.int64((mixed * np.uint64(num_cells)) >> np.uint64(32))


@without_gil
def _next_cell(cell, num_cells):  # type: ignore[no-untyped-def]
    return cell + 1 if cell + 1 < num_cells else 0


@without_gil
def _probe(cells, key):  # type: ignore[no-untyped-def]
    """The cell holding ``key``, or the empty cell that ends its probe (where it would go)."""
    cell = _home(key, len(cells))
    while True:
        entry = cells[cell]
        if entry == -1 or entry >> 32 == key:
            return cell
        cell = _next_cell(cell, len(cells))


@without_gil
def _hashed_lookup(cells, ids):  # type: ignore[no-untyped-def]
    out = np.empty(len(ids), np.int64)
    for i in range(len(ids)):
        if i + _AHEAD < len(ids):
            prefetch(cells, _home(ids[i + _AHEAD], len(cells)))
        entry = cells[_probe(cells, ids[i])]
        out[i] = -1 if entry == -1 else entry & 0xFFFFFFFF
    return out


@without_gil
def _hashed_insert(cells, ids, slots):  # type: ignore[no-untyped-def]
    """Put each id at its slot; the number of ids that were held already (their slot replaced)."""
    replaced = 0
    for i in range(len(ids)):
        if i + _AHEAD < len(ids):
            prefetch(cells, _home(ids[i + _AHEAD], len(cells)))
        cell = _probe(cells, ids[i])
        replaced += cells[cell] != -1
        cells[cell] = (ids[i] << 32) | slots[i]
    return replaced


@without_gil
def _hashed_remove(cells, ids):  # type: ignore[no-untyped-def]
    """Empty each id's cell, moving back the entries after it whose probe passed through it;
    the number of ids removed."""
    n = len(cells)
    removed = 0
    for i in range(len(ids)):
        if i + _AHEAD < len(ids):
            prefetch(cells, _home(ids[i + _AHEAD], n))
        hole = _probe(cells, ids[i])
        if cells[hole] == -1:
            continue
        removed += 1
        cell = _next_cell(hole, n)
        while cells[cell] != -1:
            # The entry may fill the hole if its probe, from its home to where it is, passes it
            # (distances along the probe, around the table's end: a division each as `%`).
            from_home, from_hole = cell - _home(cells[cell] >> 32, n), cell - hole
            if (from_home + n if from_home < 0 else from_home) >= (from_hole + n if from_hole < 0 else from_hole):
                cells[hole] = cells[cell]
                hole = cell
            cell = _next_cell(cell, n)
        cells[hole] = -1
    return removed


def _live(ids: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    live = slots >= 0
    return ids[live], slots[live]


def _merge(ids_a: Tensor, slots_a: Tensor, ids_b: Tensor, slots_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two sorted runs (no id in both) as one, placed by each id's rank in the other run:
    O(n log m) with no sort of the union."""
    at_a = torch.searchsorted(ids_b, ids_a) + torch.arange(len(ids_a), device=ids_a.device)
    at_b = torch.searchsorted(ids_a, ids_b) + torch.arange(len(ids_b), device=ids_b.device)
    merged_ids = torch.empty(len(ids_a) + len(ids_b), dtype=ids_a.dtype, device=ids_a.device)
    merged_slots = torch.empty(len(ids_a) + len(ids_b), dtype=torch.int32, device=ids_a.device)
    merged_ids[at_a], merged_ids[at_b] = ids_a, ids_b
    merged_slots[at_a], merged_slots[at_b] = slots_a, slots_b
    return merged_ids, merged_slots


def make_slot_map(
    num_embeddings: int, static_ids: Tensor, num_slots: int, device: torch.device, budgeted: bool = True
) -> DenseSlotMap | HashedSlotMap | SortedSlotMap:
    """The map for a cache, on ``device``; ``budgeted``: the map's bytes are the device budget's (else dense)."""
    kind = slot_map_kind(num_embeddings, num_slots) if budgeted else "dense"
    if kind == "hashed":
        return HashedSlotMap(num_embeddings, static_ids, num_slots, device)
    return (DenseSlotMap if kind == "dense" else SortedSlotMap)(num_embeddings, static_ids, num_slots, device)
