"""TorchRec's ``Batch`` (dense features, a KeyedJaggedTensor of ids, labels) as a
`lightning_hotcache._ops.step_graph.BatchLayout`: what makes two batches one graph's, and the
static copy a graph reads.

A KeyedJaggedTensor carries host values beside its tensors (its keys, samples per key, ids per
key): a step reads them to split the ids by feature, so a graph recorded with them serves only
batches with the same ones. One-hot features of a fixed batch size have the same every step;
multi-hot ones change with the ids' lengths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch


def _tensor_signature(tensor: Tensor | None) -> Any:
    return None if tensor is None else (tuple(tensor.shape), tensor.dtype, tensor.device)


_TENSOR_FIELDS = frozenset({"dense_features", "sparse_features", "labels"})


def _host_fields(batch: Any) -> tuple[tuple[str, Any], ...] | None:
    """The fields a ``Batch`` dataclass (or subclass) has beside its tensors, as (name, value),
    where they are all host values a graph can be recorded with (`BatchShare`'s counts); None
    for anything else."""
    if not isinstance(batch, Batch) or not dataclasses.is_dataclass(batch):
        return None
    extra = tuple((f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch) if f.name not in _TENSOR_FIELDS)
    return None if any(isinstance(value, Tensor) for _, value in extra) else extra


class TorchRecBatches:
    """`BatchLayout` of torchrec's ``Batch`` and its dataclass subclasses whose other fields are
    host values (`lightning_hotcache.distributed.global_batch.BatchShare`): those values are part
    of the signature. Any other batch gets a signature equal to no other, so it steps eagerly."""

    def signature(self, batch: Batch) -> Any:
        extra = _host_fields(batch)
        if extra is None:
            return object()
        features = batch.sparse_features
        return (
            type(batch),
            extra,
            _tensor_signature(batch.dense_features),
            _tensor_signature(batch.labels),
            tuple(features.keys()),
            features.stride(),
            tuple(features.length_per_key()),  # on the host: the datamodules build it with the batch
            _tensor_signature(features.values()),
            _tensor_signature(features.weights_or_none()),
            _tensor_signature(features.lengths()),
            features.variable_stride_per_key(),
        )

    def static_copy(self, batch: Batch) -> Batch:
        features = batch.sparse_features
        weights = features.weights_or_none()
        static_features = KeyedJaggedTensor(
            keys=features.keys(),
            values=features.values().clone(),
            weights=None if weights is None else weights.clone(),
            lengths=features.lengths().clone(),
            offsets=features.offsets().clone(),
            stride=features.stride(),
            length_per_key=features.length_per_key(),
            offset_per_key=features.offset_per_key(),
        )
        return dataclasses.replace(
            batch, dense_features=batch.dense_features.clone(), sparse_features=static_features, labels=batch.labels.clone()
        )

    def refill(self, static: Batch, batch: Batch) -> None:
        static.dense_features.copy_(batch.dense_features, non_blocking=True)
        static.labels.copy_(batch.labels, non_blocking=True)
        into, features = static.sparse_features, batch.sparse_features
        into.values().copy_(features.values(), non_blocking=True)
        into.lengths().copy_(features.lengths(), non_blocking=True)
        into.offsets().copy_(features.offsets(), non_blocking=True)
        weights = features.weights_or_none()
        if weights is not None:
            into.weights().copy_(weights, non_blocking=True)
