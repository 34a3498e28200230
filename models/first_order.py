"""The first-order (linear) term of a CTR model: a weight per sparse id and per dense feature.

LR is this term alone; FM, DeepFM and Wide & Deep add it to their embedding tower's logit
(`CTRModel.uses_first_order`). The per-id weights are a TorchRec EmbeddingBagCollection of
their own, beside the model's dim-D tables, so every strategy places and trains them as it
does any table: row-wise rule, sparse gradients, checkpoints, ``hotcache`` tiers and
``torchrec`` sharding alike.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import Tensor, nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from lightning_hotcache.embedding.torchrec_lookup import GradientRowsSink, PooledGradientsSink, pooled_in_one_node
from lightning_hotcache._ops.guards import check_not_empty
from lightning_hotcache.optim.rowwise import use_sparse_gradients

# A weight is the mean of a row of 4 columns, not a row of 1: FBGEMM's table-batched kernels
# (TorchRec's sharded tables, hotcache's fused device tier) refuse rows that are not a multiple
# of 4 floats. The columns start at zero and get the same gradient (a quarter of the weight's),
# so they stay equal; the scale-invariant row-wise rules (row-wise Adagrad, Adam) then move the
# mean as they would a single weight (up to their eps), and SGD moves it at a quarter of its lr.
# The cost: 16 bytes a row, a quarter of what a dim-16 table takes.
FIRST_ORDER_DIM = 4
FIRST_ORDER_SUFFIX = "_linear"


def first_order_table(table: EmbeddingBagConfig) -> EmbeddingBagConfig:
    """The first-order table of ``table``: same rows and features, `FIRST_ORDER_DIM` zero columns,
    named ``<table>_linear`` (table names are unique across a model's collections)."""
    return dataclasses.replace(
        table, name=f"{table.name}{FIRST_ORDER_SUFFIX}", embedding_dim=FIRST_ORDER_DIM, init_fn=nn.init.zeros_
    )


class FirstOrderArch(nn.Module):
    """``w0 + <w_dense, x> + sum over sparse features of w[id]``: logits of shape (B,).

    Args:
        tables: the model's embedding tables; each gets a first-order table (`first_order_table`).
        num_dense_features: width of the dense input.
        device: where the per-id weights are declared (``meta`` to defer them, as the model's tables).
    """

    def __init__(
        self, tables: Sequence[EmbeddingBagConfig], num_dense_features: int, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.embedding_bag_collection = EmbeddingBagCollection(
            tables=[first_order_table(t) for t in tables], device=device
        )
        use_sparse_gradients(self.embedding_bag_collection)
        self.dense = nn.Linear(num_dense_features, 1)

    def forward(self, dense_features: Tensor, sparse_features: KeyedJaggedTensor) -> Tensor:
        return self.logits(dense_features, self.lookup(sparse_features))

    def lookup(
        self,
        sparse_features: KeyedJaggedTensor,
        gradient_rows_to: GradientRowsSink | None = None,
        pooled_gradients_to: PooledGradientsSink | None = None,
    ) -> Tensor:
        """The batch's pooled per-id weights: (B, F * FIRST_ORDER_DIM), each feature's columns
        equal. ``gradient_rows_to``, ``pooled_gradients_to``: see `pooled_in_one_node`."""
        check_not_empty(sparse_features)
        pooled = pooled_in_one_node(self.embedding_bag_collection, sparse_features, gradient_rows_to, pooled_gradients_to)
        return self.embedding_bag_collection(sparse_features).values() if pooled is None else pooled

    def logits(self, dense_features: Tensor, pooled: Tensor) -> Tensor:
        """Logits (B,) from the dense features and the pooled weights of `lookup`."""
        # Summing all columns and dividing sums each id's mean.
        return self.dense(dense_features).squeeze(-1) + pooled.sum(dim=1) / FIRST_ORDER_DIM

    @staticmethod
    def squared_norms(pooled: Tensor) -> Tensor:
        """Per sample, the sum over features of the squared pooled weight, (B,), from `lookup`'s
        output: a weight's FIRST_ORDER_DIM equal columns count as the one weight they are."""
        return pooled.square().sum(dim=1) / FIRST_ORDER_DIM
