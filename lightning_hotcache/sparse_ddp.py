"""Replicated tables under plain DDP: their sparse gradients averaged outside DDP's reducer.

Under ``strategy="ddp"`` (or ``auto`` with several processes) every rank holds every table
and the row-wise optimizer needs the tables' gradients averaged over the ranks, as DDP
averages the dense ones. DDP's reducer can do that for sparse gradients, but with gloo it
corrupts the heap now and then (torch 2.13: ``malloc(): unaligned tcache chunk detected``
or SIGSEGV inside ``loss.backward()``, about once in a few thousand steps; reproduced with
a plain ``nn.EmbeddingBag(sparse=True)`` model under ``DistributedDataParallel``, no
Lightning, no library code), while the same gradients reduced by a synchronous collective
after backward ran 12,000 steps clean. So the tables stay out of DDP (`keep_out_of_ddp`) and
`average_sparse_gradients` averages their gradients right before the row-wise step, with
dense all-gathers that every backend has. Left out of DDP, they are also left out of the
broadcast of rank 0's weights DDP makes when it wraps the model: the zoo's models broadcast
them at fit start (`collectives.broadcast_from_rank_zero`), so ranks seeded apart still train
one model.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hotcache import collectives
from lightning_hotcache._compat import set_ddp_ignored_parameters
from lightning_hotcache.sorting import sum_by_index


def keep_out_of_ddp(module: nn.Module, parameters: Iterable[Tensor]) -> None:
    """Tell a later ``DistributedDataParallel(module)`` not to reduce ``parameters``
    (their gradients are then the caller's to reduce, e.g. with `average_sparse_gradients`)."""
    ids = {id(p) for p in parameters}
    set_ddp_ignored_parameters(module, [name for name, p in module.named_parameters() if id(p) in ids])


@torch.no_grad()
def average_sparse_gradients(parameters: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Replace each parameter's sparse gradient with its mean over the ranks of ``group``.

    Every rank must pass the same parameters in the same order (a rank whose gradient is
    None takes part with an empty one). Tables of one width and dtype travel together,
    stacked by row offset: one all-gather of the rows' counts for all widths, then two per
    width (row indices, gradient rows), however many tables. Dense all-gathers rather than a
    sparse all-reduce: every backend has them (NCCL has no sparse all-reduce). Each result
    is coalesced (rows sorted, repeats summed, by `sum_by_index`: no sparse COO coalesce).
    """
    by_width: dict[tuple[int, torch.dtype], list[Tensor]] = defaultdict(list)
    for param in parameters:
        if param.grad is not None and not param.grad.is_sparse:
            raise ValueError(
                f"average_sparse_gradients takes sparse gradients; got a dense one for a {tuple(param.shape)} "
                "parameter (build its table with nn.EmbeddingBag(sparse=True))"
            )
        by_width[(param.shape[1], param.dtype)].append(param)
    if not by_width:
        return
    stacks = [_stack_gradients(params) for params in by_width.values()]
    counts = _all_gather(torch.tensor([len(indices) for _, indices, _ in stacks], device=stacks[0][1].device), group)
    world = len(counts)
    sizes_by_width = torch.stack(counts, dim=1).tolist()  # [width group][rank]
    for params, (offsets, indices, values), sizes in zip(by_width.values(), stacks, sizes_by_width):
        width = params[0].shape[1]
        longest = max(sizes)
        padded_indices = indices.new_zeros(longest)
        padded_indices[: len(indices)] = indices
        padded_values = values.new_zeros(longest, width)
        padded_values[: len(values)] = values
        every_indices = _all_gather(padded_indices, group)
        every_values = _all_gather(padded_values, group)
        rows, row_values = sum_by_index(
            torch.cat([i[:n] for i, n in zip(every_indices, sizes)]), torch.cat([v[:n] for v, n in zip(every_values, sizes)])
        )
        row_values = row_values.div_(world).to(params[0].dtype)
        bounds = torch.searchsorted(rows, torch.tensor(offsets, device=rows.device)).tolist()
        for param, offset, start, end in zip(params, offsets, bounds, bounds[1:]):
            if param.grad is None and start == end:
                continue  # no rank looked this table up: leave it without a gradient, as DDP would
            param.grad = torch.sparse_coo_tensor(
                (rows[start:end] - offset).unsqueeze(0), row_values[start:end], param.shape, is_coalesced=True
            )


def _stack_gradients(params: list[Tensor]) -> tuple[list[int], Tensor, Tensor]:
    """Row offsets of ``params`` stacked, and their gradients' (uncoalesced) row indices,
    shifted by those offsets, and rows."""
    offsets = list(itertools.accumulate((param.shape[0] for param in params), initial=0))
    device, width, dtype = params[0].device, params[0].shape[1], params[0].dtype
    indices = [torch.empty(0, dtype=torch.long, device=device)]
    values = [torch.empty(0, width, dtype=dtype, device=device)]
    for param, offset in zip(params, offsets):
        if param.grad is not None:
            indices.append(param.grad._indices()[0] + offset)  # uncoalesced: no sort needed here
            values.append(param.grad._values())
    return offsets, torch.cat(indices), torch.cat(values)


def _all_gather(tensor: Tensor, group: dist.ProcessGroup | None) -> list[Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    collectives.all_gather(parts, tensor, group=group)
    return parts
