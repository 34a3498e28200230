"""Callbacks: training figures on the progress bar and in the loggers (`metrics`), and a
predict run's predictions written in the data's order (`predictions`, loaded on first use)."""

from typing import Any

from lightning_hotcache.callbacks.metrics import CacheMetrics, SamplesPerSecond

__all__ = ["CacheMetrics", "SamplesPerSecond", "PredictionWriter"]


def __getattr__(name: str) -> Any:
    if name == "PredictionWriter":
        from lightning_hotcache.callbacks.predictions import PredictionWriter

        return PredictionWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
