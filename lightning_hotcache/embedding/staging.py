"""Staging: a batch's ids checked, put in the module's feature order, and turned into locked
slots of the device tables, ahead of its forward (`prefetch`) or at its start.

All of it runs on the host, where the batch's ids are before they go to the device and where
the caches keep their directories: the device receives the batch's slots in one copy and the
rows it missed, and is never read. (A batch handed over on the device is copied back to the
host first, which waits for it: prefetching stages the batch before its move.)

The caches that lock rows are acquired all at once (`DeviceCache.acquire_all`: every cache's
misses are read before any is installed, so a prefetch thread never leaves one half-staged;
with ``staging_threads`` the caches side by side, each on a thread), under the module's lock;
the rest of a batch's staging (checking and ordering its ids, its slots in place, its
distinct rows per device table, the copies to the device) touches no cache and runs
outside it, so that on a prefetch thread it overlaps the step's forward and backward. Those
need no lock in training: a batch taken from the queue is the step's own, and the rows an
update has changed are marked and unlocked (`finish`) by whoever holds the lock next when a
prefetch thread holds it then, before anything is evicted or written back (`locked`). Tables
wholly on the device in shared device tables lock nothing (slot == row): their ids become rows
by the layout's per-feature base alone, and only their lookups are counted.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from typing import Iterator

import torch
from torch import Tensor
from torchrec import KeyedJaggedTensor

from lightning_hotcache.cache.device import DeviceCache
from lightning_hotcache.cache.side_by_side import SideBySide
from lightning_hotcache.cache.upload import to_device
from lightning_hotcache.embedding.batch import (
    StagedBatch,
    TableReads,
    add_per_key,
    check_ids,
    concat_spans,
    in_feature_order,
    on_device,
    put_spans,
    runs_of,
    same_batch,
    sorted_reads,
)
from lightning_hotcache.embedding.layout import Layout
from lightning_hotcache._ops.guards import check_not_empty
from lightning_hotcache._ops.host_rows import on_cpu
from lightning_hotcache._ops.sorting import Distinct, distinct_rows, unique


# A batch's ids as staging finds them (`Staging._ids`): the features checked and in the
# module's order, their values, what each value reads, each acquired cache's spans of values,
# and each acquired cache's ids.
_Prepared = tuple[KeyedJaggedTensor, Tensor, Tensor, dict[str, list[tuple[int, int]]], list[Tensor]]


class Staging:
    """Stages batches into ``caches`` (cache key -> cache) laid out by ``layout``, and keeps
    the staged batches until their rows may be unlocked."""

    def __init__(self, layout: Layout, caches: dict[str, DeviceCache], device: torch.device, threads: int = 1) -> None:
        self.layout = layout
        self.device = device
        self.caches = caches
        # Threads that work on a batch's caches at once (see `lightning_hotcache.cache.side_by_side`).
        self.side_by_side = SideBySide(threads, device)
        # The module's lock. Staging (possibly on a prefetch thread), forward and the backward
        # update all change the caches' directories; this re-entrant lock keeps those changes
        # from interleaving. It is held for the directories' work alone, not for a batch's
        # preparation, lookup or row update: on a prefetch thread, staging the next batch then
        # overlaps the step instead of holding up its forward and backward. Take it through
        # `locked`.
        self.lock = threading.RLock()
        # In shared device tables whole tables are read at their rows directly; elsewhere every
        # cache is acquired (a whole table's acquire counts, and names the rows a batch read).
        self._acquired = [key for key in caches if not (layout.shared and caches[key].identity)]
        self._counted_only = [key for key in caches if key not in self._acquired]
        self._positions = {key: layout.positions(key) for key in caches}
        # Each acquired cache's features as runs of consecutive ones (first, end): a batch's
        # values of a run are one slice (a stack of every table is one run, not one per table).
        self._runs = {key: runs_of(self._positions[key]) for key in self._acquired}
        self._value_base = layout.value_base()
        # Whether staged batches carry each device table's distinct reads (`TableReads`), for an
        # update that sums gradients itself (set by it), and whether the device finds them
        # (`sorted_reads`) rather than the host; the features reading each table, as runs.
        self.sums_gradients = False
        self.sorts_reads_on_device = False
        feature_table = layout.device_table_of_feature()
        self._table_runs = [runs_of([k for k, t in enumerate(feature_table) if t == table]) for table in range(len(layout.device_rows))]
        self.queue: deque[StagedBatch] = deque()
        # Batches announced and not yet staged, as `_ids` prepared them with each acquired
        # cache's ids deduplicated (oldest first): a batch is checked, ordered and
        # deduplicated once, when announced (see `announce`).
        self._announced: deque[tuple[KeyedJaggedTensor, _Prepared, list[Distinct | None]]] = deque()
        self._windowed = any(caches[key].window is not None for key in self._acquired)
        # Batches in forward or backward. Only the training thread and its backward change the
        # list, and never at once (forward does not run during the backward it waits for).
        self.in_flight: list[StagedBatch] = []
        # Batches whose update is queued, with whether it changed their rows, left for the
        # lock's next holder to mark and unlock (see `finish`).
        self._finished: deque[tuple[StagedBatch, bool]] = deque()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The module's lock, held to change or read the caches' directories, with every batch
        finished meanwhile marked and unlocked first (see `finish`)."""
        with self.lock:
            self._settle_finished()
            yield

    def _ids(self, features: KeyedJaggedTensor) -> _Prepared:
        """``features`` (on the host) checked and in the module's order; its values; what each
        value reads (a stack's global id, a whole table's row in a shared device table); each
        acquired cache's spans of values; and each acquired cache's ids."""
        check_not_empty(features)
        ours = in_feature_order(features, self.layout.features, self.layout.input_of, self.layout.table_of)
        check_ids(ours, self.layout.table_of)  # everything validated before any row is touched
        values = on_cpu(ours.values(), torch.int64)  # on the host already: no call unless a cast
        bounds = ours.offset_per_key()
        if self._value_base is None:
            indices = values.clone()  # the caches' slots are written into it
        else:
            indices = add_per_key(values, self._value_base, bounds)
        spans = {key: [(bounds[a], bounds[b]) for a, b in self._runs[key]] for key in self._acquired}
        # A stack reads global ids (in `indices`); a table of its own reads its ids.
        ids = [concat_spans(indices if key in self.layout.stacks else values, spans[key]) for key in self._acquired]
        return ours, values, indices, spans, ids

    def announce(self, features: KeyedJaggedTensor) -> None:
        """A future training batch (on the host), staged later with ``announced=True`` in this
        order: checked, ordered and deduplicated now, outside the module's lock (on a reader
        thread that work overlaps the staging of earlier batches), and under the lookahead
        policy the caches' windows learn its ids, and the host rows it will miss are paged in
        from memory-mapped host stores (after the lock: that waits for no one)."""
        prepared = self._ids(features)
        found = [None if self.caches[key].identity else unique(ids, return_counts=True) for key, ids in zip(self._acquired, prepared[4])]
        if not self._windowed:  # no lock: one thread appends, staging pops (a deque's ends are thread-safe)
            self._announced.append((features, prepared, found))
            return
        with self.locked():
            coming = self.side_by_side.map(lambda k: self.caches[self._acquired[k]].announce(prepared[4][k], found[k]), range(len(found)))
            self._announced.append((features, prepared, found))
        for key, misses in zip(self._acquired, coming):
            if misses is not None:
                self.caches[key].read_ahead(misses)

    def clear_window(self) -> None:
        with self.locked():
            self._announced.clear()
            for key in self._acquired:
                self.caches[key].clear_window()

    def _announced_ids(self, features: KeyedJaggedTensor) -> tuple[_Prepared, list[Distinct | None]] | None:
        """`_ids` of ``features``, the oldest batch announced, and its caches' distinct ids, as
        its announcement found them (``None`` when no batch is announced: the window was cleared)."""
        if not self._announced:
            return None
        oldest, prepared, found = self._announced.popleft()
        if not same_batch(oldest, features):
            raise RuntimeError(
                "stage(announced=True) got a batch other than the oldest announced one; stage announced batches in "
                "the order they were announced."
            )
        return prepared, found

    def prefetch(self, features: KeyedJaggedTensor, arrives_as: KeyedJaggedTensor | None = None, announced: bool = False) -> None:
        """Stage ``features`` ahead of its forward (see `stage`), queued for `take`."""
        self.queue.append(self.stage(features, arrives_as, announced))

    def check(self, features: KeyedJaggedTensor) -> None:
        """Nothing to do: a batch's forward takes it staged (`prefetch`) or stages it then."""

    def stage(self, features: KeyedJaggedTensor, arrives_as: KeyedJaggedTensor | None = None, announced: bool = False) -> StagedBatch:
        """Stage ``features``, the batch as forward will get it (``arrives_as``: the same batch
        already moved to the device, whose values are then never read here; ``announced``: the
        oldest batch `announce`d)."""
        arriving = features if arrives_as is None else arrives_as
        ahead = self._announced_ids(features) if announced else None
        if features.values().device.type != "cpu":
            features = features.to(torch.device("cpu"))
        prepared, found = ahead or (self._ids(features), None)
        ours, values, indices, spans, ids = prepared
        bounds, per_key = ours.offset_per_key(), ours.length_per_key()
        with self.locked():
            acquired = DeviceCache.acquire_all([self.caches[k] for k in self._acquired], ids, announced, found, self.side_by_side)
            for key in self._counted_only:
                self.caches[key].count_lookups(sum(per_key[k] for k in self._positions[key]))
        tickets: dict[str, list[int]] = {}
        read: list[tuple[DeviceCache, Tensor]] = []
        for key, got in zip(self._acquired, acquired):
            cache = self.caches[key]
            tickets[key] = [got.ticket]
            read.append((cache, got.read))
            if cache.identity:  # slot == id: `indices` holds it already
                continue
            # The kernel reads slots at their place in its table; features apart too: one call.
            put_spans(indices, spans[key], got.slots, offset=self.layout.regions[key].start)
        if arriving.values().device != values.device:
            ours = on_device(arriving, features, ours, self.layout.features, self.layout.input_of, self.layout.table_of)
        on_the_device = to_device(indices, self.device)
        reads = []
        if self.sums_gradients:
            spans_of_tables = [[(bounds[a], bounds[b]) for a, b in runs] for runs in self._table_runs]
            if self.sorts_reads_on_device:
                reads = [sorted_reads(_rows_in(on_the_device, spans)) for spans in spans_of_tables]
            else:
                tables = zip(spans_of_tables, self.layout.device_rows)
                reads = [self._distinct_reads(_rows_in(indices, spans), num_rows) for spans, num_rows in tables]
        return StagedBatch(arriving, ours, on_the_device, tickets, read, reads=reads)

    def _distinct_reads(self, rows: Tensor, num_rows: int) -> TableReads:
        """A device table's reads found on the host: the distinct ``rows`` (every value's row,
        of the table's ``num_rows``), and each value's place among them."""
        distinct, inverse = distinct_rows(rows, num_rows)
        return TableReads(to_device(distinct, self.device), to_device(inverse, self.device))

    def take(self, features: KeyedJaggedTensor, training: bool) -> StagedBatch:
        """The staged batch of ``features``: the next prefetched one, or staged now (from the
        host: a batch on the device is copied back, and the copy waits for the device). A
        prefetched one is taken without the lock (a prefetch thread only appends to the queue)."""
        if self.in_flight:
            self.release_abandoned()
        if self.queue and same_batch(self.queue[0].features, features):
            return self.queue.popleft()
        if self.queue and training:
            raise RuntimeError(
                "forward() got a different training batch than the next prefetched one; prefetch batches in the "
                "order they are forwarded."
            )
        return self.stage(features)  # not prefetched (or an evaluation batch between prefetched training batches)

    def release(self, staged: StagedBatch) -> None:
        """Unlock ``staged``'s rows."""
        with self.locked():
            self._unlock(staged)

    def _unlock(self, staged: StagedBatch) -> None:
        for key, tickets in staged.tickets.items():
            for ticket in tickets:
                self.caches[key].release(ticket)

    def keep(self, staged: StagedBatch, output: Tensor) -> None:
        """Keep ``staged`` locked until its backward (or until ``output`` is gone without one)."""
        staged.output = weakref.ref(output)
        self.in_flight.append(staged)

    def finish(self, staged: StagedBatch, changed: bool = True) -> None:
        """``staged``'s update is queued: mark its rows changed (``changed``: to be written back
        on eviction) and unlock them. Backward calls this and must not wait for a prefetch
        thread's staging: while that holds the lock, the lock's next holder does it (`locked`),
        before it evicts or writes back any row; the rows stay locked until then."""
        self.in_flight = [s for s in self.in_flight if s is not staged]
        self._finished.append((staged, changed))
        if self.lock.acquire(blocking=False):
            try:
                self._settle_finished()
            finally:
                self.lock.release()

    def _settle_finished(self) -> None:
        while self._finished:  # only the lock's holder takes from it
            staged, changed = self._finished.popleft()
            if changed:
                for cache, slots in staged.read:
                    cache.mark_updated(slots)
            self._unlock(staged)

    def release_abandoned(self) -> None:
        # A training forward whose output is gone without its backward having come (e.g. a
        # skipped step) never gets one: its rows may be unlocked. One whose output is alive
        # stays locked. Called only from forward, never while a backward may be running.
        alive = []
        for staged in self.in_flight:
            if staged.output is not None and staged.output() is not None:
                alive.append(staged)
            else:
                self.release(staged)
        self.in_flight = alive

    def clear(self) -> None:
        """Drop (and unlock) batches prefetched but never forwarded."""
        with self.locked():
            while self.queue:
                self._unlock(self.queue.popleft())


def _rows_in(indices: Tensor, spans: list[tuple[int, int]]) -> Tensor:
    """The rows ``indices`` holds in ``spans``, end to end."""
    return concat_spans(indices, spans) if spans else indices[:0]

