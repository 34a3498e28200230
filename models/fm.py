"""FM (Rendle, 2010): a factorization machine over the sparse fields and the dense features."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from typing_extensions import override

from models.base import CTRModel
from models.interactions import PairwiseInteraction


class DenseFields(nn.Module):
    """Each dense feature as an FM field of its own, ``x_j * v_j``: (B, num_features) -> (B, num_features, dim).

    A real-valued input of Rendle's FM, so dense features interact with every sparse field
    and with each other, each through its own factor ``v_j``.
    """

    def __init__(self, num_features: int, dim: int) -> None:
        super().__init__()
        # Small, as libFM's init_stdev: x_j can be in the tens (log counts), and the dense
        # pairs add up in the initial logit.
        self.factors = nn.Parameter(torch.randn(num_features, dim) * 0.01)

    def forward(self, dense_features: Tensor) -> Tensor:
        return dense_features.unsqueeze(-1) * self.factors


class FM(CTRModel):
    """Factorization machine: ``w0 + sum_i w_i x_i + sum_{i<j} <v_i, v_j> x_i x_j``.

    The first-order term is `models.first_order.FirstOrderArch`; the pairwise term
    (`models.interactions.PairwiseInteraction`) is over the sparse fields (their pooled
    embeddings) and one field per dense feature (`DenseFields`). No deep tower.

    Args:
        tables: the datamodule's embedding tables (one shared embedding_dim).
        num_dense_features: width of the dense input.
        **kwargs: `CTRModel` options (embedding_optimizer, dense_lr, dense_weight_decay, embedding_l2).
    """

    uses_first_order = True

    @override
    def build_dense_arch(self) -> nn.Module:
        return DenseFields(self.num_dense_features, self.embedding_dim)

    @override
    def build_interaction(self) -> nn.Module:
        return PairwiseInteraction()

    @override
    def build_over_arch(self, in_features: int) -> nn.Module:
        # The pairwise sum is the logit's second-order term as it is (the bias is the first-order term's).
        return nn.Identity()
