"""AccessProfiler / AccessStats: exact and sketched counts, coverage, sampling, persistence."""

from __future__ import annotations

import json
import re
import zipfile
from collections import Counter

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagConfig
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_hotcache.planner.profiling import (
    AccessProfiler,
    AccessStats,
    TableSignature,
    plot_coverage,
    profile_batches,
    run_batch_size,
)


def table(name: str, rows: int, features: list[str], dim: int = 8) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=dim, feature_names=features)


def kjt(features: dict[str, tuple[list[int], list[int]]], weighted: bool = False) -> KeyedJaggedTensor:
    """A KJT from {feature: (lengths, values)}; every feature must have the same number of bags."""
    keys = list(features)
    lengths = torch.tensor([n for f in keys for n in features[f][0]], dtype=torch.int32)
    values = torch.tensor([v for f in keys for v in features[f][1]], dtype=torch.int64)
    weights = torch.rand(len(values)) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights)


def zipf_batch(rng: np.random.Generator, features: dict[str, int], bags: int, max_hot: int = 3):
    """A random multi-hot batch with Zipf-distributed ids; returns the KJT and its ids per feature."""
    content = {}
    for feature, rows in features.items():
        lengths = rng.integers(0, max_hot + 1, size=bags).tolist()
        values = ((rng.zipf(1.3, size=sum(lengths)) - 1) % rows).tolist()
        content[feature] = (lengths, values)
    return kjt(content), {f: v for f, (_, v) in content.items()}


def as_dict(stats: AccessStats, name: str) -> dict[int, int]:
    ids, counts = stats.top_ids(name)
    return dict(zip(ids.tolist(), counts.tolist()))


TABLES = [table("t_user", 50, ["user"]), table("t_item", 3000, ["item", "item_hist"])]


def test_exact_counts_match_brute_force_on_zipf_batches() -> None:
    rng = np.random.default_rng(1)
    profiler = AccessProfiler(TABLES)
    truth = {"t_user": Counter(), "t_item": Counter()}
    uniques: dict[str, list[int]] = {"t_user": [], "t_item": []}
    for step in range(30):
        # "noise" belongs to no table; every 5th batch lacks item_hist.
        features = {"user": 50, "item": 3000, "noise": 10**9}
        if step % 5:
            features["item_hist"] = 3000
        batch, ids = zipf_batch(rng, features, bags=64)
        profiler.observe(batch)
        item_ids = ids["item"] + ids.get("item_hist", [])
        truth["t_user"].update(ids["user"])
        truth["t_item"].update(item_ids)
        uniques["t_user"].append(len(set(ids["user"])))
        uniques["t_item"].append(len(set(item_ids)))
    stats = profiler.stats()
    assert stats.num_batches == stats.num_batches_seen == 30
    for name in ("t_user", "t_item"):
        assert stats.is_exact(name) and stats.error_bound(name) == 0
        assert as_dict(stats, name) == dict(truth[name])
        assert stats.num_lookups[name] == sum(truth[name].values())
        ids, counts = stats.top_ids(name)
        assert np.all(np.diff(counts) <= 0)
        assert counts.dtype == np.int64
        assert stats.unique_rows_per_batch(name) == (pytest.approx(np.mean(uniques[name])), max(uniques[name]))
    top3_ids, top3_counts = stats.top_ids("t_item", 3)
    assert top3_counts.tolist() == sorted(truth["t_item"].values(), reverse=True)[:3]


def test_multi_hot_and_weighted_kjts_count_lookups() -> None:
    content = {"user": ([2, 0, 3], [4, 4, 1, 4, 49]), "item": ([1, 1, 1], [7, 7, 2999])}
    plain, weighted = AccessProfiler(TABLES), AccessProfiler(TABLES)
    plain.observe(kjt(content))
    weighted.observe(kjt(content, weighted=True))
    for stats in (plain.stats(), weighted.stats()):
        assert as_dict(stats, "t_user") == {4: 3, 1: 1, 49: 1}
        assert as_dict(stats, "t_item") == {7: 2, 2999: 1}
        assert stats.unique_rows_per_batch("t_user") == (3.0, 3)


def test_coverage_on_hand_made_example() -> None:
    profiler = AccessProfiler([table("t", 100, ["f"])])
    profiler.observe(kjt({"f": ([10], [3, 3, 3, 3, 3, 1, 1, 1, 7, 7])}))
    stats = profiler.stats()
    assert stats.top_ids("t")[0].tolist() == [3, 1, 7]
    assert stats.coverage("t", 0) == 0.0
    assert stats.coverage("t", 1) == pytest.approx(0.5)
    assert stats.coverage("t", 2) == pytest.approx(0.8)
    assert stats.coverage("t", 3) == 1.0
    assert stats.coverage("t", 100) == 1.0
    np.testing.assert_allclose(stats.coverage("t", np.arange(5)), [0, 0.5, 0.8, 1, 1])
    rows, fraction = stats.coverage_curve("t")
    assert rows[0] == 0 and fraction[0] == 0 and rows[-1] == 100 and fraction[-1] == 1
    assert np.all(np.diff(rows) > 0) and np.all(np.diff(fraction) >= 0)
    np.testing.assert_allclose(fraction, stats.coverage("t", rows))
    with pytest.raises(ValueError, match="num_rows"):
        stats.coverage("t", -1)
    with pytest.raises(KeyError, match="no_such"):
        stats.coverage("no_such", 1)


def test_space_saving_keeps_heavy_hitters_within_error_bound() -> None:
    rows, capacity = 1_000_000, 200
    tables = [table("big", rows, ["f"])]
    rng = np.random.default_rng(7)
    batches = [((rng.zipf(1.2, size=2000) - 1) * 7919 % rows).tolist() for _ in range(20)]
    halves = [AccessProfiler(tables, exact_max_bytes=rows, sketch_capacity=capacity) for _ in range(2)]
    whole = AccessProfiler(tables, exact_max_bytes=rows, sketch_capacity=capacity)
    for i, ids in enumerate(batches):
        batch = kjt({"f": ([len(ids)], ids)})
        whole.observe(batch)
        halves[i % 2].observe(batch)
    truth = Counter(i for ids in batches for i in ids)
    n = sum(truth.values())
    assert len(truth) > 10 * capacity  # the stream does not fit the sketch
    merged = halves[0].stats().merge(halves[1].stats())
    for stats in (whole.stats(), merged):
        assert not stats.is_exact("big") and stats.num_lookups["big"] == n
        bound = stats.error_bound("big")
        assert 0 < bound <= n / capacity
        held = as_dict(stats, "big")
        assert len(held) == capacity
        assert {i for i, c in truth.items() if c > n / capacity} <= held.keys()
        for i, estimate in held.items():
            assert truth[i] <= estimate <= truth[i] + bound
        assert max(c for i, c in truth.items() if i not in held) <= bound
        # The coverage estimate bounds the true coverage of the best r rows from above.
        true_sorted = np.cumsum(sorted(truth.values(), reverse=True)) / n
        for r in (1, 10, capacity, 5 * capacity):
            assert true_sorted[r - 1] <= stats.coverage("big", r) + 1e-12
        assert stats.coverage("big", rows) == 1.0
        assert "sketch" in stats.summary()


def test_merge_of_exact_stats_equals_one_profile() -> None:
    rng = np.random.default_rng(3)
    batches = [zipf_batch(rng, {"user": 50, "item": 3000, "item_hist": 3000}, bags=16)[0] for _ in range(6)]
    whole, a, b = (AccessProfiler(TABLES) for _ in range(3))
    for i, batch in enumerate(batches):
        whole.observe(batch)
        (a if i < 2 else b).observe(batch)
    merged, expected = a.stats().merge(b.stats()), whole.stats()
    assert merged.num_batches == 6 and merged.is_exact("t_item")
    for name in ("t_user", "t_item"):
        assert as_dict(merged, name) == as_dict(expected, name)
        assert merged.unique_rows_per_batch(name) == pytest.approx(expected.unique_rows_per_batch(name))


def test_sample_fraction_observes_the_seeded_subset() -> None:
    num, fraction, seed = 200, 0.3, 5
    tables = [table("t", num, ["f"])]

    def observed(seed: int) -> set[int]:
        profiler = AccessProfiler(tables, sample_fraction=fraction, seed=seed)
        for i in range(num):  # batch i reads row i only, so the counts tell which batches were observed
            profiler.observe(kjt({"f": ([1], [i])}))
        stats = profiler.stats()
        assert stats.num_batches_seen == num
        assert stats.num_batches == len(stats.top_ids("t")[0])
        return set(stats.top_ids("t")[0].tolist())

    expected = set(np.flatnonzero(np.random.default_rng(seed).random(num) < fraction).tolist())
    assert observed(seed) == expected
    assert 0.2 * num < len(expected) < 0.4 * num
    assert observed(seed + 1) != expected
    with pytest.raises(ValueError, match="sample_fraction"):
        AccessProfiler(tables, sample_fraction=0.0)


@pytest.fixture
def mixed_stats() -> AccessStats:
    tables = [table("small", 100, ["a"]), table("big", 100_000, ["b", "c"], dim=16)]
    profiler = AccessProfiler(tables, exact_max_bytes=8 * 1000, sketch_capacity=32)
    rng = np.random.default_rng(0)
    for _ in range(5):
        profiler.observe(zipf_batch(rng, {"a": 100, "b": 100_000, "c": 100_000}, bags=100)[0])
    return profiler.stats()


def test_save_load_round_trip(tmp_path, mixed_stats: AccessStats) -> None:
    path = tmp_path / "profile.stats"  # no .npz suffix: the file is written where asked
    mixed_stats.save(path)
    assert path.is_file() and zipfile.is_zipfile(path)
    loaded = AccessStats.load(path, tables=[table("big", 100_000, ["b", "c"], 16), table("small", 100, ["a"])])
    assert loaded.tables == mixed_stats.tables
    assert (loaded.num_batches, loaded.num_batches_seen) == (mixed_stats.num_batches, mixed_stats.num_batches_seen)
    assert loaded.num_lookups == mixed_stats.num_lookups
    for name in ("small", "big"):
        for got, want in zip(loaded.top_ids(name), mixed_stats.top_ids(name)):
            np.testing.assert_array_equal(got, want)
        assert loaded.is_exact(name) == mixed_stats.is_exact(name)
        assert loaded.error_bound(name) == mixed_stats.error_bound(name)
        assert loaded.unique_rows_per_batch(name) == mixed_stats.unique_rows_per_batch(name)
    assert loaded.is_exact("small") and not loaded.is_exact("big")
    assert loaded.summary() == mixed_stats.summary()
    assert TableSignature.from_config(table("big", 100_000, ["b", "c"], 16)) == loaded.tables[1]


def test_load_rejects_stats_of_other_tables(tmp_path, mixed_stats: AccessStats) -> None:
    path = tmp_path / "p.npz"
    mixed_stats.save(path)
    small, big = table("small", 100, ["a"]), table("big", 100_000, ["b", "c"], dim=16)
    rows_differ = r"table big has 100000 rows in the stats but 200000 in the model: profile again with `hotcache"
    with pytest.raises(ValueError, match=rows_differ):
        AccessStats.load(path, [small, table("big", 200_000, ["b", "c"], 16)])
    with pytest.raises(ValueError, match="table big has embedding_dim 16 in the stats but 32 in the model"):
        AccessStats.load(path, [small, table("big", 100_000, ["b", "c"], 32)])
    with pytest.raises(ValueError, match=r"table big reads features \['b', 'c'\] in the stats but \['b'\]"):
        AccessStats.load(path, [small, table("big", 100_000, ["b"], 16)])
    with pytest.raises(ValueError, match="table big is in the stats but not in the model"):
        AccessStats.load(path, [small])
    with pytest.raises(ValueError, match="table extra is in the model but not in the stats"):
        AccessStats.load(path, [small, big, table("extra", 5, ["x"])])


def test_load_rejects_corrupt_files(tmp_path, mixed_stats: AccessStats) -> None:
    good = tmp_path / "good.npz"
    mixed_stats.save(good)
    data = good.read_bytes()
    (tmp_path / "truncated.npz").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.npz").write_text("not stats at all\n")
    np.save(tmp_path / "array.npy", np.arange(3))
    with np.load(good) as npz:
        arrays = dict(npz)
    np.savez_compressed(tmp_path / "version.npz", **{**arrays, "format_version": np.array(99)})
    np.savez_compressed(tmp_path / "missing.npz", **{k: v for k, v in arrays.items() if k != "ids_1"})
    np.savez_compressed(tmp_path / "range.npz", **{**arrays, "ids_0": arrays["ids_0"] + 1000})
    np.savez_compressed(tmp_path / "pickled.npz", meta=np.array([{"a": 1}], dtype=object), format_version=np.array(1))
    for name in ("truncated.npz", "text.npz", "array.npy", "version.npz", "missing.npz", "range.npz", "pickled.npz"):
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            AccessStats.load(tmp_path / name)
    with pytest.raises(ValueError, match="version 99"):
        AccessStats.load(tmp_path / "version.npz")
    with pytest.raises(FileNotFoundError):
        AccessStats.load(tmp_path / "absent.npz")


def test_bad_ids_raise_before_counting() -> None:
    profiler = AccessProfiler(TABLES)
    profiler.observe(kjt({"user": ([2], [1, 2]), "item": ([1], [5])}))
    before = profiler.stats()
    # item is fine, item_hist has two bad ids: the first (3000) is named and nothing of the batch is counted.
    bad = kjt({"user": ([1], [3]), "item": ([1], [6]), "item_hist": ([3], [1, 3000, 4000])})
    with pytest.raises(ValueError, match=r"'item_hist' of table t_item has id 3000"):
        profiler.observe(bad)
    with pytest.raises(ValueError, match=r"'user' of table t_user has id -1"):
        profiler.observe(kjt({"user": ([2], [0, -1])}))
    after = profiler.stats()
    assert after.num_batches == before.num_batches == 1
    for name in ("t_user", "t_item"):
        assert as_dict(after, name) == as_dict(before, name)
    floats = KeyedJaggedTensor.from_lengths_sync(
        keys=["user"], values=torch.tensor([1.0, 2.0]), lengths=torch.tensor([2], dtype=torch.int32)
    )
    with pytest.raises(TypeError, match="integers"):
        profiler.observe(floats)
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        profiler.observe(torch.tensor([1, 2]))  # type: ignore[arg-type]


def test_plot_coverage_writes_png(tmp_path, mixed_stats: AccessStats) -> None:
    path = tmp_path / "coverage.png"
    plot_coverage(mixed_stats, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_batches_on_torchrec_batches(capsys) -> None:
    rng = np.random.default_rng(2)
    kjts = [zipf_batch(rng, {"user": 50, "item": 3000, "item_hist": 3000}, bags=8)[0] for _ in range(6)]
    batches = [Batch(dense_features=torch.zeros(8, 4), sparse_features=k, labels=torch.zeros(8)) for k in kjts]
    stats = profile_batches(batches, TABLES, max_batches=4, progress=True)
    assert stats.num_batches == 4
    assert "batch" in capsys.readouterr().err
    direct = AccessProfiler(TABLES)
    for k in kjts[:4]:
        direct.observe(k)
    assert as_dict(stats, "t_item") == as_dict(direct.stats(), "t_item")
    # Plain KJTs from a generator (no len), quietly, with profiler settings passed through.
    sampled = profile_batches(iter(kjts), TABLES, progress=False, sample_fraction=0.5, seed=1)
    assert sampled.num_batches_seen == 6 and sampled.num_batches < 6
    summary = stats.summary()
    assert "t_user" in summary and "t_item" in summary and "exact" in summary


def test_save_into_missing_folder_names_it(tmp_path, mixed_stats: AccessStats) -> None:
    folder = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=re.escape(f"save {folder / 'stats.npz'}: the folder {folder} does not")):
        mixed_stats.save(folder / "stats.npz")


def test_stats_record_the_batch_size(tmp_path) -> None:
    # The largest observed batch: an epoch's last batch may be smaller.
    rng = np.random.default_rng(3)
    profiler = AccessProfiler(TABLES)
    assert profiler.stats().batch_size is None  # nothing observed yet
    for bags in (16, 16, 5):
        profiler.observe(zipf_batch(rng, {"user": 50, "item": 3000}, bags=bags)[0])
    stats = profiler.stats()
    assert stats.batch_size == 16
    stats.save(tmp_path / "s.npz")
    assert AccessStats.load(tmp_path / "s.npz").batch_size == 16
    assert "3 batches of 16 observed of 3 seen" in stats.summary()
    small = AccessProfiler(TABLES)
    small.observe(zipf_batch(rng, {"user": 50}, bags=4)[0])
    assert stats.merge(small.stats()).batch_size == 16


def test_a_runs_batch_size_is_its_full_one_even_when_a_shuffled_epoch_starts_short() -> None:
    # Issue 29 item 10: the first batch alone was taken, so stats made with the run's own config were
    # refused whenever shuffling put the epoch's short last batch first.
    rng = np.random.default_rng(5)

    def batches(*sizes: int) -> list[KeyedJaggedTensor]:
        return [zipf_batch(rng, {"user": 50}, bags=n)[0] for n in sizes]

    assert run_batch_size(batches(5, 16, 16)) == run_batch_size(batches(16, 5)) == run_batch_size(batches(16, 16)) == 16
    assert run_batch_size(batches(5)) == 5  # an epoch of one batch: the profile saw that one too
    assert run_batch_size([]) is None
    profiler = AccessProfiler(TABLES)
    for batch in batches(16, 16, 5):
        profiler.observe(batch)
    profiler.stats().check_run(TABLES, run_batch_size(batches(5, 16, 16)))


def test_stats_that_cannot_serve_a_run_say_to_profile_again(tmp_path) -> None:
    rng = np.random.default_rng(4)
    profiler = AccessProfiler(TABLES, sample_fraction=0.01)
    profiler.observe(zipf_batch(rng, {"user": 50, "item": 3000}, bags=16)[0])
    none_observed = profiler.stats()
    with pytest.raises(ValueError, match=r"hold no batches \(1 seen, none observed: raise sample_fraction\).*hotcache profile"):
        none_observed.check_run(TABLES, 16)
    with pytest.raises(ValueError, match=r"hold no batches \(0 seen.*hotcache profile"):
        AccessProfiler(TABLES).stats().check_run(TABLES)
    profiler = AccessProfiler(TABLES)
    profiler.observe(zipf_batch(rng, {"user": 50, "item": 3000}, bags=16)[0])
    stats = profiler.stats()
    stats.check_run(TABLES, 16)
    stats.check_run(TABLES)  # the run's batch size unknown: not compared
    with pytest.raises(ValueError, match=r"batches of 16 samples but this run's batches have 32.*hotcache profile"):
        stats.check_run(TABLES, 32)
    with pytest.raises(ValueError, match="table t_item is in the stats but not in the model.*hotcache profile"):
        stats.check_run(TABLES[:1], 16)
    # A file from before batch sizes were recorded loads (for its summary and plots) but cannot plan.
    stats.save(tmp_path / "s.npz")
    with np.load(tmp_path / "s.npz") as npz:
        arrays = dict(npz)
    meta = json.loads(str(arrays["meta"]))
    del meta["batch_size"]
    np.savez_compressed(tmp_path / "old.npz", **{**arrays, "meta": np.array(json.dumps(meta))})
    old = AccessStats.load(tmp_path / "old.npz", TABLES)
    assert old.batch_size is None and old.num_batches == 1
    with pytest.raises(ValueError, match="do not record their batch size.*hotcache profile"):
        old.check_run(TABLES, 16)


def test_a_feature_read_by_several_tables_counts_into_each() -> None:
    # As TorchRec allows (e.g. a model's dim-D tables and its first-order tables over the same features).
    tables = [*TABLES, table("t_item_linear", 3000, ["item", "item_hist"], dim=4)]
    profiler = AccessProfiler(tables)
    profiler.observe(kjt({"user": ([1, 1], [3, 4]), "item": ([1, 2], [7, 7, 9]), "item_hist": ([0, 1], [9])}))
    stats = profiler.stats()
    assert as_dict(stats, "t_item") == as_dict(stats, "t_item_linear") == {7: 2, 9: 2}
    assert stats.unique_rows_per_batch("t_item_linear") == (2.0, 2)
    assert as_dict(stats, "t_user") == {3: 1, 4: 1}
