"""Interaction blocks TorchRec lacks in the (dense, pooled embeddings) -> features shape.

Both take the dense arch output and the (B, F, D) pooled embeddings, like
torchrec.models.dlrm.InteractionArch, so any zoo model can swap them in.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor, nn
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet, VectorCrossNet
from torchrec.modules.deepfm import DeepFM, FactorizationMachine
from torchrec.modules.mlp import MLP

CrossNetVersion = Literal["v2", "low_rank", "v1"]


class FMInteraction(nn.Module):
    """DeepFM's two towers over the fields (dense projection as one field, plus the F
    embeddings): a factorization machine for second-order terms and a deep MLP.
    Output: (B, deep_layer_sizes[-1] + 1)."""

    def __init__(self, num_fields: int, embedding_dim: int, deep_layer_sizes: Sequence[int]) -> None:
        super().__init__()
        self.fm = FactorizationMachine()
        self.deep = DeepFM(dense_module=MLP(num_fields * embedding_dim, list(deep_layer_sizes)))

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        fields = torch.cat([dense.unsqueeze(1), sparse], dim=1)
        return torch.cat([self.deep([fields]), self.fm([fields])], dim=1)


class CrossDeepInteraction(nn.Module):
    """DCN's parallel towers over x0 = [flattened embeddings, dense features]: a cross
    network (v2 full-rank, v2 low-rank, or v1 vector) beside a deep MLP.
    Output: (B, in_features + deep_layer_sizes[-1])."""

    def __init__(
        self,
        in_features: int,
        num_cross_layers: int,
        deep_layer_sizes: Sequence[int],
        version: CrossNetVersion = "v2",
        low_rank: int = 32,
    ) -> None:
        super().__init__()
        if version == "v2":
            self.cross: nn.Module = CrossNet(in_features, num_cross_layers)
        elif version == "low_rank":
            self.cross = LowRankCrossNet(in_features, num_cross_layers, low_rank=low_rank)
        elif version == "v1":
            self.cross = VectorCrossNet(in_features, num_cross_layers)
        else:
            raise ValueError(f"Unknown cross network version {version!r}; choose 'v2', 'low_rank' or 'v1'.")
        self.deep = MLP(in_features, list(deep_layer_sizes))

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        x0 = torch.cat([sparse.flatten(1), dense], dim=1)
        return torch.cat([self.cross(x0), self.deep(x0)], dim=1)
