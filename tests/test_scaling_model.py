"""The communication model (lightning_hotcache.planner.traffic): formulas on small hand-made workloads,
and benchmarks/scaling_model.py's exact law of the synthetic data."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

import lightning_hotcache.planner.traffic as tr

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # appended: shadows nothing
import scaling_model as sm  # noqa: E402

BATCH = 4096
WORLD_SIZES = [1, 2, 4, 8, 64, 1024]


def table(name: str, groups: list[tuple[float, int, bool]], dim: int = 16, cache_slots: int = 0) -> tr.TableLoad:
    """A one-hot table from (per-lookup probability of each row, rows, static) groups."""
    p, rows, static = (np.array(x) for x in zip(*groups))
    return tr.TableLoad(name, dim, 1, 1.0, p.astype(float), rows.astype(float), static.astype(bool), cache_slots)


def workload(hot_rows_of_big: int = 50) -> tr.Workload:
    """A small table read whole every step, and a big one: 50 frequent rows (each read by
    nearly every batch), a long flat tail."""
    small = table("small", [(1 / 8, 8, True)])
    frequent, tail = 0.5 / 50, 0.5 / 99_950
    groups = [(frequent, hot_rows_of_big, True), (frequent, 50 - hot_rows_of_big, False), (tail, 99_950, False)]
    big = table("big", [g for g in groups if g[1] > 0], cache_slots=2_000)
    return tr.Workload((small, big), BATCH, state_width=1, dense_params=10_000)


@pytest.mark.parametrize("design", sorted(tr.DESIGNS))
def test_one_rank_sends_nothing(design: str) -> None:
    traffic = tr.DESIGNS[design](workload(), 1)
    assert traffic.send_bytes_per_rank == traffic.recv_bytes_per_rank == 0
    assert traffic.collectives == 0


def test_torchrec_table_wise_is_flat_in_ranks() -> None:
    w = workload()
    per_rank = {n: tr.torchrec_table_wise(w, n).send_bytes_per_rank for n in WORLD_SIZES}
    # Every rank sends its own batch's ids and (forward, backward) pooled rows of its tables:
    # only the remote share (N-1)/N changes with N.
    lookup_bytes = BATCH * 2 * (tr.ID_BYTES + tr.LENGTH_BYTES + 2 * 16 * tr.FLOAT_BYTES)
    for n in WORLD_SIZES[1:]:
        dense = 2 * (n - 1) / n * w.dense_params * tr.FLOAT_BYTES
        splits = (n - 1) * 2 * tr.ID_BYTES
        assert per_rank[n] == pytest.approx((n - 1) / n * lookup_bytes + dense + splits)
    # Flat but for the splits all-to-all (16 bytes per peer): (1023/1024) / (7/8) of the payload.
    splits = {n: tr.torchrec_table_wise(w, n).parts["kjt_splits"] for n in (8, 1024)}
    assert per_rank[1024] - splits[1024] == pytest.approx((1023 / 1024) / (7 / 8) * (per_rank[8] - splits[8]))


def test_torchrec_table_wise_busiest_rank_hosts_tables() -> None:
    # Two tables on 64 ranks: each table's host sends its pooled rows to 63 ranks.
    traffic = tr.torchrec_table_wise(workload(), 64)
    assert traffic.max_send_bytes_per_rank > 63 * BATCH * 16 * tr.FLOAT_BYTES > 20 * traffic.parts["pooled_forward"]


def test_all_gather_grows_linearly_in_ranks() -> None:
    w = workload()
    per_rank = {n: tr.all_gather(w, n).send_bytes_per_rank for n in WORLD_SIZES}
    assert per_rank[1024] / per_rank[64] == pytest.approx(1023 / 63, rel=0.1)
    # The all-gather of every rank's (id, gradient row) pairs: (N - 1) times one rank's rows.
    unique = sum(t.expected_unique(BATCH) for t in w.tables)
    gathered = 1023 * unique * (tr.ID_BYTES + 16 * tr.FLOAT_BYTES)
    assert per_rank[1024] == pytest.approx(gathered, rel=0.05)


def test_row_wise_grows_linearly_in_ranks() -> None:
    w = workload()
    assert tr.torchrec_row_wise(w, 1024).send_bytes_per_rank > 500 * tr.torchrec_row_wise(w, 2).send_bytes_per_rank


def test_hotcache_follows_the_rows_one_rank_reads() -> None:
    w = workload()
    per_rank = {n: tr.hotcache(w, n).send_bytes_per_rank for n in WORLD_SIZES}
    # Fetch (ids and rows) and gradient (rows back along the fetch's route) of the other
    # ranks' share of one rank's distinct rows; only the counts (8 bytes per width and peer)
    # and DDP's all-reduce grow with N.
    read = sum(t.expected_unique(BATCH) for t in w.tables)
    rows = 1023 / 1024 * read * (tr.ID_BYTES + 2 * 16 * tr.FLOAT_BYTES)
    counts = 1023 * 1 * tr.ID_BYTES
    dense = 2 * 1023 / 1024 * w.dense_params * tr.FLOAT_BYTES
    assert per_rank[1024] == pytest.approx(rows + counts + dense)
    def payload(n: int) -> float:
        return sum(v for k, v in tr.hotcache(w, n).parts.items() if k.endswith(("_ids", "_rows")))

    assert payload(1024) == pytest.approx(1023 / 1024 / (7 / 8) * payload(8))
    assert per_rank[1024] < tr.torchrec_table_wise(w, 1024).send_bytes_per_rank
    assert per_rank[1024] < tr.all_gather(w, 1024).send_bytes_per_rank / 100


def test_misses_shrink_with_cache_slots() -> None:
    tail = [(1 / 10_000, 10_000, False)]
    misses = [tr.lru_misses(table("t", tail, cache_slots=slots), BATCH) for slots in (0, 2_000, 8_000, 10_000)]
    assert misses[0] == pytest.approx(table("t", tail).expected_unique(BATCH))
    assert misses[0] > misses[1] > misses[2] > misses[3] == 0


def test_model_table_has_bytes_for_every_design_and_world_size() -> None:
    results = tr.model_table(workload(), WORLD_SIZES)
    assert set(results) == set(tr.DESIGNS)
    for design in results.values():
        assert set(design) == {str(n) for n in WORLD_SIZES}
        for entry in design.values():
            assert {"send_bytes_per_rank", "recv_bytes_per_rank", "collectives"} <= set(entry)
            assert all(math.isfinite(entry[k]) for k in ("send_bytes_per_rank", "recv_bytes_per_rank"))


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        table("t", [(0.5, 10, False)])
    with pytest.raises(ValueError, match="ranks"):
        tr.all_gather(workload(), 0)


def test_workload_from_stats_predicts_unique_rows_per_batch(synthetic_factory) -> None:
    from lightning_hotcache import HotColdPlanner
    from lightning_hotcache.planner.profiling import profile_batches

    # Tables up to 20k rows, 16 profiled batches of 256: the profile has seen only part of
    # the big tables, so the unseen tail matters.
    dm = synthetic_factory(scale=0.01, num_embeddings_cap=20_000)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    stats = profile_batches(batches, dm.tables, progress=False)
    plan = HotColdPlanner(device_budget=0.2, grow_budget_to_minimum=True).plan(dm.tables, stats)
    by_stats = tr.workload_from_stats(stats, plan, batch_size=dm.batch_size, state_width=1, dense_params=0)
    exact = sm.synthetic_workload(dm, plan, state_width=1, dense_params=0)
    split = 0
    for estimated, law in zip(by_stats.tables, exact.tables):
        measured, _ = stats.unique_rows_per_batch(law.name)
        assert estimated.expected_unique(dm.batch_size * estimated.lookups_per_sample) == pytest.approx(measured, rel=0.05)
        assert law.expected_unique(dm.batch_size * law.lookups_per_sample) == pytest.approx(measured, rel=0.05)
        assert law.num_embeddings == estimated.num_embeddings
        assert law.static_rows == estimated.static_rows == len(plan.table(law.name).static_ids)
        if not law.on_device:
            # The plan's static ids are the profile's hottest: under the exact law (ids mapped
            # back to Zipf ranks) they take most lookups, a little less than in the profile itself.
            ids, counts = stats.top_ids(law.name)
            in_profile = counts[np.isin(ids, plan.table(law.name).static_ids)].sum() / stats.num_lookups[law.name]
            assert 0.5 < float((law.probability * law.rows)[law.static].sum()) <= in_profile
            split += 1
    assert split > 0


def test_zipf_rank_probabilities_match_the_sampler() -> None:
    from datamodules.synthetic import zipf_ranks

    u = np.random.default_rng(0).random(200_000)
    for rows, exponent in ((50, 1.05), (7, 1.0)):
        drawn = np.bincount(zipf_ranks(u, np.array(rows), exponent), minlength=rows) / len(u)
        np.testing.assert_allclose(drawn, sm.zipf_rank_probabilities(rows, exponent), atol=3e-3)
