"""A plain collection's tables as consecutive rows of one tensor, so a step reads and writes
them all with one op each.

TorchRec's unsharded `EmbeddingBagCollection` gives every table a weight of its own, so the
forward looks each table up with an `embedding_bag` of its own and the row-wise step gathers and
writes each table apart: on a GPU, where ``auto``'s step is bound by the host's launches, that is
host time per table per op, a large share of the step with tens of tables (benchmarks/README.md).
FBGEMM's table-batched module stores all tables in one weight for that reason, but it keeps its own optimizer and needs its
CUDA build. Here each table's ``nn.Parameter`` stays where TorchRec put it, with its name, shape,
state dict and sharders, but its data is a view of one stack of rows: the forward
(`lightning_hotcache.embedding.torchrec_lookup`) and the row-wise step
(`lightning_hotcache.optim.rowwise`) find the stack with `stacked_rows` and run one op on it; where
the tables are not stacked (a user's own collection, a table swapped), they run per table as
before.

`stack_tables` lays a collection's tables out so (its values unchanged); `move_stacked_tables`
keeps them so across ``module.to(device)``, which otherwise moves each parameter apart.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor, nn
from torchrec import EmbeddingBagCollection


def stacked_rows(weights: Sequence[Tensor]) -> Tensor | None:
    """The (total rows, dim) tensor whose consecutive row ranges are ``weights``, in order (a
    view sharing their memory and version counter), or None where they are not laid out so.

    Checked at every call from the weights' addresses (a walk over the tables' pointers, far
    cheaper than the per-table lookups, gathers and writes the stack saves; see
    benchmarks/README.md): a user may swap a table's data between steps, and a stale stack
    would write rows to memory no table uses."""
    first = weights[0]
    if first.is_meta or first.dim() != 2 or not first.is_contiguous():
        return None
    try:
        address = first.data_ptr()
    except RuntimeError:  # a traced tensor (torch.export's fakes) has no memory: the tables trace apart
        return None
    dim, item, rows = first.shape[1], first.element_size(), 0
    for weight in weights:
        if (
            weight.data_ptr() != address
            or weight.dim() != 2
            or weight.shape[1] != dim
            or weight.dtype != first.dtype
            or weight.device != first.device
            or not weight.is_contiguous()
        ):
            return None
        address += weight.numel() * item
        rows += weight.shape[0]
    # Tables allocated apart may lie end to end in memory too; only one storage holding them
    # all makes them one tensor.
    if first.untyped_storage().nbytes() < (first.storage_offset() + rows * dim) * item:
        return None
    return first.detach().as_strided((rows, dim), (dim, 1))


def _stackable(collection: nn.Module) -> list[nn.Parameter] | None:
    """The table weights of a TorchRec collection whose tables can share one stack (allocated,
    one width, one dtype and device), in the collection's order; None otherwise."""
    if not isinstance(collection, EmbeddingBagCollection):
        return None
    weights = [bag.weight for bag in collection.embedding_bags.values()]
    if (
        len(weights) < 2
        or any(w.is_meta or w.dim() != 2 for w in weights)
        or len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1
    ):
        return None
    return weights


def _point_into(weights: Sequence[nn.Parameter], stack: Tensor) -> None:
    """Make each weight's data its rows of ``stack`` (the Parameter objects stay: optimizers and
    their state keep them)."""
    for weight, rows in zip(weights, stack.split([len(w) for w in weights])):
        weight.data = rows


@torch.no_grad()
def stack_tables(module: nn.Module) -> None:
    """Lay the tables of every TorchRec `EmbeddingBagCollection` under ``module`` out as one
    stack each, values unchanged. Tables already stacked, declared only (meta) or of several
    widths are left as they are. Holds the tables twice while copying (they free one by one as
    the stack takes them): tables too large for that are deferred (``defer_table_init``), and
    `lightning_hotcache.embedding.table_init.materialize_tables` allocates them stacked."""
    for collection in module.modules():
        weights = _stackable(collection)
        if weights is None or stacked_rows(weights) is not None:
            continue
        stack = torch.cat([w.detach() for w in weights])
        _point_into(weights, stack)


def allocate_stacked(collection: EmbeddingBagCollection, device: torch.device) -> bool:
    """Give the declared-only (meta) tables of ``collection`` uninitialized memory on ``device``
    as one stack; returns False (nothing done) where they cannot share one."""
    weights = [bag.weight for bag in collection.embedding_bags.values()]
    others_declared = any(b.is_meta for b in collection.buffers())  # to_empty's, then
    if len(weights) < 2 or others_declared or len({(w.shape[1], w.dtype) for w in weights}) != 1:
        return False
    stack = torch.empty(sum(len(w) for w in weights), weights[0].shape[1], dtype=weights[0].dtype, device=device)
    for bag, weight, rows in zip(collection.embedding_bags.values(), weights, stack.split([len(w) for w in weights])):
        # New parameters, as `nn.Module.to_empty` makes: a meta tensor's data cannot be set to memory.
        bag.weight = nn.Parameter(rows, requires_grad=weight.requires_grad)
    return True


def move_stacked_tables(module: nn.Module, fn: Callable[[Tensor], Tensor]) -> None:
    """Apply ``fn`` (what ``nn.Module._apply`` applies: a move, a cast) to every stack of tables
    under ``module`` as a whole and point its tables into the result, before ``_apply`` walks the
    parameters: it would move each table apart (and the stack would be lost). The tables then are
    where ``fn`` puts them, so ``_apply``'s own ``fn`` leaves them as they are."""
    with torch.no_grad():
        for collection in module.modules():
            weights = _stackable(collection)
            stack = None if weights is None else stacked_rows(weights)
            if stack is None:
                continue
            moved = fn(stack)
            # To the meta device a parameter's data cannot be set: `_apply` makes new ones.
            if moved is not stack and not moved.is_meta:
                _point_into(weights, moved)
