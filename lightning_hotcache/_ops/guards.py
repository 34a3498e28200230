"""A non-finite training loss stops the run (or skips its batch) before anything learns from it.

One NaN in a dense feature makes the loss NaN, and its backward would write NaN into every
embedding row the batch read and into the dense weights; training would then "finish" with
loss nan and a checkpoint full of NaNs. Lightning has no built-in check before backward
(``detect_anomaly`` is a debugging tool, far too slow to leave on), so the zoo's models call
`finite_loss_or_skip` in ``training_step`` (and say so with ``checks_non_finite_loss``), and
the hotcache strategy checks the loss of any other model before its backward. One scalar
per step: checking the gradients instead would read every pooled gradient, which measured
as much as FBGEMM's whole fused backward.
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchrec import KeyedJaggedTensor

NonFiniteLossAction = Literal["raise", "skip"]
NON_FINITE_LOSS_ACTIONS: tuple[str, ...] = ("raise", "skip")


class NonFiniteLossError(FloatingPointError):
    """The training loss (or an embedding gradient) was NaN or infinite."""


def check_non_finite_loss_action(action: str) -> None:
    if action not in NON_FINITE_LOSS_ACTIONS:
        raise ValueError(f"non_finite_loss must be one of {NON_FINITE_LOSS_ACTIONS}, got {action!r}.")


def finite_loss_or_skip(loss: Tensor, trainer: pl.Trainer, batch_idx: int, action: NonFiniteLossAction) -> Tensor | None:
    """The step's loss on the host, if every rank's is finite: the mean over ranks of their
    losses (with `share_mean`'s shares, the global batch's mean loss), a scalar on the CPU, for
    ``self.log``; ``None`` where the step must not go on to backward. Every rank decides together
    (one rank's NaN stops or skips the step everywhere, so no rank waits in a collective that
    never comes).

    ``action="raise"`` raises `NonFiniteLossError` naming the step, the batch and (with
    several processes) the ranks whose loss is not finite; ``"skip"`` warns and returns None:
    the caller returns None from ``training_step``, which makes Lightning skip backward and the
    optimizer step.

    One read of the device a step: the losses are copied to the host once and everything
    after looks at the copy. Logged from the copy, the loss reaches the progress bar and the
    loggers without another (Lightning turns a progress-bar metric into a number with
    ``item()`` every step, which on a device tensor waits for the whole step's queued work),
    and across processes without Lightning's ``sync_dist`` all-reduce: the gathered losses
    already hold every rank's.
    """
    # Every rank's loss, not a yes/no: the error then names the rank(s) that went non-finite
    # and their loss, where rank 0 used to quote its own finite one. Still one scalar per rank.
    # In one process there is nothing to gather: a DDP-family strategy would still make the
    # collective with itself (an NCCL call and kernel a step on CUDA) where `auto` makes none.
    own = loss.detach().float().mean().reshape(1)
    losses = (trainer.strategy.all_gather(own).reshape(-1) if trainer.world_size > 1 else own).cpu()
    bad_ranks = (~torch.isfinite(losses)).nonzero().reshape(-1).tolist()
    if not bad_ranks:
        return losses.mean()
    where = f"global step {trainer.global_step} (epoch {trainer.current_epoch}, batch {batch_idx})"
    which = f"({', '.join(str(losses[rank].item()) for rank in bad_ranks)})"
    if len(losses) > 1:
        which = f"on rank{'s' if len(bad_ranks) > 1 else ''} {', '.join(map(str, bad_ranks))} {which}"
    if action == "skip":
        rank_zero_warn(f"Skipped the batch at {where}: its training loss is not finite {which}.")
        return None
    raise NonFiniteLossError(
        f"The training loss is not finite {which} at {where}. "
        "Stopped before backward: no embedding row or dense weight learned from it. Look for NaN/inf in that "
        "batch's dense features or labels, or lower the learning rates; `non_finite_loss='skip'` skips such "
        "batches instead."
    )


def check_not_empty(features: KeyedJaggedTensor) -> None:
    """Refuse a batch of zero samples before torchrec fails on it with a bare IndexError."""
    if features.stride() == 0:
        raise ValueError(
            f"Got an empty batch (0 samples; features {features.keys()}). Drop empty batches in the data loader "
            "(e.g. filter them out, or DataLoader(drop_last=True) when the last batch can be empty)."
        )


def check_feature_dtypes(dense: Tensor, sparse: KeyedJaggedTensor, dense_dtype: torch.dtype) -> None:
    """Refuse a batch's features of types the model cannot take, naming the field and the type
    to give, before torch fails deep in a layer (or, for float ids, casts them silently): dense
    features of the dense layers' float type, integer ids."""
    if dense.dtype != dense_dtype:
        raise TypeError(
            f"The batch's dense_features are {dense.dtype}, the model's dense layers {dense_dtype}: give "
            f"{dense_dtype} dense features (e.g. `.to({dense_dtype})` in the dataset)."
        )
    if sparse.values().is_floating_point():
        raise TypeError(
            f"The batch's sparse_features ids are {sparse.values().dtype}: give integer ids (int64 or int32); "
            "a float id would be rounded to a row in silence."
        )


def check_label_dtype(labels: Tensor) -> None:
    """Refuse integer labels, naming the type to give: the loss takes float labels."""
    if not labels.is_floating_point():
        raise TypeError(f"The batch's labels are {labels.dtype}: give float labels in {{0, 1}} (e.g. `.float()`), as the loss takes.")
