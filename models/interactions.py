"""Interaction blocks TorchRec lacks in the (dense, pooled embeddings) -> features shape, and
DLRM's dot-product interaction with a cheaper backward (`GatheredInteractionArch`).

The interactions take the dense arch output and the (B, F, D) pooled embeddings, like
torchrec.models.dlrm.InteractionArch, so any zoo model can swap them in; the pieces they are
built of (`CompressedInteractionNetwork`, `FeatureGate`, `FactorizationMachineTerm`) take the
(B, m, D) fields.
`MultiHeadBilinearFusion` is an over arch: FinalMLP's two streams to one logit.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor, nn
from torchrec.models.dlrm import InteractionArch
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet, LowRankMixtureCrossNet, VectorCrossNet
from torchrec.modules.deepfm import DeepFM
from torchrec.modules.mlp import MLP
from typing_extensions import override

CrossNetVersion = Literal["v2", "low_rank", "mixture", "v1"]


class GatheredInteractionArch(InteractionArch):
    """TorchRec's DLRM `InteractionArch` (pairwise dot products of the dense output and the F
    embeddings, upper triangle, after the dense output), the triangle taken with one
    ``gather`` from the flattened products.

    TorchRec indexes the (B, F+1, F+1) products with two index tensors, whose backward is
    ``index_put_`` with accumulation: slow on a CPU, a sort of all B x F(F+1)/2 positions on
    CUDA (a fifth of a DLRM step's GPU time in the profile of `benchmarks/results/h200-6ced9e8`).
    ``gather``'s backward is a ``scatter_add`` onto distinct positions: the same values, bit
    for bit, in about half the time on a CPU. Its one more buffer is not persistent, as TorchRec's is not: checkpoints do
    not change.
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__(num_sparse_features)
        rows, columns = self.triu_indices
        self.register_buffer("flat_triu_indices", rows * (num_sparse_features + 1) + columns, persistent=False)

    @override
    def forward(self, dense_features: Tensor, sparse_features: Tensor) -> Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        products = torch.bmm(combined, combined.transpose(1, 2)).flatten(1)
        upper = torch.gather(products, 1, self.flat_triu_indices.expand(len(products), -1))
        return torch.cat((dense_features, upper), dim=1)


def deep_mlp(in_features: int, layer_sizes: Sequence[int], dropout: float = 0.0) -> MLP:
    """TorchRec's MLP (a ReLU after every layer), with ``nn.Dropout(dropout)`` after each ReLU
    when ``dropout`` > 0: the deep towers' one regularization knob, shared by every zoo model.

    With ``dropout=0`` it is exactly ``MLP(in_features, layer_sizes)``, and with any value the
    same parameters (dropout has none), so checkpoints load either way.
    """
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1) (the probability of zeroing a unit), got {dropout}.")
    if not dropout:
        return MLP(in_features, list(layer_sizes))
    # A factory: MLP calls it once per layer, so each layer gets modules of its own.
    return MLP(in_features, list(layer_sizes), activation=lambda: nn.Sequential(nn.ReLU(), nn.Dropout(dropout)))


class FMInteraction(nn.Module):
    """DeepFM's two towers over the fields (dense projection as one field, plus the F
    embeddings): a factorization machine for second-order terms (`FactorizationMachineTerm`)
    and a deep MLP (`deep_mlp`, with ``dropout``). Output: (B, deep_layer_sizes[-1] + 1)."""

    def __init__(
        self, num_fields: int, embedding_dim: int, deep_layer_sizes: Sequence[int], dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.fm = FactorizationMachineTerm()
        self.deep = DeepFM(dense_module=deep_mlp(num_fields * embedding_dim, deep_layer_sizes, dropout))

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        fields = torch.cat([dense.unsqueeze(1), sparse], dim=1)
        return torch.cat([self.deep([fields]), self.fm(fields)], dim=1)


class CrossDeepInteraction(nn.Module):
    """DCN's parallel towers over x0 = [flattened embeddings, dense features]: a cross
    network (v2 full-rank, v2 low-rank, v2 mixture of ``num_experts`` low-rank experts, or
    v1 vector) beside a deep MLP (`deep_mlp`, with ``dropout``).
    Output: (B, in_features + deep_layer_sizes[-1])."""

    def __init__(
        self,
        in_features: int,
        num_cross_layers: int,
        deep_layer_sizes: Sequence[int],
        version: CrossNetVersion = "v2",
        low_rank: int = 32,
        num_experts: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if version == "v2":
            self.cross: nn.Module = CrossNet(in_features, num_cross_layers)
        elif version == "low_rank":
            self.cross = LowRankCrossNet(in_features, num_cross_layers, low_rank=low_rank)
        elif version == "mixture":
            if num_experts < 1:
                raise ValueError(f"num_experts must be >= 1 for the mixture cross network, got {num_experts}.")
            self.cross = LowRankMixtureCrossNet(in_features, num_cross_layers, num_experts=num_experts, low_rank=low_rank)
        elif version == "v1":
            self.cross = VectorCrossNet(in_features, num_cross_layers)
        else:
            raise ValueError(
                f"Unknown cross network version {version!r}; choose 'v2', 'low_rank', 'mixture' or 'v1'."
            )
        self.deep = deep_mlp(in_features, deep_layer_sizes, dropout)

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        x0 = torch.cat([sparse.flatten(1), dense], dim=1)
        return torch.cat([self.cross(x0), self.deep(x0)], dim=1)


class CompressedInteractionNetwork(nn.Module):
    """xDeepFM's CIN (Lian et al., 2018): explicit crosses at the vector level, one degree
    higher per layer, over fields X^0 (B, m, D).

    Layer k maps X^{k-1} (B, H_{k-1}, D) to H_k feature maps, each a weighted sum of the
    Hadamard products of every (previous map, field) pair:
    ``X^k[h] = sum_{i, j} W^k[h, i, j] * (X^{k-1}[i] ∘ X^0[j])`` (linear, as in the paper's
    equation; the products keep the embedding axis, so crosses stay vector-wise). Every
    layer's maps are sum-pooled over the embedding axis and concatenated.
    Output: (B, sum(layer_sizes)).
    """

    def __init__(self, num_fields: int, layer_sizes: Sequence[int]) -> None:
        super().__init__()
        if not layer_sizes or min(layer_sizes) < 1:
            raise ValueError(f"CIN layer_sizes must be a non-empty list of sizes >= 1, got {list(layer_sizes)}.")
        widths = [num_fields, *layer_sizes]
        # W^k as a linear map over the (i, j) pairs, flattened i-major (see forward).
        self.layers = nn.ModuleList(
            nn.Linear(previous * num_fields, size, bias=False) for previous, size in zip(widths, layer_sizes)
        )

    def forward(self, fields: Tensor) -> Tensor:
        # The sum is taken over i first (a matmul of X^{k-1} with W^k), then over j against
        # X^0: the (B, H_{k-1} * m, D) tensor of every pair's product is never built: the same
        # result, with less memory traffic forward and backward.
        x, pooled = fields, []
        batch, num_fields, dim = fields.shape
        for layer in self.layers:
            size, previous = layer.out_features, x.shape[1]
            by_i = layer.weight.view(size, previous, num_fields).transpose(0, 1).reshape(previous, size * num_fields)
            partial = (x.transpose(1, 2) @ by_i).view(batch, dim, size, num_fields)  # (B, D, H_k, m)
            x = torch.einsum("bdhj,bjd->bhd", partial, fields)  # (B, H_k, D)
            pooled.append(x.sum(dim=2))
        return torch.cat(pooled, dim=1)


class CINInteraction(nn.Module):
    """xDeepFM's two towers over the fields (dense projection as one field, plus the F
    embeddings): a CIN for explicit vector-wise crosses and a deep MLP over the flattened
    fields for implicit ones (`deep_mlp`, with ``dropout``).
    Output: (B, sum(cin_layer_sizes) + deep_layer_sizes[-1])."""

    def __init__(
        self,
        num_fields: int,
        embedding_dim: int,
        cin_layer_sizes: Sequence[int],
        deep_layer_sizes: Sequence[int],
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.cin = CompressedInteractionNetwork(num_fields, cin_layer_sizes)
        self.deep = deep_mlp(num_fields * embedding_dim, deep_layer_sizes, dropout)

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        fields = torch.cat([dense.unsqueeze(1), sparse], dim=1)
        return torch.cat([self.cin(fields), self.deep(fields.flatten(1))], dim=1)


class FeatureGate(nn.Module):
    """FinalMLP's stream-specific feature selection (Mao et al., 2023): the flattened fields
    (B, m * D) times a gate ``2 * sigmoid(MLP(context))`` in (0, 2), one weight per element.

    The context is the embeddings of the ``context_fields`` (indices into the m fields), so
    a stream can weigh every field by, say, who the user is; with no context fields it is a
    learned vector, and the gate a learned per-element weighting shared by all samples.
    """

    def __init__(
        self, num_fields: int, embedding_dim: int, context_fields: Sequence[int], hidden_sizes: Sequence[int]
    ) -> None:
        super().__init__()
        bad = [i for i in context_fields if not 0 <= i < num_fields]
        if bad:
            raise ValueError(f"Gate context fields {bad} are out of range for {num_fields} fields.")
        self.context_fields = list(context_fields)
        self.context_bias = None if self.context_fields else nn.Parameter(torch.zeros(1, embedding_dim))
        context_size = embedding_dim * max(1, len(self.context_fields))
        # The output is a logit per element: no activation on MLP's last layer.
        self.gate = MLP(context_size, [*hidden_sizes, num_fields * embedding_dim], activation_on_last=False)

    def forward(self, fields: Tensor) -> Tensor:
        if self.context_bias is None:
            context = fields[:, self.context_fields].flatten(1)
        else:
            context = self.context_bias.expand(fields.shape[0], -1)
        return fields.flatten(1) * (2 * torch.sigmoid(self.gate(context)))


class DualStreamInteraction(nn.Module):
    """FinalMLP's two MLP streams over the fields (dense projection as one field, plus the F
    embeddings), each behind its own `FeatureGate`, so the two learn to look at different
    features. The streams are `deep_mlp` (with ``dropout``); the gates have no dropout.
    Output: (B, stream1_layer_sizes[-1] + stream2_layer_sizes[-1]), the two streams side by
    side (what `MultiHeadBilinearFusion` takes)."""

    def __init__(
        self,
        num_fields: int,
        embedding_dim: int,
        stream1_layer_sizes: Sequence[int],
        stream2_layer_sizes: Sequence[int],
        gate_layer_sizes: Sequence[int],
        stream1_context_fields: Sequence[int] = (),
        stream2_context_fields: Sequence[int] = (),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if not stream1_layer_sizes or not stream2_layer_sizes:
            raise ValueError(
                f"Both streams need at least one layer; got {list(stream1_layer_sizes)} and {list(stream2_layer_sizes)}."
            )
        width = num_fields * embedding_dim
        self.gate1 = FeatureGate(num_fields, embedding_dim, stream1_context_fields, gate_layer_sizes)
        self.gate2 = FeatureGate(num_fields, embedding_dim, stream2_context_fields, gate_layer_sizes)
        self.stream1 = deep_mlp(width, stream1_layer_sizes, dropout)
        self.stream2 = deep_mlp(width, stream2_layer_sizes, dropout)

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        fields = torch.cat([dense.unsqueeze(1), sparse], dim=1)
        return torch.cat([self.stream1(self.gate1(fields)), self.stream2(self.gate2(fields))], dim=1)


class MultiHeadBilinearFusion(nn.Module):
    """FinalMLP's fusion of two stream outputs x (B, x_dim) and y (B, y_dim), given side by
    side as (B, x_dim + y_dim), into one logit (B, 1):
    ``b + w_x·x + w_y·y + sum_h x_h^T W_h y_h``, with x and y each cut into ``num_heads``
    equal chunks x_h, y_h (heads keep the bilinear term's size down).
    """

    def __init__(self, x_dim: int, y_dim: int, num_heads: int = 1) -> None:
        super().__init__()
        if num_heads < 1 or x_dim % num_heads or y_dim % num_heads:
            raise ValueError(
                f"num_heads must be >= 1 and divide both stream widths ({x_dim} and {y_dim}); got {num_heads}."
            )
        self.x_dim, self.num_heads = x_dim, num_heads
        self.linear = nn.Linear(x_dim + y_dim, 1)  # b + w_x·x + w_y·y
        self.bilinear = nn.Parameter(torch.empty(num_heads, x_dim // num_heads, y_dim // num_heads))
        nn.init.xavier_normal_(self.bilinear)

    def forward(self, xy: Tensor) -> Tensor:
        x, y = xy[:, : self.x_dim], xy[:, self.x_dim :]
        heads_x = x.unflatten(1, (self.num_heads, -1))
        heads_y = y.unflatten(1, (self.num_heads, -1))
        bilinear = torch.einsum("bhi,hij,bhj->b", heads_x, self.bilinear, heads_y)
        return self.linear(xy) + bilinear.unsqueeze(1)


class FactorizationMachineTerm(nn.Module):
    """The second-order term of Rendle's factorization machine over fields (B, m, D): the dot
    products of every two fields, ``sum_{i<j} <v_i, v_j>``, in O(m * D) as
    ``0.5 * sum_d ((sum_i v_id)^2 - sum_i v_id^2)``. Output: (B, 1).

    Not torchrec.modules.deepfm.FactorizationMachine: that one flattens the fields into one
    row of m * D scalars before its sums, so it adds the products of every two scalars (across
    embedding dimensions, and within a field), not the fields' dot products.
    """

    def forward(self, fields: Tensor) -> Tensor:
        square_of_sum = fields.sum(dim=1).square()
        sum_of_squares = fields.square().sum(dim=1)
        return 0.5 * (square_of_sum - sum_of_squares).sum(dim=1, keepdim=True)


class PairwiseInteraction(nn.Module):
    """FM's pairwise term over all fields: the dense arch's fields (B, n, D) beside the F
    embeddings (B, F, D). Output: (B, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fm = FactorizationMachineTerm()

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        return self.fm(torch.cat([dense, sparse], dim=1))


class DeepInteraction(nn.Module):
    """Wide & Deep's deep tower: an MLP (`deep_mlp`, with ``dropout``) over [flattened
    embeddings, dense features]. Output: (B, deep_layer_sizes[-1])."""

    def __init__(self, in_features: int, deep_layer_sizes: Sequence[int], dropout: float = 0.0) -> None:
        super().__init__()
        self.deep = DeepFM(dense_module=deep_mlp(in_features, deep_layer_sizes, dropout))

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        return self.deep([sparse, dense])
