"""The directory's compiled steps (lightning_hotcache/cache/directory.py) against the torch
expressions they replace, on random inputs."""

from __future__ import annotations

import pytest
import torch

from lightning_hotcache.cache import directory
from lightning_hotcache.cache.lookahead import NEVER


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_split_hits_locks_the_hits_and_returns_the_misses(gen) -> None:
    distinct = torch.randperm(1000, generator=gen)[:300].sort().values
    slots = torch.where(torch.rand(300, generator=gen) < 0.3, -1, torch.randperm(300, generator=gen))
    counts = torch.randint(1, 9, (300,), generator=gen)
    last_used = torch.zeros(300, dtype=torch.int64)
    holders = torch.randint(0, 3, (300,), dtype=torch.int32, generator=gen)  # other batches in flight
    before = holders.clone()
    missing, needed, missed_reads, missed = directory.split_hits(distinct, slots, counts, last_used, holders, 7)
    at = (slots < 0).nonzero().squeeze(1)
    assert torch.equal(missing, at) and torch.equal(needed, distinct[at]) and torch.equal(missed_reads, counts[at])
    assert missed == int(counts[at].sum()) and 0 < missed < int(counts.sum())
    expected = torch.zeros(300, dtype=torch.int64)
    expected[slots[slots >= 0]] = 7
    assert torch.equal(last_used, expected)
    assert torch.equal(holders, before.index_add(0, slots[slots >= 0], torch.ones(300 - len(at), dtype=torch.int32)))


def test_install_names_resets_and_locks_the_victims(gen) -> None:
    slots = torch.where(torch.rand(50, generator=gen) < 0.4, -1, torch.arange(50))
    missing = (slots < 0).nonzero().squeeze(1)
    victims = torch.randperm(100, generator=gen)[: len(missing)] + 50
    needed = torch.randint(0, 10**6, (len(missing),), generator=gen)
    id_of_slot, frequency, last_used = torch.full((150,), -1), torch.ones(150, dtype=torch.int64), torch.zeros(150, dtype=torch.int64)
    holders = torch.zeros(150, dtype=torch.int32)
    expected = slots.clone()
    expected[missing] = victims
    directory.install(slots, missing, victims, needed, id_of_slot, frequency, last_used, holders, 3)
    assert torch.equal(slots, expected)
    assert torch.equal(id_of_slot[victims], needed) and not frequency[victims].any() and (last_used[victims] == 3).all()
    assert (holders[victims] == 1).all()
    untouched = torch.ones(150, dtype=torch.bool)
    untouched[victims] = False
    assert (id_of_slot[untouched] == -1).all() and (frequency[untouched] == 1).all() and not last_used[untouched].any()
    assert not holders[untouched].any()


def test_letting_go_takes_one_holder_from_each_slot_and_skips_misses() -> None:
    holders = torch.tensor([2, 1, 0, 3, 1], dtype=torch.int32)
    directory.let_go(holders, torch.tensor([0, 3, -1, 4]))
    assert holders.tolist() == [1, 1, 0, 2, 0]


def test_reads_counted_and_slots_filtered(gen) -> None:
    frequency = torch.zeros(20, dtype=torch.int64)
    slots, counts = torch.randperm(20, generator=gen)[:12], torch.randint(1, 5, (12,), generator=gen)
    directory.count_reads(frequency, slots, counts)
    assert torch.equal(frequency, torch.zeros(20, dtype=torch.int64).index_add_(0, slots, counts))
    id_of_slot = torch.where(torch.rand(20, generator=gen) < 0.5, -1, torch.arange(20) * 10)
    assert torch.equal(directory.occupied(slots, id_of_slot), slots[id_of_slot[slots] >= 0])
    held = id_of_slot[slots].clone()
    assert torch.equal(directory.vacate(slots, id_of_slot), held) and (id_of_slot[slots] == -1).all()


def test_dense_map_kept_by_the_steps_that_walk_its_ids(gen) -> None:
    # Its lookup, assignments and removals ride along in split_hits, install and vacate: the
    # same map and the same answers as the map's own calls (slots_of, scatter) around them.
    rows, num_slots = 1000, 200
    slot_of_id = torch.full((rows,), -1, dtype=torch.int32)
    id_of_slot = torch.full((num_slots,), -1)
    held = torch.randperm(rows, generator=gen)[:80]
    slot_of_id[held], id_of_slot[:80] = torch.arange(80, dtype=torch.int32), held
    distinct = torch.randperm(rows, generator=gen)[:100].sort().values
    counts = torch.randint(1, 9, (100,), generator=gen)
    last_used, apart = torch.zeros(num_slots, dtype=torch.int64), torch.zeros(num_slots, dtype=torch.int64)
    holders, holders_apart = torch.zeros(num_slots, dtype=torch.int32), torch.zeros(num_slots, dtype=torch.int32)
    slots, *found = directory.look_up_and_split_hits(slot_of_id, distinct, counts, last_used, holders, 5)
    expected_slots = directory.slots_of(slot_of_id, distinct)
    assert torch.equal(slots, expected_slots) and (slots >= 0).any() and (slots < 0).any()
    expected = directory.split_hits(distinct, expected_slots.clone(), counts, apart, holders_apart, 5)
    assert all(torch.equal(a, b) for a, b in zip(found[:3], expected[:3])) and found[3] == expected[3]
    assert torch.equal(last_used, apart) and torch.equal(holders, holders_apart)
    missing, needed = found[0], found[1]
    victims = torch.arange(80, 80 + len(missing))
    frequency = torch.zeros(num_slots, dtype=torch.int64)
    directory.install(slots, missing, victims, needed, id_of_slot, frequency, last_used, holders, 6, slot_of_id=slot_of_id)
    assert torch.equal(slot_of_id[needed], victims.int()) and torch.equal(directory.slots_of(slot_of_id, distinct), slots)
    evicted = torch.tensor([0, 3, 81])
    gone = directory.vacate(evicted, id_of_slot, slot_of_id=slot_of_id)
    assert torch.equal(gone, torch.cat([held[[0, 3]], needed[1:2]])) and (slot_of_id[gone] == -1).all()
    assert int((slot_of_id >= 0).sum()) == 80 + len(missing) - 3


def test_dirty_by_id_orders_the_changed_slots_by_id(gen) -> None:
    id_of_slot = torch.randperm(10**6, generator=gen)[:200]  # distinct ids, in no order
    dirty = torch.rand(200, generator=gen) < 0.5
    slots = torch.randperm(200, generator=gen)[:120]
    changed = slots[dirty[slots]]
    expected_ids, order = id_of_slot[changed].sort()
    before = dirty.clone()
    ids, taken = directory.dirty_by_id(slots, dirty, id_of_slot)
    assert len(changed) > 0 and torch.equal(ids, expected_ids) and torch.equal(taken, changed[order])
    assert torch.equal(dirty, before)  # the marks stay until the write-back is made
    clean = torch.zeros(200, dtype=torch.bool)
    assert [len(t) for t in directory.dirty_by_id(slots, clean, id_of_slot)] == [0, 0]


@pytest.mark.parametrize("windowed", [False, True])
def test_unread_keeps_the_reserves_order(gen, windowed) -> None:
    reserve = torch.randperm(40, generator=gen)[:25]
    last_used = torch.randint(0, 10, (40,), generator=gen)
    next_read = torch.where(torch.rand(40, generator=gen) < 0.5, NEVER, torch.randint(0, 9, (40,), generator=gen))
    keep = last_used[reserve] < 5
    if windowed:
        keep &= next_read[reserve] == NEVER
    assert torch.equal(directory.unread(reserve, last_used, 5, next_read if windowed else None, NEVER), reserve[keep])


@pytest.mark.parametrize(("first", "count"), [(3, 5), (14, 6), (16, 16), (30, 0)])
def test_ring_entries_wrap_around_the_ring(first: int, count: int) -> None:
    ring = torch.arange(100, 116)
    expected = ring[(torch.arange(first, first + count)) % 16]
    taken = directory.ring_entries(ring, first, count)
    assert torch.equal(taken, expected)
    taken += 1  # a copy: the ring is written again by later announcements
    assert torch.equal(ring, torch.arange(100, 116))


@pytest.mark.parametrize("count", [5, 40, 90, 200])
def test_window_victims_are_the_torch_top_k(gen, count: int) -> None:
    start, slots, cap = 10, 210, 7
    holders = torch.randint(0, 4, (slots,), dtype=torch.int32, generator=gen)  # locked above 0
    next_read = torch.where(torch.rand(slots, generator=gen) < 0.2, NEVER, 100 + torch.randint(0, 12, (slots,), generator=gen))
    frequency = torch.randint(0, 12, (slots,), generator=gen)  # ties, and some above the cap
    spare, victims, free = directory.window_victims(holders, next_read, frequency, start, count, cap, NEVER)
    # Short of spare slots, the victims are all of them, then the farthest read; else none.
    assert torch.equal(victims[: len(spare)], spare) if len(spare) < count else len(victims) == 0
    farthest = victims[len(spare) :]
    unlocked = holders[start:] == 0
    assert free == int(unlocked.sum())
    never = next_read[start:] == NEVER
    assert torch.equal(spare, (unlocked & never).nonzero().squeeze(1) + start)
    awaited = (unlocked & ~never).nonzero().squeeze(1) + start
    key = next_read * (cap + 1) + (cap - frequency.clamp(max=cap))  # farthest, then fewest reads
    need = min(max(count - len(spare), 0), len(awaited))
    assert len(farthest) == need and len(set(farthest.tolist())) == need
    assert set(farthest.tolist()) <= set(awaited.tolist())
    # The same keys as a top-k (ties may pick other slots), the farthest next read first.
    assert torch.equal(key[farthest].sort(descending=True).values, torch.topk(key[awaited], need).values)
    assert torch.equal(next_read[farthest], next_read[farthest].sort(descending=True).values)


@pytest.mark.parametrize("ascending", [True, False])
@pytest.mark.parametrize("counted", [True, False])
def test_tally_counts_ids_per_segment(gen, ascending, counted) -> None:
    ends = torch.tensor([3, 10, 11, 40])  # segments [0, 3), [3, 10), [10, 11), [11, 40)
    ids = torch.randint(0, 40, (200,), generator=gen)
    ids = ids.sort().values if ascending else ids
    counts = torch.randint(1, 4, (200,), generator=gen) if counted else None
    into = torch.full((4,), 5, dtype=torch.int64)
    directory.tally(into, ends, ids, counts, ascending)
    segments = torch.searchsorted(ends, ids, right=True)
    expected = torch.full((4,), 5, dtype=torch.int64).index_add_(0, segments, torch.ones_like(ids) if counts is None else counts)
    assert torch.equal(into, expected)


def test_match_sorted_finds_common_ids(gen) -> None:
    held = torch.randperm(500, generator=gen)[:120].sort().values
    ids = torch.randperm(500, generator=gen)[:200].sort().values
    at, source = directory.match_sorted(held, ids)
    assert torch.equal(ids[at], held[source]) and torch.equal(at, torch.isin(ids, held).nonzero().squeeze(1))
    assert len(directory.match_sorted(held, held[:0])[0]) == 0 and len(directory.match_sorted(held[:0], ids)[0]) == 0


def test_dense_map_steps(gen) -> None:
    slot_of_id = torch.full((100,), -1, dtype=torch.int32)
    ids, slots = torch.randperm(100, generator=gen)[:30], torch.randperm(60, generator=gen)[:30]
    directory.scatter(slot_of_id, ids, slots)
    looked_up = directory.slots_of(slot_of_id, torch.arange(100))
    expected = torch.full((100,), -1)
    expected[ids] = slots
    assert looked_up.dtype == torch.int64 and torch.equal(looked_up, expected)
    directory.scatter(slot_of_id, ids[:10], -1)
    expected[ids[:10]] = -1
    assert torch.equal(slot_of_id.long(), expected)


def test_link_announced_matches_the_window_books_by_hand(gen) -> None:
    # The torch expressions the lookahead window ran before: link each id's latest read in the
    # window to this announcement, give its own ring entries no next read yet, move last_at.
    rows, ring_length, start, first, number = 50, 64, 10, 30, 7
    last_at = torch.where(torch.rand(rows, generator=gen) < 0.5, -1, torch.randint(0, first, (rows,), generator=gen)).to(torch.int32)
    ring = torch.randint(0, 5, (ring_length,), generator=gen)
    distinct = torch.randperm(rows, generator=gen)[:20].sort().values
    expected_ring, expected_last_at = ring.clone(), last_at.clone()
    latest = last_at[distinct].long()
    linked = latest >= start
    expected_ring[latest[linked] & (ring_length - 1)] = number
    expected_ring[torch.arange(first, first + 20) & (ring_length - 1)] = NEVER
    expected_last_at[distinct] = torch.arange(first, first + 20, dtype=torch.int32)
    unlinked = directory.link_announced(last_at, ring, distinct, start, first, number, NEVER)
    assert torch.equal(unlinked, distinct[~linked]) and torch.equal(ring, expected_ring) and torch.equal(last_at, expected_last_at)
    next_read = torch.zeros(8, dtype=torch.int64)
    absent = directory.fill_where_resident(next_read, torch.tensor([3, -1, 5, -1]), number, torch.tensor([10, 11, 12, 13]))
    assert next_read.tolist() == [0, 0, 0, 7, 0, 7, 0, 0] and absent.tolist() == [11, 13]


def test_the_link_pass_looks_resident_rows_up_in_a_dense_map_as_the_look_up_does(gen) -> None:
    # One call with the map against the link, the map's look-up and fill_where_resident.
    rows, ring_length, start, first, number = 50, 64, 10, 30, 7
    last_at = torch.where(torch.rand(rows, generator=gen) < 0.5, -1, torch.randint(0, first, (rows,), generator=gen)).to(torch.int32)
    ring = torch.randint(0, 5, (ring_length,), generator=gen)
    distinct = torch.randperm(rows, generator=gen)[:20].sort().values
    slot_of_id = torch.full((rows,), -1, dtype=torch.int32)
    slot_of_id[torch.randperm(rows, generator=gen)[:25]] = torch.randperm(12 * 25, generator=gen)[:25].to(torch.int32)
    books = [(last_at.clone(), ring.clone(), torch.zeros(12 * 25, dtype=torch.int64)) for _ in range(2)]
    unlinked = directory.link_announced(books[0][0], books[0][1], distinct, start, first, number, NEVER)
    expected = directory.fill_where_resident(books[0][2], directory.slots_of(slot_of_id, unlinked), number, unlinked)
    coming = directory.link_announced(books[1][0], books[1][1], distinct, start, first, number, NEVER, slot_of_id, books[1][2])
    assert 0 < len(coming) < len(unlinked) and torch.equal(coming, expected)
    assert all(torch.equal(a, b) for a, b in zip(*books))
    with pytest.raises(ValueError, match="both or neither"):
        directory.link_announced(last_at, ring, distinct, start, first, number, NEVER, slot_of_id)


def test_count_reads_notes_reads_and_next_reads_in_one_pass() -> None:
    frequency, next_read = torch.zeros(6, dtype=torch.int64), torch.full((6,), NEVER)
    directory.count_reads(frequency, torch.tensor([4, 1]), torch.tensor([3, 2]), next_read, torch.tensor([9, 8]))
    assert frequency.tolist() == [0, 2, 0, 0, 3, 0] and next_read.tolist() == [NEVER, 8, NEVER, NEVER, 9, NEVER]
    directory.count_reads(frequency, torch.tensor([0]), None, next_read, torch.tensor([5]))  # no counts: next reads alone
    assert frequency.tolist() == [0, 2, 0, 0, 3, 0] and next_read[0] == 5


def test_compiles_where_nothing_can_be_cached(monkeypatch) -> None:
    # A read-only install with no writable cache directory: numba refuses to cache, and the
    # steps must still compile (each process for itself) rather than fail the import.
    import importlib

    from numba.core import caching

    monkeypatch.setattr(caching.CacheImpl, "_locator_classes", [])  # numba finds nowhere to cache
    uncached = importlib.reload(directory)
    try:
        assert uncached.slots_of(torch.tensor([4, -1, 2], dtype=torch.int32), torch.tensor([2, 0])).tolist() == [2, 4]
    finally:
        monkeypatch.undo()
        importlib.reload(directory)


def test_add_per_key_and_the_id_check_against_torch(gen) -> None:
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from lightning_hotcache.embedding.batch import add_per_key, check_ids

    lengths = [3, 0, 5, 2]
    values = torch.randint(0, 10, (sum(lengths),), generator=gen, dtype=torch.int32)
    bases = torch.tensor([0, 100, 200, 300])
    offsets = [0, 3, 3, 8, 10]
    assert torch.equal(add_per_key(values, bases, offsets), values.long() + torch.repeat_interleave(bases, torch.tensor(lengths)))
    tables = {f"f{k}": EmbeddingBagConfig(name=f"t{k}", embedding_dim=4, num_embeddings=10, feature_names=[f"f{k}"]) for k in range(4)}
    features = KeyedJaggedTensor.from_lengths_sync(list(tables), values, torch.tensor([1, 2, 0, 0, 3, 2, 1, 1]))  # 2 samples
    check_ids(features, tables)  # all in range
    values[9] = 10  # the last id of f3 (t3)
    with pytest.raises(ValueError, match="Feature 'f3' of table 't3' has id 10, outside"):
        check_ids(features, tables)


@pytest.mark.parametrize("span", [1, 7, 2**11, 2**26, 2**45])
@pytest.mark.parametrize("count", [0, 1, 5_000])
def test_sort_by_key_is_torchs_stable_sort(gen, span: int, count: int) -> None:
    keys = torch.randint(-span, span, (count,), generator=gen)
    values = torch.randint(0, 3, (count,), generator=gen)  # repeats: only a stable sort keeps their order
    ordered, carried = directory.sort_by_key(keys, values)
    expected = torch.sort(keys, stable=True)
    assert torch.equal(ordered, expected.values) and torch.equal(carried, values[expected.indices])


def test_prefetch_compiles_into_a_loop_and_changes_nothing() -> None:
    import numba
    import numpy as np

    from lightning_hotcache._ops.compiled import prefetch

    @numba.njit
    def gather(values, at):  # type: ignore[no-untyped-def]
        out = np.empty(len(at), values.dtype)
        for i in range(len(at)):
            if i + 4 < len(at):
                prefetch(values, at[i + 4])
            out[i] = values[at[i]]
        return out

    values, at = np.arange(100, dtype=np.int64) * 3, np.array([5, 99, 0, 42, 7, 7, 63, 1])
    assert np.array_equal(gather(values, at), values[at])
    with pytest.raises(numba.core.errors.TypingError):  # 1-D arrays and integer places only
        numba.njit(lambda v: prefetch(v, 1.5))(values)


@pytest.mark.parametrize("lfu", [True, False])
def test_eviction_scores_rank_empty_then_by_reads_or_last_use_and_lock_the_batches_in_flight(gen, lfu: bool) -> None:
    last_used = torch.randint(0, 40, (300,), generator=gen)
    frequency = torch.randint(0, 9, (300,), generator=gen)
    id_of_slot = torch.randint(-1, 1000, (300,), generator=gen)
    holders = torch.randint(0, 3, (300,), dtype=torch.int32, generator=gen)
    issued, start = 40, 50
    key = frequency * (issued + 1) + last_used if lfu else last_used
    expected = torch.where(id_of_slot < 0, -1, key)[start:]
    locked = holders[start:] > 0
    scores, free = directory.eviction_scores(last_used, holders, frequency, id_of_slot, start, issued, lfu)
    assert torch.equal(scores, expected.masked_fill(locked, torch.iinfo(torch.int64).max))
    assert free == int((~locked).sum()) and 0 < free < 250
    slots = torch.tensor([7, 299, 50, 7])
    assert torch.equal(directory.scores_of(slots, last_used, frequency, id_of_slot, issued, lfu), torch.where(id_of_slot < 0, -1, key)[slots])
