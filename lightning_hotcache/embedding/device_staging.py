"""Staging for caches whose directory is in device memory (`DeviceDirectory`): the host only
prepares a batch, and the device admits its rows at the step.

Ahead of the step (`stage`, on a prefetch thread or inline) the host checks the batch's ids,
puts them in the module's feature order and copies them to the device: work per value that
needs no cache, under no lock. At the step's forward (`take`) each cache's ids are admitted on
the device, in the step's stream order and in ops of fixed sizes (nothing the host waits for,
so the step can be captured in a CUDA graph), and replaced in place by their locations: a slot
at its place in the device table, or a host row the kernels read and step in place
(`triton_tbe.location_of_host_row`). The batch holds its cells until its update is done
(`Staging.finish`) or, without one, until its lookup is; only one batch is admitted at a time
(admission is the step's own, not a prefetch's), so the rows of the batch in flight are all a
cell ever has to keep.

Everything else (announcements, the queue of prefetched batches, finishing and releasing) is
`Staging`'s, with no ticket to release.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchrec import KeyedJaggedTensor

from lightning_hotcache.cache.device import DeviceCache
from lightning_hotcache.cache.device_directory import DeviceDirectory
from lightning_hotcache.cache.upload import to_device
from lightning_hotcache.embedding.batch import StagedBatch, concat_spans, on_device
from lightning_hotcache.embedding.layout import Layout
from lightning_hotcache.embedding.staging import Staging


class DirectoryStaging(Staging):
    """`Staging` of ``caches`` laid out by ``layout``, whose split caches keep their directory in
    device memory (`DeviceCache.on_device`); tables wholly on the device read their rows
    directly, as under `Staging`."""

    def __init__(self, layout: Layout, caches: dict[str, DeviceCache], device: torch.device) -> None:
        super().__init__(layout, caches, device)
        self.directories: dict[str, DeviceDirectory] = {}
        for key in self._acquired:
            directory = caches[key].on_device
            if directory is None:
                raise ValueError(f"Cache {key!r} keeps its directory on the host; DirectoryStaging stages device directories only.")
            self.directories[key] = directory
        self._starts = {key: layout.regions[key].start for key in self.directories}

    def announce(self, features: KeyedJaggedTensor) -> None:
        """A future training batch, checked and ordered now (off the step's path, as `Staging`
        does); no cache learns of it."""
        self._announced.append((features, self._ids(features), [None] * len(self._acquired)))

    def stage(self, features: KeyedJaggedTensor, arrives_as: KeyedJaggedTensor | None = None, announced: bool = False) -> StagedBatch:
        """``features`` prepared for its step: checked, in the module's order, its ids (a
        stack's global ids) on the device; admitted at `take`."""
        arriving = features if arrives_as is None else arrives_as
        ahead = self._announced_ids(features) if announced else None
        if features.values().device.type != "cpu":
            features = features.to(torch.device("cpu"))
        ours, values, indices, spans, _ = ahead[0] if ahead is not None else self._ids(features)
        per_key = ours.length_per_key()
        with self.locked():
            for key in self._counted_only:
                self.caches[key].count_lookups(sum(per_key[k] for k in self._positions[key]))
        if arriving.values().device != values.device:
            ours = on_device(arriving, features, ours, self.layout.features, self.layout.input_of, self.layout.table_of)
        return StagedBatch(arriving, ours, to_device(indices, self.device), {}, [], spans=spans)

    def take(self, features: KeyedJaggedTensor, training: bool) -> StagedBatch:
        """`Staging.take`, the batch then admitted: its ids become locations, its cells held."""
        staged = super().take(features, training)
        for key, directory in self.directories.items():
            spans = staged.spans[key]
            admission = directory.admit(concat_spans(staged.indices, spans), training)
            slots = admission.locations
            # Slots are the cache's; in the device table they start at its region.
            _put_spans(staged.indices, spans, torch.where(slots >= 0, slots + self._starts[key], slots))
            staged.held[key] = admission
        return staged

    def _unlock(self, staged: StagedBatch) -> None:
        while staged.held:  # each admission released once, whoever releases the batch
            key, admission = staged.held.popitem()
            self.directories[key].release(admission)


def _put_spans(target: Tensor, spans: list[tuple[int, int]], values: Tensor) -> None:
    """``target[a:b]`` for each span in turn becomes the next of ``values`` (on the device)."""
    done = 0
    for a, b in spans:
        target[a:b] = values[done : done + b - a]
        done += b - a
