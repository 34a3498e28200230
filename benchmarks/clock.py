"""StepClock: training throughput between a warm-up batch and the last batch of a fit."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl


class StepClock(pl.Callback):
    """Wall time and samples from the end of batch ``warmup - 1`` to the end of the last batch
    (set-up, table initialization and profiling fall before it). ``on_start`` is called when
    the timed window opens, e.g. to reset counters."""

    def __init__(self, warmup: int, on_start: Any = None) -> None:
        self.warmup = warmup
        self.on_start = on_start
        self.start = self.end = 0.0
        self.samples = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.warmup - 1:
            if self.on_start is not None:
                self.on_start()
            self.start = time.perf_counter()
        elif batch_idx >= self.warmup:
            self.samples += batch.labels.shape[0]
            self.end = time.perf_counter()

    @property
    def samples_per_s(self) -> float:
        return self.samples / (self.end - self.start)
