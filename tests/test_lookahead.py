"""The lookahead window (`LookaheadWindow`) and the cache that evicts by it: each resident
row's next announced read, kept through ring growth and moved positions, and Belady's choice
when the window sees the whole trace."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_hotcache import RowWiseOptimizerConfig
from lightning_hotcache.cache import DeviceCache, HostStore
from lightning_hotcache.cache.lookahead import NEVER, LookaheadWindow

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # appended: shadows nothing
from hit_rate import belady_hits  # noqa: E402

ROWS = 50


@pytest.mark.parametrize("max_position", [2**31 - 1, 400])  # 400: positions moved down every ~20 batches
def test_each_rows_next_read_is_its_nearest_announced_batch(max_position: int) -> None:
    # Every row resident at slot == id; batches announced up to 6 ahead of their retirement.
    rng = np.random.default_rng(0)
    trace = [torch.from_numpy(rng.zipf(1.3, int(rng.integers(1, 40))) % ROWS) for _ in range(120)]
    window = LookaheadWindow(ROWS, ROWS, max_position=max_position)
    announced = 0
    for retired, ids in enumerate(trace):
        while announced < min(retired + 1 + int(rng.integers(0, 6)), len(trace)):
            window.announce(trace[announced], slot_of=lambda distinct: distinct)
            announced += 1
        oldest, next_reads = window.retire(len(ids), "t")
        assert torch.equal(oldest.distinct, ids.unique())
        window.installed(oldest.distinct, next_reads)
        expected = torch.full((ROWS,), NEVER)
        for number in range(announced - 1, retired, -1):  # the nearest written last
            expected[trace[number]] = number
        assert torch.equal(window.next_read, expected), f"after batch {retired}"
    assert len(window) == 0 and window._end - window._start == 0


def test_a_cleared_window_forgets_every_announced_read() -> None:
    window = LookaheadWindow(ROWS, ROWS)
    window.announce(torch.tensor([1, 2]), slot_of=lambda distinct: distinct)
    window.clear()
    assert len(window) == 0 and not window.awaited(torch.arange(ROWS)).any()
    window.announce(torch.tensor([2, 3]), slot_of=lambda distinct: distinct)  # links nothing to the forgotten batch
    oldest, next_reads = window.retire(2, "t")
    assert torch.equal(next_reads, torch.full((2,), NEVER))


@pytest.mark.parametrize("capacity", [40, 120])
def test_a_window_over_the_whole_trace_evicts_as_belady(capacity: int) -> None:
    # Knowing every next read, the cache evicts the row read farthest ahead: Belady's optimum
    # (each batch reads a row once, so hits are not weighed by repeated lookups).
    rng = np.random.default_rng(1)
    trace = [np.unique(rng.zipf(1.2, 32) % 2000) for _ in range(150)]
    sgd = RowWiseOptimizerConfig(name="sgd")
    cache = DeviceCache("t", 2000, 2, sgd, torch.empty(0, dtype=torch.int64), capacity, "lookahead", HostStore("t", 2000, 2, {}), torch.device("cpu"))
    for ids in trace:
        cache.announce(torch.from_numpy(ids))
    for ids in trace:
        cache.release(DeviceCache.acquire_all([cache], [torch.from_numpy(ids)], announced=True)[0].ticket)
    assert cache.counters.hits == belady_hits(trace, capacity)
