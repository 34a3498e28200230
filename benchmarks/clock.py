"""StepClock: training throughput between a warm-up batch and the last batch of a fit."""

from __future__ import annotations

import time
from typing import Any, Callable

import lightning.pytorch as pl


class StepClock(pl.Callback):
    """Wall time and samples from the end of batch ``warmup - 1`` to the end of the last batch
    (set-up, table initialization and profiling fall before it; teardown after it).

    Args:
        warmup: batches before the timed window.
        probe: read at the start of the window (``at_start``) and after every timed batch
            (``at_end``: the last batch's reading), e.g. counters to take differences of.
    """

    def __init__(self, warmup: int, probe: Callable[[], Any] | None = None) -> None:
        self.warmup = warmup
        self.probe = probe
        self.start = self.end = 0.0
        self.samples = 0
        self.at_start: Any = None
        self.at_end: Any = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.warmup - 1:
            self.at_start = self.probe() if self.probe else None
            self.start = time.perf_counter()
        elif batch_idx >= self.warmup:
            self.samples += batch.labels.shape[0]
            self.end = time.perf_counter()
            self.at_end = self.probe() if self.probe else None

    @property
    def samples_per_s(self) -> float:
        return self.samples / (self.end - self.start)


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096
    except OSError:
        return 0

