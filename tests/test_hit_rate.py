"""benchmarks/hit_rate.py's ceiling: Belady's offline optimum at batch granularity."""

from __future__ import annotations

import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # appended: shadows nothing
from hit_rate import belady_hits  # noqa: E402


def test_belady_evicts_the_row_used_farthest_ahead_and_never_the_batchs_own() -> None:
    trace = [np.array(ids) for ids in ([1], [2], [3], [1, 1], [2])]
    # At batch 2, rows 1 (next read at batch 3) and 2 (batch 4) are resident: 2 goes, so batch 3
    # hits twice (both lookups of row 1). LRU would evict row 1 and hit nothing.
    assert belady_hits(trace, capacity=2) == 2
    assert belady_hits(trace, capacity=3) == 3  # all but the first reads of 1, 2, 3
    with pytest.raises(ValueError, match="a batch reads 2 rows, more than the 1"):
        belady_hits([np.array([1, 2])], capacity=1)
    # Starting with row 1 resident (a plan's static row), its first reads hit too.
    assert belady_hits(trace, capacity=2, initial=[1]) == 3


def _lru_hits(batches: list[np.ndarray], capacity: int) -> int:
    resident: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for ids in batches:
        distinct, counts = np.unique(ids, return_counts=True)
        hits += int(sum(c for i, c in zip(distinct.tolist(), counts) if i in resident))
        for i in distinct.tolist():
            resident[i] = None
            resident.move_to_end(i)
        while len(resident) > capacity:
            victim = next(i for i in resident if i not in set(distinct.tolist()))
            del resident[victim]
    return hits


@pytest.mark.parametrize("capacity", [40, 120, 400])
def test_belady_is_a_ceiling_for_lru(capacity: int) -> None:
    rng = np.random.default_rng(0)
    trace = [rng.zipf(1.2, 32) % 2000 for _ in range(300)]
    optimum, lru = belady_hits(trace, capacity), _lru_hits(trace, capacity)
    assert optimum >= lru
    # Room for every row: only a row's lookups in the batch that first reads it miss.
    seen: set[int] = set()
    first_reads = 0
    for ids in trace:
        first_reads += sum(1 for i in ids.tolist() if i not in seen)
        seen.update(ids.tolist())
    assert belady_hits(trace, 2000) == _lru_hits(trace, 2000) == sum(len(ids) for ids in trace) - first_reads
