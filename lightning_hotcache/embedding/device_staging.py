"""Staging for caches whose directory is in device memory (`DeviceDirectory`): the host only
checks a batch ahead of its step, and the step itself, on the device, turns its ids into rows.

Ahead of the step (`prefetch`, on the strategy's threads, or `announce` before it) the host
checks the batch's ids against their tables (on the host already: no wait) and counts the
lookups of tables wholly on the device. At the step's forward (`take`) everything is device
ops of sizes the host knows (the batch's ids per feature): the features put in the module's
order, the ids made a stack's global ids, each cache's ids admitted (`DeviceDirectory.admit`)
and replaced by their locations (a slot at its place in the device table, or a host row the
kernels read and step in place: `triton_tbe.location_of_host_row`). No host read, no wait for
another thread (the module's lock guards only the record of checked batches), no Python state
that a step changes for good: the step can be recorded in a CUDA graph
(`lightning_hotcache._ops.step_graph`) and replayed without its Python. A batch holds its cells
from its forward until its update is done (`finish`) or, without one, its lookup; batches are
admitted one forward at a time, so a cell only ever has to stay with the batch in flight.

Under the lookahead policy an announced batch's ids are also moved to the device (from pinned
memory, without a wait) and handed to each directory's window (`DeviceDirectory.announce`).

A forward of a batch that was not checked ahead (an evaluation batch, a direct call) checks it
then, which copies its ids to the host; inside a step a graph records, the batch is a static
copy of one its model checked before handing it to the graph (`HotColdEmbeddingBagCollection.check`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque

import numpy as np
import torch
from torch import Tensor
from torchrec import KeyedJaggedTensor
from typing_extensions import override

from lightning_hotcache.cache.device import DeviceCache
from lightning_hotcache.cache.device_directory import DeviceDirectory
from lightning_hotcache.embedding.batch import StagedBatch, check_ids, concat_spans, in_feature_order, same_batch
from lightning_hotcache.embedding.layout import Layout
from lightning_hotcache.embedding.staging import Staging
from lightning_hotcache._ops import step_graph
from lightning_hotcache._ops.guards import check_not_empty


class DirectoryStaging(Staging):
    """`Staging` of ``caches`` laid out by ``layout`` whose split caches keep their directory in
    device memory (`DeviceCache.on_device`); tables wholly on the device read their rows at
    their place, as under `Staging`."""

    def __init__(self, layout: Layout, caches: dict[str, DeviceCache], device: torch.device) -> None:
        super().__init__(layout, caches, device)
        self.directories: dict[str, DeviceDirectory] = {}
        for key in self._acquired:
            directory = caches[key].on_device
            if directory is None:
                raise ValueError(f"Cache {key!r} keeps its directory on the host; DirectoryStaging stages device directories only.")
            self.directories[key] = directory
        self._starts = {key: layout.regions[key].start for key in self.directories}
        base = layout.value_base()
        self._host_base = base  # per feature, added to its ids
        self._base = None if base is None else base.to(device)
        # The directories that keep a lookahead window: announced batches' ids go to them.
        self._windows = {key: d for key, d in self.directories.items() if d.window_rows}
        # Batches checked ahead, by the memory of their values as forward will get them: their
        # values, weakly (an entry is gone with its batch, so a later batch at the same address
        # is never taken for it), and the batch on the host, whose sizes per feature it keeps.
        self._checked: dict[int, tuple[weakref.ref[Tensor], KeyedJaggedTensor]] = {}
        self._announced_batches: deque[KeyedJaggedTensor] = deque()

    def _check(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` on the host (a batch on the device is copied, which waits for it),
        its ids checked against their tables and the lookups of whole tables counted."""
        return self._checked_in_our_order(features)[0]

    def _checked_in_our_order(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
        """`_check` of ``features``, and the host batch in the module's feature order."""
        host = features if features.values().device.type == "cpu" else features.to(torch.device("cpu"))
        check_not_empty(host)
        ours = in_feature_order(host, self.layout.features, self.layout.input_of, self.layout.table_of)
        check_ids(ours, self.layout.table_of)
        per_key = ours.length_per_key()
        with self.lock:
            for key in self._counted_only:
                self.caches[key].count_lookups(sum(per_key[k] for k in self._positions[key]))
        return host, ours

    def announce(self, features: KeyedJaggedTensor) -> None:
        """A future training batch (on the host), prefetched later with ``announced=True``:
        checked now, and under lookahead its ids handed to the directories' windows."""
        _, ours = self._checked_in_our_order(features)
        self._announced_batches.append(features)
        if not self._windows:
            return
        indices, bounds = self._stack_ids(ours, self._host_base), ours.offset_per_key()
        for key, directory in self._windows.items():
            ids = concat_spans(indices, [(bounds[a], bounds[b]) for a, b in self._runs[key]])
            if self.device.type == "cuda":
                ids = ids.pin_memory().to(self.device, non_blocking=True)
            with self.lock:  # a reader thread announces while the training thread admits
                directory.announce(ids)

    def prefetch(self, features: KeyedJaggedTensor, arrives_as: KeyedJaggedTensor | None = None, announced: bool = False) -> None:
        """Check ``features`` (on the host; the oldest batch announced where ``announced``) for
        its forward, which gets it as ``arrives_as``."""
        if announced and self._announced_batches:
            host = self._announced_batches.popleft()
            if not same_batch(host, features):
                raise RuntimeError(
                    "prefetch(announced=True) got a batch other than the oldest announced one; prefetch announced "
                    "batches in the order they were announced."
                )
        else:
            host = self._check(features)
        arriving = (features if arrives_as is None else arrives_as).values()
        with self.lock:  # the record is written here (a prefetch thread) and taken by forward
            for address in [a for a, (values, _) in self._checked.items() if values() is None]:
                del self._checked[address]
            self._checked[arriving.data_ptr()] = (weakref.ref(arriving), host)

    def check(self, features: KeyedJaggedTensor) -> None:
        """`prefetch` ``features`` (as forward will get it) unless it was already."""
        if self._checked_ahead(features) is None:
            self.prefetch(features)

    def _checked_ahead(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor | None:
        """The host batch of ``features`` where it was checked ahead, else None."""
        values = features.values()
        with self.lock:
            entry = self._checked.get(values.data_ptr())
        if entry is None:
            return None
        alive = entry[0]()
        return entry[1] if alive is not None and alive.shape == values.shape else None

    def _checked_host_batch(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features``'s host batch checked ahead (taken from the record), or checked now;
        inside a recorded step, the static copy itself (its model checked what it copies)."""
        host = self._checked_ahead(features)
        if host is not None:
            with self.lock:
                self._checked.pop(features.values().data_ptr(), None)
            return host
        if step_graph.recording():
            return features
        return self._check(features)

    def take(self, features: KeyedJaggedTensor, training: bool) -> StagedBatch:
        """``features`` (as forward got it) staged: in the module's order, its ids made rows or
        locations on the device, each cache's cells held."""
        if self.in_flight:
            self.release_abandoned()
        host = self._checked_host_batch(features)
        ours = self._in_our_order(features, host)
        indices, bounds = self._stack_ids(ours, self._base), ours.offset_per_key()
        staged = StagedBatch(features, ours, indices, {}, [], recorded=step_graph.recording())
        for key, directory in self.directories.items():
            spans = [(bounds[a], bounds[b]) for a, b in self._runs[key]]
            # A window is announced to from a reader thread too.
            with self.lock if directory.window_rows else contextlib.nullcontext():
                admission = directory.admit(concat_spans(indices, spans), training)
            slots = admission.locations
            # Slots are the cache's; in the device table they start at its region.
            _put_spans(indices, spans, torch.where(slots >= 0, slots + self._starts[key], slots))
            staged.held[key] = admission
        return staged

    def _stack_ids(self, ours: KeyedJaggedTensor, base: Tensor | None) -> Tensor:
        """``ours``' ids (in the module's feature order) as the stacks' global ids: each
        feature's plus its table's ``base``, sized by the host's counts (no wait)."""
        values = ours.values()
        if base is None:
            return values.to(torch.int64, copy=True)
        per_key = ours.lengths().view(len(self.layout.features), ours.stride()).sum(1)
        return values.to(torch.int64) + base.repeat_interleave(per_key, output_size=len(values))

    def _in_our_order(self, features: KeyedJaggedTensor, host: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` in the module's feature order, its sizes per feature those of ``host``
        (the same batch on the host, or ``features`` itself), so that nothing waits for the device."""
        layout = self.layout
        ours = in_feature_order(features, layout.features, layout.input_of, layout.table_of, sized_like=host)
        per_input = dict(zip(host.keys(), host.length_per_key()))
        per_key = [per_input[layout.input_of[f]] for f in layout.features]
        return KeyedJaggedTensor(
            keys=ours.keys(), values=ours.values(), lengths=ours.lengths(), weights=ours.weights_or_none(),
            stride=ours.stride(), length_per_key=per_key, offset_per_key=np.cumsum([0, *per_key]).tolist(),
        )  # fmt: skip

    def finish(self, staged: StagedBatch, changed: bool = True) -> None:
        """``staged``'s update is queued: its cells are released now, behind it on the stream
        (a directory is the training thread's alone: no lock to wait for)."""
        self.in_flight = [s for s in self.in_flight if s is not staged]
        self._unlock(staged)

    def release(self, staged: StagedBatch) -> None:
        self._unlock(staged)

    @override
    def release_abandoned(self) -> None:
        # A batch admitted in a recording that was refused: the admission never ran on the
        # device (a CUDA capture runs nothing; the CPU stand-in puts back what it wrote), so it
        # holds no cell, and releasing its cells would take holds of other batches away.
        self.in_flight = [staged for staged in self.in_flight if not staged.recorded]
        super().release_abandoned()

    def _unlock(self, staged: StagedBatch) -> None:
        while staged.held:  # each admission released once, whoever releases the batch
            key, admission = staged.held.popitem()
            self.directories[key].release(admission)

    def clear(self) -> None:
        """Forget the batches checked ahead and never forwarded."""
        with self.lock:
            self._checked.clear()

    def clear_window(self) -> None:
        self._announced_batches.clear()
        for directory in self._windows.values():
            directory.clear_window()


def _put_spans(target: Tensor, spans: list[tuple[int, int]], values: Tensor) -> None:
    """``target[a:b]`` for each span in turn becomes the next of ``values`` (on the device)."""
    done = 0
    for a, b in spans:
        target[a:b] = values[done : done + b - a]
        done += b - a
