"""DLRM and DLRM-DCN: dense MLP and pooled embeddings meet in a pairwise (or cross-net) interaction.

Built from torchrec.models.dlrm's blocks; DLRM_DCN swaps the dot-product interaction for
torchrec's low-rank DCNv2 interaction, as MLPerf's DLRM-DCNv2 does.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn
from torchrec import EmbeddingBagConfig
from torchrec.models.dlrm import DenseArch, InteractionDCNArch, OverArch
from torchrec.modules.crossnet import LowRankCrossNet
from typing_extensions import override

from models.base import CTRModel
from models.interactions import GatheredInteractionArch, deep_mlp


class DLRM(CTRModel):
    """DLRM (Naumov et al., 2019).

    Args:
        tables: the datamodule's embedding tables (one shared embedding_dim).
        num_dense_features: width of the dense input.
        dense_arch_layer_sizes: hidden sizes of the bottom MLP; a last layer of
            ``embedding_dim`` is added so dense output meets the embeddings.
        over_arch_layer_sizes: hidden sizes of the top MLP; a last layer of 1 (the logit) is added.
        dropout: probability of zeroing each unit after every hidden layer of the top MLP while
            training (`models.interactions.deep_mlp`; the bottom MLP has none); 0 turns it off.
        **kwargs: `CTRModel` options (embedding_optimizer, dense_lr, dense_weight_decay, embedding_l2).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        num_dense_features: int,
        dense_arch_layer_sizes: Sequence[int] = (64,),
        over_arch_layer_sizes: Sequence[int] = (128, 64),
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(tables, num_dense_features, **kwargs)

    @override
    def build_dense_arch(self) -> nn.Module:
        sizes = [*self.hparams.dense_arch_layer_sizes, self.embedding_dim]
        return DenseArch(self.num_dense_features, sizes)

    @override
    def build_interaction(self) -> nn.Module:
        return GatheredInteractionArch(self.num_sparse_features)

    @override
    def build_over_arch(self, in_features: int) -> nn.Module:
        over_arch = OverArch(in_features, [*self.hparams.over_arch_layer_sizes, 1])
        if self.hparams.dropout:
            # TorchRec's OverArch is Sequential(MLP, Linear) and takes no dropout: swap in the
            # zoo's MLP, under the same name (the parameters and checkpoint keys do not change).
            over_arch.model[0] = deep_mlp(in_features, self.hparams.over_arch_layer_sizes, self.hparams.dropout)
        return over_arch


class DLRM_DCN(DLRM):
    """DLRM with a low-rank DCNv2 interaction (MLPerf DLRM-DCNv2).

    Args:
        dcn_num_layers: cross layers in the interaction.
        dcn_low_rank_dim: rank of each cross layer's weight.
        **kwargs: `DLRM` options.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        num_dense_features: int,
        dcn_num_layers: int = 3,
        dcn_low_rank_dim: int = 32,
        **kwargs: Any,
    ) -> None:
        super().__init__(tables, num_dense_features, **kwargs)

    @override
    def build_interaction(self) -> nn.Module:
        in_features = (self.num_sparse_features + 1) * self.embedding_dim
        crossnet = LowRankCrossNet(
            in_features=in_features, num_layers=self.hparams.dcn_num_layers, low_rank=self.hparams.dcn_low_rank_dim
        )
        return InteractionDCNArch(self.num_sparse_features, crossnet)
