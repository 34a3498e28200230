"""Host arrays the CUDA kernels read and write in place: page-locked and mapped into the
devices' address space (``cudaHostRegister``), as FBGEMM's UVM tables map theirs
(``new_host_mapped_tensor``).

An array registered here stays a CPU tensor; its ``data_ptr`` is valid on the device too
(unified addressing), which is what Triton's launcher resolves (``cuPointerGetAttribute``), so a
kernel takes it as it takes a device tensor. Unlike ``pin_memory()``, registering copies
nothing and does not round the allocation up. The registration ends with the array's memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from typing import Callable, Sequence

import torch
from torch import Tensor

from lightning_hotcache.kernels import triton_tbe

# cudaHostRegisterPortable | cudaHostRegisterMapped: every context may use it, through a device pointer.
_PORTABLE_MAPPED = 1 | 2


class HostMappingError(RuntimeError):
    """The host memory could not be mapped into the devices' address space."""


def why_unmappable(array: Tensor) -> str | None:
    """Why ``array`` cannot be mapped for CUDA kernels (None where it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if array.device.type != "cpu":
        return f"it is on {array.device}, not in host memory"
    if not array.is_contiguous():
        return "it is not contiguous"
    return None


def map_for_devices(array: Tensor) -> Callable[[], None]:
    """Page-lock ``array``'s memory and map it into the CUDA devices' address space, until the
    array is freed or the returned call unmaps it (once per array: a view of a mapped array is
    mapped already). Raises `HostMappingError` naming the reason where the driver refuses. The driver alone decides
    what it can lock (whether ``ulimit -l`` bounds it is the driver's to say: torch's pinned
    buffers are not held to it), so nothing is refused ahead of it."""
    why = why_unmappable(array)
    if why is not None:
        raise HostMappingError(f"cannot map a host array for the CUDA kernels: {why}.")
    pointer, size = array.data_ptr(), array.numel() * array.element_size()
    if size == 0:
        return lambda: None
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(pointer, size, _PORTABLE_MAPPED)
    if int(status) != 0:
        _clear_last_cuda_error()
        raise HostMappingError(
            f"cudaHostRegister refused to page-lock {size} bytes of host memory ({status}): free host memory (or "
            "raise ulimit -l where the driver counts locked memory against it), or use host_storage=<directory>, "
            "whose rows reach the device through staged copies."
        )
    return weakref.finalize(array, cudart.cudaHostUnregister, pointer)


def map_all_for_devices(arrays: Sequence[Tensor], device: torch.device) -> None:
    """`map_for_devices` each of ``arrays`` and `check_the_kernels_read` the first on
    ``device``: all mapped, or, where any step fails, none (those already mapped are unmapped,
    so that arrays kept for a host directory do not stay page-locked), and the
    `HostMappingError` raised."""
    unmaps: list[Callable[[], None]] = []
    try:
        for array in arrays:
            unmaps.append(map_for_devices(array))
        if arrays:  # one read answers for every array: the same driver and launcher
            check_the_kernels_read(arrays[0], device)
    except HostMappingError:
        for unmap in unmaps:
            unmap()
        raise


def check_the_kernels_read(array: Tensor, device: torch.device) -> None:
    """Read the first row of ``array`` (host rows, mapped) with the Triton kernels on ``device``
    and compare it with the host's, so that a driver or Triton that cannot resolve a registered
    host pointer is found where the collection is built, which then keeps the host directory,
    rather than in the first step. Raises `HostMappingError` naming what failed."""
    if array.numel() == 0:
        return
    row = array[:1].reshape(1, -1)
    saved = row.clone()
    # Values of its own for the read (the rows may still be zero pages, which a read that
    # fails quietly could return too), put back after it.
    probe = torch.arange(1, row.shape[1] + 1, dtype=torch.float32).view(1, -1)
    row.copy_(probe)
    slots = torch.zeros(1, row.shape[1], device=device)
    location = triton_tbe.location_of_host_row(torch.zeros(1, dtype=torch.int64, device=device))
    try:
        read = triton_tbe.pooled(slots, location, torch.tensor([0, 1], device=device), host_weight=row).cpu()
    except (RuntimeError, ValueError) as error:  # Triton's launcher refuses a pointer it cannot resolve
        raise HostMappingError(f"the Triton kernels could not read the mapped host rows ({error})") from error
    finally:
        row.copy_(saved)
    if not torch.equal(read, probe):
        raise HostMappingError("the Triton kernels read other values than the mapped host rows hold")


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a refused registration, so that torch's next
    kernel launch check does not report it as its own (torch binds no ``cudaGetLastError``: the
    runtime torch loaded is found among the process's libraries)."""
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps if "libcudart" in line)
        ctypes.CDLL(path).cudaGetLastError()
