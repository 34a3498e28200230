"""Every collective the library runs, on the device its process group's backend needs.

gloo moves CPU tensors, NCCL CUDA tensors of the current device: a CPU tensor handed to an
NCCL group fails (a checkpoint's gathered tables, a cache that lives in host memory), and a
CUDA tensor to most gloo collectives too. `group_device` says which device a group takes;
the wrappers below move their tensors there and the results back, so callers pass tensors
wherever they live. `tests/test_collectives.py` checks that the library calls
``torch.distributed``'s collectives nowhere else.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def group_device(group: Any = None) -> torch.device:
    """The device of the tensors ``group``'s backend moves: the current CUDA device for NCCL,
    else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Done:
    """What an async collective returns once its result has been copied back (nothing to wait for)."""

    def wait(self) -> bool:
        return True


def all_to_all_single(
    output: Tensor,
    input: Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """`torch.distributed.all_to_all_single` on ``group``'s device. Async only where the tensors
    are there already (else it runs synchronously, to copy the result back)."""
    device = group_device(group)
    if output.device == device and input.device == device:
        return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
    out = torch.empty_like(output, device=device)
    dist.all_to_all_single(out, input.to(device), output_split_sizes, input_split_sizes, group=group)
    output.copy_(out)
    return _Done() if async_op else None


def all_gather(parts: list[Tensor], tensor: Tensor, group: Any = None) -> None:
    """`torch.distributed.all_gather` into ``parts`` (on any device) on ``group``'s device."""
    device = group_device(group)
    gathered = [torch.empty_like(p, device=device) for p in parts]
    dist.all_gather(gathered, tensor.contiguous().to(device), group=group)
    for part, got in zip(parts, gathered):
        part.copy_(got)


def all_reduce(tensor: Tensor, group: Any = None) -> None:
    """`torch.distributed.all_reduce` (sum) of ``tensor`` in place, on ``group``'s device."""
    device = group_device(group)
    if tensor.device == device:
        dist.all_reduce(tensor, group=group)
        return
    on_device = tensor.to(device)
    dist.all_reduce(on_device, group=group)
    tensor.copy_(on_device)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order. torch moves the pickled bytes to the
    group's device itself (for NCCL, the current CUDA device)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


@torch.no_grad()
def broadcast_from_rank_zero(tensors: Iterable[Tensor], group: Any = None) -> None:
    """Give every rank of ``group`` rank 0's values of ``tensors`` (in place; a
    `torch.distributed.broadcast` each, on ``group``'s device)."""
    device = group_device(group)
    for tensor in tensors:
        on_device = tensor.to(device)
        dist.broadcast(on_device, src=0, group=group)
        if on_device is not tensor:
            tensor.copy_(on_device)
