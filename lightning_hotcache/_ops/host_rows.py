"""Rows written into a host tensor at distinct row indices: ``index_copy_`` as a compiled loop.

On the CPU torch's ``index_copy_`` moves a 2-D tensor's rows element by element (a
TensorIterator over every value); a loop that copies whole rows is faster on one thread than
``index_copy_`` on several, and holds no GIL (`lightning_hotcache._ops.compiled`;
benchmarks/README.md). Staging writes evicted rows back to the host tables with it and
installs fetched rows into a CPU cache's slots; the row-wise optimizers write stepped rows
back with it on the CPU. Written by hand: torch has no row copy
by index on the CPU other than ``index_copy_`` / ``index_put_`` (the same kernel).

A large copy is split between the calling thread and helper threads where the machine has
cores to spare beyond the training loop's and the staging thread's (`copy_threads`): writing
rows to random places of a table of many GB waits on memory for every row, and threads wait
side by side, so a second thread shortens the copy where a core is free for it
(`benchmarks/row_copy.py`). A GPU host's staging thread writes a 1% cache's evicted rows back
with it on every batch. The rows are distinct, so the threads' writes never overlap and the
result is the same. Python threads, not numba's parallel loops: numba's default threading
layer aborts when two threads (the staging thread and the training loop) run parallel loops
at once.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from lightning_hotcache._ops.compiled import without_gil
from lightning_hotcache._ops.switches import Switch, setting


# Values (rows x width) below which a copy stays on one thread: handing chunks to helper
# threads costs tens of microseconds, a copy of 256k values a few hundred.
SPLIT_VALUES = 1 << 18


@without_gil
def _first_out_of_range(at, num_rows):  # type: ignore[no-untyped-def]
    for k in range(len(at)):
        if at[k] < 0 or at[k] >= num_rows:
            return k
    return -1


@without_gil
def _copy_rows(target, at, rows):  # type: ignore[no-untyped-def]
    width = rows.shape[1]
    for k in range(len(at)):
        row = at[k]
        for j in range(width):
            target[row, j] = rows[k, j]


@without_gil
def _put_rows(target, at, rows):  # type: ignore[no-untyped-def]
    # One compiled call where the copy is not split (a staging thread's calls each hand the GIL over).
    bad = _first_out_of_range(at, target.shape[0])  # checked first: a bad index writes nothing, as with index_copy_
    if bad < 0:
        _copy_rows(target, at, rows)
    return bad


@functools.cache
def host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def copy_threads() -> int:
    """Threads a large row copy is split between: ``LIGHTNING_HOTCACHE_COPY_THREADS`` (for A/B
    measurements), else the cores beyond two (the training loop's and the staging thread's),
    at most 8, and at least the calling thread alone."""
    configured = setting(Switch.COPY_THREADS)
    if configured is None:
        return max(1, min(8, host_cores() - 2))
    if not configured.strip().isdigit() or int(configured) < 1:
        raise ValueError(
            f"LIGHTNING_HOTCACHE_COPY_THREADS={configured!r}: give the number of threads a large row copy is "
            "split between, 1 or more (1 keeps it on the calling thread), or unset it for the default."
        )
    return int(configured)


class _Helpers:
    """The helper threads of split copies, started at the first and kept until
    `release_helpers` (the end of a fit: no thread outlives it); a forked child (a DataLoader
    worker) has none of them and starts its own (`_forget_in_child`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the staging thread and the training loop both copy rows
        self.pool: ThreadPoolExecutor | None = None
        self.workers = 0

    def start(self, workers: int, copies: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[Future[None]]:
        """``_copy_rows`` of each of ``copies`` on a helper. Queued under the lock: a
        `release_helpers` from another thread then waits for them rather than refusing them."""
        with self.lock:
            if self.pool is None or self.workers != workers:  # new only where the thread count was changed
                self.pool = ThreadPoolExecutor(workers, thread_name_prefix="hotcache-row-copy")
                self.workers = workers
            return [self.pool.submit(_copy_rows, *copy) for copy in copies]


_helpers = _Helpers()


def release_helpers() -> None:
    """End the helper threads once their copies are done (the next split copy starts them
    again): the hotcache strategy's teardown and the zoo model's ``on_fit_end`` call it, so
    that no thread outlives a fit."""
    with _helpers.lock:
        pool, _helpers.pool = _helpers.pool, None
    if pool is not None:
        pool.shutdown(wait=True)


def _forget_in_child() -> None:
    global _helpers
    _helpers = _Helpers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _copy_split(target: np.ndarray, at: np.ndarray, rows: np.ndarray, threads: int) -> None:
    chunks = min(threads, rows.size // SPLIT_VALUES)
    step = -(-len(at) // chunks)
    helped = _helpers.start(threads - 1, [(target, at[i : i + step], rows[i : i + step]) for i in range(step, len(at), step)])
    _copy_rows(target, at[:step], rows[:step])
    for done in helped:
        done.result()


def on_cpu(tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``tensor.to("cpu", dtype)``, without the call where it is on the CPU in that type already:
    on a staging thread beside a training loop every torch call hands the GIL over and waits to
    take it back (`lightning_hotcache._ops.compiled`), a no-op copy included."""
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
    torch's: it copies a column as one scatter, faster than a loop of one-value rows."""
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
    into, ids, values = _numpy(target), at.numpy(), _numpy(rows)
    threads = copy_threads()
    if threads == 1 or values.size < 2 * SPLIT_VALUES:
        bad = _put_rows(into, ids, values)
    else:
        bad = _first_out_of_range(ids, len(into))
        if bad < 0:
            _copy_split(into, ids, values, threads)
    if bad >= 0:
        raise IndexError(f"Row index {int(at[bad])} is out of range for a tensor of {target.shape[0]} rows.")
    # Written through numpy behind autograd's back: mark the tensor changed, as index_copy_ does.
    torch.autograd.graph.increment_version(target)
