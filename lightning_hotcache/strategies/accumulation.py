"""Gradient accumulation is refused by strategies that step embedding rows in backward.

``hotcache`` and ``torchrec`` apply the row-wise rule to a batch's rows inside backward (FBGEMM's
fused kernel, or the PyTorch path's update in its lookup's backward), so with
``accumulate_grad_batches=k`` rows would be stepped on every micro-batch while the dense
layers step once per k: another model than
``auto`` learns (the second micro-batch would also read rows the first already moved).
Accumulating the rows' gradients across micro-batches instead would keep every row a window
reads locked in the cache until the optimizer step; a k times larger batch trains the same
model (accumulation only emulates one) for the cost of its distinct rows, so we refuse with
that advice rather than fall out of exactness in silence.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.trainer.states import TrainerFn


def largest_accumulation(trainer: pl.Trainer) -> int:
    """The most micro-batches per optimizer step the fit will use (a scheduler's largest factor)."""
    factors = [trainer.accumulate_grad_batches]
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, GradientAccumulationScheduler):
            factors.extend(callback.scheduling.values())
    return max(factors)


def refuse_gradient_accumulation(trainer: pl.Trainer, strategy_name: str) -> None:
    """Raise when a fit would accumulate gradients over micro-batches (see the module docstring)."""
    if trainer.state.fn != TrainerFn.FITTING:
        return
    _refuse(largest_accumulation(trainer), strategy_name)


def refuse_gradient_accumulation_now(trainer: pl.Trainer, strategy_name: str) -> None:
    """Raise when this training step would accumulate: called before each step's forward,
    for accumulation that a callback turns on mid-fit (as `GradientAccumulationScheduler`
    does, at an epoch start), before a row of the step is updated."""
    _refuse(trainer.accumulate_grad_batches, strategy_name)


def _refuse(factor: int, strategy_name: str) -> None:
    if factor > 1:
        raise ValueError(
            f"accumulate_grad_batches={factor} does not train what `auto` trains under strategy={strategy_name!r}: "
            f"embedding rows are updated in the backward of every micro-batch, not once per optimizer step. "
            f"Train with a {factor}x larger batch size instead (what accumulation emulates; its embedding cost is "
            f"only the batch's distinct rows), or use strategy='auto'/'ddp' for accumulation."
        )
