"""Lookups: a staged batch's slots -> pooled rows (batch, sum of the features' dims).

- `FusedLookup`: every feature in one FBGEMM table-batched embedding call; the kernel's own
  backward applies the row-wise rule to the rows read (one process).
- `LookupForOwners`: the same call, but its backward hands the output's gradient to a
  callback instead of updating this rank's copies (across ranks, each row's owner applies
  the ranks' mean gradient; see `OwnersUpdate`).
- `EmbeddingBagLookup`: one ``embedding_bag`` per feature on its cache's slots, with sparse
  gradients that a hook on each cache's weights applies (see `HookUpdate`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import PoolingType

from lightning_hotcache.cache.device import DeviceCache
from lightning_hotcache.cache.fused import FusedTables
from lightning_hotcache.embedding.batch import StagedBatch, bag_offsets
from lightning_hotcache.embedding.layout import Layout


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
        offsets, weights = self._inputs(staged)
        return self.fused(staged.indices, offsets, weights)


class _NoKernelBackward(torch.autograd.Function):
    """FBGEMM's lookup with a backward that passes the output's gradient to ``on_gradient``.
    ``anchor`` is a scalar that requires grad, so that autograd calls this backward (the TBE's
    weights take no part)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        anchor: Tensor,
        lookup: FusedLookup,
        on_gradient: Callable[[StagedBatch, Tensor], None],
        staged: StagedBatch,
    ) -> Tensor:
        ctx.on_gradient, ctx.staged = on_gradient, staged
        with torch.no_grad():
            return FusedLookup.__call__(lookup, staged)

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
            return super().__call__(staged)
        return _NoKernelBackward.apply(self._anchor, self, self.on_gradient, staged)


class EmbeddingBagLookup:
    """One ``embedding_bag`` per feature on its cache's slots (sparse gradients)."""

    def __init__(self, layout: Layout, caches: dict[str, DeviceCache], is_weighted: bool, device: torch.device) -> None:
        self.features = [(layout.table_of[f], caches[layout.cache_of_feature[f]]) for f in layout.features]
        self.is_weighted = is_weighted
        self.device = device

    def __call__(self, staged: StagedBatch) -> Tensor:
        ours = staged.ours
        offsets, bounds, batch = bag_offsets(ours).to(self.device, torch.int64), ours.offset_per_key(), ours.stride()
        pooled = []
        for k, (table, cache) in enumerate(self.features):
            a, b = bounds[k], bounds[k + 1]
            pooled.append(
                nn.functional.embedding_bag(
                    staged.indices[a:b],
                    cache.weight,
                    offsets[k * batch : (k + 1) * batch + 1] - a,
                    mode="sum" if table.pooling == PoolingType.SUM else "mean",
                    sparse=True,
                    per_sample_weights=ours.weights()[a:b] if self.is_weighted else None,
                    include_last_offset=True,
                )
            )
        return torch.cat(pooled, dim=1)
