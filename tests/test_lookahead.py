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
from lightning_hotcache.cache import DeviceCache, HostStore, directory
from lightning_hotcache.cache.lookahead import NEVER, LookaheadWindow

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # appended: shadows nothing
from hit_rate import belady_hits  # noqa: E402

ROWS = 50


@pytest.mark.parametrize("max_position", [2**31 - 1, 400])  # 400: positions moved down every ~20 batches
@pytest.mark.parametrize("dense_map", [False, True], ids=["looked-up", "dense-map"])
def test_each_rows_next_read_is_its_nearest_announced_batch(max_position: int, dense_map: bool) -> None:
    # Every row resident at slot == id, found by a look-up or in a dense map read inside the
    # link pass; batches announced up to 6 ahead of their retirement.
    rng = np.random.default_rng(0)
    trace = [torch.from_numpy(rng.zipf(1.3, int(rng.integers(1, 40))) % ROWS) for _ in range(120)]
    window = LookaheadWindow(ROWS, ROWS, max_position=max_position)
    slot_of_id = torch.arange(ROWS, dtype=torch.int32) if dense_map else None
    announced = 0
    for retired, ids in enumerate(trace):
        while announced < min(retired + 1 + int(rng.integers(0, 6)), len(trace)):
            coming = window.announce(trace[announced], slot_of=lambda distinct: distinct, slot_of_id=slot_of_id)
            assert len(coming) == 0  # every row is resident
            announced += 1
        oldest, next_reads = window.retire(len(ids), "t")
        assert torch.equal(oldest.distinct, ids.unique())
        directory.count_reads(torch.zeros(ROWS, dtype=torch.int64), oldest.distinct, None, window.next_read, next_reads)  # as an acquire notes them
        expected = torch.full((ROWS,), NEVER)
        for number in range(announced - 1, retired, -1):  # the nearest written last
            expected[trace[number]] = number
        assert torch.equal(window.next_read, expected), f"after batch {retired}"
    assert len(window) == 0 and window._end - window._start == 0


def test_a_cleared_window_forgets_every_announced_read() -> None:
    window = LookaheadWindow(ROWS, ROWS)
    window.announce(torch.tensor([1, 2]), slot_of=lambda distinct: distinct)
    window.clear()
    assert len(window) == 0 and bool((window.next_read == NEVER).all())
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


def test_the_default_window_reaches_its_samples_within_its_bounds() -> None:
    from lightning_hotcache.cache.lookahead import default_lookahead_batches

    assert [default_lookahead_batches(b) for b in (None, 64, 256, 512, 1000, 2048, 8192)] == [64, 256, 256, 256, 132, 64, 64]


def test_a_fit_reads_the_default_window_for_its_batch_size(tmp_path) -> None:
    from conftest import cpu_trainer, tiny_synthetic

    from lightning_hotcache import HotCacheStrategy
    from models import create_model

    dm = tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=4 * 1024, batch_size=1024)
    model = create_model("dlrm", dm.tables, dm.num_dense_features)
    strategy = HotCacheStrategy(device_budget=0.05, profile_batches=2, cache_policy="lookahead", grow_budget_to_minimum=True)
    cpu_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(model, dm)
    assert strategy.window_batches == strategy.plan.lookahead_batches == 128  # 131,072 samples of 1,024
    assert any(not t.on_device for t in strategy.plan.tables), "some table is split"
    assert strategy.plan.window_bytes > 0 and "lookahead window: 128 batches" in str(strategy.plan)
