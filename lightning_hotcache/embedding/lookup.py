"""Lookups: a staged batch's slots -> pooled rows (batch, sum of the features' dims).

- `FusedLookup`: every feature in one FBGEMM table-batched embedding call; the kernel's own
  backward applies the row-wise rule to the rows read (one process).
- `LookupForOwners`: the same call, but its backward hands the output's gradient to a
  callback instead of updating this rank's copies (across ranks, each row's owner applies
  the ranks' mean gradient; see `OwnersUpdate`).
- `EmbeddingBagLookup`: one ``embedding_bag`` (or the Triton TBE's `pooled`) per device table
  (a width) and pooling mode, whose backward, like `LookupForOwners`', hands the output's
  gradient to the update (see `SummingUpdate`, `TritonUpdate`): no sparse gradient, which would
  need sorting to sum.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import PoolingType

from lightning_hotcache.cache.fused import FusedTables
from lightning_hotcache.embedding.batch import StagedBatch, bag_offsets, concat_spans, runs_of
from lightning_hotcache.embedding.layout import Layout
from lightning_hotcache.kernels import triton_tbe


class FusedLookup:
    """All features in one FBGEMM call on slot ids (a KJT's offsets are feature-major bags, as TBE wants)."""

    def __init__(self, fused: FusedTables, is_weighted: bool, device: torch.device) -> None:
        self.fused = fused
        self.is_weighted = is_weighted
        self.device = device

    def _inputs(self, staged: StagedBatch) -> tuple[Tensor, Tensor | None]:
        ours = staged.ours
        weights = ours.weights().to(self.device, torch.float32) if self.is_weighted else None
        return bag_offsets(ours).to(self.device, torch.int64), weights

    def __call__(self, staged: StagedBatch) -> Tensor:
        return self.pooled(staged)

    def pooled(self, staged: StagedBatch) -> Tensor:
        offsets, weights = self._inputs(staged)
        return self.fused(staged.indices, offsets, weights)


class _GradientToCallback(torch.autograd.Function):
    """A lookup whose backward passes the output's gradient to ``on_gradient``, which updates
    the rows itself. ``anchor`` is a scalar that requires grad, so that autograd calls this
    backward (no table takes part in autograd)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        anchor: Tensor,
        pooled: Callable[[StagedBatch], Tensor],
        on_gradient: Callable[[StagedBatch, Tensor], None],
        staged: StagedBatch,
    ) -> Tensor:
        ctx.on_gradient, ctx.staged = on_gradient, staged
        with torch.no_grad():
            return pooled(staged)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        ctx.on_gradient(ctx.staged, grad)
        return (None,) * 4


class LookupForOwners(FusedLookup):
    """`FusedLookup` whose backward calls ``on_gradient(staged, output_grad)`` and updates nothing:
    FBGEMM's own backward would apply this rank's gradient to its copies, where the ranks' mean
    gradient must be applied once, by each row's owner."""

    def __init__(self, fused: FusedTables, is_weighted: bool, device: torch.device, on_gradient: Callable[[StagedBatch, Tensor], None]) -> None:
        super().__init__(fused, is_weighted, device)
        self.on_gradient = on_gradient
        self._anchor = torch.zeros((), requires_grad=True)  # not a parameter: nothing trains it

    def __call__(self, staged: StagedBatch) -> Tensor:
        if not torch.is_grad_enabled():
            return self.pooled(staged)
        return _GradientToCallback.apply(self._anchor, self.pooled, self.on_gradient, staged)


class EmbeddingBagLookup:
    """One ``embedding_bag`` per device table and pooling mode: every feature of a width (its
    stack's split tables and its whole tables, in one device table) reads it in one call, so a
    step's lookups follow the widths, not the features or tables (26 tables: one call, not 26).
    The features of a device table need not be adjacent in the output's (table) order: their
    ids are cut out and put end to end, and their pooled rows back in order with one
    concatenation. Its backward calls ``on_gradient(staged, output_grad)``.

    Args:
        weights: each device table's weight array.
        triton: pool with the Triton TBE's kernel (`triton_tbe.pooled`) instead of ``embedding_bag``.
        host_weights: with ``triton``, each device table's host rows where its cache's directory is
            in device memory (None for the others): a staged batch's indices are then locations,
            and a row read from the host is pooled from there (`DirectoryStaging`).
    """

    def __init__(
        self,
        layout: Layout,
        weights: list[Tensor],
        is_weighted: bool,
        device: torch.device,
        on_gradient: Callable[[StagedBatch, Tensor], None],
        triton: bool = False,
        host_weights: list[Tensor | None] | None = None,
    ) -> None:
        self.triton = triton
        hosts = host_weights or [None] * len(weights)
        # A group per device table and pooling mode (``embedding_bag`` pools one way a call); the
        # Triton kernel pools each bag as its feature says, so a group per device table there.
        groups: dict[tuple[int, PoolingType | None], list[int]] = {}
        for k, (feature, table) in enumerate(zip(layout.features, layout.device_table_of_feature())):
            groups.setdefault((table, None if triton else layout.table_of[feature].pooling), []).append(k)
        # Each group's features as runs of adjacent ones (a run's ids and bags are one view), and
        # which of them pool by mean (on the device, made once; None: none does).
        self.groups = []
        for (table, pooling), ks in groups.items():
            means = [layout.table_of[layout.features[k]].pooling == PoolingType.MEAN for k in ks]
            mean = torch.tensor(means, dtype=torch.int32, device=device) if any(means) else None
            mode = "mean" if pooling == PoolingType.MEAN else "sum"
            self.groups.append((weights[table], hosts[table], mode, mean, len(ks), runs_of(ks)))
        # The output (table order) as pieces ``(group, first, end)``: features adjacent in the
        # output and of one group (so adjacent in its output too) come out in one copy.
        place = {k: (g, j) for g, ks in enumerate(groups.values()) for j, k in enumerate(ks)}
        self.output_pieces: list[tuple[int, int, int]] = []
        for k in range(len(layout.features)):
            g, j = place[k]
            if self.output_pieces and self.output_pieces[-1][0] == g:
                self.output_pieces[-1] = (g, self.output_pieces[-1][1], j + 1)
            else:
                self.output_pieces.append((g, j, j + 1))
        self.is_weighted = is_weighted
        self.device = device
        self.on_gradient = on_gradient
        self._anchor = torch.zeros((), requires_grad=True)  # not a parameter: nothing trains it

    def __call__(self, staged: StagedBatch) -> Tensor:
        if not torch.is_grad_enabled():
            return self.pooled(staged)
        return _GradientToCallback.apply(self._anchor, self.pooled, self.on_gradient, staged)

    def pooled(self, staged: StagedBatch) -> Tensor:
        ours = staged.ours
        offsets, bounds, batch = bag_offsets(ours).to(self.device, torch.int64), ours.offset_per_key(), ours.stride()
        lengths = offsets.diff()
        weights = ours.weights() if self.is_weighted else None
        pooled: list[Tensor] = []  # per group (features, batch, dim)
        for weight, host, mode, mean, count, runs in self.groups:
            spans = [(bounds[a], bounds[b]) for a, b in runs]
            bag_lengths = concat_spans(lengths, [(a * batch, b * batch) for a, b in runs])
            indices, bags = concat_spans(staged.indices, spans), torch.cat([bag_lengths.new_zeros(1), bag_lengths.cumsum(0)])
            per_sample = None if weights is None else concat_spans(weights, spans)
            if self.triton:
                bag_mean = None if mean is None else mean.repeat_interleave(batch, output_size=count * batch)
                per_sample = None if per_sample is None else per_sample.to(self.device)
                rows = triton_tbe.pooled(weight, indices, bags, bag_mean, per_sample, host_weight=host)
            else:
                rows = nn.functional.embedding_bag(
                    indices, weight, bags, mode=mode, per_sample_weights=per_sample, include_last_offset=True
                )
            pooled.append(rows.view(count, batch, -1))
        # Feature-major bags to (batch, features x dim), the columns in table order.
        pieces = [pooled[g][a:b].transpose(0, 1).reshape(batch, -1) for g, a, b in self.output_pieces]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
