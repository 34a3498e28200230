"""Global batches split across processes, so N processes x batch B learn what 1 x N*B learns.

Each training step reads one *global* batch of N*B samples, split into N shares, one per
process; every process draws the same global batch order, so no sampler pads an epoch with
repeated samples. Where an epoch does not divide into whole global batches, the last one is
smaller and its shares differ in size by at most one sample. DDP (and hotcache, and
TorchRec's strategy) average gradients over processes, so a process whose loss is the plain
mean of its share would weigh its samples by 1/(N*n_r) instead of 1/n: `share_mean` scales
each share so that the average over processes is the mean over the global batch.

A global batch of fewer samples than processes leaves some shares empty. Those processes
still make every collective call of the step (DDP's all-reduce, hotcache's row exchange),
so their share is one sample of the global batch marked as padding: it takes part in the
forward and backward with weight 0 and is left out of metrics and predictions.

Why a subclass of TorchRec's ``Batch``: a batch moves to the device through its ``to``,
which builds a plain ``Batch`` and would drop the share's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torchrec.datasets.utils import Batch


def share_bounds(samples: int, num_shares: int, share: int) -> tuple[int, int]:
    """``[start, stop)`` of share ``share`` of ``samples`` samples split into ``num_shares``:
    consecutive, in share order, sizes differing by at most one (the first shares larger)."""
    if not 0 <= share < num_shares:
        raise ValueError(f"share {share} out of range [0, {num_shares})")
    base, extra = divmod(samples, num_shares)
    start = share * base + min(share, extra)
    return start, start + base + (share < extra)


@dataclass
class BatchShare(Batch):
    """One process's share of a global batch (a TorchRec ``Batch`` with three fields more).

    Args:
        global_samples: samples of the whole global batch, over all shares.
        num_shares: processes the global batch is split across.
        padding: trailing samples of this share that are not data (0, or 1 for an empty share).
    """

    global_samples: int
    num_shares: int
    padding: int = 0

    def _with_tensors_of(self, batch: Batch) -> BatchShare:
        return replace(
            self, dense_features=batch.dense_features, sparse_features=batch.sparse_features, labels=batch.labels
        )

    def to(self, device: torch.device, non_blocking: bool = False) -> BatchShare:
        return self._with_tensors_of(super().to(device, non_blocking=non_blocking))

    def pin_memory(self) -> BatchShare:
        return self._with_tensors_of(super().pin_memory())

    @property
    def num_real(self) -> int:
        """Samples of this share that are data."""
        return int(self.labels.shape[0]) - self.padding


def real_samples(batch: Any) -> int:
    """Samples of ``batch`` that are data (all of a plain ``Batch``)."""
    return batch.num_real if isinstance(batch, BatchShare) else int(batch.labels.shape[0])


def share_mean(per_sample: Tensor, batch: Any) -> Tensor:
    """The loss this process backpropagates: a mean over processes of these is the mean of
    ``per_sample`` over the global batch.

    A plain ``Batch``, or an even share, gets the plain mean. An uneven share (the last
    global batch of an epoch) gets ``sum over its real samples * N / n``; an empty share
    gets 0, still a function of the whole forward, so its backward runs (and its collectives)
    with zero gradients.
    """
    samples = int(batch.labels.shape[0])
    if per_sample.dim() == 0 or per_sample.shape[0] != samples:
        raise ValueError(
            f"share_mean needs one loss per sample of the batch ({samples}), got a loss of shape "
            f"{tuple(per_sample.shape)}: a model's loss_fn must not reduce, e.g. nn.BCEWithLogitsLoss(reduction='none') "
            "rather than nn.BCEWithLogitsLoss() (the mean is taken over the global batch, also at an uneven epoch end)."
        )
    if not isinstance(batch, BatchShare):
        return per_sample.mean()
    if batch.padding == 0 and batch.global_samples == batch.num_shares * per_sample.shape[0]:
        return per_sample.mean()
    return per_sample[: batch.num_real].sum() * (batch.num_shares / batch.global_samples)
