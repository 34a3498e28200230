"""HotColdEmbeddingBagCollection behaviour besides exactness: bad input, checkpoints, capacity."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_embedding_exactness import TABLES, UPSTREAM, make_plan, zipf_batches
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor

from lightning_hotcache.cache import CacheCapacityError, DeviceCache, HostStore
from lightning_hotcache.embedding import HotColdEmbeddingBagCollection
from lightning_hotcache.embedding.batch import concat_spans, put_spans


def module(fraction: float | None = 0.05, depth: int = 0, policy: str = "lru") -> HotColdEmbeddingBagCollection:
    torch.manual_seed(0)
    plan = make_plan(zipf_batches(), fraction, depth, policy)
    return HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=TABLES), plan, cache_policy=policy)


def kjt(**features: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(features),
        values=torch.tensor([v for vs in features.values() for v in vs]),
        lengths=torch.ones(sum(len(v) for v in features.values()), dtype=torch.int32),
    )


GOOD = dict(user=[1, 2], item=[3, 4], item_hist=[5, 6], tag=[7, 8])


def two_bags(**features: list[int]) -> KeyedJaggedTensor:
    """Two samples: the first id of each feature in the first bag, the rest in the second."""
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(features),
        values=torch.tensor([v for vs in features.values() for v in vs]),
        lengths=torch.tensor([n for vs in features.values() for n in (1, len(vs) - 1)], dtype=torch.int32),
    )


@pytest.mark.parametrize("ids_per_feature", ["equal", "unequal"])  # the check's two paths
@pytest.mark.parametrize(("feature", "bad", "table"), [("user", 1500, "t_user"), ("item_hist", -1, "t_item"), ("tag", 10**6, "t_tag")])
def test_out_of_range_ids_name_table_feature_and_id_before_touching_rows(feature, bad, table, ids_per_feature) -> None:
    m = module()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    counters = {n: c.counters.lookups for n, c in m.caches.items()}
    batch = two_bags(**{**GOOD, feature: [0, bad], **({"item": [3, 4, 4]} if ids_per_feature == "unequal" else {})})
    assert (len(set(batch.length_per_key())) == 1) == (ids_per_feature == "equal")
    with pytest.raises(ValueError, match=rf"Feature '{feature}' of table '{table}' has id {bad}"):
        m(batch)
    with pytest.raises(ValueError, match=str(bad)):
        m.prefetch(batch)
    assert {n: c.counters.lookups for n, c in m.caches.items()} == counters  # nothing was staged
    torch.testing.assert_close(m.state_dict(), before)


def test_missing_feature_and_wrong_dtype() -> None:
    m = module()
    with pytest.raises(KeyError, match="Feature 'tag' of table 't_tag' is missing"):
        m(kjt(user=[1], item=[2], item_hist=[3]))
    floats = KeyedJaggedTensor.from_lengths_sync(
        keys=list(GOOD), values=torch.arange(8, dtype=torch.float32), lengths=torch.ones(8, dtype=torch.int32)
    )
    with pytest.raises(TypeError, match="dtype torch.float32"):
        m(floats)


def test_forward_must_follow_prefetch_order() -> None:
    m = module(depth=1)
    first, second = zipf_batches(2, seed=5)
    m.prefetch(first)
    with pytest.raises(RuntimeError, match="prefetch batches in the order"):
        m(second)
    with torch.no_grad():
        m(second)  # an evaluation batch may come between prefetched training batches
    m(first).values().sum().backward()
    m.prefetch(second)
    m.clear_prefetched()
    assert all(c.num_locked() == 0 for c in m.caches.values())


def test_cache_too_small_for_batches_in_flight_is_a_clear_error() -> None:
    m = module(fraction=None, depth=0)  # slots for exactly one batch in flight
    batches = zipf_batches(4, seed=7)
    with pytest.raises(CacheCapacityError, match="dynamic cache slots are free"):
        for b in batches:
            m.prefetch(b)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cold_cache_fills_empty_slots_before_evicting_anything(policy: str) -> None:
    from lightning_hotcache import RowWiseOptimizerConfig
    from lightning_hotcache.cache import DeviceCache, HostStore

    sgd = RowWiseOptimizerConfig(name="sgd")
    host = HostStore("t", 100, 4, sgd.state_widths(4))
    host.load("weight", torch.arange(400, dtype=torch.float32).view(100, 4))
    cache = DeviceCache("t", 100, 4, sgd, torch.tensor([0]), 10, policy, host, torch.device("cpu"))
    seen: list[int] = []
    for batch in ([1, 2, 3], [4, 5, 6], [7, 8, 9], [10]):  # exactly the 10 dynamic slots
        slots, ticket = cache.acquire(torch.tensor(batch))
        seen += slots.tolist()
        cache.release(ticket)
    assert sorted(seen) == list(range(1, 11)) and cache.counters.evicted_rows == 0
    slots, ticket = cache.acquire(torch.tensor([1, 11]))  # row 1 hits; 11 evicts a row of the oldest batch
    resident = cache.slot_map.lookup(torch.arange(1, 12)) >= 0
    assert cache.counters.evicted_rows == 1 and int(resident[1:3].sum()) == 1 and bool(resident[[0, *range(3, 11)]].all())
    assert torch.equal(cache.weight[slots], host.weight[[1, 11]])


@pytest.mark.parametrize("policy", ["lfu", "lru", "lookahead"])
def test_a_batch_held_while_later_ones_come_and_go_locks_its_own_rows_only(policy: str) -> None:
    """A training batch staged ahead stays held while evaluation batches are staged and released
    after it (a mid-epoch validation): its rows stay locked, theirs are free again at once. With
    a watermark of released tickets, every later batch's rows counted as locked until the held
    one came back, and 20 such batches overflowed the 10 dynamic slots."""
    from lightning_hotcache import RowWiseOptimizerConfig
    from lightning_hotcache.cache import DeviceCache, HostStore

    sgd = RowWiseOptimizerConfig(name="sgd")
    host = HostStore("t", 100, 4, sgd.state_widths(4))
    host.load("weight", torch.arange(400, dtype=torch.float32).view(100, 4))
    cache = DeviceCache("t", 100, 4, sgd, torch.tensor([0]), 10, policy, host, torch.device("cpu"))
    held_slots, held = cache.acquire(torch.tensor([1, 2, 3]))
    for first in range(4, 64, 3):
        batch = torch.tensor([first, first + 1, first + 2, 2])  # row 2 read again by a batch released at once
        slots, ticket = cache.acquire(batch)
        assert torch.equal(cache.weight[slots], host.weight[batch])
        cache.release(ticket)
        assert cache.num_locked() == 3 and torch.equal(cache.slot_map.lookup(torch.tensor([1, 2, 3])), held_slots)
    cache.release(held)
    cache.release(held)  # a ticket released twice lets go once
    assert cache.num_locked() == 0 and int(cache.holders.min()) == 0


def test_reserved_victims_go_in_lfu_order_and_never_a_row_read_since_the_scan() -> None:
    from lightning_hotcache import RowWiseOptimizerConfig
    from lightning_hotcache.cache import DeviceCache, HostStore

    sgd = RowWiseOptimizerConfig(name="sgd")
    host = HostStore("t", 100, 4, sgd.state_widths(4))
    cache = DeviceCache("t", 100, 4, sgd, torch.tensor([0]), 10, "lfu", host, torch.device("cpu"))
    for row in range(1, 11):  # fills the 10 dynamic slots; row k is read k times
        for _ in range(row):
            cache.release(cache.acquire(torch.tensor([row]))[1])

    def resident() -> list[int]:
        return [row for row in range(1, 20) if int(cache.slot_map.lookup(torch.tensor([row]))) >= 0]

    cache.release(cache.acquire(torch.tensor([11]))[1])  # a scan: evicts row 1, reserves rows 2, 3, ...
    assert 1 not in resident() and len(cache._reserve) > 0
    for _ in range(3):  # row 2 is read more than row 3 since the scan: LFU now evicts 3 first
        cache.release(cache.acquire(torch.tensor([2]))[1])
    cache.release(cache.acquire(torch.tensor([12]))[1])
    assert resident() == [2, *range(4, 13)]
    _, locked = cache.acquire(torch.tensor([4]))  # the reserve's front, read and locked since the scan
    cache.release(cache.acquire(torch.tensor([13]))[1])
    assert resident() == [2, 4, *range(6, 14)]
    cache.release(locked)


def test_state_dict_interchanges_with_plain_ebc_and_survives_training() -> None:
    m = module(fraction=0.01)
    for batch, grad in zip(zipf_batches(), UPSTREAM):
        m(batch).values().backward(grad)
    trained = m.state_dict()
    plain = EmbeddingBagCollection(tables=TABLES)
    plain.load_state_dict(trained)  # same keys and shapes as torchrec's module
    fresh = module(fraction=0.01)
    fresh.load_state_dict(trained)
    torch.testing.assert_close(fresh.state_dict(), trained)
    batch = zipf_batches(1, seed=11)[0]
    with torch.no_grad():
        torch.testing.assert_close(fresh(batch).values(), plain(batch).values())
    with pytest.raises(RuntimeError, match="shape"):
        fresh.load_state_dict({**trained, "embedding_bags.t_tag.weight": torch.zeros(3, 8)})


def test_evaluation_updates_nothing_and_unlocks_rows() -> None:
    m = module(fraction=None)
    before = m.state_dict()
    before = {k: v.clone() for k, v in before.items()}
    with torch.no_grad():
        for batch in zipf_batches():
            m(batch)
    assert all(c.num_locked() == 0 for c in m.caches.values())
    torch.testing.assert_close(m.state_dict(), before)


def test_skipped_backward_releases_rows_once_output_is_gone() -> None:
    """A training forward whose output is dropped (a skipped step) must not keep its rows
    locked, or a cache sized for one batch in flight would overflow on the next one."""
    m = module(fraction=None)
    for batch in zipf_batches():
        m(batch)
    kept = m(zipf_batches()[0])
    assert len(m._staging.in_flight) == 1 and kept.values().requires_grad


@pytest.mark.parametrize("kind", ["dense", "hashed", "sorted"])
def test_every_slot_map_trains_exactly(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_embedding_exactness import assert_same, train_hotcache, train_reference

    from lightning_hotcache import RowWiseOptimizerConfig
    from lightning_hotcache.cache import slot_map

    monkeypatch.setattr(slot_map, "slot_map_kind", lambda num_embeddings, num_resident: kind)
    config = RowWiseOptimizerConfig(name="adam", lr=0.05)
    batches = zipf_batches()
    plan = make_plan(batches, 0.1, 2, "lfu")
    module = train_hotcache(config, batches, UPSTREAM, plan, "lfu", "memory", 2)
    expected = {"dense": slot_map.DenseSlotMap, "hashed": slot_map.HashedSlotMap, "sorted": slot_map.SortedSlotMap}[kind]
    assert all(isinstance(c.slot_map, expected) for c in module.caches.values() if not c.identity)
    assert_same(module, train_reference(config, batches, UPSTREAM))


def test_a_slot_map_outside_the_device_budget_is_dense() -> None:
    # Where the directory is host memory apart from the device (rows on CUDA), its bytes are
    # not the budget's, and the dense map's lookups are the fastest.
    from lightning_hotcache.cache.slot_map import DenseSlotMap, make_slot_map, slot_map_kind

    ids, cpu = torch.arange(10), torch.device("cpu")
    assert slot_map_kind(10**6, 110) != "dense"  # the budget would pay 4 MB for 110 rows
    assert not isinstance(make_slot_map(10**6, ids, 110, cpu), DenseSlotMap)
    assert isinstance(make_slot_map(10**6, ids, 110, cpu, budgeted=False), DenseSlotMap)


@pytest.mark.parametrize("kind", ["hashed", "sorted"])
def test_slot_maps_agree_under_random_edits(kind: str) -> None:
    from lightning_hotcache.cache.slot_map import DenseSlotMap, HashedSlotMap, SortedSlotMap, sparse_map_bytes_per_resident

    g = torch.Generator().manual_seed(0)
    static = torch.randperm(1000, generator=g)[:50].sort().values
    sparse = HashedSlotMap(1000, static, 150, torch.device("cpu")) if kind == "hashed" else SortedSlotMap(1000, static, 150, torch.device("cpu"))
    maps = [DenseSlotMap(1000, static, 150, torch.device("cpu")), sparse]
    resident: dict[int, int] = {}
    free_slots = list(range(50, 150))
    merges = 0
    for step in range(120):
        gone = list(resident)[: 2 if len(resident) < 80 else 5]  # fills up, then turns over
        for m in maps:
            m.remove(torch.tensor(gone, dtype=torch.int64))
        left = [resident.pop(i) for i in gone]
        taken = {*resident, *gone, *static.tolist()}
        new = [i for i in torch.randperm(1000, generator=g).tolist() if i not in taken][:5]
        slots = [free_slots.pop() for _ in new]
        free_slots += left
        if step % 3 == 2 and gone:  # a row evicted and fetched again, into the slot it left
            free_slots.remove(left[0])
            free_slots.append(slots[0])
            new[0], slots[0] = gone[0], left[0]
        for m in maps:
            m.assign(torch.tensor(new), torch.tensor(slots))
        resident.update(zip(new, slots))
        probe = torch.cat([torch.randint(0, 1000, (200,), generator=g), torch.tensor(gone, dtype=torch.int64)])
        torch.testing.assert_close(maps[0].lookup(probe), maps[1].lookup(probe))
        # Never past the room the planner pays for (for the sorted map, evicted entries wait there).
        held = sum(t.numel() * t.element_size() for t in maps[1].tensors())
        assert held <= 150 * sparse_map_bytes_per_resident(1000 if kind == "hashed" else 2**31)
        if kind == "hashed":  # a removal frees its cell: the table holds the resident ids alone
            assert int((sparse.cells >= 0).sum()) == sparse.resident == len(static) + len(resident)
        merges += len(sparse.runs[1][0]) == 0 if kind == "sorted" else 0
    # The sorted map dropped its evicted entries more than once along the way.
    assert kind == "hashed" or merges > 1


def test_hashed_slot_map_answers_misses_when_every_slot_is_taken() -> None:
    # A lookup probes until it meets the id or an empty cell: the table keeps one.
    from lightning_hotcache.cache.slot_map import HashedSlotMap

    m = HashedSlotMap(100, torch.empty(0, dtype=torch.int64), 1, torch.device("cpu"))
    m.assign(torch.tensor([5], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))  # ids of any int type
    assert m.lookup(torch.tensor([5, 7, -1])).tolist() == m.lookup(torch.tensor([5, 7, -1], dtype=torch.int32)).tolist() == [0, -1, -1]
    with pytest.raises(RuntimeError, match="holds 1 of 1 ids; 1 more do not fit"):
        m.assign(torch.tensor([9]), torch.tensor([0]))


def test_hashed_slot_map_removes_from_runs_of_colliding_ids() -> None:
    # Backward-shift deletion: removing an id moves back the entries whose probe passed its
    # cell, across the table's end too. Ids that share a few home cells, against a dict.
    from lightning_hotcache.cache.slot_map import HashedSlotMap, _home

    m = HashedSlotMap(10**6, torch.empty(0, dtype=torch.int64), 6, torch.device("cpu"))
    cells = len(m.cells)
    homes: dict[int, list[int]] = {}
    for i in range(20_000):
        homes.setdefault(_home(i, cells), []).append(i)
    crowded = [*homes[cells - 1][:3], *homes[0][:2], *homes[cells - 2][:2], *homes[3][:2]]  # runs that wrap around
    g = torch.Generator().manual_seed(0)
    expected: dict[int, int] = {}
    for _ in range(300):
        if len(expected) == 6 or (expected and torch.rand(1, generator=g).item() < 0.5):
            gone = list(expected)[int(torch.randint(len(expected), (1,), generator=g))]
            m.remove(torch.tensor([gone]))
            del expected[gone]
        else:
            absent = [i for i in crowded if i not in expected]
            new = absent[int(torch.randint(len(absent), (1,), generator=g))]
            slot = next(s for s in range(6) if s not in expected.values())
            m.assign(torch.tensor([new]), torch.tensor([slot]))
            expected[new] = slot
        assert m.lookup(torch.tensor(crowded)).tolist() == [expected.get(i, -1) for i in crowded]
        assert m.resident == len(expected) == int((m.cells >= 0).sum())


def test_recent_run_is_merged_at_the_size_that_keeps_merging_cheapest() -> None:
    # Merging into a recent run costs its size every step, merging the whole run costs the
    # whole run every time the recent one fills: the room that minimizes the sum is
    # sqrt(2 x whole room x ids added per step), far below a quarter of the room here.
    from lightning_hotcache.cache.slot_map import SortedSlotMap

    m = SortedSlotMap(10**7, torch.empty(0, dtype=torch.int64), 100_000, torch.device("cpu"))
    room = int((2 * m.max_entries * 100) ** 0.5)
    assert room < m.max_entries // 4
    longest = 0
    for step in range(200):
        ids = torch.arange(step * 100, (step + 1) * 100) * 7
        m.assign(ids, torch.arange(step * 100, (step + 1) * 100), ascending=True)
        longest = max(longest, len(m.runs[1][0]))
    assert room - 100 < longest <= room
    assert m.lookup(torch.tensor([0, 7 * 19_999, 5])).tolist() == [0, 19_999, -1]


def test_mmap_host_files_hold_the_current_tables_after_flush(tmp_path) -> None:
    import numpy as np

    from test_embedding_exactness import train_hotcache

    from lightning_hotcache import RowWiseOptimizerConfig

    batches = zipf_batches()
    plan = make_plan(batches, 0.01, 0, "lru")
    m = train_hotcache(RowWiseOptimizerConfig(name="rowwise_adagrad"), batches, UPSTREAM, plan, "lru", tmp_path, 0)
    m.flush()
    for table in TABLES:
        # The split tables of one width share their stack's files, each at its first global id.
        name, start = f"split_tables_dim{table.embedding_dim}", m.layout.id_starts[table.name]
        rows = slice(start, start + table.num_embeddings)
        on_disk = np.fromfile(tmp_path / f"{name}.weight.f32", dtype=np.float32).reshape(-1, table.embedding_dim)[rows]
        torch.testing.assert_close(torch.from_numpy(on_disk), m.state_dict()[f"embedding_bags.{table.name}.weight"])
        momentum = np.fromfile(tmp_path / f"{name}.momentum.f32", dtype=np.float32)[rows]
        assert (momentum > 0).any()  # optimizer state travels to disk with its rows


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("budget", [1.0, 0.3, 0.1, "minimum"])
def test_device_bytes_stay_within_the_budget(optimizer, budget) -> None:
    from conftest import tiny_synthetic

    from lightning_hotcache import HotColdPlanner, RowWiseOptimizerConfig
    from lightning_hotcache.planner.profiling import profile_batches

    dm = tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=2048, batch_size=64)
    dm.setup("fit")
    stats = profile_batches(list(dm.train_dataloader()), dm.tables, progress=False)
    config = RowWiseOptimizerConfig(optimizer)
    if budget == "minimum":
        budget = HotColdPlanner(1.0, config, prefetch_depth=3).minimum_bytes(dm.tables, stats)
    plan = HotColdPlanner(budget, config, prefetch_depth=3).plan(dm.tables, stats)
    m = HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=dm.tables), plan, config)
    for batch in list(dm.train_dataloader())[:12]:  # fill the caches: slot maps hold their dynamic ids
        m(batch.sparse_features).values().sum().backward()
        assert m.device_bytes() <= plan.budget_bytes
        assert m.device_bytes() <= plan.device_bytes  # the planner never counts less than the caches hold


def test_sorted_slot_map_holds_the_bytes_the_planner_counts() -> None:
    from lightning_hotcache.cache.slot_map import SortedSlotMap, make_slot_map, sparse_map_bytes_per_resident

    # The planner counts a sorted map for tables past int32 ids (smaller ones are hashed).
    num_embeddings = 2**31
    bound = sparse_map_bytes_per_resident(num_embeddings)
    static = torch.arange(0, 2000, 2)
    m = make_slot_map(num_embeddings, static, 1350, torch.device("cpu"))
    assert isinstance(m, SortedSlotMap)
    m.assign(torch.arange(1, 601, 2), torch.arange(1000, 1300))
    m.remove(torch.arange(1, 101, 2))
    m.assign(torch.arange(3001, 3101, 2), torch.arange(1300, 1350))
    held = sum(t.numel() * t.element_size() for t in m.tensors())
    resident = len(static) + 300
    assert held <= resident * bound
    assert m.lookup(torch.tensor([0, 1, 101, 3001, 5])).tolist() == [0, -1, 1050, 1300, -1]


@pytest.mark.parametrize("kernel", ["fbgemm", "pytorch"])
@pytest.mark.parametrize("weighted", [False, True])
def test_batches_with_other_features_or_order_read_the_same_rows(kernel, weighted) -> None:
    # A batch may carry features of other modules and list them in any order: the module
    # takes its own, in its order, and pools exactly what it pools from a batch of only those.
    from test_embedding_exactness import SUM_TABLES

    from lightning_hotcache import RowWiseOptimizerConfig

    batch = zipf_batches(steps=1, weighted=weighted)[0]
    by_feature = batch.to_dict()
    keys = ["tag", "extra", "item_hist", "user", "item"]
    extra = KeyedJaggedTensor.from_lengths_sync(["extra"], torch.arange(batch.stride()), torch.ones(batch.stride(), dtype=torch.int32),
                                                torch.ones(batch.stride()) if weighted else None)  # fmt: skip
    parts = {**by_feature, "extra": extra.to_dict()["extra"]}
    shuffled = KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat([parts[k].values() for k in keys]),
        lengths=torch.cat([parts[k].lengths() for k in keys]).int(),
        weights=torch.cat([parts[k].weights() for k in keys]) if weighted else None,
    )
    plan = make_plan([batch], 0.1, 0, "lfu", tables=SUM_TABLES)
    module = HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=SUM_TABLES, is_weighted=weighted), plan,
                                                    RowWiseOptimizerConfig("sgd"), kernel=kernel)  # fmt: skip
    with torch.no_grad():
        expected = module(batch).values()
        got = module(shuffled).values()
    torch.testing.assert_close(got, expected)


def _row_3_updated_and_evicted(defers: bool) -> tuple[DeviceCache, HostStore]:
    """A one-slot cache whose row 3 was updated to 7.0 and then evicted by row 5. With
    ``defers`` (CUDA's write-backs, which land once their copy is done) the write-back is in
    flight, landing at the acquire after next on the CPU, and the host store still holds the
    old row; without (a CPU cache's own), it landed when evicted."""
    from lightning_hotcache import RowWiseOptimizerConfig

    sgd = RowWiseOptimizerConfig(name="sgd")
    host = HostStore("t", 10, 2, sgd.state_widths(2))
    host.load("weight", torch.zeros(10, 2))
    cache = DeviceCache("t", 10, 2, sgd, torch.empty(0, dtype=torch.int64), 1, "lru", host, torch.device("cpu"))
    assert not cache.defers_write_backs
    cache.defers_write_backs = defers
    slots, ticket = cache.acquire(torch.tensor([3]))
    cache.weight[slots] = 7.0  # an update of row 3
    cache.mark_updated(slots)
    cache.release(ticket)
    cache.release(cache.acquire(torch.tensor([5]))[1])
    assert cache.counters.written_back_rows == 1
    assert torch.equal(host.weight[3], torch.zeros(2) if defers else torch.full((2,), 7.0))
    return cache, host


@pytest.mark.parametrize("defers", [True, False], ids=["deferred", "at-once"])
def test_a_row_fetched_again_before_its_write_back_lands_comes_from_the_evicted_copy(defers: bool) -> None:
    # The directory decides on the host; a row evicted and fetched again before its write-back
    # landed must come back with its update, not as the host's stale row.
    cache, host = _row_3_updated_and_evicted(defers)
    slots, ticket = cache.acquire(torch.tensor([3]))
    assert torch.equal(cache.weight[slots], torch.full((1, 2), 7.0))
    assert torch.equal(host.weight[3], torch.full((2,), 7.0))  # landed after this acquire's fetch
    cache.release(ticket)
    assert torch.equal(cache.full()[3], torch.full((2,), 7.0))


def test_a_write_back_that_fails_keeps_the_row_marked_changed(monkeypatch) -> None:
    # A host write that raises (say, a full disk under a memory-mapped store) must not lose the
    # update: the row stays marked changed, and the next write-back writes it.
    from lightning_hotcache import RowWiseOptimizerConfig

    sgd = RowWiseOptimizerConfig(name="sgd")
    host = HostStore("t", 10, 2, sgd.state_widths(2))
    host.load("weight", torch.zeros(10, 2))
    cache = DeviceCache("t", 10, 2, sgd, torch.empty(0, dtype=torch.int64), 1, "lru", host, torch.device("cpu"))
    slots, ticket = cache.acquire(torch.tensor([3]))
    cache.weight[slots] = 7.0
    cache.mark_updated(slots)
    cache.release(ticket)

    def full_disk(*args: object) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(host, "write", full_disk)
    with pytest.raises(OSError, match="No space"):
        cache.acquire(torch.tensor([5]))  # evicts row 3 from the only slot
    monkeypatch.undo()
    cache.write_back()
    assert torch.equal(host.weight[3], torch.full((2,), 7.0))


@pytest.mark.parametrize("defers", [True, False], ids=["deferred", "at-once"])
def test_whole_table_reads_land_every_write_back_first(defers: bool) -> None:
    cache, _ = _row_3_updated_and_evicted(defers)
    assert torch.equal(cache.host_weights(torch.tensor([3])), torch.full((1, 2), 7.0))
    cache.load_rows("weight", 0, torch.ones(10, 2))  # a load after the write-back: nothing lands over it later
    cache.release(cache.acquire(torch.tensor([6]))[1])
    assert torch.equal(cache.full(), torch.ones(10, 2))


@pytest.mark.parametrize("policy", ["lfu", "lookahead"])
def test_lookahead_keeps_the_rows_an_announced_batch_reads(policy: str) -> None:
    # Two dynamic slots. Row 1 is read three times, row 2 once; batch 3 brings row 3, and
    # batch 4 reads row 2 again. LFU evicts row 2 (read least) and misses it at batch 4; the
    # lookahead cache, told one batch ahead, evicts row 1 instead (no announced batch reads it).
    from lightning_hotcache import RowWiseOptimizerConfig
    from lightning_hotcache.cache import DeviceCache, HostStore

    sgd = RowWiseOptimizerConfig(name="sgd")
    host = HostStore("t", 10, 2, sgd.state_widths(2))
    cache = DeviceCache("t", 10, 2, sgd, torch.empty(0, dtype=torch.int64), 2, policy, host, torch.device("cpu"))
    trace = [torch.tensor(ids) for ids in ([1, 1], [2], [1], [3], [2])]
    cache.announce(trace[0])
    for step, ids in enumerate(trace):
        if step + 1 < len(trace):
            cache.announce(trace[step + 1])  # one batch ahead of the acquire
        cache.release(DeviceCache.acquire_all([cache], [ids], announced=True)[0].ticket)
    assert cache.counters.hits == (2 if policy == "lookahead" else 1)


@pytest.mark.parametrize("policy", ["lfu", "lookahead"])
def test_an_announced_batch_is_deduplicated_once_and_must_come_in_order(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    # Announcing a batch checks, orders and deduplicates its ids (under every policy: the
    # strategy's reader thread does it beside the staging of the batch before); its staging
    # reuses that work, so it must be the batch announced first: any other is refused, never
    # staged with its ids.
    import lightning_hotcache.cache.device as device_module
    import lightning_hotcache.cache.lookahead as lookahead_module
    import lightning_hotcache.embedding.staging as staging_module

    m = module(0.05, depth=2, policy=policy)
    batches = zipf_batches(steps=2)
    in_staging = _count_calls(monkeypatch, device_module, "unique")
    in_window = _count_calls(monkeypatch, lookahead_module, "unique")
    announcing = _count_calls(monkeypatch, staging_module, "unique")
    checked = _count_calls(monkeypatch, staging_module, "check_ids")
    for batch in batches:
        m.announce(batch)
    announced = (len(in_staging), len(in_window), len(announcing), len(checked))
    assert announced[:2] == (0, 0) and announced[2] > 0 and announced[3] == 2
    with pytest.raises(RuntimeError, match="oldest announced"):
        m.prefetch(batches[1], announced=True)
    m.clear_prefetched()  # the window forgotten: announce again
    for batch in batches:
        m.announce(batch)
    for batch in batches:
        m.prefetch(batch, announced=True)
    assert (len(in_staging), len(in_window), len(announcing), len(checked)) == (0, 0, 2 * announced[2], 4)  # staging added none
    for batch, grad in zip(batches, UPSTREAM):
        m(batch).values().backward(grad)


def test_an_acquire_of_another_batch_than_the_announced_one_is_refused() -> None:
    from lightning_hotcache import RowWiseOptimizerConfig
    from lightning_hotcache.cache import DeviceCache, HostStore

    sgd = RowWiseOptimizerConfig(name="sgd")
    cache = DeviceCache("t", 10, 2, sgd, torch.empty(0, dtype=torch.int64), 4, "lookahead", HostStore("t", 10, 2, {}), torch.device("cpu"))
    cache.announce(torch.tensor([1, 2, 2]))
    with pytest.raises(RuntimeError, match="got 2 ids, but the oldest announced batch has 3"):
        DeviceCache.acquire_all([cache], [torch.tensor([1, 2])], announced=True)


def _count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[None]:
    calls: list[None] = []
    original = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(None)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_batch_moved_to_the_device_is_put_in_order_with_the_hosts_sizes() -> None:
    # Staging reads the host batch; forward gets the moved one, put in the module's order with
    # the sizes per feature the host batch knows (computing them on a device would wait for it).
    from torchrec import EmbeddingBagConfig

    from lightning_hotcache.embedding.batch import in_feature_order, on_device

    host = KeyedJaggedTensor.from_lengths_sync(keys=["b", "a"], values=torch.tensor([5, 6, 7]), lengths=torch.tensor([1, 1, 0, 1]))
    arriving = KeyedJaggedTensor(keys=["b", "a"], values=host.values().clone(), lengths=host.lengths().clone())
    assert arriving.length_per_key_or_none() is None  # as a moved batch may come
    order, input_of = ["a", "b"], {"a": "a", "b": "b"}
    table_of = {f: EmbeddingBagConfig(name=f"t_{f}", num_embeddings=10, embedding_dim=2, feature_names=[f]) for f in order}
    host_ours = in_feature_order(host, order, input_of, table_of)
    ours = on_device(arriving, host, host_ours, order, input_of, table_of)
    assert ours.keys() == order and ours.length_per_key_or_none() == host_ours.length_per_key() == [1, 2]
    assert ours.offset_per_key_or_none() == host_ours.offset_per_key()
    assert torch.equal(ours.values(), torch.tensor([7, 5, 6])) and torch.equal(ours.lengths(), host_ours.lengths())


@pytest.mark.parametrize("spans", [[(2, 5)], [(0, 3), (6, 9)], [(1, 1), (4, 8), (8, 10)], [(5, 6), (0, 2)]])
def test_spans_cut_out_and_put_back_as_torch_would(spans) -> None:
    values = torch.arange(100, 110)
    expected = torch.cat([values[a:b] for a, b in spans])
    assert torch.equal(concat_spans(values, spans), expected)
    assert torch.equal(concat_spans(values.float(), spans), expected.float())  # any dtype, on the host
    target = torch.zeros(10, dtype=torch.int64)
    put_spans(target, spans, expected - 100, offset=100)
    written = torch.zeros(10, dtype=torch.bool)
    for a, b in spans:
        written[a:b] = True
    assert torch.equal(target[written], values[written]) and not target[~written].any()
    with pytest.raises(ValueError, match="values for spans of"):
        put_spans(target, spans, expected[1:])
    with pytest.raises(ValueError, match=r"within \[0, 10\)"):
        put_spans(target, [(8, 12)], torch.zeros(4, dtype=torch.int64))