"""lightning-hotcache: train CTR models whose embedding tables outgrow the accelerator.

Importing this package registers the strategies' names with Lightning; every part (the
strategies, profiler, planner, cache, embedding module) loads on first use, so that a command
that needs none of them (``hotcache --help``) imports neither TorchRec nor numba.
"""

from importlib import import_module
from typing import Any

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_hotcache._compat import alias_moved_modules

alias_moved_modules()  # old flat module paths still import, with a DeprecationWarning

_LAZY = {
    "HotCacheStrategy": "lightning_hotcache.strategies.hotcache",
    "TorchRecStrategy": "lightning_hotcache.strategies.torchrec",
    "CacheMetrics": "lightning_hotcache.callbacks.metrics",
    "SamplesPerSecond": "lightning_hotcache.callbacks.metrics",
    "ROWWISE_OPTIMIZERS": "lightning_hotcache.optim.rowwise",
    "RowWiseOptimizer": "lightning_hotcache.optim.rowwise",
    "RowWiseOptimizerConfig": "lightning_hotcache.optim.rowwise",
    "use_sparse_gradients": "lightning_hotcache.optim.rowwise",
    "average_sparse_gradients": "lightning_hotcache.distributed.sparse_ddp",
    "keep_out_of_ddp": "lightning_hotcache.distributed.sparse_ddp",
    "AccessProfiler": "lightning_hotcache.planner.profiling",
    "AccessStats": "lightning_hotcache.planner.profiling",
    "profile_batches": "lightning_hotcache.planner.profiling",
    "plot_coverage": "lightning_hotcache.planner.profiling",
    "HotColdPlanner": "lightning_hotcache.planner.plan",
    "HotColdPlan": "lightning_hotcache.planner.plan",
    "TablePlan": "lightning_hotcache.planner.plan",
    "HotColdEmbeddingBagCollection": "lightning_hotcache.embedding",
    "to_torchrec": "lightning_hotcache.embedding",
    "HostStore": "lightning_hotcache.cache",
    "DeviceCache": "lightning_hotcache.cache",
    "CacheCapacityError": "lightning_hotcache.cache",
    "BatchShare": "lightning_hotcache.distributed.global_batch",
    "share_mean": "lightning_hotcache.distributed.global_batch",
    "real_samples": "lightning_hotcache.distributed.global_batch",
    "PredictionWriter": "lightning_hotcache.callbacks.predictions",
}

# Registered names take no settings (Lightning), so common settings get names of their own;
# anything else: `class_path: lightning_hotcache.HotCacheStrategy` with `init_args`.
# A share of small tables can be less than the batches in flight need, so the fractional
# presets grow to that minimum (with a warning): every preset trains every shipped config.
STRATEGY_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "hotcache": ("hot rows on the device within half the free device memory, LFU cache for the rest", {}),
    "hotcache_10pct": (
        "hotcache with a device budget of 10% of the embedding bytes, or the minimum the batches in flight need",
        {"device_budget": 0.1, "grow_budget_to_minimum": True},
    ),
    "hotcache_1pct": (
        "hotcache with a device budget of 1% of the embedding bytes, or the minimum the batches in flight need",
        {"device_budget": 0.01, "grow_budget_to_minimum": True},
    ),
    "hotcache_lru": ("hotcache with an LRU dynamic cache", {"cache_policy": "lru"}),
    "hotcache_static": ("FAE: static hot rows only, misses staged per batch", {"cache_policy": "static"}),
}


def _hotcache_strategy(**init_args: Any) -> Strategy:
    """A `HotCacheStrategy` for a registered name (imported when a Trainer asks for one)."""
    from lightning_hotcache.strategies.hotcache import HotCacheStrategy

    return HotCacheStrategy(**init_args)


def _torchrec_strategy(**init_args: Any) -> Strategy:
    """A `TorchRecStrategy` for the registered name ``torchrec``."""
    from lightning_hotcache.strategies.torchrec import TorchRecStrategy

    return TorchRecStrategy(**init_args)


for _name, (_description, _init_args) in STRATEGY_PRESETS.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, _hotcache_strategy, description=_description, **_init_args)
if "torchrec" not in StrategyRegistry:
    StrategyRegistry.register(
        "torchrec", _torchrec_strategy, description="TorchRec's DistributedModelParallel sharding (baseline)"
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_hotcache' has no attribute {name!r}")


__all__ = ["STRATEGY_PRESETS", *_LAZY]
__version__ = "0.1.0"
