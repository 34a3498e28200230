"""Staging threads (`staging_threads`): a width's split tables stacked in several caches, each
staged on a thread of its own (`lightning_hotcache.cache.side_by_side`), learn exactly what
TorchRec learns, with every table's counters its own; the map's threads carry the caller's
torch state and end before it goes on; bad settings are clear errors. (Across processes:
test_ddp's ``2-rowwise_adagrad-lookahead-2threads``.)"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from conftest import exactness_matrix
import torch
from forked import from_a_fresh_process, in_forked_child
from test_embedding_exactness import (
    BUDGETS,
    ONE_WIDTH_TABLES,
    ONE_WIDTH_UPSTREAM,
    assert_same,
    make_plan,
    train_hotcache,
    train_reference,
    zipf_batches,
)
from torchrec import EmbeddingBagConfig

from lightning_hotcache import HotCacheStrategy, RowWiseOptimizerConfig
from lightning_hotcache.cache import DeviceCache
from lightning_hotcache.cache.side_by_side import SideBySide
from lightning_hotcache.embedding import HotColdEmbeddingBagCollection
from lightning_hotcache.embedding.layout import balanced_parts, build_layout

# Four split tables of one width, so that two parts have two tables each.
FOUR_TABLES = [*ONE_WIDTH_TABLES, EmbeddingBagConfig(name="t_shop", num_embeddings=400, embedding_dim=8, feature_names=["shop"])]


def _tables(rows: list[int], dim: int = 8) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t{k}", num_embeddings=n, embedding_dim=dim, feature_names=[f"f{k}"]) for k, n in enumerate(rows)]


def test_parts_take_whole_tables_of_about_equal_weight_in_the_tables_order() -> None:
    tables = _tables([100] * 5)
    weights = {"t0": 50, "t1": 10, "t2": 40, "t3": 30, "t4": 20}
    parts = balanced_parts(tables, weights, 2)
    assert [[t.name for t in part] for part in parts] == [["t0", "t1", "t4"], ["t2", "t3"]]  # 80 and 70
    assert [[t.name for t in part] for part in balanced_parts(tables[:1], weights, 3)] == [["t0"]]  # no empty part


def test_parts_are_regions_of_the_widths_one_device_table() -> None:
    tables = [*_tables([100, 200, 300, 50]), EmbeddingBagConfig(name="t_wide", num_embeddings=80, embedding_dim=16, feature_names=["g"])]
    slots = {"t0": 10, "t1": 20, "t2": 30, "t3": 50, "t_wide": 80}
    layout = build_layout(tables, slots, split={"t0", "t1", "t2", "t_wide"}, fused=False, world=1, parts=2)
    assert {key: [t.name for t in members] for key, members in layout.stacks.items()} == {
        "<split tables of dim 8, part 1 of 2>": ["t2"],  # 30 slots
        "<split tables of dim 8, part 2 of 2>": ["t0", "t1"],  # 10 + 20
        "<split tables of dim 16>": ["t_wide"],  # one split table of its width: one part
    }
    regions = {key: (r.table, r.start, r.rows) for key, r in layout.regions.items()}
    assert regions == {
        "<split tables of dim 8, part 1 of 2>": (0, 0, 30),
        "<split tables of dim 8, part 2 of 2>": (0, 30, 30),
        "t3": (0, 60, 50),  # the whole table after the width's stacks
        "<split tables of dim 16>": (1, 0, 80),
    }
    assert layout.device_rows == [110, 80]
    assert layout.id_starts == {"t2": 0, "t0": 0, "t1": 100, "t_wide": 0}  # each part's global ids start at 0
    # Across processes too, each part's tables starting at multiples of the world size (a
    # global id's owner is its row's owner) and each part spanning a multiple of it (`OwnedRows`
    # gives each part the next keys).
    across = build_layout(tables, slots, split={"t0", "t1", "t2", "t_wide"}, fused=False, world=4, parts=2)
    assert list(across.stacks) == list(layout.stacks)
    assert across.id_starts == {"t2": 0, "t0": 0, "t1": 100, "t_wide": 0}
    assert across.stack_ids == {"<split tables of dim 8, part 1 of 2>": 300, "<split tables of dim 8, part 2 of 2>": 300,
                                "<split tables of dim 16>": 80}  # fmt: skip


CASES = exactness_matrix(
    ["budget", "policy", "kernel", "storage", "depth"],
    together={"budget": ["10%", "minimum"], "policy": ["lfu", "lookahead"], "depth": [0, 2]},
    apart={"kernel": ["fbgemm", "pytorch"], "storage": ["memory", "mmap"]},
)


@pytest.mark.parametrize(("budget", "policy", "kernel", "storage", "depth"), CASES)
def test_stacks_staged_side_by_side_learn_what_torchrec_learns(budget, policy, kernel, storage, depth, tmp_path, monkeypatch) -> None:
    config = RowWiseOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    batches = zipf_batches(seed=3, extra={"shop": 400})
    plan = make_plan(batches, BUDGETS[budget], depth, policy, FOUR_TABLES)
    upstream = [torch.randn(len(u), 8 * 5, generator=torch.Generator().manual_seed(k)) for k, u in enumerate(ONE_WIDTH_UPSTREAM)]
    reference = train_reference(config, batches, upstream, FOUR_TABLES)
    stages_on = set()
    begin = DeviceCache._begin_acquire

    def watched(self, *args, **kwargs):
        stages_on.add(threading.get_ident())
        return begin(self, *args, **kwargs)

    monkeypatch.setattr(DeviceCache, "_begin_acquire", watched)
    module = train_hotcache(
        config, batches, upstream, plan, policy, "memory" if storage == "memory" else tmp_path, depth, FOUR_TABLES,
        kernel=kernel, staging_threads=2,
    )  # fmt: skip
    assert "4 split table(s) stacked in 2 caches staged side by side by 2 threads" in module.kernel_note, module.kernel_note
    assert len(stages_on) == 2  # each part's acquire on a thread of its own
    assert_same(module, reference)
    for table in FOUR_TABLES:  # every table's counters are its own, in whichever part it is
        read = sum(b[f].values().numel() for b in batches for f in table.feature_names)
        assert module.caches[table.name].counters.lookups == read
    fields = ("lookups", "hits", "fetched_rows", "evicted_rows", "written_back_rows")
    parts = {id(c.group): c.group for c in module.caches.values()}
    assert len(parts) == 2
    for field in fields:
        assert sum(getattr(module.caches[t.name].counters, field) for t in FOUR_TABLES) == sum(
            getattr(p.counters, field) for p in parts.values()
        )
    if budget == "minimum":
        assert all(p.counters.evicted_rows > 0 for p in parts.values())  # both parts really cycled


def test_a_second_part_has_a_host_store_of_its_own(tmp_path) -> None:
    batches = zipf_batches(steps=2, extra={"shop": 400})
    plan = make_plan(batches, None, 0, "lfu", FOUR_TABLES)
    module = HotColdEmbeddingBagCollection(FOUR_TABLES, plan, host_storage=tmp_path, kernel="pytorch", staging_threads=2)
    files = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".f32")
    assert {f.split(".")[0] for f in files} == {"split_tables_dim8_part1", "split_tables_dim8_part2"}, files
    module.release_host_storage()


def test_the_map_returns_in_order_and_carries_grad_mode_and_ends_every_share_before_raising() -> None:
    side_by_side = SideBySide(3, torch.device("cpu"))
    assert side_by_side.map(lambda x: x * 10, range(7)) == [0, 10, 20, 30, 40, 50, 60]
    with torch.no_grad():
        assert side_by_side.map(lambda _: torch.is_grad_enabled(), range(3)) == [False] * 3
    assert side_by_side.map(lambda _: torch.is_grad_enabled(), range(3)) == [True] * 3
    finished = []

    def work(k: int) -> int:
        if k == 0:  # the caller's share fails at once, while the others still work
            raise RuntimeError("the first share's error")
        time.sleep(0.2)
        finished.append(k)
        return k

    with pytest.raises(RuntimeError, match="the first share's error"):
        side_by_side.map(work, range(3))
    assert sorted(finished) == [1, 2]  # the map waited for them before raising


def test_one_thread_works_on_the_caller_alone() -> None:
    side_by_side = SideBySide(1, torch.device("cpu"))
    assert side_by_side.map(lambda _: threading.get_ident(), range(3)) == [threading.get_ident()] * 3
    assert side_by_side._pool is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_staging_threads_are_clear_errors(bad) -> None:
    with pytest.raises(ValueError, match="staging_threads must be a whole number of threads, at least 1"):
        HotCacheStrategy(staging_threads=bad)
    batches = zipf_batches(steps=1, extra={"shop": 400})
    with pytest.raises(ValueError, match="staging_threads must be"):
        HotColdEmbeddingBagCollection(FOUR_TABLES, make_plan(batches, None, 0, "lfu", FOUR_TABLES), staging_threads=bad)


def test_tables_staged_side_by_side_equal_one_stack_after_training() -> None:
    # The same run with one stack and with two parts: same weights, same optimizer state.
    config = RowWiseOptimizerConfig(name="adam", lr=0.05)
    batches = zipf_batches(seed=4, extra={"shop": 400})
    plan = make_plan(batches, BUDGETS["minimum"], 2, "lfu", FOUR_TABLES)
    upstream = [torch.randn(len(u), 8 * 5, generator=torch.Generator().manual_seed(k)) for k, u in enumerate(ONE_WIDTH_UPSTREAM)]
    one, two = (
        train_hotcache(config, batches, upstream, plan, "lfu", "memory", 2, FOUR_TABLES, kernel="pytorch", staging_threads=threads)
        for threads in (1, 2)
    )
    torch.testing.assert_close(two.state_dict(), one.state_dict(), rtol=0, atol=0)
    for name, arrays in two.optimizer_state().items():
        for key, value in arrays.items():
            torch.testing.assert_close(value, one.optimizer_state()[name][key], rtol=0, atol=0)


def test_released_threads_end_and_come_back_for_the_next_batch() -> None:
    before = set(threading.enumerate())  # another test's staging may still hold threads of the same name
    side_by_side = SideBySide(2, torch.device("cpu"))
    side_by_side.map(lambda x: x, range(2))
    started = [t for t in threading.enumerate() if t not in before]
    assert [t.name for t in started] == ["hotcache-staging_0"]
    side_by_side.release()
    assert not started[0].is_alive()
    assert side_by_side.map(lambda x: x + 1, range(2)) == [1, 2]
    side_by_side.release()


_SIDE_BY_SIDE = SideBySide(2, torch.device("cpu"))


def _maps_in_child() -> bool:
    return _SIDE_BY_SIDE.map(lambda x: x * 2, range(4)) == [0, 2, 4, 6]


def fork_with_the_threads_started(tmp_path) -> str:
    """In a fresh process (`forked.from_a_fresh_process`): the staging threads started, then a fork."""
    _SIDE_BY_SIDE.map(lambda x: x, range(2))
    assert "hotcache-staging_0" in [t.name for t in threading.enumerate()]
    return in_forked_child(_maps_in_child, tmp_path)


def test_a_forked_process_stages_on_threads_of_its_own(tmp_path) -> None:
    # Threads do not survive a fork: a child that kept the parent's pool would wait for ever.
    answer = from_a_fresh_process("test_side_by_side:fork_with_the_threads_started", tmp_path)
    assert answer == "True", answer


def test_the_other_threads_cpu_time_is_counted_for_the_caller() -> None:
    # The prefetch thread's `cache/staging_cpu_ms` adds it to its own: on two threads staging's
    # CPU time would otherwise be half counted, and read as waiting.
    def busy(_: int) -> int:
        ended = time.thread_time() + 0.05
        while time.thread_time() < ended:
            pass
        return 0

    side_by_side = SideBySide(2, torch.device("cpu"))
    side_by_side.map(busy, range(2))
    assert side_by_side.helper_cpu_seconds() >= 0.05  # the other thread's share, not the caller's
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(side_by_side.helper_cpu_seconds()))
    thread.start()
    thread.join()
    assert elsewhere == [0.0]  # another caller's maps are its own
    assert SideBySide(1, torch.device("cpu")).helper_cpu_seconds() == 0.0
    side_by_side.release()
