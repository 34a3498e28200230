"""Callbacks that put training figures on the progress bar and in the loggers."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


def _num_samples(batch: Any) -> int:
    labels = getattr(batch, "labels", None)
    if labels is None:
        raise TypeError(
            f"SamplesPerSecond expects batches with a `labels` tensor (torchrec's Batch); got {type(batch).__name__}."
        )
    return int(labels.shape[0])


class SamplesPerSecond(Callback):
    """Training throughput (samples/s on this rank) on the progress bar and in the loggers.

    Lightning's ThroughputMonitor logs only to loggers, not the progress bar, and needs a
    batch-size function per model; CTR batches always carry labels, so we count those. The
    figure is an exponential moving average over batches, so one slow step does not hide
    the trend; the first batch of each epoch (data loader start-up) is not counted.
    """

    def __init__(self, smoothing: float = 0.9) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}.")
        self.smoothing = smoothing
        self._last: float | None = None
        self._rate: float | None = None

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last is not None and now > self._last:
            rate = _num_samples(batch) / (now - self._last)
            self._rate = rate if self._rate is None else self.smoothing * self._rate + (1 - self.smoothing) * rate
            pl_module.log("train/samples_per_s", self._rate, prog_bar=True, on_step=True, on_epoch=False)
        self._last = now
