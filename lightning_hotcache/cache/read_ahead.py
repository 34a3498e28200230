"""Rows of memory-mapped host files paged in ahead of their reads.

A table larger than RAM lives in memory-mapped files (`host.map_rows`), and a miss whose page
is not in the page cache waits for the disk: one page fault at a time, in the staging of the
batch that reads it (on a 2-core machine with a virtio disk, 4,000 cold rows of 512 bytes
took 127-139 ms to read). Under the lookahead policy the rows a batch will miss are known
when the batch is announced, a window of batches before it is staged, so their pages are
asked of the kernel then (``madvise(MADV_WILLNEED)``: the kernel queues the reads and
returns), and when the batch is staged they are in the page cache (the same 4,000 rows,
advised 0.3 s before: 26 ms to advise, 7 ms to read). Nothing is read into the process or
changes the rows: the batch still reads its rows when it is staged, after every earlier
write-back, so what the model learns does not change. A page the kernel drops before then
is read again as before.

Written by hand: neither TorchRec nor FBGEMM has a host tier in files (FBGEMM's SSD tier
keeps rows in RocksDB, whose prefetch is its own). The advice is one compiled loop over the
batch's ids that holds no GIL (`lightning_hotcache.compiled`), one system call per run of
pages, made on a thread of its own so that the announcing thread (on the CPU, the training
loop) does not wait for the calls; numba cannot cache a function that calls C through
ctypes, so a process compiles it once, when it first reads ahead. ``LIGHTNING_HOTCACHE_READ_AHEAD=0`` turns it off (for A/B
measurements).
"""

from __future__ import annotations

import functools
import mmap
import os
import queue
import threading
from typing import Any, Sequence

import numba
import torch
from torch import Tensor

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
    if madvise is None or os.environ.get("LIGHTNING_HOTCACHE_READ_AHEAD", "1") == "0":
        return None

    @numba.njit(nogil=True)  # not cached: it calls C through ctypes (see the module)
    def advise(base, row_bytes, ids, page, advice):  # type: ignore[no-untyped-def]
        # ``ids`` ascending: rows on one page, or on pages that touch, make one run and one call.
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


class _ReadAheadThread:
    """One daemon thread per process that makes `read_ahead`'s system calls, so that the
    announcing thread (on the CPU, the training loop itself) does not wait for them: asking
    for a page the kernel must read costs it ~6 us (2,400 rows a batch: ~15 ms)."""

    def __init__(self) -> None:
        self.pending: queue.Queue[tuple[Sequence[Tensor], Tensor]] = queue.Queue(maxsize=MAX_PENDING)
        self.thread = threading.Thread(target=self._run, name="hotcache-read-ahead", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            arrays, ids = self.pending.get()  # the request holds the arrays: their mappings outlive the calls
            for array in arrays:
                read_ahead(array, ids)


@functools.cache
def _thread() -> _ReadAheadThread:
    return _ReadAheadThread()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_thread.cache_clear)  # a forked child has no thread: it starts its own


def read_ahead_later(arrays: Sequence[Tensor], ids: Tensor) -> bool:
    """`read_ahead` of rows ``ids`` of each of ``arrays``, on a thread of its own; whether it was
    queued (not where read-ahead is off, nor when the thread is `MAX_PENDING` requests behind)."""
    if _compiled_advise() is None or not len(ids):
        return False
    try:
        _thread().pending.put_nowait((arrays, ids))
    except queue.Full:
        return False
    return True
