"""Staging threads at background priority, so that on a CPU they take only the cores the step leaves idle.

On a CPU device the training step's torch ops run on every core (an OpenMP team of one thread
a core). A staging thread at the step's own priority gets an equal share of the cores: the
kernel preempts one of the team's threads mid-op, and the whole op waits at its barrier for
the thread that was put aside. At the lowest priority (nice 19, which any process may set
for its own threads) the scheduler runs staging while the step leaves a core idle: the
Python between ops, autograd's bookkeeping, single-threaded ops, the loader. So staging does
not stall the step's ops at their barriers, and training with a prefetch thread keeps pace
with TorchRec on a CPU, where at the step's priority it falls behind
(`benchmarks/cpu_throughput.py`, in turns; benchmarks/README.md).

Linux only: elsewhere no per-thread priority exists through `os.setpriority`, and the thread
keeps the step's. Neither torch nor Lightning sets a thread's priority, so this is ours.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

# The lowest priority a Linux thread may take (nice values run from -20 to 19).
BACKGROUND_NICE = 19


def background_priority_supported() -> bool:
    return sys.platform.startswith("linux")


def run_at_background_priority() -> None:
    """Lower the calling thread's CPU priority to `BACKGROUND_NICE`, where the OS allows a
    thread its own. Threads and processes it starts later take the same priority (Linux
    copies the creating thread's nice value): torch's OpenMP team for its ops, a pool of
    staging threads, and a DataLoader's worker processes, whose iterator the prefetch or
    reader thread makes, so that the loader too runs on the cores the step leaves idle."""
    if not background_priority_supported():
        return
    try:
        # On Linux PRIO_PROCESS with a thread's id sets that thread alone (setpriority(2), NOTES).
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError as err:  # a sandbox that filters the call: staging still runs, at the step's priority
        warnings.warn(f"Could not lower the staging thread's priority ({err}); it runs at the training step's.", stacklevel=2)
