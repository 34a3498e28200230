"""lightning-hotcache: train CTR models whose embedding tables outgrow the accelerator.

Importing this package is cheap: the torchrec-heavy parts (profiler, planner, cache,
embedding module, CLI) load on first attribute access.
"""

from importlib import import_module
from typing import Any

from lightning_hotcache.callbacks import SamplesPerSecond
from lightning_hotcache.rowwise import (
    ROWWISE_OPTIMIZERS,
    RowWiseOptimizer,
    RowWiseOptimizerConfig,
    use_sparse_gradients,
)

_LAZY = {
    "AccessProfiler": "lightning_hotcache.profiling",
    "AccessStats": "lightning_hotcache.profiling",
    "profile_batches": "lightning_hotcache.profiling",
    "plot_coverage": "lightning_hotcache.profiling",
    "HotColdPlanner": "lightning_hotcache.planner",
    "HotColdPlan": "lightning_hotcache.planner",
    "TablePlan": "lightning_hotcache.planner",
    "HotColdEmbeddingBagCollection": "lightning_hotcache.embedding",
    "HostStore": "lightning_hotcache.cache",
    "DeviceCache": "lightning_hotcache.cache",
    "CacheCapacityError": "lightning_hotcache.cache",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_hotcache' has no attribute {name!r}")


__all__ = [
    "ROWWISE_OPTIMIZERS",
    "RowWiseOptimizer",
    "RowWiseOptimizerConfig",
    "SamplesPerSecond",
    "use_sparse_gradients",
    *_LAZY,
]
__version__ = "0.1.0"
