"""The one registry of the environment switches that turn a host-side mechanism off or size it.

The mechanisms are on by default (each paid where it was measured: benchmarks/README.md); a
switch exists where a measurement pairs a run with and without it. Mechanisms that always pay
(host arrays on huge pages, kept out of forked children) have none: they are hard-wired. Read a switch only
through `enabled` or `setting`, so that every switch the package knows is listed here, as
FBGEMM lists its feature gates in ``fbgemm_gpu/config/feature_list.py``.
"""

from __future__ import annotations

import enum
import os


class Switch(enum.Enum):
    """A switch: its environment variable and what it controls."""

    READ_AHEAD = ("LIGHTNING_HOTCACHE_READ_AHEAD", "memory-mapped misses read ahead off the step's path (0: off)")
    COPY_THREADS = ("LIGHTNING_HOTCACHE_COPY_THREADS", "threads a large row copy is split between (unset: by cores)")
    PLAIN_TABLES_TRITON = (
        "LIGHTNING_HOTCACHE_PLAIN_TABLES_TRITON",
        "on CUDA, the zoo's plain tables pooled and stepped by the Triton TBE (0: embedding_bag and the PyTorch row step)",
    )
    SET_KERNELS = (
        "LIGHTNING_HOTCACHE_SET_KERNELS",
        "the device directory's ids found and victims chosen by Triton kernels over their sets (0: torch ops that "
        "gather every id's set; 1: also on a CPU under TRITON_INTERPRET=1, where they are slow, for tests; unset: on CUDA)",
    )
    DEVICE_DIRECTORY = (
        "LIGHTNING_HOTCACHE_DEVICE_DIRECTORY",
        "the Triton path's cache directory in device memory, host rows read and stepped in place (0: the host "
        "directory and staged copies; 1: also on a CPU under TRITON_INTERPRET=1, for tests; unset: on CUDA)",
    )

    def __init__(self, variable: str, controls: str) -> None:
        self.variable = variable
        self.controls = controls


def enabled(switch: Switch) -> bool:
    """Whether the mechanism of an on/off ``switch`` runs: unless its variable is ``0``."""
    return os.environ.get(switch.variable, "1") != "0"


def setting(switch: Switch) -> str | None:
    """The value of ``switch``'s variable; None where it is unset."""
    return os.environ.get(switch.variable)
