"""Wide & Deep (Cheng et al., 2016): a linear model and a deep MLP, trained jointly, logits summed."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn
from torchrec import EmbeddingBagConfig
from typing_extensions import override

from models.base import CTRModel
from models.interactions import DeepInteraction


class WideAndDeep(CTRModel):
    """Wide & Deep: ``sigmoid(wide + deep)``.

    Wide is the first-order term (`models.first_order.FirstOrderArch`: a weight per sparse id,
    a linear layer on the dense features, the bias), without the paper's hand-picked
    cross-product features. Deep is an MLP over [embeddings, dense features] (dense fed raw,
    as in the paper) with a linear output.

    Args:
        tables: the datamodule's embedding tables (one shared embedding_dim).
        num_dense_features: width of the dense input.
        deep_layer_sizes: sizes of the deep tower's hidden layers.
        dropout: probability of zeroing each unit after every layer of the deep tower while
            training (`models.interactions.deep_mlp`); 0 turns it off.
        **kwargs: `CTRModel` options (embedding_optimizer, dense_lr, dense_weight_decay, embedding_l2).
    """

    uses_first_order = True

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        num_dense_features: int,
        deep_layer_sizes: Sequence[int] = (256, 128),
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(tables, num_dense_features, **kwargs)

    @override
    def build_dense_arch(self) -> nn.Module:
        return nn.Identity()

    @override
    def build_interaction(self) -> nn.Module:
        in_features = self.num_sparse_features * self.embedding_dim + self.num_dense_features
        return DeepInteraction(in_features, self.hparams.deep_layer_sizes, self.hparams.dropout)

    @override
    def build_over_arch(self, in_features: int) -> nn.Module:
        return nn.Linear(in_features, 1, bias=False)  # the bias is the wide part's
