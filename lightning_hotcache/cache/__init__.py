"""Tiered embedding rows: host store (RAM or memory-mapped files) and device cache."""

from lightning_hotcache.cache.device import (
    CACHE_POLICIES,
    CacheCapacityError,
    CacheCounters,
    CachePolicy,
    DeviceCache,
    check_cache_policy,
)
from lightning_hotcache.cache.host import HostDirectory, HostStorageInUseError, HostStore

__all__ = [
    "CACHE_POLICIES",
    "CacheCapacityError",
    "CacheCounters",
    "CachePolicy",
    "DeviceCache",
    "HostDirectory",
    "HostStorageInUseError",
    "HostStore",
    "check_cache_policy",
]
