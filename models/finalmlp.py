"""FinalMLP (Mao et al., 2023): two gated MLP streams fused by a multi-head bilinear layer."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn
from torchrec import EmbeddingBagConfig
from torchrec.models.dlrm import DenseArch
from typing_extensions import override

from models.base import CTRModel
from models.interactions import DualStreamInteraction, MultiHeadBilinearFusion


class FinalMLP(CTRModel):
    """FinalMLP with the dense features projected into one extra field.

    Two MLP streams read all fields, each through its own feature gate (a per-element weight
    in (0, 2) computed from the stream's context features), so they specialize; their
    outputs meet in a multi-head bilinear fusion that gives the logit (the over arch).

    Args:
        tables: the datamodule's embedding tables (one shared embedding_dim).
        num_dense_features: width of the dense input.
        dense_arch_layer_sizes: hidden sizes of the MLP projecting dense features to one
            ``embedding_dim`` field (a last layer of embedding_dim is added).
        stream1_layer_sizes: sizes of the first MLP stream.
        stream2_layer_sizes: sizes of the second MLP stream.
        gate_layer_sizes: hidden sizes of each stream's gate MLP.
        stream1_gate_features: sparse feature names (KJT keys) whose embeddings drive the
            first stream's gate, e.g. the user features; empty: a learned gate shared by all
            samples.
        stream2_gate_features: the same for the second stream, e.g. the item features.
        num_heads: heads of the bilinear fusion; must divide both streams' last sizes.
        dropout: probability of zeroing each unit after every layer of both streams while
            training (`models.interactions.deep_mlp`; the gates have none); 0 turns it off.
        **kwargs: `CTRModel` options (embedding_optimizer, dense_lr, dense_weight_decay, embedding_l2).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        num_dense_features: int,
        dense_arch_layer_sizes: Sequence[int] = (64,),
        stream1_layer_sizes: Sequence[int] = (128, 64),
        stream2_layer_sizes: Sequence[int] = (128,),
        gate_layer_sizes: Sequence[int] = (64,),
        stream1_gate_features: Sequence[str] = (),
        stream2_gate_features: Sequence[str] = (),
        num_heads: int = 1,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(tables, num_dense_features, **kwargs)

    def _field_indices(self, feature_names: Sequence[str]) -> list[int]:
        """Indices among the fields (the dense field first, then the sparse features in order)."""
        names = self.sparse_arch.sparse_feature_names
        unknown = [n for n in feature_names if n not in names]
        if unknown:
            raise ValueError(f"Gate features {unknown} are not sparse features of this model; it has {names}.")
        return [1 + names.index(n) for n in feature_names]

    @override
    def build_dense_arch(self) -> nn.Module:
        return DenseArch(self.num_dense_features, [*self.hparams.dense_arch_layer_sizes, self.embedding_dim])

    @override
    def build_interaction(self) -> nn.Module:
        return DualStreamInteraction(
            self.num_sparse_features + 1,
            self.embedding_dim,
            self.hparams.stream1_layer_sizes,
            self.hparams.stream2_layer_sizes,
            self.hparams.gate_layer_sizes,
            self._field_indices(self.hparams.stream1_gate_features),
            self._field_indices(self.hparams.stream2_gate_features),
            dropout=self.hparams.dropout,
        )

    @override
    def build_over_arch(self, in_features: int) -> nn.Module:
        x_dim = self.hparams.stream1_layer_sizes[-1]
        return MultiHeadBilinearFusion(x_dim, in_features - x_dim, self.hparams.num_heads)
