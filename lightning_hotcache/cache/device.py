"""Device tier: one table's rows on the accelerator, addressed by slot ("virtual id").

Slots ``[0, S)`` hold the plan's hot rows (FAE's static region, never evicted); slots
``[S, S + C)`` are a dynamic cache (MixCache) refilled from the host store. A batch's ids
are turned into slots by `acquire` (missing rows are fetched, evicting unlocked slots
by LRU or LFU and writing changed rows back first) and its slots stay locked until its
ticket is released, so rows of batches in flight are never evicted. Locks are counts: each
slot counts the batches in flight that read it (`holders`: one more in the compiled pass that
marks a batch's reads, one fewer when its ticket is released), so tickets come back in any
order and a slot is free once no batch holds it. (A watermark of released tickets, which this
replaced, kept every slot read after an unreleased ticket locked: a mid-epoch validation, its
batches staged while training batches waited staged ahead, locked the rows of every
validation batch until the training resumed, and a long one filled the cache.) Optimizer
state lives in the same slots, so a row and its state always move together.

When the static region covers the whole table, slot == id and there is no host copy and
no bookkeeping at all: the table simply lives on the device.

The directory (id -> slot map, slot -> id, locks, scores, dirty marks, counters) lives on the
host (`books`) whatever the device: a batch's ids are there already while it is staged, ahead
of its step, and every decision (hits, victims, what to write back) is made there without
reading the device. Only rows and slot indices cross: the misses go up through pinned buffers
on a side stream (`RowUpload`), the evicted dirty rows come down into pinned memory whose host
write waits for the copy's event (`_WriteBack`). A row fetched again before its write-back has
landed is taken from the evicted copy on the device instead of the stale host row. So
staging, on a prefetch thread, makes the training thread wait for nothing. The directory's
steps over a batch's ids are compiled loops that run without the GIL (`directory`), so that
staging does not wait for a training loop's Python either. On the CPU the same code runs,
the copies being plain ones.

Across data-parallel ranks (`RowSharding`), each rank's host store holds its round-robin
shard of the rows, and only a row's owner updates it and writes it back (owner-computes, as
in HugeCTR's hybrid embedding and TorchRec's row-wise sharding). Staging reads only this
rank's own rows; a slot (static or dynamic) may hold another rank's row, but its value is
fetched from the owner's current copy in the forward that reads it (see
`lightning_hotcache.embedding.update`),
after every earlier step's update. Backward sends every gradient row to its row's owner,
which sums the ranks' rows and updates the row. So what a
rank sends per step follows the rows its own batch reads, not the number of ranks, and
evicting another rank's row is free. Tables wholly on the device work alike: every rank
holds all their rows, but only the owner's copy of a row is current.

Written by hand because neither TorchRec nor FBGEMM offers this on CPU: FBGEMM's LRU/LFU
caches are CUDA kernels of its UVM table-batched embedding, with no CPU build and no
static region chosen from measured frequencies.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch
from torch import Tensor

from lightning_hotcache.cache import directory, read_ahead
from lightning_hotcache.cache.device_directory import DeviceDirectory
from lightning_hotcache.cache.exchange import RoundRobinRows, RowSharding, gather_table
from lightning_hotcache.cache.host import HostStore, RowsAt
from lightning_hotcache.cache.host_arrays import new_array, new_host_array
from lightning_hotcache.cache.lookahead import NEVER, LookaheadWindow
from lightning_hotcache.cache.side_by_side import SideBySide
from lightning_hotcache.cache.slot_map import DenseSlotMap, make_slot_map
from lightning_hotcache.cache.upload import RowUpload
from lightning_hotcache._ops.host_rows import on_cpu, put_rows
from lightning_hotcache._ops.progress import Progress
from lightning_hotcache.optim.rowwise import RowWiseOptimizerConfig
from lightning_hotcache._ops.sorting import Distinct, lowest_first, unique

CachePolicy = Literal["lfu", "lru", "static", "lookahead"]
CACHE_POLICIES: tuple[str, ...] = ("lfu", "lru", "static", "lookahead")


def check_cache_policy(policy: str) -> None:
    if policy not in CACHE_POLICIES:
        raise ValueError(f"Unknown cache policy {policy!r}; choose one of {', '.join(CACHE_POLICIES)}.")


# A victim scan reserves slots for this many batches' misses (see `DeviceCache._choose_victims`).
RESERVE_BATCHES = 8
# Write-backs whose copy to the host may still be running; beyond this the oldest is waited for.
MAX_PENDING_WRITE_BACKS = 4

# Reads since a row came in, as the lookahead policy's tie-break among rows read next by one
# batch: capped so that (next read, reads) is one int64 key.
_USES_CAP = 2**22 - 1
# Rows of a round-robin piece copied at a time where the number of ranks changed since the save
# (`DeviceCache.load_full`): its indices and rows in memory, not the piece's.
_PIECE_ROWS = 1 << 16
# An empty reserve (never written in place: a reserve is replaced, not changed), made once, not a call a batch.
_NO_SLOTS = torch.empty(0, dtype=torch.int64)

_LOOKUPS, _MISSES, _FETCHED, _EVICTED, _WRITTEN_BACK, _READ_AHEAD = range(6)  # DeviceCache._segment_tally's tallies


def _one_by_one(work: Callable[[int], Any], items: Sequence[int]) -> list[Any]:
    return [work(item) for item in items]


class CacheCapacityError(RuntimeError):
    """A batch (with the batches in flight) needs more rows than the cache has free slots."""


@dataclass
class CacheCounters:
    """Running totals since the cache was built (readers take differences)."""

    lookups: int = 0
    hits: int = 0
    fetched_rows: int = 0
    evicted_rows: int = 0
    written_back_rows: int = 0
    read_ahead_rows: int = 0  # host rows paged in when their batch was announced (`DeviceCache.read_ahead`)
    # Distinct rows a batch read and stepped in their host rows, in place (with the directory in
    # device memory: those whose set had no way for them).
    from_host_rows: int = 0


class DeviceCache:
    """Device rows of one table: a static hot region plus an evicting dynamic region.

    Args:
        name: table name (for errors).
        num_embeddings: rows of the whole table.
        embedding_dim: row width.
        optimizer: row-wise rule (its state widths size the state slots).
        static_ids: ids pinned on the device.
        num_dynamic: dynamic slots.
        policy: ``lfu``, ``lru``, ``static`` (dynamic slots only stage each batch's misses
            and are emptied after it, as in FAE), or ``lookahead``: LFU, except that a row some
            announced future batch reads (`announce`) is evicted only when nothing else can be,
            the one read farthest ahead first (see `LookaheadWindow`).
        host: the host store of this rank's rows of the table (see ``sharding``); may be
            ``None`` only when static_ids cover all rows.
        device: where the slots live.
        sharding: ranks sharing the table (default: this process alone).
        storage: the slot arrays (``weight`` and each optimizer state, `num_slots` rows) when
            they live elsewhere, e.g. in a fused kernel's memory (see `FusedTables`); the
            cache reads and writes them in place. Default: arrays of its own.
        segment_starts: when this "table" is several tables end to end (see
            `lightning_hotcache.cache.group`), the first row of each and the total; the cache
            then also counts lookups, hits, fetches, evictions and write-backs per table
            (`segment_counters`).
        directory_on_device: the dynamic slots' directory in device memory (`on_device`).
        window_batches: with it, under ``lookahead``, the batches announced ahead, which size
            the device directory's window.
    """

    def __init__(
        self,
        name: str,
        num_embeddings: int,
        embedding_dim: int,
        optimizer: RowWiseOptimizerConfig,
        static_ids: Tensor,
        num_dynamic: int,
        policy: CachePolicy,
        host: HostStore | None,
        device: torch.device,
        sharding: RowSharding = RowSharding(),
        storage: dict[str, Tensor] | None = None,
        segment_starts: Sequence[int] | None = None,
        directory_on_device: bool = False,
        window_batches: int = 0,
    ) -> None:
        check_cache_policy(policy)
        static_ids = torch.as_tensor(static_ids, dtype=torch.int64).unique()  # sorted, for memory locality
        if len(static_ids) and (static_ids[0] < 0 or static_ids[-1] >= num_embeddings):
            raise ValueError(f"Table {name!r}: static ids must lie in [0, {num_embeddings}).")
        self.name = name
        self.num_embeddings = num_embeddings
        self.sharding = sharding
        self.policy = policy
        self._by_reads = policy in ("lfu", "lookahead")  # scores count reads (LFU), else last use (LRU)
        self.device = device
        self.books = torch.device("cpu")  # where the directory lives (see the module's docstring)
        self.identity = len(static_ids) == num_embeddings
        if not self.identity and host is None:
            raise ValueError(f"Table {name!r} is not wholly on the device, so it needs a host store.")
        self.host = None if self.identity else host
        self._upload = RowUpload(device)
        self.num_static = len(static_ids)
        self.num_dynamic = 0 if self.identity else num_dynamic
        num_slots = self.num_static + self.num_dynamic
        self.counters = CacheCounters()
        # Per-segment tallies (lookups, misses, fetched, evicted, written back), a tensor each,
        # so that counting costs one compiled call per tally and no host sync; see `segment_counters`.
        # The segments' ends, exclusive (the last one the total, past every id): `directory.tally` cuts there.
        self._segment_ends = None if segment_starts is None else torch.tensor(list(segment_starts)[1:])
        num_segments = 0 if segment_starts is None else len(segment_starts) - 1
        self._segment_tally = [torch.zeros(num_segments, dtype=torch.int64) for _ in range(_READ_AHEAD + 1)]
        self._issued = 0
        # Dynamic slots never used yet are [num_static + _never_used_from, end): a cold cache
        # fills from there without scoring every slot.
        self._never_used_from = 0
        # Victims reserved by the last scan of the dynamic slots (see `_choose_victims`), in
        # eviction order, and the ticket during which that scan ran.
        self._reserve = _NO_SLOTS
        self._reserve_ticket = 0
        self._held: dict[int, Tensor] = {}  # ticket -> the distinct slots its batch holds
        self._write_backs: deque[_WriteBack] = deque()  # oldest first
        # Whether evicted rows reach the host store later, once their copy off the device is
        # done (CUDA), or when evicted (a CPU device: the copy is done when made, and landing
        # it at once spares every later fetch the search of the rows still in flight).
        self.defers_write_backs = self._upload.asynchronous

        widths = {"weight": embedding_dim, **optimizer.state_widths(embedding_dim)}
        if storage is None:
            storage = {key: new_array((num_slots, width), device) for key, width in widths.items()}
        shapes = {key: tuple(array.shape) for key, array in storage.items()}
        if shapes != {key: (num_slots, width) for key, width in widths.items()}:
            raise ValueError(f"Table {name!r}: storage of shapes {shapes} does not hold {num_slots} slots of {widths}.")
        self.slots: dict[str, Tensor] = storage
        self.window: LookaheadWindow | None = None
        # The dynamic slots' directory in device memory, where one was asked for (see `_on_device_directory`).
        self.on_device: DeviceDirectory | None = None
        if self.identity:
            return
        # The books are written at random every batch: kept from forked workers (`host_arrays`).
        self.id_of_slot = new_host_array((num_slots,), torch.int64, fill=-1)
        self.id_of_slot[: self.num_static] = static_ids
        if directory_on_device:  # it keeps the dynamic slots' books: the host keeps none of them
            self.on_device = self._on_device_directory(policy, segment_starts, window_batches)
            return
        self.slot_map = make_slot_map(num_embeddings, static_ids, num_slots, self.books, budgeted=torch.device(device) == self.books)
        self.dirty = new_host_array((num_slots,), torch.bool)
        # Ticket of the latest batch that read each slot (its recency), and how many batches in
        # flight hold it (locked while above 0).
        self.last_used = new_host_array((num_slots,), torch.int64)
        self.holders = new_host_array((num_slots,), torch.int32)
        self.frequency = new_host_array((num_slots,), torch.int64)
        if policy == "lookahead":
            self.window = LookaheadWindow(num_embeddings, num_slots)

    def _on_device_directory(self, policy: CachePolicy, segment_starts: Sequence[int] | None, window_batches: int) -> DeviceDirectory:
        """The dynamic slots' directory in device memory (`DeviceDirectory`), over this cache's
        slots and host rows (on CUDA mapped into the device's address space by the caller:
        `lightning_hotcache.cache.host_mapping`). A batch's rows are then admitted on the device (`DeviceDirectory.admit`), never through
        `acquire`; this cache keeps the host store, the static rows and whole-table work."""
        assert self.host is not None
        if self.sharding.world != 1 or self.host.memory_mapped:
            raise ValueError(f"Table {self.name!r}: the device directory serves one process with its host rows in memory.")
        ends = None if segment_starts is None else torch.tensor(list(segment_starts)[1:])
        return DeviceDirectory(
            self.id_of_slot[: self.num_static].clone(), self.num_dynamic, policy, self.slots, self.host.arrays,
            segment_ends=ends, window_batches=window_batches if policy == "lookahead" else 0,
        )  # fmt: skip

    @staticmethod
    def num_slots(num_embeddings: int, static_ids: Tensor, num_dynamic: int) -> int:
        """Device rows a cache of this shape holds (its `storage` must have as many)."""
        num_static = len(torch.as_tensor(static_ids, dtype=torch.int64).unique())
        return num_static if num_static == num_embeddings else num_static + num_dynamic

    @property
    def weight(self) -> Tensor:
        return self.slots["weight"]

    def _tally(self, field: int, ids: Tensor, counts: Tensor | None = None, ascending: bool = False) -> None:
        """Add ``ids`` (each ``counts`` times, default once) to their segments' ``field``
        (ascending ids are walked, not searched): one compiled call (see `directory`)."""
        if self._segment_ends is not None:
            directory.tally(self._segment_tally[field], self._segment_ends, ids, counts, ascending)

    def _tallied(self, field: int) -> directory.Tally | None:
        """``field``'s tally, for a directory step that tallies as it goes (no call of its own:
        each compiled call is a GIL hand-over on a staging thread)."""
        return None if self._segment_ends is None else (self._segment_tally[field], self._segment_ends)

    def segment_counters(self, segment: int) -> CacheCounters:
        """Counters of one segment (see ``segment_starts``) since the cache was built (with the
        directory on the device, read from there: a wait for the device)."""
        if self.on_device is not None:
            c = self.on_device.counters(segment)
            return CacheCounters(
                c["lookups"], c["hits"], c["fetched_rows"], c["evicted_rows"], c["written_back_rows"], from_host_rows=c["from_host_rows"]
            )
        lookups, misses, fetched, evicted, written_back, read_ahead = (int(tally[segment]) for tally in self._segment_tally)
        return CacheCounters(lookups, lookups - misses, fetched, evicted, written_back, read_ahead)

    def device_bytes(self) -> int:
        """Bytes this cache holds on its device: slot rows and their optimizer state, and on
        the CPU, where the directory lives on the device too, the id -> slot map and per-slot
        bookkeeping (what the planner's budget covers)."""
        arrays = list(self.slots.values())
        if not self.identity and self.on_device is None and self.device == self.books:
            arrays += [self.id_of_slot, self.dirty, self.last_used, self.holders, self.frequency, *self.slot_map.tensors()]
        if self.on_device is not None:
            arrays += self.on_device.tensors()
        return sum(a.numel() * a.element_size() for a in arrays)

    # ------------------------------------------------------------ residency
    def acquire(self, ids: Tensor) -> tuple[Tensor, int]:
        """Slots of ``ids`` (any order, duplicates allowed), fetching missing rows, and the
        ticket that keeps them locked until `release`."""
        acquired = DeviceCache.acquire_all([self], [ids])[0]
        return acquired.slots, acquired.ticket  # on the host

    @staticmethod
    @torch.no_grad()
    def acquire_all(
        caches: Sequence["DeviceCache"],
        ids: Sequence[Tensor],
        announced: bool = False,
        found: Sequence[Distinct | None] | None = None,
        side_by_side: SideBySide | None = None,
    ) -> list[Acquired]:
        """`acquire` for several caches at once (misses of every cache first, then every
        install: a prefetch thread sees no cache half-staged); ``announced``: the batch is the
        oldest `announce`d one; ``found``: each cache's ids deduplicated by `unique` (with
        counts) ahead, where the caller has them; ``side_by_side``: threads that work on the
        caches at once (each cache's work on one of them). Slots are on the host; only the
        fetched rows and their slots go to the device."""
        found = found if found is not None else [None] * len(caches)
        each = side_by_side.map if side_by_side is not None else _one_by_one
        started = each(lambda k: caches[k]._begin_acquire(ids[k], announced, found[k]), range(len(caches)))
        rows = each(lambda k: None if started[k].needed is None else caches[k]._read_own(started[k].needed), range(len(caches)))

        def install(k: int) -> Acquired:
            acquired = caches[k]._finish_acquire(started[k], rows[k])
            caches[k]._land_write_backs(everything=False)
            return acquired

        return each(install, range(len(caches)))

    def announce(self, ids: Tensor, found: Distinct | None = None) -> Tensor | None:
        """A future batch will read ``ids`` (acquired with ``announced=True``, in announcing
        order; ``found``: their `unique`, where the caller has it): under ``lookahead`` its
        rows are kept until then where anything else can go, and its coming misses are
        returned (`LookaheadWindow.announce`), for `read_ahead`."""
        if self.window is None:
            return None
        return self.window.announce(on_cpu(ids, torch.int64), self.slot_map.lookup, found, self._dense_map())

    def read_ahead(self, ids: Tensor) -> None:
        """Have the host rows of ``ids`` (ascending: an announced batch's coming misses) paged in
        where the host store is memory-mapped, so that staging them waits for no disk (see
        `lightning_hotcache.cache.read_ahead`); across ranks, of this rank's own rows. Reads
        and changes no row: needs no lock."""
        if self.host is None or not self.host.memory_mapped:
            return
        if self.sharding.world > 1:
            ids = ids[self.sharding.owned(ids)]
        if self.host.read_ahead(self.sharding.local(ids)):
            self._tally(_READ_AHEAD, ids, ascending=True)
            self.counters.read_ahead_rows += len(ids)

    def clear_window(self) -> None:
        """Forget the announced batches (an epoch cut short leaves some never acquired), and
        the rows still to be read ahead for them."""
        if self.window is not None:
            self.window.clear()
            read_ahead.settle()

    def _begin_acquire(self, ids: Tensor, announced: bool = False, found: Distinct | None = None) -> _Acquire:
        """Lock the hits and free slots for the misses (their rows come next).

        The batch's ids are deduplicated first (or were ahead: ``found``, or the window's
        announcement): every later step works on distinct ids, and
        the slot map's binary searches run on sorted queries, which walk the same paths one
        after another and so stay in cache, where a batch's raw ids jump between paths."""
        ids = on_cpu(ids, torch.int64)  # to the books, where the directory lives
        self.counters.lookups += ids.numel()
        self._issued += 1
        if self.identity:
            self._tally(_LOOKUPS, ids)
            self.counters.hits += ids.numel()
            return _Acquire(ids, ids, self._issued)
        next_reads = None
        if announced and self.window:  # deduplicated when it was announced
            oldest, next_reads = self.window.retire(ids.numel(), self.name)
            distinct, inverse, counts = oldest.distinct, oldest.inverse, oldest.counts
        elif found is not None:
            distinct, inverse, counts = found
        else:
            distinct, inverse, counts = unique(ids, return_counts=True)
        # The hits locked first, so that fetching the misses cannot evict them.
        tallies, dense = (self._tallied(_LOOKUPS), self._tallied(_MISSES)), self._dense_map()
        if dense is None:
            slots = self.slot_map.lookup(distinct)
            at_missing, needed, _, missed = directory.split_hits(distinct, slots, counts, self.last_used, self.holders, self._issued, *tallies)
        else:
            slots, at_missing, needed, _, missed = directory.look_up_and_split_hits(
                dense, distinct, counts, self.last_used, self.holders, self._issued, *tallies
            )
        acquire = _Acquire(distinct, slots, self._issued, inverse=inverse, counts=counts, next_reads=next_reads)
        self._held[acquire.ticket] = slots  # the misses' slots are written into it as they are installed
        self.counters.hits += ids.numel() - missed
        if not len(at_missing):
            return acquire
        acquire.missing, acquire.needed = at_missing, needed
        acquire.victims = self._choose_victims(len(at_missing))
        self._evict(directory.occupied(acquire.victims, self.id_of_slot))
        return acquire

    def _finish_acquire(self, acquire: _Acquire, rows: dict[str, Tensor] | None) -> Acquired:
        """Install the fetched ``rows`` (of ``acquire.needed``) and lock them."""
        slots = acquire.slots
        reads = acquire.counts if self._by_reads else None  # counted toward eviction
        # Under lookahead each slot's next announced read, noted in the same pass as its reads.
        next_read = None if acquire.next_reads is None else self.window.next_read  # type: ignore[union-attr]
        if acquire.needed is not None:
            assert rows is not None and acquire.victims is not None and acquire.missing is not None
            victims, needed = acquire.victims, acquire.needed
            at = self._upload.to_device(victims)
            for key, tensor in self.slots.items():
                put_rows(tensor, at, rows[key])
            dense = self._dense_map()
            if dense is None:
                self.slot_map.assign(needed, victims, ascending=True)  # distinct ids come sorted
            alone = self.sharding.world == 1  # every fetched row is this rank's
            directory.install(
                slots, acquire.missing, victims, needed, self.id_of_slot, self.frequency, self.last_used, self.holders, acquire.ticket,
                reads, self._tallied(_FETCHED) if alone else None, dense, next_read, acquire.next_reads,
            )  # fmt: skip
            fetched = needed if alone else needed[self.sharding.owned(needed)]
            self.counters.fetched_rows += len(fetched)
            if not alone:
                self._tally(_FETCHED, fetched, ascending=True)
        elif reads is not None or next_read is not None:
            directory.count_reads(self.frequency, slots, reads, next_read, acquire.next_reads)
        if acquire.inverse is None:  # identity: slots are the ids
            return Acquired(slots, acquire.ticket, slots)
        return Acquired(slots[acquire.inverse], acquire.ticket, slots, acquire.inverse)

    def count_lookups(self, count: int) -> None:
        """Lookups served without an `acquire` (a table wholly on the device, read at its rows)."""
        self.counters.lookups += count
        self.counters.hits += count

    def count_fetched(self, ids: Tensor) -> None:
        """Rows ``ids`` were fetched into this cache from elsewhere (another rank's owner)."""
        self.counters.fetched_rows += len(ids)
        self._tally(_FETCHED, ids.to(self.books))  # the owners' rows come where the device reads them

    def num_locked(self) -> int:
        if self.on_device is not None:
            return self.on_device.num_held()
        return 0 if self.identity else int((self.holders > 0).sum())

    @torch.no_grad()
    def release(self, ticket: int) -> None:
        """Unlock the slots of an `acquire` (tickets may come back in any order; releasing a
        ticket a second time changes nothing)."""
        if self.identity:
            return
        held = self._held.pop(ticket, None)
        if held is not None:
            directory.let_go(self.holders, held)
        if self.policy == "static":
            dynamic = torch.arange(self.num_static, self.num_static + self.num_dynamic)
            unlocked = self.holders[dynamic] == 0
            self._evict(dynamic[(self.id_of_slot[dynamic] >= 0) & unlocked])

    @property
    def _row_widths(self) -> dict[str, int]:
        return {key: tensor.shape[1] for key, tensor in self.slots.items()}

    def _read_own(self, ids: Tensor) -> dict[str, Tensor]:
        """Host rows (and state) of ``ids`` for staging, on the device: across ranks only this
        rank's own rows are read; other ranks' rows are zeros until the forward that reads
        them fetches them. ``ids`` ascending, on the host."""
        assert self.host is not None
        if self.sharding.world == 1:
            rows = self._upload.gather(self.host, ids)
        else:
            owned = self.sharding.owned(ids)
            rows = {key: torch.zeros(len(ids), width, dtype=torch.float32, device=self.device) for key, width in self._row_widths.items()}
            at = self._upload.to_device(owned.nonzero().squeeze(1))
            for key, values in self._upload.gather(self.host, self.sharding.local(ids[owned])).items():
                rows[key][at] = values
        for write_back in self._write_backs:  # oldest first: the latest copy of a row wins
            write_back.serve_evicted(ids, rows, self._upload)
        return rows

    def host_weights(self, ids: Tensor) -> Tensor:
        """This rank's host weights of ``ids`` (owned here), every write-back landed first."""
        assert self.host is not None
        self._land_write_backs(everything=True)
        return self.host.weight.index_select(0, self.sharding.local(ids.to(self.books)))

    def _dense_map(self) -> Tensor | None:
        """The dense id -> slot map's array, which the directory's steps keep in the calls they
        make anyway (three compiled calls fewer a batch, each a GIL hand-over on a staging
        thread); None where the map is of another kind, which keeps itself."""
        return self.slot_map.slot_of_id if isinstance(self.slot_map, DenseSlotMap) else None

    def _choose_victims(self, count: int) -> Tensor:
        """``count`` unlocked dynamic slots to refill, emptiest first, then the least used.

        Scoring every dynamic slot for every batch would cost a full pass over the cache per
        step, more than the batch's own bookkeeping at large caches, so a scan reserves the
        `RESERVE_BATCHES` x ``count`` lowest-scored slots in order, and later batches take
        their victims from the front of that reserve. A reserved slot read since the scan has a
        new score (and may be locked) and is dropped from it; the others' scores have not
        moved, so the reserve stays in LFU/LRU order.
        What it gives up: rows installed after the scan are not victims before the next one.
        The ``static`` policy keeps the exact scan (its dynamic slots are emptied every batch).
        Under ``lookahead`` the rows an announced batch reads come after every other unlocked
        slot, the one read farthest ahead first; they never enter the reserve, and leave it
        when announced after the scan."""
        start = self.num_static
        if self._never_used_from + count <= self.num_dynamic:
            # Never-used slots are empty and unlocked: the scoring below would pick them first.
            first = start + self._never_used_from
            self._never_used_from += count
            return torch.arange(first, first + count)
        self._never_used_from = self.num_dynamic
        if self.policy != "static" and len(self._reserve) >= count:
            window = None if self.window is None else self.window.next_read
            unread = directory.unread(self._reserve, self.last_used, self._reserve_ticket, window, NEVER)
            if len(unread) >= count:
                self._reserve = unread[count:]
                return unread[:count]
        if self.window is not None:
            return self._victims_by_window(count)
        score, free = directory.eviction_scores(self.last_used, self.holders, self.frequency, self.id_of_slot, start, self._issued, self._by_reads)
        self._check_capacity(count, free)
        if self.policy == "static":
            return torch.topk(score, count, largest=False).indices + start
        ranked = lowest_first(score, min(free, RESERVE_BATCHES * count)) + start
        self._reserve, self._reserve_ticket = ranked[count:], self._issued
        return ranked[:count]

    def _check_capacity(self, count: int, free: int) -> None:
        if count > free:
            raise CacheCapacityError(
                f"Table {self.name!r}: a batch needs {count} rows that are not on the device, but only {free} of "
                f"{self.num_dynamic} dynamic cache slots are free (the others hold rows of batches in flight). "
                "Raise the device budget, lower prefetch_depth, or use smaller batches."
            )

    def _victims_by_window(self, count: int) -> Tensor:
        """Lookahead's victims among the dynamic slots: the unlocked rows no announced batch
        reads, least used first (the rest of them reserved), then the rows read farthest
        ahead, of those read next by one batch the least used first. The scan is one compiled
        pass (`directory.window_victims`): at 1% of the rows the window's rows often fill the
        cache, so it runs nearly every batch, and as torch ops (masks, a top-k over every
        awaited slot) it took twice the compiled pass's time of a batch's staging."""
        assert self.window is not None
        spare, short, free = directory.window_victims(
            self.holders, self.window.next_read, self.frequency, self.num_static, count, _USES_CAP, NEVER
        )
        self._check_capacity(count, free)
        self._reserve_ticket = self._issued
        if len(spare) >= count:
            scores = directory.scores_of(spare, self.last_used, self.frequency, self.id_of_slot, self._issued, self._by_reads)
            spare = spare[lowest_first(scores, RESERVE_BATCHES * count)]
            self._reserve = spare[count:]
            return spare[:count]
        self._reserve = _NO_SLOTS
        return short  # every spare slot, then the rows read farthest ahead

    def _evict(self, slots: Tensor) -> None:
        if len(slots) == 0:
            return
        self._write_back(*directory.dirty_by_id(slots, self.dirty, self.id_of_slot, self._tallied(_WRITTEN_BACK)))
        dense = self._dense_map()
        ids = directory.vacate(slots, self.id_of_slot, self._tallied(_EVICTED), dense)
        if dense is None:
            self.slot_map.remove(ids)
        if self.window is not None:
            self.window.emptied(slots)
        self.counters.evicted_rows += len(slots)

    def _write_back(self, ids: Tensor, slots: Tensor) -> None:
        """Start writing back the rows of ``slots``, which hold ``ids`` (ascending,
        `directory.dirty_by_id`): copied off the device now (behind every update queued),
        written to the host store once the copy is done (`_land_write_backs`)."""
        if len(slots) == 0:
            return
        # In id order: the host store's writes then go through memory in one direction, and a
        # stack of stores takes each table's rows as one slice. `index_select`, not
        # ``tensor[slots]``: 3x faster for rows on CPU.
        at = self._upload.to_device(slots)
        evicted = {key: tensor.index_select(0, at) for key, tensor in self.slots.items()}
        if self.defers_write_backs:
            rows, copied = self._upload.download(evicted)
            self._write_backs.append(_WriteBack(ids, evicted, rows, copied, self._issued))
        else:
            assert self.host is not None
            self._land_write_backs(everything=True)  # any deferred before: older copies land first
            self.host.write(self.sharding.local(ids), evicted)
        self.dirty[slots] = False
        self.counters.written_back_rows += len(slots)

    def _land_write_backs(self, everything: bool) -> None:
        """Write the rows of finished copies to the host store, oldest first. Unless
        ``everything`` (which waits for every copy), the latest acquire's stay in flight, and
        a copy still running is waited for only beyond `MAX_PENDING_WRITE_BACKS`."""
        while self._write_backs:
            oldest = self._write_backs[0]
            wait = everything or len(self._write_backs) > MAX_PENDING_WRITE_BACKS
            if not wait and (oldest.issued >= self._issued or not oldest.copied_yet()):
                return
            assert self.host is not None
            oldest.land(self.host, self.sharding)
            self._write_backs.popleft()

    # -------------------------------------------------------------- updates
    def mark_updated(self, slots: Tensor) -> None:
        """Note that ``slots`` (repeats allowed) were updated, so eviction writes them back."""
        if self.identity:
            return
        slots = slots.to(self.books)
        if self.sharding.world == 1:
            self.dirty[slots] = True
        else:  # only the owner writes a row back: other ranks' copies are dropped on eviction
            self.dirty[slots] = self.dirty[slots] | self.sharding.owned(self.id_of_slot[slots])

    def cached_slots(self, ids: Tensor) -> Tensor:
        """The slot of each of ``ids``, -1 where the row is not on the device (where ``ids`` are)."""
        return ids.to(self.device) if self.identity else self.slot_map.lookup(ids.to(self.books)).to(ids.device)

    @torch.no_grad()
    def update_host_rows(self, ids: Tensor, grads: Tensor, optimizer: RowWiseOptimizerConfig) -> None:
        """One row-wise step for distinct ``ids`` of this rank's host store (rows not on the device)."""
        if len(ids) == 0:
            return
        assert self.host is not None
        self._land_write_backs(everything=True)
        local = self.sharding.local(ids)
        rows = self.host.read(local)
        weights = rows.pop("weight")
        optimizer.update_rows(weights, rows, grads.to("cpu", weights.dtype))
        self.host.write(local, {"weight": weights, **rows})

    def ids_of_slots(self, slots: Tensor) -> Tensor:
        """The id each of ``slots`` holds (where ``slots`` are)."""
        return slots if self.identity else self.id_of_slot[slots.to(self.books)].to(slots.device)

    @torch.no_grad()
    def write_back(self) -> None:
        """Write every changed row (and its state) back to the host store."""
        if self.on_device is not None:
            self.on_device.flush()
        elif not self.identity:
            self._write_back(*directory.dirty_by_id(self.dirty.nonzero().squeeze(1), self.dirty, self.id_of_slot, self._tallied(_WRITTEN_BACK)))
            self._land_write_backs(everything=True)

    @torch.no_grad()
    def flush(self) -> None:
        """`write_back`, and make memory-mapped host files durable."""
        if not self.identity:
            assert self.host is not None
            self.write_back()
            self.host.flush_to_disk()

    # ---------------------------------------------------------- whole table
    def full(self, key: str = "weight") -> Tensor:
        """The current whole table (``weight``) or optimizer state array, on the CPU (across
        ranks a collective, also for tables wholly on the device: every rank must ask)."""
        if self.identity:
            if self.sharding.world == 1:
                # A copy, on CPU as on CUDA: the slots are a view of a device table holding other
                # tables and cache slots too, which torch.save would write whole with this table.
                return self.slots[key].detach().to("cpu", copy=True)
            owned = self.slots[key][self.sharding.rank :: self.sharding.world]  # the current copies
            return gather_table(owned.detach().cpu(), self.num_embeddings, self.sharding)
        self.flush()
        assert self.host is not None
        if self.sharding.world == 1:
            return self.host.arrays[key]
        return gather_table(self.host.arrays[key], self.num_embeddings, self.sharding)

    def load_full(self, key: str, values: Tensor | RoundRobinRows, progress: Progress | None = None) -> None:
        """Replace a whole array; cached copies are refreshed from it. ``values`` may come in
        round-robin pieces (a sharded checkpoint's, memory-mapped): each rank then copies its
        own rows piece by piece, never the whole array in memory. ``progress`` is told the
        bytes this process writes as they go in (`restored_bytes` in all)."""
        expected = (self.num_embeddings, self.slots[key].shape[1])
        if tuple(values.shape) != expected:
            raise ValueError(f"Table {self.name!r}: {key} has shape {expected}, got {tuple(values.shape)}.")
        if not isinstance(values, RoundRobinRows):
            self.load_rows(key, 0, values, progress)
        elif self.identity:  # wholly on the device: it fits in memory
            self.load_rows(key, 0, values.whole(), progress)
        else:
            assert self.host is not None
            self.load_pieces(key, values.pieces, self.host, 0, progress)

    def restored_bytes(self, key: str) -> int:
        """Bytes `load_full` writes in this process for array ``key``: the whole table where it
        is wholly on the device, else this rank's host rows."""
        if self.identity:
            array = self.slots[key]
        else:
            assert self.host is not None
            array = self.host.arrays[key]
        return array.numel() * array.element_size()

    @torch.no_grad()
    def load_pieces(self, key: str, pieces: Sequence[Tensor], host: HostStore, start: int, progress: Progress | None = None) -> None:
        """Replace an array of a table from its round-robin ``pieces`` (`RoundRobinRows`): the
        table's rows from id ``start`` on in this cache (a stack's table; its start a multiple
        of the world size, so that its row ``i`` is owned where ``i`` is), kept in ``host``
        (this rank's rows of it), piece by piece; cached copies refreshed from them. ``progress``
        as in `load_full`."""
        self._land_write_backs(everything=True)  # none may land on these rows later
        self._forget_device_rows()
        saved, world, rank = len(pieces), self.sharding.world, self.sharding.rank
        rows = sum(len(piece) for piece in pieces)
        cached = ((self.id_of_slot >= start) & (self.id_of_slot < start + rows)).nonzero().squeeze(1)
        cached_rows = self.id_of_slot[cached] - start
        for s, piece in enumerate(pieces):
            if saved == world:  # sharded as saved: a piece is one rank's host rows
                if s == rank:
                    host.load(key, piece, progress=progress)
            else:
                # Piece s holds rows s + saved * j; this rank's are those where row % world == rank.
                for first in range(0, len(piece), _PIECE_ROWS):
                    ids = s + saved * torch.arange(first, min(first + _PIECE_ROWS, len(piece)))
                    mine = (ids % world == rank).nonzero().squeeze(1)
                    put_rows(host.arrays[key], ids[mine] // world, piece[first + mine])
                    if progress is not None:
                        progress(len(mine) * piece.shape[1] * piece.element_size())
            in_piece = (cached_rows % saved == s).nonzero().squeeze(1)
            if len(in_piece):
                at = cached[in_piece].to(self.device)
                self.slots[key][at] = piece[cached_rows[in_piece] // saved].to(self.device)

    def initial_rows_at(self, key: str) -> RowsAt | None:
        """Where `load_rows` takes rows made in place (`initial_rows`'s ``into``): the host
        store's own rows, in one process (across ranks a store holds every world-th row);
        None where rows must be copied in. Write-backs in flight land first, so that none
        lands on a row made afterwards."""
        if self.identity or self.sharding.world != 1:
            return None
        assert self.host is not None
        self._land_write_backs(everything=True)
        self._forget_device_rows()  # none may be written back over the rows made
        return self.host.rows_at(key)

    @torch.no_grad()
    def load_rows(self, key: str, start: int, values: Tensor, progress: Progress | None = None) -> None:
        """Replace rows ``[start, start + len(values))`` of an array (every rank passes the
        same rows; each keeps its shard); cached copies are refreshed from them. ``progress``
        as in `load_full`."""
        values = values.detach()
        stop = start + len(values)
        if self.identity:
            self.slots[key][start:stop].copy_(values.to(self.device))
            if progress is not None:
                progress(values.numel() * self.slots[key].element_size())
            return
        assert self.host is not None
        self._land_write_backs(everything=True)  # none may land on these rows later
        self._forget_device_rows()
        values = values.cpu()
        first = start + (self.sharding.rank - start) % self.sharding.world  # first id of ours
        if first < stop:
            self.host.load(key, values[first - start :: self.sharding.world], first // self.sharding.world, progress)
        cached = (self.id_of_slot >= start) & (self.id_of_slot < stop)
        slots = cached.nonzero().squeeze(1)
        if len(slots):
            self.slots[key][slots.to(self.device)] = values[self.id_of_slot[slots] - start].to(self.device)

    def _forget_device_rows(self) -> None:
        """Before host rows are replaced, the device directory's changed rows written back and
        its cached rows forgotten (they are refreshed from the host when next read); the static
        rows, which the load refreshes, are left."""
        if self.on_device is not None:
            self.on_device.flush(static=False)
            self.on_device.clear()


@dataclass
class Acquired:
    """What `DeviceCache.acquire_all` gives per cache, on the host."""

    slots: Tensor  # the slot of every id asked for, in their order
    ticket: int  # keeps the slots locked until released
    read: Tensor  # the distinct slots read (all of `slots` where the table is wholly on the device)
    inverse: Tensor | None = None  # position in `read` of each id (None: `read` is `slots`)


@dataclass
class _Acquire:
    """An `acquire` between locking its hits and installing its misses."""

    ids: Tensor  # the batch's distinct ids (sorted), or all its ids for a table wholly on the device
    slots: Tensor  # slot of each of `ids`; -1 for misses until installed
    ticket: int
    inverse: Tensor | None = None  # position in `ids` of each id of the batch
    counts: Tensor | None = None  # lookups of each of `ids`
    missing: Tensor | None = None  # the positions in `ids` of those that miss, when there is a fetch
    needed: Tensor | None = None  # their ids
    victims: Tensor | None = None  # the slots they go to
    next_reads: Tensor | None = None  # under lookahead, the next announced read of each of `ids`


class _WriteBack:
    """Evicted rows on their way to the host store: ``evicted`` on the device (serving a
    re-fetch until they land), ``rows`` their host copies, complete once ``copied`` fires."""

    def __init__(self, ids: Tensor, evicted: dict[str, Tensor], rows: dict[str, Tensor], copied: torch.cuda.Event | None, issued: int) -> None:
        self.ids = ids  # ascending global ids, on the host
        self.evicted = evicted
        self.rows = rows
        self.copied = copied
        self.issued = issued  # the acquire that evicted them

    def copied_yet(self) -> bool:
        return self.copied is None or self.copied.query()

    def serve_evicted(self, ids: Tensor, rows: dict[str, Tensor], upload: RowUpload) -> None:
        """Where ``ids`` (ascending, on the host) are among these rows, put their evicted
        copies into ``rows`` (on the device): the host store does not hold them yet."""
        at, source = directory.match_sorted(self.ids, ids)
        if not len(at):
            return
        at, source = upload.to_device(at), upload.to_device(source)
        for key, values in rows.items():
            put_rows(values, at, self.evicted[key].index_select(0, source))

    def land(self, host: HostStore, sharding: RowSharding) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        host.write(sharding.local(self.ids), self.rows)
