"""A cache's directory in device memory, for CUDA: which rows of a table its dynamic slots hold,
found and changed by fixed-size device ops, so that a step reads nothing back and can be
captured in a CUDA graph.

The host directory (`DeviceCache`) decides on the host, ahead of the step, and moves rows
through pinned buffers; on a GPU that bookkeeping costs more host time than the step's kernels.
Here the GPU does it, as FBGEMM's UVM cache does (``lxu_cache_state``, ``lru_cache_populate``,
``lxu_cache_lookup``), with the host rows where the kernels can reach them (on CUDA, host memory
mapped into the device's address space) so that they read and write them in place.

**Set-associative.** A row may sit only in the ``ways`` slots of its set (a hash of its id), so
finding it is one gather and one compare of ``ways`` ids (FBGEMM's layout is 32 ways). The plan's
static hot rows keep slots ``[0, S)`` of their own (FAE), found by a binary search of their
sorted ids; dynamic slots are ``S + set * ways + way``.

**A batch** (`admit`): its distinct ids (one sort; their count stays on the device), then per
id: a static slot, a hit, or a miss. Misses of one set take, in order, the set's empty ways and
then its unheld ways of lowest score (LRU: last use; LFU: reads, ties by last use), never a way
a batch in flight holds (this batch's hits included); a miss whose set has no way left is
served from its host row in place for that batch: read there by the forward, stepped there by
the backward, neither dropped nor wrong. One kernel per array (`triton_tbe.move_rows`) writes
each dirty victim to its host row and reads its successor into the slot. The batch's slots stay
held until `release`. Each id's location (a slot, or `location_of_host_row`) is what the
kernels take. ``static`` policy (FAE): a batch's misses are evicted when it is released.

**Lookahead** (``lookahead`` policy, FBGEMM's cache has none): the loader announces each training
batch a window ahead of its step (`announce`), and eviction follows Belady within the window, as
the host directory's `LookaheadWindow` does: an unheld way whose row no announced batch reads goes
first (by LFU), then the one whose next read is farthest. The window is in device memory: one
row per announced batch, its distinct ids outside the static rows, ascending (`window`, of a
width fixed at the first announcement); a cell keeps its row's next announced read
(`next_read`), lowered by each announcement that reads it and found again when the row is
admitted or hit: each window row's ids searched among the batch's sorted distinct ids. Admitted training batches retire
the oldest announcement (a device count, `retired`), so the step stays capturable.

Rows read in training are marked dirty when admitted (their update follows in the step), so
an eviction or `flush` writes them back; a row read only in evaluation stays clean.

Written by hand because FBGEMM's cache kernels are CUDA code of its own build (which must match
torch and CUDA exactly, and has no build for a new GPU on the day it ships), and TorchRec's
Triton cache is forward-only; this needs only torch and Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_hotcache._ops.switches import Switch, setting
from lightning_hotcache.kernels.triton_tbe import location_of_host_row, move_rows
from lightning_hotcache.kernels.set_kernels import find_in_sets, victim_ways

DevicePolicy = Literal["lfu", "lru", "static", "lookahead"]
DEVICE_POLICIES: tuple[str, ...] = ("lfu", "lru", "static", "lookahead")

# Slots a set holds: FBGEMM's choice for its UVM cache.
WAYS = 32
# An LFU score is (reads << _READS_SHIFT) + last use, so that ties go to the older row.
_READS_SHIFT = 40
# GPU memory a slot's cell takes (its id, score, holders and dirty mark); a static slot's id takes less.
DEVICE_DIRECTORY_BYTES_PER_SLOT = 8 + 8 + 4 + 1
# Under lookahead a cell keeps its row's next announced read too.
NEXT_READ_BYTES_PER_SLOT = 8
_HELD = torch.iinfo(torch.int64).max  # a held way's score: never a victim
WINDOW_PAD = torch.iinfo(torch.int32).max  # pads a lookahead window's row: above every id it keeps
NO_READ = torch.iinfo(torch.int64).max  # no announced batch reads the row
# Window rows searched at once (`_next_reads`): bounds the search's temporary memory.
_ROWS_PER_PASS = 8
# Under lookahead a row some announced batch reads scores above every LFU score (reads stay
# below 2**22), the farther its next read the lower: _WINDOW_TIER + _FAR - next read.
_WINDOW_TIER, _FAR = 1 << 62, 1 << _READS_SHIFT
# Rows of the window beyond its batches: announced batches not yet admitted besides the window's
# (the one handed on to staging, Lightning's fetcher's, and two a prefetch thread holds).
WINDOW_SLACK = 4
# Knuth's multiplicative hash: a set is the high bits of id * _HASH, so that ids at a stride
# (a table's rows every ``world`` ids, tables at offsets) spread over the sets.
_HASH = 2654435761

# The running totals (`DeviceDirectory.counts`), one row each.
# ``window_dropped_ids``: announced ids beyond the window's width, left out of it (they cost
# hits, never a wrong row).
COUNTED = ("lookups", "hits", "fetched_rows", "evicted_rows", "written_back_rows", "from_host_rows", "window_dropped_ids")
_LOOKUPS, _HITS, _FETCHED, _EVICTED, _WRITTEN_BACK, _FROM_HOST, _DROPPED = range(len(COUNTED))


def window_width(distinct: int) -> int:
    """The width of a lookahead window's rows for batches of ``distinct`` ids outside the static
    rows: room for batches half as large again, at least 64."""
    return max(64, -(-3 * distinct // 2))


def device_window_bytes(window_batches: int, distinct: int) -> int:
    """Device memory of a lookahead window of ``window_batches`` for batches of at most
    ``distinct`` ids: its rows of 32-bit ids and their announcement numbers."""
    rows = window_batches + WINDOW_SLACK
    return rows * (4 * window_width(distinct) + 8)


@dataclass
class Admission:
    """A batch admitted into the cache: each id's location and the directory cells it holds."""

    locations: Tensor  # (N,) int64: a slot of the cache's arrays, or `location_of_host_row`
    held: Tensor  # (N,) int64: directory cells this batch holds (the trash cell where none)


class DeviceDirectory:
    """The dynamic slots of one cache, addressed by a set-associative directory in device memory.

    Args:
        static_ids: the rows held in slots ``[0, S)``, in that order (sorted, distinct).
        num_dynamic: the dynamic slots after them (the cache uses the largest multiple of the
            ways within them, or fewer ways where they are fewer than `WAYS`).
        policy: ``lfu``, ``lru``, ``static`` or ``lookahead`` (see the module's docstring).
        slots: the cache's arrays on the device (``weight`` and each optimizer state), rows
            ``[0, S + num_dynamic)``, read and written in place.
        host: the same arrays, a row per id of the table, where the kernels can reach them (mapped
            host memory on CUDA; under ``TRITON_INTERPRET=1``, CPU tensors).
        ways: slots a set holds.
        segment_ends: where each segment of the ids ends (exclusive, ascending: a stack's tables),
            for counts per segment; None: one segment.
        window_batches: under ``lookahead``, the batches announced ahead of their admission.
    """

    def __init__(
        self,
        static_ids: Tensor,
        num_dynamic: int,
        policy: DevicePolicy,
        slots: dict[str, Tensor],
        host: dict[str, Tensor],
        ways: int = WAYS,
        segment_ends: Tensor | None = None,
        window_batches: int = 0,
    ) -> None:
        if policy not in DEVICE_POLICIES:
            raise ValueError(f"The device directory keeps the {', '.join(DEVICE_POLICIES)} policies, not {policy!r}.")
        if (policy == "lookahead") != (window_batches > 0):
            raise ValueError(f"window_batches={window_batches}: the lookahead policy, and only it, needs a window of at least one batch.")
        if policy == "lookahead" and host["weight"].shape[0] >= WINDOW_PAD:
            raise ValueError(f"The lookahead window keeps ids in 32 bits: {host['weight'].shape[0]} rows are too many; use cache_policy='lfu'.")
        if set(slots) != set(host):
            raise ValueError(f"The slots hold {sorted(slots)} and the host rows {sorted(host)}: they must hold the same arrays.")
        device = slots["weight"].device
        self.device = device
        self.policy = policy
        self.static_ids = static_ids.to(device, torch.int64)
        self.num_static = int(self.static_ids.numel())
        self.ways = max(1, min(ways, num_dynamic))
        self.num_sets = num_dynamic // self.ways
        cells = self.num_sets * self.ways
        if slots["weight"].shape[0] < self.num_static + cells:
            raise ValueError(f"{self.num_static} static and {cells} dynamic slots do not fit the {slots['weight'].shape[0]} rows of the slots.")
        self.slots, self.host = slots, host
        self.trash = cells  # the cell writes for ids that take none go to
        self.ids = torch.full((cells + 1,), -1, dtype=torch.int64, device=device)
        self.score = torch.zeros(cells + 1, dtype=torch.int64, device=device)
        self.holders = torch.zeros(cells + 1, dtype=torch.int32, device=device)
        self.dirty = torch.zeros(cells + 1, dtype=torch.bool, device=device)
        self.tick = torch.zeros((), dtype=torch.int64, device=device)
        # Ids found and victims chosen by kernels over the sets (`set_kernels`), else by torch ops
        # that gather every id's whole set: the same cells (`Switch.SET_KERNELS`;
        # benchmarks/device_directory.py times both). In Triton's interpreter the kernels run
        # only where the switch asks.
        choice = setting(Switch.SET_KERNELS)
        self.set_kernels = choice == "1" or (choice is None and device.type == "cuda")
        # Running totals per segment (`COUNTED`), on the device: read them only where a reader
        # waits anyway (`counters`).
        self.segment_ends = None if segment_ends is None else segment_ends.to(device, torch.int64)
        num_segments = 1 if segment_ends is None else len(segment_ends)
        self.counts = torch.zeros(len(COUNTED), num_segments, dtype=torch.int64, device=device)
        self._way = torch.arange(self.ways, device=device)
        # The lookahead window (see the module's docstring); its rows are allocated at the first
        # announcement, whose distinct ids size them.
        self.window_rows = window_batches + WINDOW_SLACK if window_batches else 0
        self.window: Tensor | None = None
        self.window_steps = torch.full((self.window_rows,), -1, dtype=torch.int64, device=device)
        self.next_read = torch.full((cells + 1 if window_batches else 0,), NO_READ, dtype=torch.int64, device=device)
        self.retired = torch.zeros((), dtype=torch.int64, device=device)
        self.announced = 0  # announcements so far (the host's count: `announce` runs eagerly)

    @property
    def num_cells(self) -> int:
        """Dynamic slots the directory uses."""
        return self.trash

    def set_of(self, ids: Tensor) -> Tensor:
        """Each id's set."""
        return ((ids * _HASH) >> 32).remainder(max(self.num_sets, 1))

    def admit(self, ids: Tensor, training: bool) -> Admission:
        """The locations of ``ids`` (any shape flattened, on the device, in range): each
        distinct id found, or admitted with its row read in, or left on the host, its cells
        held until `release`. ``training``: the rows will be stepped (mark them dirty)."""
        ids = ids.reshape(-1).to(torch.int64)
        n = ids.numel()
        positions = torch.arange(n, device=self.device)
        sorted_ids, order = ids.sort()
        new_run = torch.ones(n, dtype=torch.bool, device=self.device)
        new_run[1:] = sorted_ids[1:] != sorted_ids[:-1]
        run = new_run.cumsum(0) - 1
        distinct = torch.full((n,), -1, dtype=torch.int64, device=self.device).scatter_(0, run, sorted_ids)
        valid = distinct >= 0
        if self.num_static:
            place = torch.searchsorted(self.static_ids, distinct).clamp_(max=self.num_static - 1)
            is_static = self.static_ids.index_select(0, place) == distinct
        else:
            place, is_static = torch.zeros_like(distinct), torch.zeros_like(valid)
        dynamic = valid & ~is_static
        if self.num_cells == 0:
            hit = admitted = torch.zeros_like(valid)
            hit_cell = new_cell = torch.full_like(distinct, self.trash)
        else:
            hit, hit_cell, admitted, new_cell = self._hits_and_victims(distinct, dynamic, positions, training)
        held = torch.where(hit, hit_cell, new_cell)
        location = torch.where(is_static, place, torch.where(hit | admitted, held + self.num_static, location_of_host_row(distinct)))
        locations = torch.empty_like(ids).scatter_(0, order, location.index_select(0, run))
        reads = torch.zeros_like(distinct).index_add_(0, run, torch.ones_like(run))  # each distinct id's
        self._count(_LOOKUPS, distinct, reads)
        self._count(_HITS, distinct, reads * (is_static | hit))
        self._count(_FETCHED, distinct, admitted)
        self._count(_FROM_HOST, distinct, dynamic & ~hit & ~admitted)
        return Admission(locations, held)

    def _count(self, field: int, ids: Tensor, amounts: Tensor) -> None:
        """Add ``amounts`` (per id; an id below 0 must have none) to the ids' segments' ``field``."""
        amounts = amounts.to(torch.int64)
        if self.segment_ends is None:
            self.counts[field] += amounts.sum()
        else:
            segments = torch.searchsorted(self.segment_ends, ids.clamp(min=0), right=True).clamp_(max=len(self.segment_ends) - 1)
            self.counts[field].index_add_(0, segments, amounts)

    def _hits_and_victims(self, distinct: Tensor, dynamic: Tensor, positions: Tensor, training: bool) -> tuple[Tensor, ...]:
        """The directory's part of `admit` for the dynamic ids among ``distinct``: which hit
        (and their cells), which are admitted (and the cells they take, their victims written
        back and their rows read in), all others left on the host."""
        ways, trash = self.ways, self.trash
        sets = self.set_of(distinct.clamp(min=0))
        hit, hit_cell, sets_held = self._lookup(distinct, dynamic, sets)
        self.holders.index_add_(0, hit_cell, torch.ones_like(hit_cell, dtype=torch.int32))
        self.tick += 1
        # Victims: per set, its misses in turn take its empty ways, then its unheld ways by
        # score, lowest first; held ways (this batch's hits too) are never taken.
        miss = dynamic & ~hit
        key = torch.where(miss, sets, self.num_sets)
        sorted_key, key_order = key.sort(stable=True)
        starts = torch.ones_like(miss)
        starts[1:] = sorted_key[1:] != sorted_key[:-1]
        first_of_set = torch.where(starts, positions, 0).cummax(0).values
        rank = torch.empty_like(positions).scatter_(0, key_order, positions - first_of_set)
        if sets_held is None:
            way, admitted = victim_ways(self.ids, self.score, self.holders, self.next_read if self.window_rows else None,
                                        sets, rank, miss, key_order, ways, _HELD, _WINDOW_TIER + _FAR, NO_READ)  # fmt: skip
        else:
            way, admitted = self._victim_ways(*sets_held, rank, miss)
        new_cell = torch.where(admitted, sets * ways + way, trash)
        leaving = self.ids.index_select(0, new_cell)
        write_rows = torch.where(admitted & (leaving >= 0) & self.dirty.index_select(0, new_cell), leaving, -1)
        fill_rows = torch.where(admitted, distinct, -1)
        slots = new_cell + self.num_static
        for key_name, array in self.slots.items():
            move_rows(array, self.host[key_name], slots, write_rows, fill_rows)
        self._count(_EVICTED, leaving, admitted & (leaving >= 0))
        self._count(_WRITTEN_BACK, write_rows, write_rows >= 0)
        self.ids[new_cell] = distinct
        self.holders.index_add_(0, new_cell, torch.ones_like(new_cell, dtype=torch.int32))
        # index_fill_, not ``dirty[cells] = value``: indexing a CUDA tensor with a Python value
        # copies the value from the host first, a wait and a copy a CUDA graph cannot record.
        if training:
            self.dirty.index_fill_(0, hit_cell, True)
        self.dirty.index_fill_(0, new_cell, training)
        if self.window_rows:
            self._note_next_reads(distinct, hit | admitted, hit_cell, new_cell, training)
        if self.policy in ("lfu", "lookahead"):
            reads = (self.score.index_select(0, hit_cell) >> _READS_SHIFT) + 1
            self.score[hit_cell] = (reads << _READS_SHIFT) + self.tick
            self.score[new_cell] = (1 << _READS_SHIFT) + self.tick
        else:
            self.score[hit_cell] = self.tick
            self.score[new_cell] = self.tick
        return hit, hit_cell, admitted, new_cell

    def _victim_ways(self, cells: Tensor, in_cells: Tensor, rank: Tensor, miss: Tensor) -> tuple[Tensor, Tensor]:
        """`victim_ways` in torch ops: every id's set's scores gathered and sorted (``cells``
        and the ids ``in_cells`` from `_lookup`)."""
        score = torch.where(in_cells < 0, -1, self.score[cells])
        if self.window_rows:  # a row an announced batch reads goes after the others, farthest read first
            ahead = self.next_read[cells]
            score = torch.where((in_cells >= 0) & (ahead != NO_READ), _WINDOW_TIER + _FAR - ahead, score)
        score = torch.where(self.holders[cells] > 0, _HELD, score)
        by_score = score.argsort(dim=1, stable=True)
        free = (score < _HELD).sum(1)
        way = by_score.gather(1, rank.clamp(max=self.ways - 1)[:, None]).squeeze(1)
        return way, miss & (rank < free)

    def _lookup(self, ids: Tensor, looked_up: Tensor, sets: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
        """Where ``ids`` (those ``looked_up``) are cached: whether each is, its cell (the trash
        cell where not) and, in torch ops, each id's set's cells ``(n, ways)`` with the ids they
        hold, which `_victim_ways` reuses (None from `find_in_sets`)."""
        if self.set_kernels:
            return (*find_in_sets(self.ids, ids, looked_up, sets, self.ways, self.trash), None)
        cells = sets[:, None] * self.ways + self._way
        in_cells = self.ids[cells]
        match = (in_cells == ids[:, None]) & looked_up[:, None]
        hit = match.any(1)
        return hit, torch.where(hit, (cells * match).sum(1), self.trash), (cells, in_cells)

    def _note_next_reads(self, distinct: Tensor, cached: Tensor, hit_cell: Tensor, new_cell: Tensor, training: bool) -> None:
        """Each cached one of ``distinct`` gets its next announced read after this batch; a
        training batch retires the oldest announcement where it is pending (fixed-size ops)."""
        pending = self.window_steps.index_select(0, self.retired.remainder(self.window_rows).view(1)).squeeze(0) == self.retired
        retiring = pending.to(torch.int64) if training else torch.zeros_like(self.retired)
        ahead = torch.where(cached, self._next_reads(distinct, self.retired + retiring), NO_READ)
        self.next_read[hit_cell] = ahead
        self.next_read[new_cell] = ahead
        self.retired += retiring

    def _next_reads(self, distinct: Tensor, since: Tensor) -> Tensor:
        """Each of ``distinct`` (ascending, then -1s)'s first read by an announced batch numbered
        ``since`` (a device count) or later, else `NO_READ`: each window row's ids are searched
        among them (a batch's distinct ids stay in cache memory while the window streams past),
        a few rows at a time."""
        best = torch.full_like(distinct, NO_READ)
        if self.window is None or distinct.numel() == 0:
            return best
        key = torch.where(distinct >= 0, distinct, NO_READ)  # still ascending
        for start in range(0, self.window_rows, _ROWS_PER_PASS):
            rows = self.window[start : start + _ROWS_PER_PASS].to(torch.int64)
            steps = self.window_steps[start : start + _ROWS_PER_PASS, None]
            place = torch.searchsorted(key, rows).clamp_(max=key.numel() - 1)
            read = (key.take(place) == rows) & (steps >= since)
            best.scatter_reduce_(0, place.reshape(-1), torch.where(read, steps, NO_READ).reshape(-1), reduce="amin")
        return best

    def announce(self, ids: Tensor) -> None:
        """A training batch admitted later, in announcing order, reads ``ids`` (on the device, in
        range): its distinct ids outside the static rows fill the window's next row, and the
        cached rows it reads take it as their next read where none comes sooner. Device ops of
        fixed sizes, except at the first announcement, which reads its distinct ids' count to
        size the window (1.5 times it)."""
        if not self.window_rows:
            raise RuntimeError(f"announce() keeps a lookahead window; the {self.policy!r} policy has none.")
        ids = ids.reshape(-1).to(torch.int64)
        sorted_ids = ids.sort().values
        keep = torch.ones_like(sorted_ids, dtype=torch.bool)
        keep[1:] = sorted_ids[1:] != sorted_ids[:-1]
        if self.num_static:
            place = torch.searchsorted(self.static_ids, sorted_ids).clamp_(max=self.num_static - 1)
            keep &= self.static_ids.index_select(0, place) != sorted_ids
        if self.window is None:
            self.window = torch.full((self.window_rows, window_width(int(keep.sum()))), WINDOW_PAD, dtype=torch.int32, device=self.device)
        row, width = self.announced % self.window_rows, self.window.shape[1]
        # The kept ids packed to the row's front, still ascending; those past its width go to a
        # spare place and are counted.
        place = keep.cumsum(0) - 1
        fits = keep & (place < width)
        packed = torch.full((width + 1,), WINDOW_PAD, dtype=torch.int64, device=self.device)
        packed.scatter_(0, torch.where(fits, place, width), sorted_ids)
        self.window[row] = packed[:width]
        self._count(_DROPPED, sorted_ids, keep & ~fits)
        self.window_steps[row].fill_(self.announced)  # no host copy of the value (see `_hits_and_victims`)
        stored = self.window[row].to(torch.int64)
        if self.num_cells:
            cell = self._lookup(stored, stored != WINDOW_PAD, self.set_of(stored))[1]
            self.next_read.scatter_reduce_(0, cell, torch.full_like(cell, self.announced), reduce="amin")
        self.announced += 1

    def clear_window(self) -> None:
        """Forget the announced batches not yet admitted (an epoch cut short)."""
        if self.window_rows:
            self.window_steps.fill_(-1)
            self.next_read.fill_(NO_READ)
            self.retired.fill_(self.announced)

    def release(self, admission: Admission) -> None:
        """The batch's cells are no longer held (its step is done, or it was only looked up).
        Under the ``static`` policy its misses leave the cache."""
        self.holders.index_add_(0, admission.held, torch.full_like(admission.held, -1, dtype=torch.int32))
        if self.policy == "static":
            self.write_back(evict=True)

    def write_back(self, evict: bool = False) -> None:
        """Write every dirty cached row to its host row, in ops of fixed sizes (a step may call
        it: the ``static`` policy's `release`); ``evict``: and empty the unheld cells."""
        self._write_back_cells(torch.arange(self.num_cells, device=self.device))
        if evict:
            in_cells = self.ids[:-1]
            leaving = (in_cells >= 0) & (self.holders[:-1] == 0)
            self._count(_EVICTED, in_cells, leaving)
            self.ids[:-1] = torch.where(leaving, -1, in_cells)

    def _write_back_cells(self, cells: Tensor) -> None:
        """Write the dirty rows among ``cells`` to their host rows; unheld, they are clean then."""
        in_cells = self.ids.index_select(0, cells)
        write_rows = torch.where((in_cells >= 0) & self.dirty.index_select(0, cells), in_cells, -1)
        none = torch.full_like(write_rows, -1)
        for key, array in self.slots.items():
            move_rows(array, self.host[key], cells + self.num_static, write_rows, none)
        self._count(_WRITTEN_BACK, write_rows, write_rows >= 0)
        self.dirty &= self.holders > 0  # a held row's step is still to come

    def flush(self, static: bool = True) -> None:
        """Every cached row's current value in the host arrays: the dirty ones written back
        (found first, which waits for the device: whole-table work, not a step's), and with
        ``static`` the static rows too."""
        dirty = ((self.ids[:-1] >= 0) & self.dirty[:-1]).nonzero().squeeze(1)
        if len(dirty):
            self._write_back_cells(dirty)
        if static and self.num_static:
            for key, array in self.slots.items():
                host = self.host[key]
                host.index_copy_(0, self.static_ids.to(host.device), array[: self.num_static].to(host.device))
        if self.device.type == "cuda":
            # The write-backs are kernels writing host memory: the host reads and writes those
            # rows next (a checkpoint, a load over them), so it waits for them here.
            torch.cuda.current_stream(self.device).synchronize()

    def clear(self) -> None:
        """Forget every cached row, writing nothing back (the host rows were just loaded):
        only while no batch is held."""
        self.ids.fill_(-1)
        self.dirty.zero_()
        self.score.zero_()
        self.next_read.fill_(NO_READ)

    def tensors(self) -> list[Tensor]:
        """The directory's own device tensors (for the device bytes it holds)."""
        window = [] if self.window is None else [self.window]
        return [self.static_ids, self.ids, self.score, self.holders, self.dirty, self.counts, *window, self.window_steps, self.next_read]

    def num_held(self) -> int:
        """Cells a batch in flight holds (a host wait: for tests)."""
        return int((self.holders[:-1] > 0).sum())

    def counters(self, segment: int | None = None) -> dict[str, int]:
        """The running totals (`COUNTED`) of one segment, or of all, read from the device (a
        host wait: for logs and tests)."""
        values = (self.counts.sum(1) if segment is None else self.counts[:, segment]).tolist()
        return dict(zip(COUNTED, values))
