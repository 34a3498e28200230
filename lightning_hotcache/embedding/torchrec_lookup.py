"""TorchRec's EmbeddingBagCollection looked up as one autograd node: what ``auto`` and ``ddp`` run.

Under ``auto`` (the baseline every GPU figure is a ratio to) a step is bound by the host: every
op is a launch from Python. TorchRec's unsharded `EmbeddingBagCollection.forward` splits the
batch into one jagged tensor per feature (a cumulative sum and splits each), looks each feature
up as a module call that records an autograd node, and the backward runs one sparse
`embedding_bag` backward per feature. `pooled_in_one_node` gives the same output from the same
tables (``ebc(features).values()``, bit for bit) with one autograd node: the forward is one
`embedding_bag` for every feature where the tables are one stack of rows (the zoo's:
`lightning_hotcache.optim.stacked_tables`), else one per feature on slices of the batch (the
features' offsets rebased in two ops); the backward one gather of the pooled gradient's rows
for every id of every feature, handed to the row-wise optimizer as one piece where the caller
asks (a fit's zoo model: no ``.grad`` per table), else each table's sparse gradient a view of
it. The gradient rows are TorchRec's, bit for bit; a table read by several features lists
them feature by feature, where autograd's accumulation of TorchRec's per-feature gradients
interleaves them, so the row-wise optimizer sums such a table's duplicate rows in another
order (the last bits of a sum). The module itself is untouched: its parameters, state dict,
sharders and checkpoints stay TorchRec's.

Written here because neither TorchRec (its fused collections need FBGEMM's CUDA build and keep
their own optimizer) nor torch (``nn.EmbeddingBag`` is one table) looks up a collection of
separate tables with one backward.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor

from lightning_hotcache._ops.switches import Switch, enabled
from lightning_hotcache.kernels import triton_tbe
from lightning_hotcache.optim.stacked_tables import stacked_rows


# Takes a collection's gradient rows as one piece: (its tables, each id's row in the tables laid
# end to end, each id's gradient row); `RowWiseOptimizer.add_row_gradients`.
GradientRowsSink = Callable[[Sequence[Tensor], Tensor, Tensor], None]
# Takes a collection's pooled gradient as one piece: (its tables, each id's row in the tables
# laid end to end, the bags' offsets, each bag's gradient row, feature-major, mean flags or None,
# per-id weights or None); `RowWiseOptimizer.add_pooled_gradients`.
PooledGradientsSink = Callable[[Sequence[Tensor], Tensor, Tensor, Tensor, "Tensor | None", "Tensor | None"], None]


def triton_pools_on(device: torch.device) -> bool:
    """Whether a stack of plain tables on ``device`` is pooled by the Triton TBE (and, where the
    row-wise optimizer takes the pooled gradient, stepped by it): on CUDA where Triton runs,
    unless ``LIGHTNING_HOTCACHE_PLAIN_TABLES_TRITON=0``. FBGEMM's table-batched module would
    need its CUDA build and its own optimizer; ``embedding_bag`` and the PyTorch row step read
    the batch's gradient rows several times over."""
    return device.type == "cuda" and enabled(Switch.PLAIN_TABLES_TRITON) and triton_tbe.why_unavailable(device) is None


@dataclass(frozen=True)
class _Plan:
    """How a collection's features map onto its tables."""

    feature_names: list[str]  # the collection's features in its output order
    bags: list[nn.EmbeddingBag]  # one per table
    table_of_feature: list[int]
    first_feature: list[int]  # per table, its first feature's position; one more: the end
    first_row_of_feature: tuple[int, ...]  # its table's first row in a stack of the tables (see stacked_tables)
    mode: str


def _plan(ebc: EmbeddingBagCollection) -> _Plan | None:
    """The plan of ``ebc``, or None where the one-node path does not apply (TorchRec's own
    forward runs then): a subclass (its forward may differ), dense gradients, half-precision
    tables, mixed pooling or widths, or anything of ``nn.EmbeddingBag`` the gradient rows below do not
    reproduce (max_norm, padding_idx, scale_grad_by_freq). Found at every call, not kept: a
    user may switch a bag's gradients or swap a table between steps (a walk over the bags,
    far cheaper than the per-table lookups it saves)."""
    bags = list(ebc.embedding_bags.values())
    modes = {bag.mode for bag in bags}
    plain = (
        type(ebc) is EmbeddingBagCollection
        and len(modes) == 1
        and modes <= {"sum", "mean"}
        and all(
            bag.sparse
            and bag.include_last_offset
            and bag.max_norm is None
            and bag.padding_idx is None
            and not bag.scale_grad_by_freq
            and bag.weight.dtype == torch.float32
            for bag in bags
        )
    )
    if not plain:
        return None
    configs = ebc.embedding_bag_configs()
    names = [name for config in configs for name in config.feature_names]
    one_width = len({config.embedding_dim for config in configs}) == 1  # the gradient's rows are (B * F, D)
    if not one_width or len(set(names)) != len(names):  # a feature read by two tables is keyed "feature@table"
        return None
    tables = [k for k, config in enumerate(configs) for _ in config.feature_names]
    firsts = list(itertools.accumulate((len(config.feature_names) for config in configs), initial=0))
    first_rows = list(itertools.accumulate((config.num_embeddings for config in configs), initial=0))
    return _Plan(names, bags, tables, firsts, tuple(first_rows[t] for t in tables), modes.pop())


def pooled_in_one_node(
    ebc: nn.Module,
    features: KeyedJaggedTensor,
    gradient_rows_to: GradientRowsSink | None = None,
    pooled_gradients_to: PooledGradientsSink | None = None,
) -> Tensor | None:
    """``ebc(features).values()``, (B, F * D), in one autograd node, where ``ebc`` is TorchRec's
    plain `EmbeddingBagCollection` with sparse gradients and the batch's keys are its features in
    order (the zoo's datamodules' batches); None otherwise (sharded or hot/cold collections,
    variable batch sizes, other key orders): the caller runs the module then.

    With ``gradient_rows_to`` (a `RowWiseOptimizer.add_row_gradients` over the tables), the
    backward hands it every table's gradient rows as one piece, where all the tables take
    gradients, and the tables get no ``.grad`` from this lookup; otherwise each table's
    sparse gradient goes to its ``.grad``. Where the tables are one stack on a device the Triton
    TBE pools on (`triton_pools_on`) it pools them, and with ``pooled_gradients_to`` (a
    `RowWiseOptimizer.add_pooled_gradients`) the backward hands over the pooled gradient itself,
    which the optimizer steps in Triton's kernel (or takes apart into gradient rows)."""
    plan = _plan(ebc) if isinstance(ebc, EmbeddingBagCollection) else None
    if (
        plan is None
        or features.keys() != plan.feature_names
        or features.variable_stride_per_key()
        or features.inverse_indices_or_none() is not None
        or (features.weights_or_none() is not None) != ebc.is_weighted()
        or (ebc.is_weighted() and features.weights().requires_grad)
    ):
        return None
    weights = [bag.weight for bag in plan.bags]
    return _PooledLookup.apply(plan, features, (gradient_rows_to, pooled_gradients_to), *weights)


class _PooledLookup(torch.autograd.Function):
    """Forward: every feature's bags pooled from its table, side by side. Backward: each id's
    gradient row (its bag's, scaled as the pooling and the id's weight scale it) in one gather,
    handed over as one piece (``gradient_rows_to``) or, per table, as a sparse gradient over
    its features' ids."""

    @staticmethod
    def forward(
        ctx: Any,
        plan: _Plan,
        features: KeyedJaggedTensor,
        sinks: tuple[GradientRowsSink | None, PooledGradientsSink | None],
        *weights: Tensor,
    ) -> Tensor:
        batch_size, num_features = features.stride(), len(plan.feature_names)
        ids, lengths, per_id = features.values(), features.lengths(), features.weights_or_none()
        starts = features.offset_per_key()  # on the host: the datamodules compute it with the batch
        ctx.plan, ctx.starts, ctx.batch_size = plan, starts, batch_size
        ctx.ids, ctx.lengths, ctx.per_id = ids, lengths, per_id
        gradient_rows_to, pooled_gradients_to = sinks
        stack = stacked_rows(weights)
        rows = _rows_end_to_end(plan, features) if stack is not None or gradient_rows_to is not None else None
        ctx.gradient_rows_to, ctx.weights = gradient_rows_to, weights
        ctx.rows = None if gradient_rows_to is None else rows
        triton = stack is not None and triton_pools_on(stack.device)
        ctx.pooled_gradients_to = pooled_gradients_to if triton and gradient_rows_to is not None else None
        if triton:
            # Every bag of every feature in one launch; bag f * B + b is the lengths' order.
            ctx.offsets = features.offsets()
            ctx.bag_mean = torch.ones(len(lengths), dtype=torch.int32, device=ids.device) if plan.mode == "mean" else None
            pooled = triton_tbe.pooled(stack, rows, ctx.offsets, ctx.bag_mean, per_id)
            return pooled.view(num_features, batch_size, -1).transpose(0, 1).reshape(batch_size, -1)
        if stack is not None:
            # Every bag of every feature in one `embedding_bag` over the stack, each id moved to
            # its table's rows there; the bags come feature by feature, (F * B, D).
            pooled = torch.nn.functional.embedding_bag(
                rows,
                stack,
                features.offsets().long(),
                mode=plan.mode,
                per_sample_weights=per_id,
                include_last_offset=True,
            )
            return pooled.view(num_features, batch_size, -1).transpose(0, 1).reshape(batch_size, -1)
        # Every feature's offsets rebased to its own first id, (F, B + 1), in two ops, not F.
        bounds = features.offsets()[_feature_bounds(batch_size, num_features, ids.device)]
        local_offsets = bounds - bounds[:, :1]
        pooled_per_feature = [
            torch.nn.functional.embedding_bag(
                ids[starts[f] : starts[f + 1]],
                weights[plan.table_of_feature[f]],
                local_offsets[f],
                mode=plan.mode,
                per_sample_weights=None if per_id is None else per_id[starts[f] : starts[f + 1]],
                include_last_offset=True,
            )
            for f in range(num_features)
        ]
        return torch.cat(pooled_per_feature, dim=1)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        plan, starts, batch_size = ctx.plan, ctx.starts, ctx.batch_size
        num_features, dim = len(plan.feature_names), grad.shape[1] // len(plan.feature_names)
        if ctx.pooled_gradients_to is not None and all(ctx.needs_input_grad[3:]):
            # Bag f * B + b's gradient row, feature-major as the offsets cut the ids.
            per_bag = grad.view(batch_size, num_features, dim).transpose(0, 1).reshape(num_features * batch_size, dim)
            ctx.pooled_gradients_to(ctx.weights, ctx.rows, ctx.offsets, per_bag, ctx.bag_mean, ctx.per_id)
            return (None, None, None, *[None] * len(plan.bags))
        # Bag (feature f, sample b) is row b * F + f of the pooled gradient viewed as (B * F, D);
        # the ids come feature by feature, sample by sample, as the lengths do.
        bag_rows = _bag_rows(batch_size, num_features, grad.device)
        rows_of_ids = torch.repeat_interleave(bag_rows, ctx.lengths, output_size=starts[-1])
        pooled_grads = grad.reshape(batch_size * num_features, dim)
        # As `embedding_bag`'s own backward scales them: by 1 / bag size, then by the id's weight.
        scales = [] if ctx.per_id is None else [ctx.per_id.unsqueeze(1)]
        if plan.mode == "mean":
            bags_of_ids = torch.repeat_interleave(
                torch.arange(len(ctx.lengths), device=grad.device), ctx.lengths, output_size=starts[-1]
            )
            scales.insert(0, ctx.lengths.to(grad.dtype).reciprocal().index_select(0, bags_of_ids).unsqueeze(1))
        # A table's features are adjacent (the collection's order is table by table), so are their ids.
        spans = [(starts[plan.first_feature[k]], starts[plan.first_feature[k + 1]]) for k in range(len(plan.bags))]
        every_id = pooled_grads.index_select(0, rows_of_ids)
        for scale in scales:
            every_id.mul_(scale)
        if ctx.gradient_rows_to is not None and all(ctx.needs_input_grad[3:]):
            ctx.gradient_rows_to(ctx.weights, ctx.rows, every_id)
            return (None, None, None, *[None] * len(plan.bags))
        table_grads: list[Tensor | None] = []
        for table, ((first, end), bag) in enumerate(zip(spans, plan.bags)):
            needed = ctx.needs_input_grad[3 + table]
            table_grads.append(
                torch.sparse_coo_tensor(
                    ctx.ids[first:end].unsqueeze(0), every_id[first:end], bag.weight.shape, is_coalesced=False, check_invariants=False
                )
                if needed
                else None
            )
        return (None, None, None, *table_grads)


def _rows_end_to_end(plan: _Plan, features: KeyedJaggedTensor) -> Tensor:
    """Each id's row in the collection's tables laid end to end: its table's first row there
    added, for every feature in one op."""
    batch_size, starts = features.stride(), features.offset_per_key()
    first_rows = torch.repeat_interleave(
        _bag_first_rows(plan.first_row_of_feature, batch_size, features.values().device),
        features.lengths(),
        output_size=starts[-1],
    )
    return features.values().long() + first_rows


# Kept per shape (a batch's shape repeats every step; the last batch of an epoch adds one).
@functools.lru_cache(maxsize=16)
def _feature_bounds(batch_size: int, num_features: int, device: torch.device) -> Tensor:
    """(F, B + 1): positions of each feature's offsets in the batch's offsets."""
    grid = torch.arange(num_features).unsqueeze(1) * batch_size + torch.arange(batch_size + 1)
    return grid.to(device)


@functools.lru_cache(maxsize=16)
def _bag_first_rows(first_row_of_feature: tuple[int, ...], batch_size: int, device: torch.device) -> Tensor:
    """(F * B,): for bag (f, b), in the lengths' order, the first row of its feature's table in the stack."""
    return torch.tensor(first_row_of_feature).repeat_interleave(batch_size).to(device)


@functools.lru_cache(maxsize=16)
def _bag_rows(batch_size: int, num_features: int, device: torch.device) -> Tensor:
    """(F * B,): for bag (f, b), in the lengths' order, its row b * F + f of the pooled output."""
    bags = torch.arange(num_features * batch_size)
    return ((bags % batch_size) * num_features + bags // batch_size).to(device)
