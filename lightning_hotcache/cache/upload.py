"""Host rows to a CUDA device through page-locked buffers on a side stream, and back.

A ``non_blocking`` host->device copy is asynchronous only from page-locked memory. Pinning
whole host tables costs a second copy of each while it is pinned, the pinned allocator rounds
sizes up, and memory-mapped tables cannot be pinned that way at all. So the rows a batch
misses are gathered from the host arrays straight into a small page-locked buffer
(``index_select(out=)``: one host copy, as before), copied on a stream of their own, and the
stream that installs them waits on an event, not the host. Buffers alternate, so gathering
the next batch's rows waits (on the host) only for the copy before last, long done by then.

On other devices there is nothing to copy: rows are the host store's `HostStore.read`.

The cache's directory lives on the host (see `DeviceCache`), so a batch's slot indices go up
too (`to_device`: through the caching host allocator's page-locked memory, which keeps a block
until its copy is done), and evicted rows come down (`download`: into page-locked memory, with
an event the host write waits for). Neither makes the host wait for the device. Nor does the
move of the training batches the prefetch thread stages (`batch_to_device`).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torchrec.streamable import Pipelineable

from lightning_hotcache._compat import TransferableData
from lightning_hotcache.cache.host import HostStore
from lightning_hotcache._ops.host_rows import on_cpu

# Buffers in rotation: the gather of batch k waits for the copy of batch k - BUFFERS.
BUFFERS = 2


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` (on the host) on ``device``, queued behind the current stream's work: the
    host does not wait (from pageable memory CUDA would wait for the stream first)."""
    if device.type != "cuda":
        return tensor if tensor.device == device else tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def batch_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensors, torchrec's ``Batch`` and ``KeyedJaggedTensor``, collections of them)
    on ``device``; on CUDA each tensor goes as `to_device` sends one, from page-locked memory
    without the host waiting.

    Lightning's own move (``move_data_to_device``) copies a torchrec ``Batch`` with
    ``non_blocking=False``, and CUDA makes such a copy, like any from pageable memory, wait
    for the work already queued on the stream: on the prefetch thread, for the training step
    in flight (a batch's 5-6 tensors: most of the stream syncs a step a GPU profile showed).
    A batch the data loader pinned is not copied again. Other types with a ``.to``
    move as Lightning moves them."""
    if device.type != "cuda":
        return move_data_to_device(batch, device)

    def move(data: Any) -> Any:
        if not isinstance(data, (Tensor, Pipelineable)):
            return move_data_to_device(data, device)
        pinned = data.pin_memory() if hasattr(data, "pin_memory") else data
        return pinned.to(device, non_blocking=True)

    return apply_to_collection(batch, TransferableData, move)


class RowUpload:
    """Gathers host rows into pinned buffers and copies them to ``device`` on a side stream.

    Per buffer and array key one page-locked tensor, grown (doubled) when a batch misses more
    rows than it holds; a few batches' misses, not tables.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.asynchronous = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.asynchronous else None
        self._buffers: list[dict[str, Tensor]] = [{} for _ in range(BUFFERS)]
        self._copied: list[torch.cuda.Event | None] = [None] * BUFFERS
        self._next = 0

    def gather(self, host: HostStore, ids: Tensor) -> dict[str, Tensor]:
        """Rows ``ids`` (host ids) of every array of ``host``, on the device. On CUDA they are
        ready for work the current stream queues next; the host does not wait for the copy."""
        if not self.asynchronous:
            return host.read(ids)
        assert self.stream is not None
        ids = on_cpu(ids)
        k, self._next = self._next, (self._next + 1) % BUFFERS
        if self._copied[k] is not None:
            self._copied[k].synchronize()  # its rows were copied out before we overwrite them
        rows = {}
        with torch.cuda.stream(self.stream):
            for key, array in host.arrays.items():
                staged = self._buffer(k, key, len(ids), array.shape[1])
                torch.index_select(array, 0, ids, out=staged)
                rows[key] = staged.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        self._copied[k] = copied
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(copied)
        for tensor in rows.values():
            tensor.record_stream(consumer)  # made on the side stream, freed after the consumer's use
        return rows

    def to_device(self, tensor: Tensor) -> Tensor:
        return to_device(tensor, self.device)

    def download(self, rows: dict[str, Tensor]) -> tuple[dict[str, Tensor], torch.cuda.Event | None]:
        """Device ``rows`` copied to the host, and the event after which the copies hold them
        (None: they hold them now). The copies are queued behind the current stream's work,
        so they see every update queued before."""
        if not self.asynchronous:
            return {key: on_cpu(value) for key, value in rows.items()}, None
        host = {}
        for key, value in rows.items():
            host[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host[key].copy_(value, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))
        return host, copied

    def _buffer(self, k: int, key: str, num_rows: int, width: int) -> Tensor:
        buffer = self._buffers[k].get(key)
        if buffer is None or len(buffer) < num_rows:
            rows = max(num_rows, 2 * (0 if buffer is None else len(buffer)))
            buffer = torch.empty(rows, width, dtype=torch.float32, pin_memory=True)
            self._buffers[k][key] = buffer
        return buffer[:num_rows]

    def pinned_bytes(self) -> int:
        """Page-locked host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for buffers in self._buffers for b in buffers.values())
