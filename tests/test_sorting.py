"""The numpy-backed sorts give exactly torch's results (the cache and the exchange rely on their order)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_hotcache._ops import sorting
from lightning_hotcache._ops.sorting import (
    MARK_WORDS_PER_ID,
    MARKS_UP_TO_ROWS,
    RADIX_SORT_FROM,
    distinct_rows,
    group_by_owner,
    lowest_first,
    sum_bag_rows,
    sum_by_index,
    unique,
)


@pytest.mark.parametrize(
    "ids",
    [[], [7], [5, 3, 5, 5, 0, 3, 2**40], list(range(100, 0, -1)) * 3, [3, -2, 3, 0], [0, 2**63 - 1, 0]],
    ids=["empty", "one", "repeats", "descending", "negative", "largest-int64"],
)
def test_unique_is_torchs(ids: list[int]) -> None:
    ids = torch.tensor(ids, dtype=torch.int64)
    for ours, torchs in zip(unique(ids, return_counts=True), torch.unique(ids, return_inverse=True, return_counts=True)):
        assert ours.dtype == torchs.dtype == torch.int64
        assert torch.equal(ours, torchs)
    distinct, inverse = unique(ids)
    assert torch.equal(distinct[inverse], ids)


@pytest.mark.parametrize("size", [10_000, RADIX_SORT_FROM - 1, RADIX_SORT_FROM, 3 * RADIX_SORT_FROM])
def test_unique_of_random_ids_and_of_a_strided_view(size: int) -> None:
    # Either side of the size from which torch's radix sort (and its unique) takes over.
    ids = torch.randint(0, 2 * size, (size,), generator=torch.Generator().manual_seed(0))
    for view in (ids, ids[::3]):
        assert all(torch.equal(a, b) for a, b in zip(unique(view, return_counts=True), torch.unique(view, return_inverse=True, return_counts=True)))


@pytest.mark.parametrize(
    ("rows", "num_rows"),
    [([0], 1), ([63, 64, 0, 63, 127, 128], 129), ([5, 5, 5], 6), (list(range(199, -1, -2)) * 2, 200)],
    ids=["one-row-table", "word-edges", "one-distinct", "descending"],
)
def test_distinct_rows_is_torchs_unique(rows: list[int], num_rows: int) -> None:
    rows = torch.tensor(rows, dtype=torch.int64)
    for ours, torchs in zip(distinct_rows(rows, num_rows), torch.unique(rows, sorted=True, return_inverse=True)):
        assert ours.dtype == torchs.dtype == torch.int64
        assert torch.equal(ours, torchs)


@pytest.mark.parametrize("num_rows", [1_000, 3_400_017, MARKS_UP_TO_ROWS + 1])
def test_distinct_rows_of_zipf_rows_marked_or_sorted(num_rows: int) -> None:
    # A table small beside the ids is marked in a bitmap, the largest ones sorted: both are torch's.
    g = torch.Generator().manual_seed(num_rows)
    rows = (torch.empty(53_248).exponential_(generator=g).pow_(3).mul_(100).long() * 7919) % num_rows
    rows[:2] = torch.tensor([0, num_rows - 1])
    for view in (rows, rows[::3]):
        assert all(torch.equal(a, b) for a, b in zip(distinct_rows(view, num_rows), torch.unique(view, sorted=True, return_inverse=True)))


@pytest.mark.parametrize("bad", [-1, 640])
def test_distinct_rows_names_a_row_outside_the_table(bad: int) -> None:
    rows = torch.tensor([3, bad, 7], dtype=torch.int64)
    assert (640 + 63) // 64 <= MARK_WORDS_PER_ID * len(rows)  # the bitmap's path, which checks
    with pytest.raises(ValueError, match=f"row {bad} is outside the table's 640 rows"):
        distinct_rows(rows, 640)


def test_distinct_rows_marks_only_where_it_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    marked = []
    real = sorting._distinct_marked
    monkeypatch.setattr(sorting, "_distinct_marked", lambda *args: marked.append(args[1]) or real(*args))
    rows = torch.arange(1_000, dtype=torch.int64)
    distinct_rows(rows, 64 * MARK_WORDS_PER_ID * 1_000)  # the bitmap's words: 32 per id
    distinct_rows(rows, 64 * MARK_WORDS_PER_ID * 1_000 + 64)  # one word more: sorted
    distinct_rows(rows[:0], 10)  # nothing to mark
    distinct_rows(rows.int(), 1_000)  # not int64: torch's
    assert marked == [64 * MARK_WORDS_PER_ID * 1_000]


def test_sum_by_index_with_a_bound_is_the_same_sum() -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (2_000,), generator=g)
    rows = torch.randn(2_000, 4, generator=g)
    for a, b in zip(sum_by_index(ids, rows, 300), sum_by_index(ids, rows)):
        assert torch.equal(a, b)


def _bags(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Bags of 0-3 values (zipf rows, many repeats): per-bag gradient rows, bag lengths, each
    value's distinct row, each value's weight."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (600,), generator=g)
    rows = (torch.empty(int(lengths.sum())).exponential_(generator=g).pow_(3).mul_(10).long() * 31) % 500
    _, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    return torch.randn(600, 16, generator=g), lengths, inverse, torch.rand(len(rows), generator=g)


@pytest.mark.parametrize("weighted", [False, True])
def test_sum_bag_rows_adds_as_index_add_does(weighted: bool) -> None:
    # Bit for bit: every exactness test compares the PyTorch path's steps with equality.
    per_bag, lengths, inverse, weights = _bags(int(weighted))
    num_rows = int(inverse.max()) + 1
    values = per_bag.repeat_interleave(lengths, dim=0)
    if weighted:
        values = values * weights[:, None]
    expected = torch.zeros(num_rows, 16).index_add_(0, inverse, values)
    got = sum_bag_rows(per_bag, lengths, inverse, num_rows, weights if weighted else None)
    assert torch.equal(got, expected)
    # Off the compiled loop (float64 rows go through torch's ops): the same sums.
    assert torch.equal(sum_bag_rows(per_bag.double(), lengths, inverse, num_rows, weights.double() if weighted else None), expected)


def test_sum_bag_rows_names_bags_and_rows_that_do_not_match() -> None:
    per_bag, lengths, inverse, _ = _bags(2)
    with pytest.raises(ValueError, match=f"the bags hold {int(lengths.sum())} values, but {len(inverse) - 1} have a row"):
        sum_bag_rows(per_bag, lengths, inverse[:-1], int(inverse.max()) + 1)
    with pytest.raises(ValueError, match="outside the 3 rows summed into"):
        sum_bag_rows(per_bag, lengths, inverse, 3)


@pytest.mark.parametrize("world", [1, 2, 200, 40_000])
def test_grouping_by_owner_is_torchs_stable_argsort(world: int) -> None:
    owners = torch.randint(0, world, (5_000,), generator=torch.Generator().manual_seed(world))
    order = group_by_owner(owners, world)
    assert order.dtype == torch.int64
    assert torch.equal(order, torch.argsort(owners, stable=True))


def test_sum_by_index_is_coalesce_without_the_coo() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (400,), generator=g)  # many repeats, unsorted
    rows = torch.randn(400, 6, generator=g)
    distinct, summed = sum_by_index(ids, rows)
    reference = torch.sparse_coo_tensor(ids.unsqueeze(0), rows, (50, 6)).coalesce()
    assert torch.equal(distinct, reference.indices()[0])
    torch.testing.assert_close(summed, reference.values(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    "size, count",
    # numpy's partition (small), the sampled threshold (a few percent to nearly all), and more than all
    [(1000, 0), (1000, 1), (1000, 37), (1000, 999), (1000, 1000), (1000, 1500),
     (100_000, 1), (100_000, 5_000), (100_000, 40_000), (100_000, 99_999), (RADIX_SORT_FROM, 100)],
)  # fmt: skip
def test_lowest_first_is_the_head_of_torchs_sort(size: int, count: int) -> None:
    generator = torch.Generator().manual_seed(count)
    values = torch.randint(0, max(size // 20, 50), (size,), generator=generator)  # many ties
    values[::7] = torch.iinfo(torch.int64).max  # locked slots, as the victim scan masks them
    values[3::11] = -1  # empty slots
    lowest = lowest_first(values, count)
    head = values.sort().indices[:count]
    assert len(lowest) == len(head) == min(count, size) and len(set(lowest.tolist())) == len(lowest)
    assert torch.equal(values[lowest], values[head])  # the same values in the same order; ties may swap


def test_lowest_first_when_the_sample_misleads() -> None:
    # The strided sample sees only 0s and sets the threshold there, which keeps too few.
    values = torch.ones(100_000, dtype=torch.int64)
    values[-5000:] = torch.arange(5000, 0, -1) + 1
    values[(torch.arange(4096) * len(values)) // 4096] = 0
    lowest = lowest_first(values, 10_000)
    assert torch.equal(values[lowest], values.sort().values[:10_000])
    assert (values[lowest] == 0).sum() == 4096


