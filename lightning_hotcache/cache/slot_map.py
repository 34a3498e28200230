"""Id -> slot maps of a device cache: a dense array, a hash table, or sorted ids searched in O(log n).

The dense map costs 4 bytes per row of the *whole* table, which at small budgets can cost
more than the cached rows themselves (1.6% of a 64-wide float table); a sparse map costs
bytes per *resident* row: 16 hashed (below), 10 sorted (15 for tables of 2**31 rows or more).
`slot_map_kind` picks the cheaper of dense and sparse in bytes; the planner counts the bytes
of the sparse map the cache's device uses (`sparse_map_bytes_per_resident`), never less than
what the chosen map holds, so the budget is honest. That is where the directory is the
device's memory (on the CPU). Where the rows are on an accelerator, the directory is host
memory outside the device budget, and the map is dense: 4 bytes a table row is at most
1/(dim + 1) of the host store's bytes for the same rows, and a lookup is 5-19x faster than
the hash table's (32k distinct ids of a GPU batch in a 34M-row stack: 0.26 / 0.18 ms against
1.35 / 3.4 ms with 0.3M / 3M resident; AMD EPYC).

The sorted map keeps the static ids (fixed for the whole run, int64, the slot being the
position) apart from the dynamic ones (int32 id and int32 slot where ids fit). Dynamic ids
are two sorted runs, as in a log-structured merge tree: every fetch merges its new ids into
a small recent run, and only when the runs (with the evicted ids they still hold) outgrow
their room, or the recent run the size that keeps the two kinds of merge cheapest, are both
merged into one. Merging the whole cache on every fetch would cost
O(cache slots) per step, the largest cost of a split-budget step before.

On CPU, where FBGEMM is importable, the resident ids go to FBGEMM's CPU hash table instead
(`HashedSlotMap`, 16 bytes per slot): a lookup is one probe sequence per id in C++ rather
than a binary search per run, and a fetch one insert, with no merges (map work 1.66 -> 0.95
ms a step at cache_micro's budget 0.1, 2.21 -> 0.92 ms at cpu_throughput's; in-process A/Bs).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightning_hotcache.cache import directory
from lightning_hotcache.cache.host_arrays import new_array

SlotMapKind = Literal["dense", "hashed", "sorted"]
DENSE_BYTES_PER_ROW = 4  # int32 slot per table row
SORTED_BYTES_PER_ENTRY = 8  # a static int64 id (its slot is its position), or a dynamic int32 id + int32 slot
# The dynamic runs may hold this many entries per dynamic slot (evicted ids wait for the next
# merge as tombstones): more room, fewer whole-cache merges, more bytes.
RUN_ROOM = 1.25
INT32_IDS_BELOW = 2**31
# The hash table's cells (int32 id, int32 slot) per slot, and the share of them in use (stale
# entries of evicted ids included) at which it is rebuilt from the resident ids. A full cache
# refills 0.8 x 2.0 - 1 = 60% of its slots between rebuilds (1.5 cells: 20%, a rebuild every
# ~3 steps at cache_micro's budget 0.01, map work 1.53 -> 1.22 ms a step with 2.0).
HASH_ROOM = 2.0
HASH_MAX_LOAD = 0.8
HASH_BYTES_PER_SLOT = int(SORTED_BYTES_PER_ENTRY * HASH_ROOM)


def sparse_map_bytes_per_resident(num_embeddings: int, device: torch.device | str | None = None) -> int:
    """Bytes per resident row of the sparse map a cache of ``num_embeddings`` rows on ``device``
    uses (hashed where `hash_table_usable`, else sorted): what the planner counts."""
    if hash_table_usable(num_embeddings, device):
        return HASH_BYTES_PER_SLOT
    if num_embeddings < INT32_IDS_BELOW:
        return int(SORTED_BYTES_PER_ENTRY * RUN_ROOM)
    # Tables too large for int32 ids keep sorted dynamic ids in int64 (with an int32 slot).
    return int((SORTED_BYTES_PER_ENTRY + 4) * RUN_ROOM)


def slot_map_kind(num_embeddings: int, num_resident: int, device: torch.device | str | None = None) -> SlotMapKind:
    if num_embeddings * DENSE_BYTES_PER_ROW <= num_resident * sparse_map_bytes_per_resident(num_embeddings, device):
        return "dense"
    return "hashed" if hash_table_usable(num_embeddings, device) else "sorted"


def hash_table_usable(num_embeddings: int, device: torch.device | str | None) -> bool:
    """Whether a cache of ``num_embeddings`` rows on ``device`` keeps its ids in `HashedSlotMap`:
    on CPU (FBGEMM's hash ops are CPU ops), for int32 ids, where FBGEMM is importable."""
    on_cpu = device is not None and torch.device(device).type == "cpu"
    return on_cpu and num_embeddings < INT32_IDS_BELOW and fbgemm_hash_table_available()


def fbgemm_hash_table_available() -> bool:
    """Whether FBGEMM's CPU hash-table ops (`HashedSlotMap`) can be called."""
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    except ImportError:
        return False
    return hasattr(torch.ops.fbgemm, "pruned_hashmap_insert") and hasattr(torch.ops.fbgemm, "pruned_hashmap_lookup")


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
    """Static ids sorted (slot = position) plus dynamic ids in two sorted runs with their slots."""

    def __init__(self, num_embeddings: int, static_ids: Tensor, num_slots: int, device: torch.device) -> None:
        self.static_ids = static_ids.to(device)  # sorted by the cache
        self.id_dtype = torch.int32 if num_embeddings < INT32_IDS_BELOW else torch.int64
        self.max_entries = int((num_slots - len(static_ids)) * RUN_ROOM)
        # [whole run, recent run], each (sorted ids, their slots; -1 where evicted).
        self.runs = [self._empty_run(device), self._empty_run(device)]

    def _empty_run(self, device: torch.device) -> tuple[Tensor, Tensor]:
        return torch.empty(0, dtype=self.id_dtype, device=device), torch.empty(0, dtype=torch.int32, device=device)

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
        narrow = ids.to(self.id_dtype)
        for run_ids, run_slots in self.runs:
            if len(run_ids):
                pos, found = self._find(run_ids, narrow)
                slot = run_slots[pos].long()
                slots = torch.where(found & (slot >= 0), slot, slots)  # an evicted entry hides nothing
        return slots

    def assign(self, ids: Tensor, slots: Tensor, ascending: bool = False) -> None:
        """Add ``ids`` (none present; ``ascending`` when sorted already) at ``slots``: merged
        into the recent run (dropping its evicted entries), or, when the runs would outgrow
        their room or the recent run its `_recent_room`, both runs into one."""
        ids = ids.to(self.id_dtype)
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
        every R/inserted steps W x inserted/R a step: the sum is least at R = sqrt(2 W inserted)
        (with a million dynamic slots and 5,000 new ids a step, 3.3 ms a step against 5.3 ms
        with a room of a quarter of W, on this 2-core CPU)."""
        return min(self.max_entries // 4, int((2 * self.max_entries * inserted) ** 0.5))

    def remove(self, ids: Tensor) -> None:
        """Drop ``ids`` (all present as dynamic ids, any order). They stay in their run with
        slot -1, which `lookup` reports as absent, until that run is next merged."""
        narrow = ids.to(self.id_dtype)
        for run_ids, run_slots in self.runs:
            if len(run_ids):
                pos, found = self._find(run_ids, narrow)
                run_slots[pos[found]] = -1


class HashedSlotMap:
    """Every resident id (static and dynamic) in FBGEMM's CPU hash table
    (`fbgemm::pruned_hashmap_insert` / `_lookup`, made for pruned inference tables: linear
    probing over (int32 id, int32 slot) cells, one probe sequence per id in C++).

    FBGEMM's table has no removal, but inserting a present id overwrites its slot, so an
    evicted id's entry is left in place: it holds while ``id_of_slot`` (the cache's slot ->
    id array, which the map only reads) still names that id at that slot, and lookups check
    it. Stale entries fill cells; when live and stale entries would pass `HASH_MAX_LOAD` of
    the table, it is rebuilt from the resident ids (one insert of each: ~2.5 ms for 100k ids
    on a 2-core CPU, every ~35 steps at cache_micro's budget 0.1)."""

    def __init__(
        self, num_embeddings: int, static_ids: Tensor, num_slots: int, device: torch.device, id_of_slot: Tensor
    ) -> None:
        if num_embeddings >= INT32_IDS_BELOW:
            raise ValueError(f"FBGEMM's hash table keeps int32 ids; {num_embeddings} rows need a sorted map.")
        self.id_of_slot = id_of_slot
        # Never full: a lookup probes until it meets its id or an empty cell.
        cells = max(num_slots + 1, int(num_slots * HASH_ROOM))
        self.table = torch.full((cells, 2), -1, dtype=torch.int32, device=device)
        self._table_offsets = torch.tensor([0, len(self.table)], dtype=torch.int64)
        self._cells_used = 0  # live and stale entries since the last rebuild (an upper bound)
        self.rebuilds = 0
        self._insert(static_ids, torch.arange(len(static_ids)))

    def tensors(self) -> list[Tensor]:
        return [self.table]

    @staticmethod
    def _one_bag(ids: Tensor) -> tuple[Tensor, Tensor]:
        """``ids`` as FBGEMM's ops take them: int32 values and the offsets of one bag."""
        return ids.to(torch.int32), torch.tensor([0, len(ids)], dtype=torch.int32)

    def _insert(self, ids: Tensor, slots: Tensor) -> None:
        narrow, bag = self._one_bag(ids)
        torch.ops.fbgemm.pruned_hashmap_insert(narrow, slots.to(torch.int32), bag, self.table, self._table_offsets)
        self._cells_used += len(narrow)

    def lookup(self, ids: Tensor) -> Tensor:
        narrow, bag = self._one_bag(ids)
        slots = torch.ops.fbgemm.pruned_hashmap_lookup(narrow, bag, self.table, self._table_offsets).long()
        directory.drop_stale(slots, self.id_of_slot, ids)  # a stale entry hides nothing
        return slots

    def assign(self, ids: Tensor, slots: Tensor, ascending: bool = False) -> None:  # any order will do
        """Add ``ids`` (none resident) at ``slots``, before the cache names them in ``id_of_slot``."""
        if self._cells_used + len(ids) > HASH_MAX_LOAD * len(self.table):
            self._rebuild()
        self._insert(ids, slots)

    def remove(self, ids: Tensor) -> None:
        """Nothing to do: an evicted id's entry stops holding once the cache clears its slot
        in ``id_of_slot``, and goes at the next rebuild."""

    def _rebuild(self) -> None:
        resident = (self.id_of_slot >= 0).nonzero().squeeze(1)
        self.table.fill_(-1)
        self._cells_used = 0
        self.rebuilds += 1
        self._insert(self.id_of_slot[resident], resident)


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
    num_embeddings: int, static_ids: Tensor, num_slots: int, device: torch.device, id_of_slot: Tensor, budgeted: bool = True
) -> DenseSlotMap | HashedSlotMap | SortedSlotMap:
    """The map for a cache, on ``device``; ``id_of_slot`` is the cache's slot -> id array (see
    `HashedSlotMap`); ``budgeted``: the map's bytes are the device budget's (else dense)."""
    kind = slot_map_kind(num_embeddings, num_slots, device) if budgeted else "dense"
    if kind == "hashed":
        return HashedSlotMap(num_embeddings, static_ids, num_slots, device, id_of_slot)
    return (DenseSlotMap if kind == "dense" else SortedSlotMap)(num_embeddings, static_ids, num_slots, device)
