"""A batch's ids sorted on the CPU through numpy: their distinct values, and grouped by owner;
and gradient rows summed by row index, with one sort and no sparse COO tensor.

Every step sorts the ids a batch reads, several times across processes (the cache's distinct
ids, the rows a device table reads, the keys of summed gradients, ids grouped by owning
rank). On CPU, torch sorts int64 below `RADIX_SORT_FROM` ids with a general stable sort that
is slower than numpy's introsort (``torch.unique`` sorts with it too, inverse and counts
included), and grouping by owner, a stable sort of small integers, is a radix sort in numpy.
From `RADIX_SORT_FROM` ids on, torch sorts integers with FBGEMM's parallel radix sort instead,
and its ``torch.unique`` is then the faster. Below that size `unique` sorts int64 ids with a
radix sort of its own, compiled and without the GIL (`_radix_unique`), faster than numpy's
at every size up to it: a cache's distinct ids are found once a batch, when it is announced
(benchmarks/README.md).
All give exactly torch's results. Tensors on other devices use torch's own ops.

The distinct rows of a table whose size is known (`distinct_rows`: a device table's reads,
gradient rows summed by row) need no sort at all while the table is small beside the ids:
each row is marked in a bitmap of the table's rows and numbered by the marks below it, three
passes without the GIL, each linear in the ids or the table. That beats torch's sort for a
cache's device table; for a table of tens of millions of rows the bitmap's fresh pages cost
more than sorting the ids would.

Summing gradient rows by index (`sum_by_index`) is a sparse COO gradient's ``coalesce``
without the COO: the distinct indices and an ``index_add_`` of the rows into them, which on
CPU is faster than ``coalesce`` at every width and size in the benchmarks; on CUDA,
``coalesce``'s values kernel sums a row's duplicates one after another, which for the hot
rows of many tables takes a large share of a DLRM step, where ``index_add_`` adds them in
parallel (benchmarks/README.md).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_hotcache._compat import add_to_each
from lightning_hotcache._ops.compiled import without_gil


# A batch's ids as `unique` with counts finds them: the distinct ids ascending, each id's
# position among them, and how often each is read.
Distinct = tuple[Tensor, Tensor, Tensor]

# torch's CPU sort of integers is FBGEMM's radix sort (parallel under OpenMP) from this many
# values on: `at::internal::GRAIN_SIZE` (ATen's SortingKernel.cpp, `can_use_radix_sort`).
RADIX_SORT_FROM = 32768

# `distinct_rows` marks rows in a bitmap for tables up to this many rows (a 2 MiB bitmap) and
# up to 32 bitmap words per id; beyond either a pass over the bitmap costs more than a sort.
MARKS_UP_TO_ROWS = 1 << 24
MARK_WORDS_PER_ID = 32


def unique(ids: Tensor, return_counts: bool = False) -> tuple[Tensor, ...]:
    """``torch.unique(ids, sorted=True, return_inverse=True, return_counts=...)`` of 1-D ``ids``:
    the distinct ids ascending, each id's position among them, and (asked for) their counts."""
    if ids.device.type != "cpu" or ids.dim() != 1 or len(ids) >= RADIX_SORT_FROM:
        return torch.unique(ids, return_inverse=True, return_counts=return_counts)
    if ids.dtype == torch.int64:
        distinct, inverse, counts = (torch.from_numpy(found) for found in _radix_unique(ids.numpy()))
        if len(inverse) == len(ids):  # else a negative id: numpy's below
            return (distinct, inverse, counts) if return_counts else (distinct, inverse)
    found = np.unique(ids.numpy(), return_inverse=True, return_counts=return_counts)
    distinct, inverse = torch.from_numpy(found[0]), torch.from_numpy(found[1].reshape(-1).astype(np.int64, copy=False))
    if return_counts:
        return distinct, inverse, torch.from_numpy(found[2].astype(np.int64, copy=False))
    return distinct, inverse


@without_gil
def _radix_unique(ids):  # type: ignore[no-untyped-def]
    """`unique` of non-negative int64 ``ids`` by a least-significant-digit radix sort: as many
    passes of up to 13 bits (a count array that stays in the L2 cache) as the largest id
    needs, each id carried with its place, then one pass that numbers the distinct ones.
    Empty results where an id is negative."""
    n = len(ids)
    largest = 0
    for i in range(n):
        if ids[i] < 0:
            return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64)
        largest = max(largest, ids[i])
    bits = 1
    while largest >> bits:
        bits += 1
    passes = (bits + 12) // 13
    digit_bits = (bits + passes - 1) // passes
    mask = (1 << digit_bits) - 1
    keys, places = ids.copy(), np.arange(n)
    next_keys, next_places = np.empty(n, np.int64), np.empty(n, np.int64)
    starts = np.empty(1 << digit_bits, np.int64)
    for shift in range(0, passes * digit_bits, digit_bits):
        starts[:] = 0
        for i in range(n):
            starts[(keys[i] >> shift) & mask] += 1
        total = 0
        for digit in range(len(starts)):
            total, starts[digit] = total + starts[digit], total
        for i in range(n):  # stable: equal digits keep the previous pass's order
            digit = (keys[i] >> shift) & mask
            next_keys[starts[digit]], next_places[starts[digit]] = keys[i], places[i]
            starts[digit] += 1
        keys, next_keys, places, next_places = next_keys, keys, next_places, places
    distinct, counts, inverse = np.empty(n, np.int64), np.zeros(n, np.int64), np.empty(n, np.int64)
    last = -1
    for i in range(n):
        if last < 0 or keys[i] != distinct[last]:
            last += 1
            distinct[last] = keys[i]
        counts[last] += 1
        inverse[places[i]] = last
    return distinct[: last + 1], inverse, counts[: last + 1]


def distinct_rows(rows: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """``torch.unique(rows, sorted=True, return_inverse=True)`` of 1-D int64 ``rows``, every one
    of them in ``[0, num_rows)`` (a row out of it is a ``ValueError``): the distinct rows
    ascending and each row's position among them."""
    words = (num_rows + 63) // 64
    markable = rows.device.type == "cpu" and rows.dim() == 1 and rows.dtype == torch.int64
    if not markable or num_rows > MARKS_UP_TO_ROWS or words > MARK_WORDS_PER_ID * len(rows):
        return torch.unique(rows, sorted=True, return_inverse=True)
    distinct, inverse = _distinct_marked(rows.numpy(), num_rows)
    if len(inverse) and inverse[0] < 0:  # the compiled loop's flag: a row outside the table
        outside = rows[(rows < 0) | (rows >= num_rows)]
        raise ValueError(f"row {outside[0].item()} is outside the table's {num_rows} rows")
    return torch.from_numpy(distinct), torch.from_numpy(inverse)


@without_gil
def _popcount(word):  # type: ignore[no-untyped-def]
    """Set bits of a uint64 (numba has no popcount of its own)."""
    word = word - ((word >> np.uint64(1)) & np.uint64(0x5555555555555555))
    word = (word & np.uint64(0x3333333333333333)) + ((word >> np.uint64(2)) & np.uint64(0x3333333333333333))
    word = (word + (word >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((word * np.uint64(0x0101010101010101)) >> np.uint64(56))


@without_gil
def _distinct_marked(rows, num_rows):  # type: ignore[no-untyped-def]
    """`distinct_rows` by a bitmap: mark every row, count the marks before each word, then a
    row's position is that count plus the marks below it in its word (-1 first where a row is
    outside the table, and nothing else written)."""
    one = np.uint64(1)
    marks = np.zeros((num_rows + 63) // 64, np.uint64)
    for row in rows:
        if row < 0 or row >= num_rows:
            return np.empty(0, np.int64), np.full(len(rows), -1, np.int64)
        marks[row >> 6] |= one << np.uint64(row & 63)
    before = np.empty(len(marks), np.int64)
    total = 0
    for word in range(len(marks)):
        before[word] = total
        total += _popcount(marks[word])
    distinct = np.empty(total, np.int64)
    inverse = np.empty(len(rows), np.int64)
    for i in range(len(rows)):
        row = rows[i]
        position = before[row >> 6] + _popcount(marks[row >> 6] & ((one << np.uint64(row & 63)) - one))
        inverse[i] = position
        distinct[position] = row
    return distinct, inverse


def group_by_owner(owners: Tensor, world: int) -> Tensor:
    """The stable permutation that sorts ``owners`` (ranks in ``[0, world)``):
    ``torch.argsort(owners, stable=True)``."""
    if owners.device.type != "cpu":
        return torch.argsort(owners, stable=True)
    narrow = np.int8 if world <= 127 else np.int16 if world <= 32767 else np.int32  # radix-sorted up to 16 bits
    return torch.from_numpy(np.argsort(owners.numpy().astype(narrow), kind="stable").astype(np.int64, copy=False))


def lowest_first(values: Tensor, count: int) -> Tensor:
    """Positions of the ``count`` smallest of 1-D ``values`` (all of them where ``count`` is
    larger), smallest first, ties in no set order: ``values.sort().indices[:count]``.

    A victim scan asks for the lowest eight batches' misses among a cache's dynamic slots'
    scores (17.6k of 362k at 10% of the Kaggle tables with batches of 2,048; 126k of 197k at 1%
    with batches of 8,192). On the CPU a strided sample's quantile, a little above ``count``'s
    share, sets a threshold; one compiled pass keeps the values at or under it (at least
    `RADIX_SORT_FROM` of them, which torch then sorts with its radix sort), and only those are
    sorted: numpy's partition of all the scores dominated the scan, so a sampled threshold
    keeps little more than the ``count`` asked for and torch's radix sort orders them
    (benchmarks/README.md). A threshold that keeps too few (a sample unlike the whole) falls
    back to numpy's partition, as do fewer values than torch's radix sort takes."""
    if values.device.type != "cpu" or values.dim() != 1 or count >= len(values):
        return values.sort().indices[: max(count, 0)]
    if count <= 0:
        return torch.empty(0, dtype=torch.int64)
    found = values.numpy()
    if len(values) >= RADIX_SORT_FROM:
        positions, under = _at_most_sampled_quantile(found, max(count, RADIX_SORT_FROM))
        if len(positions) >= count:
            order = torch.sort(torch.from_numpy(under)).indices[:count]
            return torch.from_numpy(positions)[order]
    lowest = np.argpartition(found, count - 1)[:count]
    return torch.from_numpy(lowest[np.argsort(found[lowest])])


# The sample `lowest_first` takes its threshold from, and how far above the wanted share its
# quantile lies: a quarter more and 32 of the sample's places, together six standard
# deviations of a 5% share as 4,096 random draws estimate it: a threshold falls short about never.
_SAMPLED = 4096
_SAMPLE_MARGIN = 32


@without_gil
def _at_most_sampled_quantile(values, wanted):  # type: ignore[no-untyped-def]
    """The positions and values of ``values`` at or under a strided sample's quantile a little
    above ``wanted`` values' share, in the order they come (all of them where that quantile is
    the sample's top)."""
    n = len(values)
    sample = np.empty(_SAMPLED, values.dtype)
    for i in range(_SAMPLED):
        sample[i] = values[(i * n) // _SAMPLED]
    sample.sort()
    place = (wanted * _SAMPLED) // n
    place += place // 4 + _SAMPLE_MARGIN
    everything = place >= _SAMPLED - 1
    threshold = sample[min(place, _SAMPLED - 1)]
    kept = 0
    for value in values:
        kept += everything or value <= threshold
    positions = np.empty(kept, np.int64)
    under = np.empty(kept, values.dtype)
    k = 0
    for i in range(n):
        if everything or values[i] <= threshold:
            positions[k], under[k] = i, values[i]
            k += 1
    return positions, under


def sum_by_index(indices: Tensor, rows: Tensor, num_rows: int | None = None) -> tuple[Tensor, Tensor]:
    """The distinct ``indices`` (ascending) and the float32 sum of ``rows`` at each: what
    coalescing a sparse gradient with these indices and values gives (``num_rows``: the
    indices' bound, where known: `distinct_rows` then finds them)."""
    # torch's unique, not `unique`'s numpy path: what coalescing sorts with, so never slower than
    # it, where numpy's sort is slower than torch's on some CPUs (benchmarks/README.md).
    if num_rows is None:
        distinct, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    else:
        distinct, inverse = distinct_rows(indices, num_rows)
    summed = torch.zeros(len(distinct), rows.shape[1], dtype=torch.float32, device=rows.device)
    return distinct, summed.index_add_(0, inverse.to(rows.device), rows.to(torch.float32))


def sort_with_repeats(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``rows`` sorted with repeats kept, each row's place among the distinct ones (as
    ``unique``'s inverse), and the distinct row of each sorted one: ops whose sizes are known
    on the host, so that on CUDA none waits for the device, as ``unique`` would (its size)."""
    ordered, order = torch.sort(rows)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    torch.ne(ordered[1:], ordered[:-1], out=starts[1:])
    segment = starts.cumsum(0).sub_(1)
    return ordered, torch.empty_like(segment).scatter_(0, order, segment), segment


def sum_bag_rows(per_bag: Tensor, bag_lengths: Tensor, inverse: Tensor, num_rows: int, weights: Tensor | None = None) -> Tensor:
    """The float32 sum of every value's gradient row at its distinct row (``inverse``: each
    value's, below ``num_rows``), where values come bag after bag (``bag_lengths``) and a value's
    gradient row is its bag's row of ``per_bag`` (times its weight): what
    ``zeros(num_rows).index_add_(0, inverse, per_bag[bag of each value] * weights)`` gives, in
    the same order of adds. On the CPU one compiled pass over the values, not a row per value
    gathered and then added, so no (values, dim) temporary is written and read back (and with
    weights, no second one for the products)."""
    summed = torch.zeros(num_rows, per_bag.shape[1], dtype=torch.float32, device=per_bag.device)
    on_cpu = per_bag.device.type == "cpu" and per_bag.dtype == torch.float32 and inverse.device.type == "cpu"
    if on_cpu and (weights is None or weights.dtype == torch.float32) and len(bag_lengths):
        bag_ends = bag_lengths.cumsum(0)
        if int(bag_ends[-1]) != len(inverse):
            raise ValueError(f"the bags hold {int(bag_ends[-1])} values, but {len(inverse)} have a row")
        weights_view = _NO_WEIGHTS if weights is None else weights.numpy()
        if not _sum_bags(per_bag.numpy(), bag_ends.numpy(), inverse.to(torch.int64).numpy(), weights_view, summed.numpy()):
            raise ValueError(f"a value's distinct row is outside the {num_rows} rows summed into")
        return summed
    bag_of_value = torch.repeat_interleave(torch.arange(len(bag_lengths), device=per_bag.device), bag_lengths, output_size=len(inverse))
    rows = per_bag.index_select(0, bag_of_value)
    if weights is not None:
        rows = rows * weights.to(rows.dtype)[:, None]
    return summed.index_add_(0, inverse, rows.to(torch.float32))


_NO_WEIGHTS = np.empty(0, dtype=np.float32)


@without_gil
def _sum_bags(per_bag, bag_ends, inverse, weights, summed):  # type: ignore[no-untyped-def]
    """`sum_bag_rows`' loop: value after value, its bag's row (times its weight) added to its
    distinct row, as ``index_add_`` adds them (False, and stopped, at a row outside ``summed``)."""
    start = 0
    for bag in range(len(bag_ends)):
        end = bag_ends[bag]
        for value in range(start, end):
            row = inverse[value]
            if row < 0 or row >= len(summed):
                return False
            if len(weights):
                for column in range(per_bag.shape[1]):
                    summed[row, column] += per_bag[bag, column] * weights[value]
            else:
                for column in range(per_bag.shape[1]):
                    summed[row, column] += per_bag[bag, column]
        start = end
    return True


def sum_stacked_rows(indices: Sequence[Tensor], rows: Sequence[Tensor], first_rows: Sequence[int], sizes: Sequence[int]) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Tables of one width laid end to end, table ``k``'s row ``i`` being row ``first_rows[k] + i``
    of the stack (``first_rows`` ascending): the distinct stack rows ``indices`` read (each
    ``indices[k]`` below ``sizes[k]``), ascending; the sum of ``rows`` at each; and per table its
    distinct own rows, in that order. One sort for all the tables, not one per table (26
    tables' coalescing was a tenth of a step across ranks)."""
    # Offsets added in one op, not one per table (26 kernels on CUDA).
    end = first_rows[-1] + sizes[-1]
    distinct, summed = sum_by_index(torch.cat(add_to_each(list(indices), list(first_rows))), torch.cat(list(rows)), end)
    return distinct, summed, split_stack_rows(distinct, first_rows, end)


def split_stack_rows(rows: Tensor, first_rows: Sequence[int], end: int) -> list[Tensor]:
    """Distinct ascending ``rows`` of a stack of tables (table ``k``'s first row
    ``first_rows[k]``, ascending; the last one's end ``end``) as each table's own rows, table
    by table. Reads where each table's rows end on the host."""
    bounds = torch.searchsorted(rows, torch.tensor([*first_rows, end], device=rows.device)).tolist()
    return add_to_each([rows[a:b] for a, b in itertools.pairwise(bounds)], [-first for first in first_rows])


def sum_rows_by_index(indices: Sequence[Tensor], rows: Sequence[Tensor], sizes: Sequence[int]) -> list[tuple[Tensor, Tensor]]:
    """Per table ``k``: its distinct ``indices[k]`` (ascending, each below ``sizes[k]``) and the
    sum of ``rows[k]`` at each, the tables of one width summed together (`sum_stacked_rows`)."""
    out: list[tuple[Tensor, Tensor] | None] = [None] * len(indices)
    for width in {r.shape[1] for r in rows}:
        group = [k for k, r in enumerate(rows) if r.shape[1] == width]
        first_rows = list(itertools.accumulate((sizes[k] for k in group[:-1]), initial=0))
        _, summed, own_rows = sum_stacked_rows(
            [indices[k] for k in group], [rows[k] for k in group], first_rows, [sizes[k] for k in group]
        )
        for k, own, table_sums in zip(group, own_rows, summed.split([len(r) for r in own_rows])):
            out[k] = (own, table_sums)
    return out  # type: ignore[return-value]
