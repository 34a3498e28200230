"""Replicated tables under plain DDP: their sparse gradients averaged outside DDP's reducer.

Under ``strategy="ddp"`` (or ``auto`` with several processes) every rank holds every table
and the row-wise optimizer needs the tables' gradients averaged over the ranks, as DDP
averages the dense ones. DDP's reducer can do that for sparse gradients, but with gloo it
corrupts the heap now and then (torch 2.13: ``malloc(): unaligned tcache chunk detected``
or SIGSEGV inside ``loss.backward()``, about once in a few thousand steps; reproduced with
a plain ``nn.EmbeddingBag(sparse=True)`` model under ``DistributedDataParallel``, no
Lightning, no library code), while the same gradients reduced by a synchronous collective
after backward ran 12,000 steps clean. So the tables stay out of DDP (`keep_out_of_ddp`) and
their gradients are averaged right before the row-wise step, with dense all-gathers that
every backend has: the zoo's models average each width's gradient rows inside the step
(`average_row_gradients`, `RowWiseOptimizer.step`'s ``reduce_rows``; their tables get no
``.grad``), a user's model its tables' sparse ``.grad`` (`average_sparse_gradients`). Left out of DDP, they are also left out of the
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

from lightning_hotcache.distributed import collectives
from lightning_hotcache._compat import set_ddp_ignored_parameters
from lightning_hotcache.optim.rowwise import GradientRows
from lightning_hotcache._ops.sorting import sum_by_index


def keep_out_of_ddp(module: nn.Module, parameters: Iterable[Tensor]) -> None:
    """Tell a later ``DistributedDataParallel(module)`` not to reduce ``parameters``
    (their gradients are then the caller's to reduce, e.g. with `average_sparse_gradients`)."""
    ids = {id(p) for p in parameters}
    set_ddp_ignored_parameters(module, [name for name, p in module.named_parameters() if id(p) in ids])


@torch.no_grad()
def average_row_gradients(pieces: Sequence[GradientRows], group: dist.ProcessGroup | None = None) -> list[GradientRows]:
    """For each ``(rows, gradient rows)`` (every rank passes as many, of the same widths, in the
    same order; a rank may have no rows), the distinct rows over the ranks of ``group``,
    ascending, and the mean over the ranks of each one's summed gradient rows: what DDP's
    averaging of the sparse gradients gives, coalesced. One all-gather of the rows' counts for
    all, then two per piece (row indices, gradient rows). Dense all-gathers rather than a
    sparse all-reduce: every backend has them (NCCL has no sparse all-reduce). Summed by
    `sum_by_index` (no sparse COO coalesce)."""
    if not pieces:
        return []
    counts = _all_gather(torch.tensor([len(rows) for rows, _ in pieces], device=pieces[0][0].device), group)
    world = len(counts)
    averaged = []
    for (rows, values), sizes in zip(pieces, torch.stack(counts, dim=1).tolist()):  # sizes: [rank]
        longest = max(sizes)
        padded_rows = rows.new_zeros(longest)
        padded_rows[: len(rows)] = rows
        padded_values = values.new_zeros(longest, values.shape[1])
        padded_values[: len(values)] = values
        every_rows = _all_gather(padded_rows, group)
        every_values = _all_gather(padded_values, group)
        distinct, summed = sum_by_index(
            torch.cat([r[:n] for r, n in zip(every_rows, sizes)]), torch.cat([v[:n] for v, n in zip(every_values, sizes)])
        )
        averaged.append((distinct, summed.div_(world).to(values.dtype)))
    return averaged


@torch.no_grad()
def average_sparse_gradients(parameters: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Replace each parameter's sparse gradient with its mean over the ranks of ``group``.

    Every rank must pass the same parameters in the same order (a rank whose gradient is
    None takes part with an empty one). Tables of one width and dtype travel together,
    stacked by row offset (`average_row_gradients`), however many tables. Each result is
    coalesced. The zoo's models average their tables' gradient rows inside the row-wise
    step instead (`RowWiseOptimizer.step`'s ``reduce_rows``), where they need no ``.grad``.
    """
    by_width: dict[tuple[int, torch.dtype], list[Tensor]] = defaultdict(list)
    for param in parameters:
        if param.grad is not None and not param.grad.is_sparse:
            raise ValueError(
                f"average_sparse_gradients takes sparse gradients; got a dense one for a {tuple(param.shape)} "
                "parameter (build its table with nn.EmbeddingBag(sparse=True))"
            )
        by_width[(param.shape[1], param.dtype)].append(param)
    stacks = [_stack_gradients(params) for params in by_width.values()]
    averaged = average_row_gradients([(indices, values) for _, indices, values in stacks], group)
    for params, (offsets, _, _), (rows, row_values) in zip(by_width.values(), stacks, averaged):
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
