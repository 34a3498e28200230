"""Host arrays the CUDA kernels read and write in place: page-locked and mapped into the
devices' address space (``cudaHostRegister``), as FBGEMM's UVM tables map theirs
(``new_host_mapped_tensor``).

An array registered here stays a CPU tensor; its ``data_ptr`` is valid on the device too
(unified addressing), which is what Triton's launcher resolves (``cuPointerGetAttribute``), so a
kernel takes it as it takes a device tensor. Unlike ``pin_memory()``, registering copies
nothing and does not round the allocation up. The registration ends with the array's memory.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

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


def map_for_devices(array: Tensor) -> None:
    """Page-lock ``array``'s memory and map it into the CUDA devices' address space, until the
    array is freed (once per array: a view of a mapped array is mapped already). Raises
    `HostMappingError` naming the reason where the driver refuses (e.g. a locked-memory limit)."""
    why = why_unmappable(array)
    if why is not None:
        raise HostMappingError(f"cannot map a host array for the CUDA kernels: {why}.")
    cudart = torch.cuda.cudart()
    pointer, size = array.data_ptr(), array.numel() * array.element_size()
    if size == 0:
        return
    status = cudart.cudaHostRegister(pointer, size, _PORTABLE_MAPPED)
    if int(status) != 0:
        raise HostMappingError(
            f"cudaHostRegister refused {size} bytes of host memory ({status}): raise the locked-memory limit "
            "(ulimit -l) or use host_storage=<directory>, whose rows reach the device through staged copies."
        )
    weakref.finalize(array, cudart.cudaHostUnregister, pointer)

