"""Large host arrays on 2 MiB pages (Linux transparent huge pages, THP).

A lookup or a row-wise update touches random rows of tables that span gigabytes. With 4 KiB
pages nearly every row read is also a TLB miss and a page walk; with 2 MiB pages the page
tables of a few GB fit the TLB's second level. Measured on the 2-core CPU at
cpu_throughput's setting (26 tables, 33.8M rows of dim 16, batch 2048): FBGEMM's row-wise
Adagrad backward 10.7 -> 9.7 ms a step with the tables and their state on 2 MiB pages.

Written by hand because neither PyTorch nor FBGEMM offers it per tensor: PyTorch's only switch
(``THP_MEM_ALLOC_ENABLE``) is process-wide and also puts every large temporary on 2 MiB pages,
which then fault and get zeroed 2 MiB at a time on every step (the same lookup's forward went
from 3.1 to 5.0 ms under it). Here only the long-lived arrays are advised:

* `zeros_on_huge_pages` maps a new array and advises ``MADV_HUGEPAGE`` before anything
  touches it, so its pages fault in as 2 MiB pages (host stores in RAM);
* `move_to_huge_pages` collapses an array that is already filled (``MADV_COLLAPSE``, Linux 6.1+,
  in place, 2 MiB at a time), for memory allocated by someone else (FBGEMM's TBE weights).

Both are hints: where the kernel has THP off, is older or has no free huge pages, arrays stay
on 4 KiB pages, unchanged, and nothing fails. ``LIGHTNING_HOTCACHE_HUGE_PAGES=0`` turns both
off (for A/B measurements).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import os
import sys
from typing import Callable

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>
_MADV_COLLAPSE = 25


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux") or os.environ.get("LIGHTNING_HOTCACHE_HUGE_PAGES", "1") == "0":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _advise(tensor: Tensor, advice: int) -> bool:
    """``madvise`` the whole 2 MiB pages inside ``tensor``'s memory; whether the kernel took it."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    start = tensor.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    end = (start + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    return end > first and madvise(first, end - first, advice) == 0


def zeros_on_huge_pages(rows: int, width: int) -> Tensor:
    """A zero float32 array in a mapping of its own, advised before anything touches it, so its
    pages fault in as 2 MiB pages where the kernel grants them (and only when first written:
    the kernel's zero pages, no fill pass). The tensor holds the mapping; freed with it."""
    nbytes = rows * width * 4
    if _madvise() is None or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(rows, width, dtype=torch.float32)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP built out of the kernel: 4 KiB pages, as any array
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.float32).view(rows, width)


def move_to_huge_pages(tensor: Tensor) -> bool:
    """Put ``tensor``'s filled memory on 2 MiB pages in place; whether the kernel did (values
    never change; about 2 s per GB on the 2-core CPU, so only for long-lived arrays)."""
    return _advise(tensor, _MADV_HUGEPAGE) and _advise(tensor, _MADV_COLLAPSE)
