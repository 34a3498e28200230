"""The one registry of the environment switches that turn a host-side mechanism off or size it.

The mechanisms are on by default (each paid where it was measured: benchmarks/README.md); a
switch exists so that a measurement can pair a run with and without it, or so that an
unusual host (no huge pages, a sandbox that refuses madvise) can opt out. Read a switch only
through `enabled` or `setting`, so that every switch the package knows is listed here, as
FBGEMM lists its feature gates in ``fbgemm_gpu/config/feature_list.py``.
"""

from __future__ import annotations

import enum
import os


class Switch(enum.Enum):
    """A switch: its environment variable and what it controls."""

    HUGE_PAGES = ("LIGHTNING_HOTCACHE_HUGE_PAGES", "host arrays on 2 MiB pages (0: 4 KiB pages)")
    DONTFORK = ("LIGHTNING_HOTCACHE_DONTFORK", "host arrays left out of forked DataLoader workers (0: inherited)")
    READ_AHEAD = ("LIGHTNING_HOTCACHE_READ_AHEAD", "memory-mapped misses read ahead off the step's path (0: off)")
    COPY_THREADS = ("LIGHTNING_HOTCACHE_COPY_THREADS", "threads a large row copy is split between (unset: by cores)")

    def __init__(self, variable: str, controls: str) -> None:
        self.variable = variable
        self.controls = controls


def enabled(switch: Switch) -> bool:
    """Whether the mechanism of an on/off ``switch`` runs: unless its variable is ``0``."""
    return os.environ.get(switch.variable, "1") != "0"


def setting(switch: Switch) -> str | None:
    """The value of ``switch``'s variable; None where it is unset."""
    return os.environ.get(switch.variable)
