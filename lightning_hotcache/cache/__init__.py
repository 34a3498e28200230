"""Tiered embedding rows: host store (RAM or memory-mapped files) and device cache."""

from lightning_hotcache.cache.device import (
    CACHE_POLICIES,
    CacheCapacityError,
    CacheCounters,
    CachePolicy,
    DeviceCache,
    check_cache_policy,
)
from lightning_hotcache.cache.host import HostStore

__all__ = ["CACHE_POLICIES", "CacheCapacityError", "CacheCounters", "CachePolicy", "DeviceCache", "HostStore", "check_cache_policy"]
