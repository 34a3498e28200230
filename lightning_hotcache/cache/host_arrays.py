"""Large long-lived host arrays: on 2 MiB pages, and not shared with forked processes.

**2 MiB pages** (Linux transparent huge pages, THP). A lookup or a row-wise update touches
random rows of tables that span gigabytes. With 4 KiB pages nearly every row read is also a
TLB miss and a page walk; with 2 MiB pages the page tables of a few GB fit the TLB's second
level, so lookups and row-wise updates (FBGEMM's row-wise Adagrad backward among them) spend
less time walking page tables (benchmarks/README.md).

**Not shared with forked processes** (``MADV_DONTFORK``). DataLoader workers are forked from
the training process, and after a fork every page of the parent is shared copy-on-write with
the children for as long as they live: the parent's first write to each page then faults and
copies it. Staging writes evicted rows back to random rows of host stores of many GB, so for
thousands of steps nearly every row written would be a fault and a page copy, which makes
staging's write-back many times slower while workers live, and more so the more workers there
are (benchmarks/README.md). The children never read these arrays (they load data), so they do
not get them at all.

Written by hand because neither PyTorch nor FBGEMM offers either per tensor: PyTorch's only
page switch (``THP_MEM_ALLOC_ENABLE``) is process-wide and also puts every large temporary on
2 MiB pages, which then fault and get zeroed 2 MiB at a time on every step (slowing the same
lookup's forward down). Here only the long-lived arrays are advised:

* `new_host_array` maps a new array and advises it before anything touches it, so its pages
  fault in as 2 MiB pages and stay out of forked children (host stores in RAM, the cache's
  books; through `new_array`, the id -> slot map, cache slots and device tables where their
  device is the CPU);
* `move_to_huge_pages` collapses an array that is already filled (``MADV_COLLAPSE``, Linux 6.1+,
  in place, 2 MiB at a time), for memory allocated by someone else (FBGEMM's TBE weights).
  Those stay shared with forked children: marking memory that its allocator may hand out
  again would crash a child that later reads what the parent put there.

All are hints: where the kernel has THP off, is older or has no free huge pages, arrays stay
on 4 KiB pages, unchanged, and nothing fails; they are always on (each paid where measured:
benchmarks/README.md).
A forked process that reads one of these arrays gets SIGSEGV: fork before building the module
(Lightning's ``ddp_fork`` launches its processes before the strategy builds it), or spawn.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import mmap
import sys
from typing import Callable

import torch
from torch import Tensor


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>
_MADV_COLLAPSE = 25


@functools.cache
def libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise(address, length, advice)`` (addresses as integers, which numba's
    compiled loops can pass too; see `read_ahead`), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def _advise(tensor: Tensor, advice: int) -> bool:
    """``madvise`` the whole 2 MiB pages inside ``tensor``'s memory; whether the kernel took it."""
    madvise = libc_madvise()
    if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    start = tensor.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    end = (start + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    return end > first and madvise(first, end - first, advice) == 0


def new_host_array(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, fill: float | None = 0) -> Tensor:
    """A host array of ``shape``, in an anonymous mapping of its own that forked processes do
    not get and whose pages fault in as 2 MiB pages where the kernel grants them (see the
    module). The tensor holds the mapping; freed with it.

    ``fill`` is written to every element now, so that the page faults (2 MiB pages are zeroed,
    and may be compacted, as they fault in) are paid here and not by the steps that first
    write each page: leaving the per-slot books and CPU cache slots to fault in during
    staging made it 2-3x slower. ``None`` leaves the kernel's zero pages, no pass over the
    memory, for an array the caller writes whole next (a host store, which table init fills).
    Arrays under 2 MiB are plain tensors (a page or two copied once after a fork)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.full(shape, 0 if fill is None else fill, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_DONTFORK"):
        memory.madvise(mmap.MADV_DONTFORK)
    if libc_madvise() is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP built out of the kernel: 4 KiB pages, as any array
            memory.madvise(mmap.MADV_HUGEPAGE)
    array = torch.frombuffer(memory, dtype=dtype).view(shape)
    if fill is not None:
        array.fill_(fill)
    return array


def new_array(shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype = torch.float32, fill: float = 0) -> Tensor:
    """An array filled with ``fill`` on ``device`` that training writes every step (cache slots,
    device tables, the id -> slot map): on the CPU a `new_host_array`, elsewhere a plain tensor."""
    if torch.device(device).type == "cpu":
        return new_host_array(shape, dtype, fill)
    return torch.full(shape, fill, dtype=dtype, device=device)


def move_to_huge_pages(tensor: Tensor) -> bool:
    """Put ``tensor``'s filled memory on 2 MiB pages in place; whether the kernel did (values
    never change; collapsing copies every page, which is slow for gigabytes, so only for
    long-lived arrays)."""
    return _advise(tensor, _MADV_HUGEPAGE) and _advise(tensor, _MADV_COLLAPSE)
