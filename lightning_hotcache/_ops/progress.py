"""Progress bars for whole-table work: the bytes of the tables counted on stderr, where the
tables are large enough for the work to take a while.

Drawing a table's initial rows and restoring its rows from a checkpoint run at memory or disk
speed: 17 GB of rows took ~17 s to draw on one core, 4 GiB of memory-mapped tables ~19 s to
restore from a sharded checkpoint, and the tables of a terabyte take minutes. Below
`PROGRESS_FROM_BYTES` the work is quick and shows nothing. A bar counts what the process itself
writes (across ranks, one rank's share; only rank 0 shows its bar, as Lightning's progress
bar does).
"""

from __future__ import annotations

from typing import Callable

from tqdm.auto import tqdm

# Work over tables of at least this many bytes shows a bar.
PROGRESS_FROM_BYTES = 2**30

# Told the bytes written since its last call (`byte_bar`'s ``update``).
Progress = Callable[[int], None]


def byte_bar(total: int, desc: str, show: bool = True) -> tqdm:
    """A bar of ``total`` bytes on stderr, disabled (it counts, but prints nothing) where
    ``show`` is False or ``total`` is under `PROGRESS_FROM_BYTES`. Use it as a context manager."""
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not show or total < PROGRESS_FROM_BYTES)
