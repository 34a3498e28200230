"""Rows of memory-mapped host files paged in ahead of their reads.

A table larger than RAM lives in memory-mapped files (`host.map_rows`), and a miss whose page
is not in the page cache waits for the disk: one page fault at a time, in the staging of the
batch that reads it, so a batch's cold rows cost it one disk round trip each. Under the
lookahead policy the rows a batch will miss are known when the batch is announced, a window
of batches before it is staged, so their pages are asked of the kernel then
(``madvise(MADV_WILLNEED)``: the kernel queues the reads and returns, and serves them side by
side), and when the batch is staged they are in the page cache and read at memory speed
(benchmarks/README.md). Nothing is read into the process or changes the rows: the batch still
reads its rows when it is staged, after every earlier write-back, so what the model learns
does not change. A page the kernel drops before then is read on its fault, as without the
advice.

Written by hand: neither TorchRec nor FBGEMM has a host tier in files (FBGEMM's SSD tier
keeps rows in RocksDB, whose prefetch is its own). The advice is one compiled loop over the
batch's ids that holds no GIL (`lightning_hotcache._ops.compiled`), one system call per run of
pages, made on a thread of its own so that the announcing thread (on the CPU, the training
loop) does not wait for the calls; numba cannot cache a function that calls C through
ctypes, so a process compiles it once, when it first reads ahead.
``LIGHTNING_HOTCACHE_READ_AHEAD=0`` turns it off (for A/B measurements).
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from collections import deque
from typing import Any, Sequence

import numba
import torch
from torch import Tensor

from lightning_hotcache._ops.switches import Switch, enabled
from lightning_hotcache.cache.host_arrays import libc_madvise

_MADV_WILLNEED = 3  # <asm-generic/mman-common.h>
# Requests (a cache's coming misses of one announced batch) the read-ahead thread may hold
# before new ones are dropped: a hint, so a dropped batch's rows are read when it is staged, as
# without read-ahead. As many as the longest default window holds batches.
MAX_PENDING = 256


@functools.cache
def _compiled_advise() -> Any | None:
    """The compiled loop (None where there is no ``madvise`` or read-ahead is off)."""
    madvise = libc_madvise()
    if madvise is None or not enabled(Switch.READ_AHEAD):
        return None

    @numba.njit(nogil=True)  # not cached: it calls C through ctypes (see the module)
    def advise(base, row_bytes, ids, page, advice):  # type: ignore[no-untyped-def]
        # ``ids`` ascending: a row whose first page the run reaches joins it (one call a run).
        runs = 0
        start = end = -1
        for i in range(len(ids)):
            low = (base + ids[i] * row_bytes) // page * page
            high = base + (ids[i] + 1) * row_bytes
            if low <= end:
                end = max(end, high)
                continue
            if end >= 0:
                madvise(start, end - start, advice)
                runs += 1
            start, end = low, high
        if end >= 0:
            madvise(start, end - start, advice)
            runs += 1
        return runs

    return advise


def read_ahead(array: Tensor, ids: Tensor) -> int:
    """Ask the kernel to page in rows ``ids`` (ascending, in range) of ``array``, a contiguous
    host array mapped from a file; the runs of pages asked for (0 where read-ahead is off).
    A hint: an advice the kernel refuses changes nothing but the time the read takes."""
    advise = _compiled_advise()
    if advise is None or not len(ids) or not array.numel():
        return 0
    row_bytes = array.stride(0) * array.element_size()
    return int(advise(array.data_ptr(), row_bytes, ids.to(torch.int64).contiguous().numpy(), mmap.PAGESIZE, _MADV_WILLNEED))


class _Requests:
    """The rows still to be read ahead, and the thread that makes their system calls, so that
    the announcing thread (on the CPU, the training loop itself) does not wait for them
    (each page the kernel must read is a system call that waits for it, thousands a batch). The
    thread runs while there are requests and ends when there are none: no thread outlives the
    work, and `settle` leaves none behind at the end of a fit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: deque[tuple[Sequence[Tensor], Tensor]] = deque()
        self.worker: threading.Thread | None = None

    def submit(self, arrays: Sequence[Tensor], ids: Tensor) -> bool:
        with self.lock:
            if len(self.pending) >= MAX_PENDING:
                return False
            self.pending.append((arrays, ids))  # the request holds the arrays: their mappings outlive the calls
            if self.worker is None:
                self.worker = threading.Thread(target=self._work, name="hotcache-read-ahead", daemon=True)
                self.worker.start()
        return True

    def _work(self) -> None:
        while True:
            with self.lock:
                if not self.pending:
                    self.worker = None
                    return
                arrays, ids = self.pending.popleft()
            for array in arrays:
                read_ahead(array, ids)

    def settle(self) -> None:
        with self.lock:
            self.pending.clear()
            worker = self.worker
        if worker is not None:
            worker.join()


_requests = _Requests()


def _forget_in_child() -> None:
    # A forked child has none of the parent's threads (its worker, maybe its lock's holder).
    global _requests
    _requests = _Requests()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def read_ahead_later(arrays: Sequence[Tensor], ids: Tensor) -> bool:
    """`read_ahead` of rows ``ids`` of each of ``arrays``, on the read-ahead thread; whether it
    was queued (not where read-ahead is off, nor when `MAX_PENDING` requests wait)."""
    if _compiled_advise() is None or not len(ids):
        return False
    return _requests.submit(arrays, ids)


def settle() -> None:
    """Drop the requests not made yet and wait for the read-ahead thread to end (it ends once
    idle; the calls it is making take microseconds a row): when the announced batches are
    forgotten, as at the end of a fit."""
    _requests.settle()
