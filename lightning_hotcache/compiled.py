"""Host loops compiled by numba to run without the GIL, for what staging does on its threads.

hotcache stages batches on threads beside the training loop, which on a GPU host runs Python
for most of a step. Each torch call a staging thread makes hands the GIL over and must take it
back, which beside a thread running Python cost ~0.1 ms a call on a 2-core AMD EPYC
(`benchmarks/staging.py --beside-python`). A loop compiled with ``nogil=True`` is one call
that holds no GIL while it runs, and passes over a batch's ids once where torch ops pass once
per op. Written as loops over numpy views of the host tensors (`Tensor.numpy()` shares memory).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numba

F = TypeVar("F", bound=Callable[..., object])


def without_gil(function: F) -> F:
    """``function`` compiled to run without the GIL, at its first call. Cached on disk (next to
    its file, or in the user's cache directory), so that a machine compiles it once, not every
    process; where neither is writable numba refuses to cache, and each process compiles."""
    try:
        return numba.njit(nogil=True, cache=True)(function)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(nogil=True)(function)
