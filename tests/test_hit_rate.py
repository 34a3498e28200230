"""benchmarks/hit_rate.py's ceiling (Belady's offline optimum at batch granularity) and its model of
a lookahead cache."""

from __future__ import annotations

import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # appended: shadows nothing
from hit_rate import belady_hits, lookahead_hits  # noqa: E402


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


def test_lookahead_model_keeps_the_rows_the_window_reads_and_is_lfu_without_one() -> None:
    # Two dynamic slots. Row 1 is read twice early (LFU keeps it), then never again; row 2 comes
    # back at batch 4. At batch 3 (row 3 in), LFU evicts row 2 (read once); a window of 1 batch
    # sees row 2 coming and evicts row 1 instead, so batch 4 hits.
    trace = [np.array(ids) for ids in ([1, 1], [2], [1], [3], [2])]
    assert lookahead_hits(trace, 10, np.empty(0, np.int64), capacity=2, window=0) == 1  # batch 2
    assert lookahead_hits(trace, 10, np.empty(0, np.int64), capacity=2, window=1) == 2  # and batch 4
    # Static rows are pinned and always hit (batches 0 and 2); they take no dynamic slot, so the
    # one slot must take row 3 over row 2 whatever the window.
    assert lookahead_hits(trace, 10, np.array([1]), capacity=1, window=1) == 3
    with pytest.raises(ValueError, match="cannot hold them"):
        lookahead_hits([np.array([1, 2])], 10, np.empty(0, np.int64), capacity=1, window=0)


@pytest.mark.parametrize("capacity", [40, 120])
def test_lookahead_model_over_the_whole_trace_is_beladys_optimum(capacity: int) -> None:
    # A window as long as the trace knows every next read: it evicts as Belady does. Each batch
    # reads a row once: with repeats, hits weigh rows by their lookups, and farthest-first can
    # then lose by a tie (within 1 lookup of 2,757 on such a trace).
    rng = np.random.default_rng(1)
    trace = [np.unique(rng.zipf(1.2, 32) % 2000) for _ in range(150)]
    none = np.empty(0, np.int64)
    assert lookahead_hits(trace, 2000, none, capacity, window=len(trace)) == belady_hits(trace, capacity)
    assert lookahead_hits(trace, 2000, none, capacity, window=0) <= belady_hits(trace, capacity)


def test_the_device_directory_stacked_hits_as_the_host_directory_where_its_sets_hold_the_batch() -> None:
    # Tables stacked as a collection stacks them: a 32-way device LFU against the host's fully
    # associative LFU on the same plan, and the lookahead policy, which only the host keeps.
    from conftest import tiny_synthetic
    from hit_rate import SGD, stacked_replay

    from lightning_hotcache import HotColdPlanner
    from lightning_hotcache.planner.profiling import profile_batches

    dm = tiny_synthetic(num_embeddings_cap=50_000, num_train_samples=64 * 40, batch_size=64, scale=0.05)
    source = dm.source("train")
    batches = [source.batch(i * 64, (i + 1) * 64) for i in range(40)]
    plan = HotColdPlanner(0.05, SGD, cache_policy="lfu", grow_budget_to_minimum=True).plan(dm.tables, profile_batches(batches[:10], dm.tables, progress=False))
    trace = batches[10:]
    assert any(not t.on_device for t in plan.tables)
    host, device = stacked_replay(dm.tables, plan, trace, "host"), stacked_replay(dm.tables, plan, trace, "device")
    print(f"stacked LFU hit rates: host {host:.4f}, device {device:.4f}")
    assert 0.3 < device <= 1 and abs(device - host) < 0.02, (host, device)
    assert stacked_replay(dm.tables, plan, trace, "host", window=4) >= host - 1e-9
