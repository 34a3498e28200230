"""Rows written into a host tensor at distinct row indices: ``index_copy_`` as a compiled loop.

On the CPU torch's ``index_copy_`` moves a 2-D tensor's rows element by element (a
TensorIterator over every value); a loop that copies whole rows wrote 13k rows of 128
floats into an 8M-row table in 0.9-1.4 ms where ``index_copy_`` took 2.6-3.6 ms on 2
threads (5.2 on one), and 50k rows in 8-9.5 against 11-14 ms (AMD EPYC, AVX2), on one
thread and holding no GIL (`lightning_hotcache.compiled`). Staging writes evicted rows back
to the host tables with it and installs fetched rows into a CPU cache's slots; the row-wise
optimizers write stepped rows back with it on the CPU. Written by hand: torch has no row copy
by index on the CPU other than ``index_copy_`` / ``index_put_`` (the same kernel).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lightning_hotcache.compiled import without_gil


@without_gil
def _put_rows(target, at, rows):  # type: ignore[no-untyped-def]
    for k in range(len(at)):  # checked first: a bad index writes nothing, as with index_copy_
        if at[k] < 0 or at[k] >= target.shape[0]:
            return k
    width = rows.shape[1]
    for k in range(len(at)):
        row = at[k]
        for j in range(width):
            target[row, j] = rows[k, j]
    return -1


def on_cpu(tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``tensor.to("cpu", dtype)``, without the call where it is on the CPU in that type already:
    on a staging thread beside a training loop every torch call hands the GIL over and waits to
    take it back (`lightning_hotcache.compiled`), a no-op copy included."""
    if tensor.device.type == "cpu" and (dtype is None or tensor.dtype == dtype):
        return tensor
    return tensor.to("cpu", dtype)


def _numpy(tensor: Tensor) -> np.ndarray:
    # detach() only where needed: on a staging thread each torch call hands the GIL over.
    return tensor.detach().numpy() if tensor.requires_grad else tensor.numpy()


def put_rows(target: Tensor, at: Tensor, rows: Tensor) -> None:
    """``target.index_copy_(0, at, rows)`` for distinct ``at``: row ``at[k]`` of ``target``
    becomes ``rows[k]``. Compiled for 2-D host tensors of one dtype, rows of 2 values or more;
    elsewhere torch's op. Rows of one value (Adagrad's accumulator, Adam's step count) are
    torch's: it copies a column as one scatter, 30 against 54 us for 4k rows (AMD EPYC)."""
    if not (
        target.device.type == rows.device.type == at.device.type == "cpu"
        and target.dim() == rows.dim() == 2
        and target.shape[1] > 1
        and at.dim() == 1
        and at.dtype == torch.int64
        and target.dtype == rows.dtype
        and target.shape[1] == rows.shape[1]
        and len(at) == len(rows)
    ):
        target.index_copy_(0, at, rows)
        return
    bad = _put_rows(_numpy(target), at.numpy(), _numpy(rows))
    if bad >= 0:
        raise IndexError(f"Row index {int(at[bad])} is out of range for a tensor of {target.shape[0]} rows.")
    # Written through numpy behind autograd's back: mark the tensor changed, as index_copy_ does.
    torch.autograd.graph.increment_version(target)
