"""Replicated tables under plain DDP: their sparse gradients averaged outside DDP's reducer.

Under ``strategy="ddp"`` (or ``auto`` with several processes) every rank holds every table
and the row-wise optimizer needs the tables' gradients averaged over the ranks, as DDP
averages the dense ones. DDP's reducer can do that for sparse gradients, but with gloo it
corrupts the heap now and then (torch 2.13: ``malloc(): unaligned tcache chunk detected``
or SIGSEGV inside ``loss.backward()``, about once in a few thousand steps; reproduced with
a plain ``nn.EmbeddingBag(sparse=True)`` model under ``DistributedDataParallel``, no
Lightning, no library code). The same sparse ``all_reduce`` called synchronously after
backward ran 12,000 steps clean. So the tables stay out of DDP (`keep_out_of_ddp`) and
`average_sparse_gradients` reduces their gradients right before the row-wise step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hotcache._compat import set_ddp_ignored_parameters


def keep_out_of_ddp(module: nn.Module, parameters: Iterable[Tensor]) -> None:
    """Tell a later ``DistributedDataParallel(module)`` not to reduce ``parameters``
    (their gradients are then the caller's to reduce, e.g. with `average_sparse_gradients`)."""
    ids = {id(p) for p in parameters}
    set_ddp_ignored_parameters(module, [name for name, p in module.named_parameters() if id(p) in ids])


@torch.no_grad()
def average_sparse_gradients(parameters: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Replace each parameter's sparse gradient with its mean over the ranks of ``group``.

    Every rank must pass the same parameters in the same order (a rank whose gradient is
    None takes part with an empty one). Tables of one width and dtype travel as one sparse
    tensor, stacked by row offset: one collective per width, not per table. Each result is
    coalesced (rows sorted, repeats summed).
    """
    by_width: dict[tuple[int, torch.dtype], list[Tensor]] = defaultdict(list)
    for param in parameters:
        if param.grad is not None and not param.grad.is_sparse:
            raise ValueError(
                f"average_sparse_gradients takes sparse gradients; got a dense one for a {tuple(param.shape)} "
                "parameter (build its table with nn.EmbeddingBag(sparse=True))"
            )
        by_width[(param.shape[1], param.dtype)].append(param)
    world = dist.get_world_size(group)
    for (width, dtype), params in by_width.items():
        offsets = [0]
        for param in params:
            offsets.append(offsets[-1] + param.shape[0])
        indices, values = [], []
        for param, offset in zip(params, offsets):
            if param.grad is not None:
                indices.append(param.grad._indices()[0] + offset)  # uncoalesced: no sort needed here
                values.append(param.grad._values())
        device = params[0].device
        stacked = torch.sparse_coo_tensor(
            torch.cat(indices).unsqueeze(0) if indices else torch.empty(1, 0, dtype=torch.long, device=device),
            torch.cat(values) if values else torch.empty(0, width, dtype=dtype, device=device),
            (offsets[-1], width),
        )
        dist.all_reduce(stacked, group=group)
        summed = stacked.coalesce()
        rows, row_values = summed.indices()[0], summed.values() / world
        bounds = torch.searchsorted(rows, torch.tensor(offsets, device=rows.device)).tolist()
        for param, offset, start, end in zip(params, offsets, bounds, bounds[1:]):
            if param.grad is None and start == end:
                continue  # no rank looked this table up: leave it without a gradient, as DDP would
            param.grad = torch.sparse_coo_tensor(
                (rows[start:end] - offset).unsqueeze(0), row_values[start:end], param.shape, is_coalesced=True
            )
