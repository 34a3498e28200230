"""Threads that stage several caches at once: one batch's work on caches whose directories are
apart (the parts of a width's split tables, `lightning_hotcache.embedding.layout`) spread over
a few threads.

On a GPU host staging bounds a small cache's step: the prefetch thread took longer a batch than
`auto`'s whole step, on a host whose other cores were mostly idle (benchmarks/README.md), and
its work (the directory's compiled passes, the row gathers and writes) is one thread's, pass
after pass. The directory's passes hold no GIL and torch's copies release it, so caches
of their own staged on threads of their own run side by side.

Written by hand around `concurrent.futures`: its pool's threads do not see the caller's
thread-local torch state, which staging's copies need (no autograd on the device tables, the
caller's CUDA stream, which orders the copies with the step's work); a map here carries both,
runs one share of the work on the calling thread, and returns only once every share is done,
failed or not, so that no thread still works on a cache when the caller goes on or reports
the error.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Iterator, Sequence, TypeVar

import torch

from lightning_hotcache._ops.host_rows import host_cores

Item = TypeVar("Item")
Result = TypeVar("Result")


def check_staging_threads(threads: object) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"staging_threads must be a whole number of threads, at least 1; got {threads!r}.")


class SideBySide:
    """Maps work over items on up to ``threads`` threads (the caller's among them), each item's
    work on one thread; ``device``: where the work's copies go (its current CUDA stream is
    carried to the other threads)."""

    def __init__(self, threads: int, device: torch.device) -> None:
        check_staging_threads(threads)
        self.threads = threads
        self.device = device
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()  # the process whose threads the pool holds
        # CPU seconds the other threads spent on the shares of each caller (thread id), running
        # totals: what a caller's maps cost beyond its own CPU time, which holds its own share.
        self._helper_cpu: dict[int, float] = {}

    def map(self, work: Callable[[Item], Result], items: Sequence[Item]) -> list[Result]:
        """``[work(item) for item in items]``, shared among the threads (items round-robin)."""
        shares = min(self.threads, len(items))
        if shares <= 1:
            return [work(item) for item in items]
        carried = self._carried_state()

        def share(k: int) -> tuple[list[Result], float]:
            started = time.thread_time()
            with carried():
                return [work(item) for item in items[k::shares]], time.thread_time() - started

        pool = self._threads()
        others = [pool.submit(share, k) for k in range(1, shares)]
        try:
            done = [share(0)[0]]
        finally:
            wait(others)  # every share ends before the caller goes on, or raises
        caller = threading.get_ident()
        for future in others:
            results, cpu = future.result()  # the first error among them, if any
            done.append(results)
            self._helper_cpu[caller] = self._helper_cpu.get(caller, 0.0) + cpu
        return [done[k % shares][k // shares] for k in range(len(items))]

    def helper_cpu_seconds(self) -> float:
        """CPU seconds the other threads have spent on the calling thread's maps, in all."""
        return self._helper_cpu.get(threading.get_ident(), 0.0)

    def _carried_state(self) -> Callable[[], contextlib.AbstractContextManager[None]]:
        grad = torch.is_grad_enabled()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

        @contextlib.contextmanager
        def carried() -> Iterator[None]:
            with torch.set_grad_enabled(grad), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                yield

        return carried

    def release(self) -> None:
        """End the threads (the next map starts them again): the strategy's teardown calls it,
        so that no thread outlives a fit."""
        pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)

    def _threads(self) -> ThreadPoolExecutor:
        # A forked child (a loader worker) inherits the pool but not its threads: it makes its own.
        if self._pool is None or self._pid != os.getpid():
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="hotcache-staging")
            self._pid = os.getpid()
            # Idle threads end with the staging that owns them, if no teardown ended them first.
            weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool
