"""DeepFM (Guo et al., 2017): a factorization machine and a deep MLP over shared embeddings."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn
from torchrec import EmbeddingBagConfig
from torchrec.models.dlrm import DenseArch
from typing_extensions import override

from models.base import CTRModel
from models.interactions import FMInteraction


class DeepFM(CTRModel):
    """DeepFM with the dense features projected into one extra field.

    As in the paper, the logit is the FM's first-order term (`models.first_order.FirstOrderArch`:
    a weight per sparse id, a linear layer on the raw dense features, the bias) plus its
    second-order term and the deep tower's output, the last two weighed by the over arch.

    Args:
        tables: the datamodule's embedding tables (one shared embedding_dim).
        num_dense_features: width of the dense input.
        dense_arch_layer_sizes: hidden sizes of the MLP projecting dense features to one
            ``embedding_dim`` field (a last layer of embedding_dim is added).
        deep_layer_sizes: sizes of the deep tower over all fields.
        dropout: probability of zeroing each unit after every layer of the deep tower while
            training (`models.interactions.deep_mlp`); 0 turns it off.
        **kwargs: `CTRModel` options (embedding_optimizer, dense_lr, dense_weight_decay, embedding_l2).
    """

    uses_first_order = True

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        num_dense_features: int,
        dense_arch_layer_sizes: Sequence[int] = (64,),
        deep_layer_sizes: Sequence[int] = (128, 64),
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(tables, num_dense_features, **kwargs)

    @override
    def build_dense_arch(self) -> nn.Module:
        return DenseArch(self.num_dense_features, [*self.hparams.dense_arch_layer_sizes, self.embedding_dim])

    @override
    def build_interaction(self) -> nn.Module:
        return FMInteraction(
            self.num_sparse_features + 1, self.embedding_dim, self.hparams.deep_layer_sizes, self.hparams.dropout
        )

    @override
    def build_over_arch(self, in_features: int) -> nn.Module:
        return nn.Linear(in_features, 1, bias=False)  # the bias is the first-order term's
