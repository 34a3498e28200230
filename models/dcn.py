"""DCN (Wang et al., 2017; DCN-V2, 2021): a cross network beside a deep MLP over [embeddings, dense]."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn
from torchrec import EmbeddingBagConfig
from typing_extensions import override

from models.base import CTRModel
from models.interactions import CrossDeepInteraction, CrossNetVersion


class DCN(CTRModel):
    """Deep & Cross Network, parallel structure; cross network v2 by default.

    Args:
        tables: the datamodule's embedding tables (one shared embedding_dim).
        num_dense_features: width of the dense input (fed raw, as in the paper).
        cross_version: ``v2`` (full-rank DCN-V2), ``low_rank`` (DCN-V2 low-rank), ``mixture``
            (DCN-V2's mixture of low-rank experts, gated per sample) or ``v1``.
        num_cross_layers: depth of the cross network.
        low_rank: rank of each cross layer (of each expert's) when ``cross_version`` is
            ``low_rank`` (``mixture``).
        num_experts: low-rank experts per cross layer when ``cross_version="mixture"``.
        deep_layer_sizes: sizes of the deep tower.
        dropout: probability of zeroing each unit after every layer of the deep tower while
            training (`models.interactions.deep_mlp`); 0 turns it off.
        **kwargs: `CTRModel` options (embedding_optimizer, dense_lr, dense_weight_decay, embedding_l2).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        num_dense_features: int,
        cross_version: CrossNetVersion = "v2",
        num_cross_layers: int = 3,
        low_rank: int = 32,
        num_experts: int = 4,
        deep_layer_sizes: Sequence[int] = (128, 64),
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(tables, num_dense_features, **kwargs)

    @override
    def build_dense_arch(self) -> nn.Module:
        return nn.Identity()

    @override
    def build_interaction(self) -> nn.Module:
        return CrossDeepInteraction(
            in_features=self.num_sparse_features * self.embedding_dim + self.num_dense_features,
            num_cross_layers=self.hparams.num_cross_layers,
            deep_layer_sizes=self.hparams.deep_layer_sizes,
            version=self.hparams.cross_version,
            low_rank=self.hparams.low_rank,
            num_experts=self.hparams.num_experts,
            dropout=self.hparams.dropout,
        )

    @override
    def build_over_arch(self, in_features: int) -> nn.Module:
        return nn.Linear(in_features, 1)
