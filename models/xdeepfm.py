"""xDeepFM (Lian et al., 2018): a Compressed Interaction Network and a deep MLP over shared embeddings."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn
from torchrec import EmbeddingBagConfig
from typing_extensions import override

from models.deepfm import DeepFM
from models.interactions import CINInteraction


class XDeepFM(DeepFM):
    """xDeepFM with the dense features projected into one extra field: explicit vector-wise
    crosses of bounded degree (the CIN, one degree per layer) beside implicit ones (the deep
    MLP), both over the same fields.

    As in the paper, the logit is the linear part (`models.first_order.FirstOrderArch`: a
    weight per sparse id, a linear layer on the raw dense features, the bias) plus the CIN's
    and the deep tower's outputs, weighed by the over arch.

    Args:
        tables: the datamodule's embedding tables (one shared embedding_dim).
        num_dense_features: width of the dense input.
        dense_arch_layer_sizes: hidden sizes of the MLP projecting dense features to one
            ``embedding_dim`` field (a last layer of embedding_dim is added).
        cin_layer_sizes: feature maps of each CIN layer (k layers cross up to k + 1 fields).
        deep_layer_sizes: sizes of the deep tower over all fields.
        **kwargs: `DeepFM`'s ``dropout`` (of the deep tower) and `CTRModel` options.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        num_dense_features: int,
        dense_arch_layer_sizes: Sequence[int] = (64,),
        cin_layer_sizes: Sequence[int] = (64, 64),
        deep_layer_sizes: Sequence[int] = (128, 64),
        **kwargs: Any,
    ) -> None:
        super().__init__(
            tables, num_dense_features, dense_arch_layer_sizes=dense_arch_layer_sizes, deep_layer_sizes=deep_layer_sizes, **kwargs
        )

    # The dense arch (one projected field), the first-order term and the bias-free over arch
    # are DeepFM's; the FM term gives way to the CIN.
    @override
    def build_interaction(self) -> nn.Module:
        return CINInteraction(
            self.num_sparse_features + 1,
            self.embedding_dim,
            self.hparams.cin_layer_sizes,
            self.hparams.deep_layer_sizes,
            self.hparams.dropout,
        )
