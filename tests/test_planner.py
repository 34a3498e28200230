"""HotColdPlanner: budgets in every form, greedy hot rows, the minimum, JSON round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from lightning_hotcache import HotCacheStrategy, RowWiseOptimizerConfig
from lightning_hotcache.planner.plan import HotColdPlan, HotColdPlanner, batches_in_flight, resolve_budget, row_bytes
from lightning_hotcache.planner.profiling import AccessProfiler

TABLES = [
    EmbeddingBagConfig(name="small", num_embeddings=50, embedding_dim=8, feature_names=["s"]),
    EmbeddingBagConfig(name="skewed", num_embeddings=20_000, embedding_dim=32, feature_names=["k"]),
    EmbeddingBagConfig(name="flat", num_embeddings=20_000, embedding_dim=32, feature_names=["f"]),
]
SGD = RowWiseOptimizerConfig(name="sgd")
TOTAL = sum(t.num_embeddings * row_bytes(t, SGD) for t in TABLES)


def stats(batches: int = 20, batch: int = 256):
    rng = np.random.default_rng(0)
    profiler = AccessProfiler(TABLES)
    for _ in range(batches):
        s = rng.integers(0, 50, batch)
        k = np.minimum(rng.zipf(1.3, batch) - 1, 19_999)
        f = rng.integers(0, 20_000, batch)
        profiler.observe(
            KeyedJaggedTensor.from_lengths_sync(
                keys=["s", "k", "f"],
                values=torch.from_numpy(np.concatenate([s, k, f])),
                lengths=torch.ones(3 * batch, dtype=torch.int32),
            )
        )
    return profiler.stats()


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(1000, 1000), ("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5kb", 1500), (0.5, TOTAL // 2), ("0.25", TOTAL // 4)],
)
def test_budget_forms(budget, expected) -> None:
    assert resolve_budget(budget, TOTAL) == expected


@pytest.mark.parametrize("budget", [0, -5, 1.5, 0.0, "lots", "2XB", True, "0GB", "0.0000001kb"])
def test_bad_budgets_are_clear_errors(budget) -> None:
    with pytest.raises(ValueError, match="device_budget"):
        resolve_budget(budget, TOTAL)


@pytest.mark.parametrize("budget", [1, "1", " 1 "])
def test_budget_of_one_is_refused_not_read_as_one_byte(budget) -> None:
    # Issue 23 item 11: YAML's `device_budget: 1` is an int, which meant 1 byte (and, with
    # grow_budget_to_minimum, training at the minimum with only a warning).
    message = r"device_budget=1 means 1 byte; write 1\.0 for the whole tables or '1GB'"
    with pytest.raises(ValueError, match=message):
        resolve_budget(budget, TOTAL)
    with pytest.raises(ValueError, match=message):  # at construction, before a CLI run builds the model
        HotCacheStrategy(device_budget=budget, grow_budget_to_minimum=True)


def test_budget_in_bytes_far_below_the_minimum_is_not_grown() -> None:
    # Issue 23 item 11: `device_budget: 2` (meant as 2 GB, or as everything) was grown to the
    # minimum with a warning; bytes a thousandfold short are a unit mistake, refused.
    minimum = HotColdPlanner(1000, SGD, prefetch_depth=2).minimum_bytes(TABLES, stats())
    far_below = HotColdPlanner(2, SGD, prefetch_depth=2, grow_budget_to_minimum=True)
    message = r"device_budget=2 means 2 bytes, [\d,]+x below the minimum .*Write the size with a unit \('2GB'\)"
    with pytest.raises(ValueError, match=message):
        far_below.plan(TABLES, stats())
    plan = HotColdPlanner(0.5, SGD, prefetch_depth=2).plan(TABLES, stats())
    with pytest.raises(ValueError, match=message):  # a plan file is held to the same rule
        far_below.check_plan(plan, TABLES)
    # Bytes a little short, and fractions however short, still grow to the minimum.
    for budget in (minimum // 2, str(minimum // 2), 1e-9):
        with pytest.warns(UserWarning, match="planning with the minimum"):
            grown = HotColdPlanner(budget, SGD, prefetch_depth=2, grow_budget_to_minimum=True).plan(TABLES, stats())
        assert grown.budget_bytes == minimum


def test_auto_budget_is_positive() -> None:
    assert resolve_budget("auto", TOTAL) > 0


def test_everything_fits_needs_no_stats() -> None:
    plan = HotColdPlanner(1.0, SGD).plan(TABLES)
    assert all(t.on_device and t.expected_hit_rate == 1.0 for t in plan.tables)
    assert plan.device_bytes == TOTAL
    assert plan.sharding_plan is not None  # made by TorchRec's planner
    assert [line.split()[3] for line in str(plan).splitlines()[2:5]] == ["all"] * 3


def test_split_tables_are_charged_the_directory_that_lives_on_the_device() -> None:
    from lightning_hotcache.cache.device_directory import DEVICE_DIRECTORY_BYTES_PER_SLOT
    from lightning_hotcache.cache.slot_map import sparse_map_bytes_per_resident
    from lightning_hotcache.planner.plan import SLOT_BOOKKEEPING_BYTES, row_bytes

    # On a CPU the device is the host and the budget pays for the host directory (id -> slot
    # map, per-slot bookkeeping); on CUDA for the device directory's cells, which take less, so
    # the same budget buys more rows.
    st = stats()
    plans = {
        device: HotColdPlanner(0.1, SGD, prefetch_depth=1, device=device, prefetch_thread=False).plan(TABLES, st)
        for device in ("cpu", "cuda")
    }
    for device, plan in plans.items():
        assert plan.device_bytes <= plan.budget_bytes
        for t in (t for t in plan.tables if not t.on_device):
            config = next(c for c in TABLES if c.name == t.name)
            directory = sparse_map_bytes_per_resident(config.num_embeddings) + SLOT_BOOKKEEPING_BYTES if device == "cpu" else DEVICE_DIRECTORY_BYTES_PER_SLOT
            assert t.device_bytes == (len(t.static_ids) + t.cache_slots) * (row_bytes(config, SGD) + directory), (device, t.name)
    rows = {d: sum(len(t.static_ids) + t.cache_slots for t in p.tables if not t.on_device) for d, p in plans.items()}
    assert rows["cpu"] < rows["cuda"]


def test_on_cuda_the_lookahead_window_in_device_memory_and_its_cells_next_reads_are_paid_by_the_budget() -> None:
    from lightning_hotcache.cache.device_directory import DEVICE_DIRECTORY_BYTES_PER_SLOT, NEXT_READ_BYTES_PER_SLOT, device_window_bytes
    from lightning_hotcache.planner.plan import row_bytes

    st = stats()
    options = {"prefetch_depth": 1, "device": "cuda", "prefetch_thread": False}
    lfu = HotColdPlanner(0.1, SGD, **options).plan(TABLES, st)
    plan = HotColdPlanner(0.1, SGD, cache_policy="lookahead", lookahead_batches=8, **options).plan(TABLES, st)
    split = [c for c in TABLES if not plan.table(c.name).on_device]
    assert split
    for config in split:
        t = plan.table(config.name)
        assert t.device_bytes == (len(t.static_ids) + t.cache_slots) * (row_bytes(config, SGD) + DEVICE_DIRECTORY_BYTES_PER_SLOT + NEXT_READ_BYTES_PER_SLOT)
    window = device_window_bytes(8, sum(st.unique_rows_per_batch(c.name)[1] for c in split))
    assert plan.device_bytes + window <= plan.budget_bytes  # the window's memory is the budget's
    rows = [sum(len(t.static_ids) + t.cache_slots for t in p.tables if not t.on_device) for p in (plan, lfu)]
    assert rows[0] < rows[1]


def test_split_prefers_coverage_per_byte_and_respects_budget() -> None:
    st = stats()
    plan = HotColdPlanner(0.1, SGD, prefetch_depth=1).plan(TABLES, st)
    small, skewed, flat = (plan.table(n) for n in ("small", "skewed", "flat"))
    assert small.on_device  # cheaper whole than as a cache
    assert not skewed.on_device and not flat.on_device
    # Rows of one size are bought by their reads: no row left on the host was read more often
    # than a row bought (ties go either way), so the skewed table, whose hot rows are read
    # many times, gets them all, while the flat one's rows are read once or twice.
    bought, left = [], []
    for table in (skewed, flat):
        ids, counts = st.top_ids(table.name)
        on_device = torch.from_numpy(np.isin(ids, table.static_ids))
        bought.append(counts[on_device]), left.append(counts[~on_device])
    assert min(int(c.min()) for c in bought) >= max(int(c.max()) for c in left)
    assert int(left[1].max()) <= 2 < int(bought[0].max())
    assert skewed.expected_hit_rate > 0.85 > 0.6 > flat.expected_hit_rate
    assert plan.device_bytes <= plan.budget_bytes
    # Hot rows are the measured hottest ones; every split table has room for the batches in flight.
    top, _ = st.top_ids("skewed", len(skewed.static_ids))
    assert set(skewed.static_ids.tolist()) == set(top.tolist())
    assert skewed.cache_slots >= plan.batches_in_flight * st.unique_rows_per_batch("skewed")[1]


def test_more_budget_never_lowers_hit_rates() -> None:
    st = stats()
    rates = [
        [t.expected_hit_rate for t in HotColdPlanner(b, SGD).plan(TABLES, st).tables] for b in (0.1, 0.2, 0.3, 0.6, 1.0)
    ]
    for low, high in zip(rates, rates[1:]):
        assert all(h >= lo - 1e-12 for lo, h in zip(low, high))


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_no_table_is_split_at_a_cost_above_its_whole_size(depth: int) -> None:
    # "mid" needs nearly all its rows as slots for the batches in flight, so headroom and hot
    # rows on top of them would cost more than the table whole.
    tables = [
        EmbeddingBagConfig(name="mid", num_embeddings=2000, embedding_dim=32, feature_names=["m"]),
        EmbeddingBagConfig(name="big", num_embeddings=50_000, embedding_dim=32, feature_names=["b"]),
    ]
    rng = np.random.default_rng(0)
    profiler = AccessProfiler(tables)
    for _ in range(20):
        ids = [np.minimum(rng.zipf(1.2, 256) - 1, t.num_embeddings - 1) for t in tables]
        profiler.observe(
            KeyedJaggedTensor.from_lengths_sync(
                keys=["m", "b"], values=torch.from_numpy(np.concatenate(ids)), lengths=torch.ones(512, dtype=torch.int32)
            )
        )
    st = profiler.stats()
    whole = {t.name: t.num_embeddings * row_bytes(t, SGD) for t in tables}
    planner = HotColdPlanner(1.0, SGD, prefetch_depth=depth)
    minimum = planner.minimum_bytes(tables, st)
    for budget in np.linspace(minimum, sum(whole.values()) - 1, 12).astype(int):
        plan = HotColdPlanner(int(budget), SGD, prefetch_depth=depth).plan(tables, st)
        assert plan.device_bytes <= budget
        for t in plan.tables:
            if not t.on_device:
                assert len(t.static_ids) + t.cache_slots < t.num_embeddings, (budget, t.name)
                assert t.device_bytes < whole[t.name], (budget, t.name)


def test_budget_below_minimum_says_the_minimum() -> None:
    with pytest.raises(ValueError, match=r"the minimum is .* \((\d+) bytes\)") as err:
        HotColdPlanner(1000, SGD, prefetch_depth=2).plan(TABLES, stats())
    minimum = int(str(err.value).split("(")[1].split(" bytes")[0])
    planner = HotColdPlanner(minimum, SGD, prefetch_depth=2)
    assert planner.minimum_bytes(TABLES, stats()) == minimum
    assert planner.plan(TABLES, stats()).device_bytes <= minimum  # exactly the minimum works


def test_split_without_stats_asks_for_profiling() -> None:
    with pytest.raises(ValueError, match="hotcache profile"):
        HotColdPlanner(0.1, SGD).plan(TABLES)


def test_optimizer_state_counts_in_the_budget() -> None:
    adam = RowWiseOptimizerConfig(name="adam")
    assert row_bytes(TABLES[0], adam) == 4 * (8 + 8 + 8 + 1)
    plan_sgd = HotColdPlanner(0.2, SGD).plan(TABLES, stats())
    plan_adam = HotColdPlanner(int(0.2 * TOTAL), adam).plan(TABLES, stats())
    assert len(plan_adam.table("skewed").static_ids) < len(plan_sgd.table("skewed").static_ids)


def test_json_round_trip_and_checks(tmp_path) -> None:
    plan = HotColdPlanner(0.1, SGD, prefetch_depth=1, cache_policy="lru").plan(TABLES, stats())
    plan.save(tmp_path / "plan.json")
    loaded = HotColdPlan.load(tmp_path / "plan.json", TABLES)
    assert loaded.to_dict() == plan.to_dict()
    other = [EmbeddingBagConfig(name="small", num_embeddings=51, embedding_dim=8, feature_names=["s"])]
    with pytest.raises(ValueError, match="51x8 in the model but 50x8 in the plan"):
        HotColdPlan.load(tmp_path / "plan.json", other)
    (tmp_path / "bad.json").write_text('{"format_version": 1, "tables": [')
    with pytest.raises(ValueError, match="bad.json is not a readable hot/cold plan"):
        HotColdPlan.load(tmp_path / "bad.json")


def test_batches_in_flight_are_the_strategys() -> None:
    # The training batch, the staged ones, the one Lightning's fetcher holds, a validation
    # batch, and the one a prefetch thread is staging.
    assert batches_in_flight(1, prefetch_thread=False) == 4
    assert batches_in_flight(2, prefetch_thread=True) == 6
    planner = HotColdPlanner(0.1, SGD, prefetch_depth=1)
    plan = planner.plan(TABLES, stats())
    assert (plan.prefetch_depth, plan.batches_in_flight) == (1, 4)
    assert "prefetch depth 1 (4 batches in flight)" in str(plan)
    # The thread counts on CUDA by default, in one process or several, as in the strategy.
    assert HotColdPlanner(prefetch_depth=1, device="cuda").batches_in_flight == 5
    assert HotColdPlanner(prefetch_depth=1, device="cuda", world_size=2).batches_in_flight == 5
    assert HotColdPlanner(prefetch_depth=1, prefetch_thread=True).batches_in_flight == 5
    with pytest.raises(ValueError, match="the minimum is .* for 4 batches in flight"):
        HotColdPlanner(1000, SGD, prefetch_depth=1).plan(TABLES, stats())


@pytest.mark.parametrize("budget", [0.3, 0.5, 0.7, 0.9])
def test_budget_beyond_the_profiled_rows_is_spent(budget: float) -> None:
    # At these budgets every profiled row of the split tables is a static row.
    st = stats()
    plan = HotColdPlanner(budget, SGD).plan(TABLES, st)
    assert plan.budget_bytes * 0.99 <= plan.device_bytes <= plan.budget_bytes, plan
    less = HotColdPlanner(budget - 0.1, SGD).plan(TABLES, st)
    assert sum(t.expected_hit_rate for t in plan.tables) > sum(t.expected_hit_rate for t in less.tables)
    assert plan.note == ""


def test_budget_left_unused_is_explained() -> None:
    st = stats()
    # The static policy has no cache slots to spend on rows the profile never saw.
    static = HotColdPlanner(0.3, SGD, cache_policy="static").plan(TABLES, st)
    unused = static.budget_bytes - static.device_bytes
    assert unused > 0.05 * static.budget_bytes
    assert "every profiled row of the split tables (skewed, flat) is a static row" in static.note
    assert static.note in str(static)
    whole = HotColdPlanner(2 * TOTAL, SGD).plan(TABLES)
    assert "every table is whole on the device" in whole.note


def test_plan_is_checked_against_the_run(tmp_path) -> None:
    st = stats(batch=256)
    planner = HotColdPlanner(0.1, SGD, prefetch_depth=1)
    plan = planner.plan(TABLES, st, batch_size=256)
    assert plan.batch_size == 256
    planner.check_plan(plan, TABLES, batch_size=256)
    HotColdPlanner(0.1, SGD, prefetch_depth=0).check_plan(plan, TABLES)  # fewer batches in flight fit
    mismatches = [
        (HotColdPlanner(0.1, SGD, prefetch_depth=1, world_size=2), TABLES, 256, "world size 1 .* this run has 2"),
        (HotColdPlanner(0.1, SGD, prefetch_depth=1, cache_policy="lru"), TABLES, 256, "cache_policy 'lfu' .* 'lru'"),
        (HotColdPlanner(0.1, SGD, prefetch_depth=2), TABLES, 256, "4 batches in flight .* this run has 5"),
        (HotColdPlanner(0.05, SGD, prefetch_depth=1), TABLES, 256, "needs .* on the device .* device_budget 0.05"),
        (planner, TABLES, 512, "batches of 256 samples .* this run's batches have 512"),
        (planner, TABLES[:2], 256, "Tables in the plan but not in the model: flat"),
    ]
    for checker, tables, batch, message in mismatches:
        with pytest.raises(ValueError, match=f"{message}.*hotcache plan"):
            checker.check_plan(plan, tables, batch_size=batch)
    # A plan grown to its minimum fits a run that grows its budget too.
    grown = HotColdPlanner(1000, SGD, prefetch_depth=1, grow_budget_to_minimum=True)
    with pytest.warns(UserWarning, match="below the minimum"):
        minimal = grown.plan(TABLES, st)
    assert minimal.budget_bytes == minimal.minimum_bytes == planner.minimum_bytes(TABLES, st)
    grown.check_plan(minimal, TABLES)
    with pytest.raises(ValueError, match="device_budget 1000 allows"):
        HotColdPlanner(1000, SGD, prefetch_depth=1).check_plan(minimal, TABLES)


def test_a_plan_is_refused_for_a_longer_lookahead_window_than_it_counted() -> None:
    # Its window's host memory was checked for the window it was made with; a longer one was not.
    def planner(window: int) -> HotColdPlanner:
        return HotColdPlanner(0.1, SGD, cache_policy="lookahead", lookahead_batches=window)

    plan = planner(8).plan(TABLES, stats())
    planner(8).check_plan(plan, TABLES)
    planner(2).check_plan(plan, TABLES)  # a shorter window takes less host memory
    with pytest.raises(ValueError, match=r"lookahead window of 8 batches was counted as ~.* reads 9 batches ahead.*hotcache plan"):
        planner(9).check_plan(plan, TABLES)
    # A plan saved before windows were counted (no lookahead_batches) is not refused for it.
    planner(64).check_plan(HotColdPlan.from_dict(plan.to_dict() | {"lookahead_batches": 0, "window_bytes": 0}), TABLES)


def test_stats_that_cannot_serve_the_run_are_refused() -> None:
    # Else the plan is made and training fails at its first step, asking for more budget.
    with pytest.raises(ValueError, match="hold no batches.*hotcache profile"):
        HotColdPlanner(0.1, SGD).plan(TABLES, AccessProfiler(TABLES).stats())
    with pytest.raises(ValueError, match="batches of 256 samples but this run's batches have 1024.*hotcache profile"):
        HotColdPlanner(0.1, SGD).plan(TABLES, stats(batch=256), batch_size=1024)
    with pytest.raises(ValueError, match="table extra is in the model but not in the stats.*hotcache profile"):
        extra = EmbeddingBagConfig(name="extra", num_embeddings=9, embedding_dim=8, feature_names=["x"])
        HotColdPlanner(0.1, SGD).plan([*TABLES, extra], stats())


def test_the_lookahead_window_is_counted_in_host_memory(tmp_path, monkeypatch) -> None:
    import lightning_hotcache.planner.plan as planner_module

    def planned(k: int) -> HotColdPlan:
        return HotColdPlanner(0.1, SGD, cache_policy="lookahead", lookahead_batches=k).plan(TABLES, stats())

    assert HotColdPlanner(0.1, SGD, cache_policy="lfu", lookahead_batches=64).plan(TABLES, stats()).window_bytes == 0
    two, four = planned(2), planned(4)
    # Per announced batch: 768 lookups of 8-byte ids 4 times over, and for each split table its
    # lookups' places and 4 arrays as long as its most distinct rows a batch.
    split = [t for t in two.tables if not t.on_device]
    per_batch = 4 * 8 * 768 + sum(8 * 256 + 4 * 8 * stats().unique_rows_per_batch(t.name)[1] for t in split)
    assert four.window_bytes - two.window_bytes == pytest.approx(2 * per_batch, abs=2)
    # A prefetch thread's reader holds two batches more, announced ahead of it.
    threaded = HotColdPlanner(0.1, SGD, cache_policy="lookahead", lookahead_batches=2, prefetch_thread=True).plan(TABLES, stats())
    assert threaded.window_bytes - two.window_bytes == pytest.approx(2 * per_batch, abs=2)
    assert "lookahead window: 2 batches" in str(two)
    two.save(tmp_path / "plan.json")
    assert HotColdPlan.load(tmp_path / "plan.json").window_bytes == two.window_bytes
    monkeypatch.setattr(planner_module, "_available_host_memory", lambda: two.window_bytes + 1)
    with pytest.raises(ValueError, match="A lookahead window of 4 batches needs .* lower lookahead_batches"):
        planned(4)


@pytest.mark.parametrize(
    ("thread", "depth", "device", "table_bytes", "chosen"),
    [
        (None, None, "cpu", 2**20, (False, 1)),  # small tables on a CPU: inline
        (None, None, "cpu", 2**31, (True, 3)),  # large ones: the thread, three batches ahead
        (True, None, "cpu", 2**20, (True, 1)),  # asked for: one ahead unless told
        (None, 2, "cpu", 2**31, (True, 2)),
        (False, None, "cpu", 2**31, (False, 1)),
        (None, None, "cuda", 2**20, (True, 1)),
    ],
)
def test_staging_is_chosen_by_device_and_table_size_unless_given(thread, depth, device, table_bytes, chosen, monkeypatch) -> None:
    from lightning_hotcache.planner.plan import staging_choice

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert tuple(vars(staging_choice(thread, depth, device, table_bytes)).values()) == chosen
    monkeypatch.setattr("os.cpu_count", lambda: 1)  # one core: no thread to run beside the step
    assert staging_choice(None, None, "cpu", 2**31).thread is False


def test_a_hand_edited_plan_is_checked_and_its_bytes_counted_again() -> None:
    # Issue 69 item 10: a plan with cache_slots 1000x a table's rows trained, and the printed
    # plan still said what the file said.
    import dataclasses

    planner = HotColdPlanner(0.1, SGD)
    plan = planner.plan(TABLES, stats())
    split = next(t for t in plan.tables if not t.on_device)
    edited = [dataclasses.replace(t, cache_slots=1000 * t.num_embeddings) if t is split else t for t in plan.tables]
    with pytest.raises(ValueError, match=rf"table {split.name} has .* cache slots but only {split.num_embeddings:,} rows"):
        planner.check_plan(dataclasses.replace(plan, tables=edited), TABLES)
    understated = [dataclasses.replace(t, device_bytes=1) for t in plan.tables]
    counted = planner.with_this_runs_bytes(dataclasses.replace(plan, tables=understated), TABLES)
    assert [t.device_bytes for t in counted.tables] == [t.device_bytes for t in plan.tables]
    tight = HotColdPlanner(plan.device_bytes - 1, SGD)  # the real bytes no longer fit, whatever the file says
    with pytest.raises(ValueError, match="on the device but device_budget"):
        tight.check_plan(dataclasses.replace(plan, tables=understated), TABLES)
