"""A batch's ids sorted on the CPU through numpy: their distinct values, and grouped by owner;
and gradient rows summed by row index, with one sort and no sparse COO tensor.

Every step sorts the ids a batch reads, several times across processes (the cache's distinct
ids, the rows a device table reads, the keys of summed gradients, ids grouped by owning
rank). On CPU, torch sorts int64 with a stable sort that takes 240 us for 8k ids on 2 cores
where numpy's introsort takes 56 (``torch.unique`` sorts with it: 250 vs 115 us with the
inverse and counts; 1.0 vs 0.8 ms for 53k ids), and grouping by owner, a stable sort of
small integers, is a radix sort in numpy (23 vs 122 us for 8k ids). From 32768 ids on
(`RADIX_SORT_FROM`), torch sorts integers with FBGEMM's parallel radix sort instead, and its
``torch.unique`` is the faster: 0.55 against numpy's 2.0 ms for 32768 Zipf ids of the Criteo
Kaggle tables, 9 against 33 ms for 262k (AMD EPYC, 2 cores), where 32767 ids take 1.5 ms.
Both give exactly torch's results. Tensors on other devices use torch's own ops.

Summing gradient rows by index (`sum_by_index`) is a sparse COO gradient's ``coalesce``
without the COO: the distinct indices and an ``index_add_`` of the rows into them. On CPU (AMD
EPYC, 2 cores) it took 1.5 / 5.0 / 24 ms where ``coalesce`` took 3.7 / 10.1 / 60 ms for 53k Zipf
ids of dim 16, 53k of dim 128 and 213k of dim 128; on CUDA, ``coalesce``'s values kernel sums a
row's duplicates one after another, which cost 19 of a 32 ms DLRM step on an H200 for the hot
rows of 26 tables (first GPU run), where ``index_add_`` adds them in parallel.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_hotcache._compat import add_to_each


# A batch's ids as `unique` with counts finds them: the distinct ids ascending, each id's
# position among them, and how often each is read.
Distinct = tuple[Tensor, Tensor, Tensor]

# torch's CPU sort of integers is FBGEMM's radix sort (parallel under OpenMP) from this many
# values on: `at::internal::GRAIN_SIZE` (ATen's SortingKernel.cpp, `can_use_radix_sort`).
RADIX_SORT_FROM = 32768


def unique(ids: Tensor, return_counts: bool = False) -> tuple[Tensor, ...]:
    """``torch.unique(ids, sorted=True, return_inverse=True, return_counts=...)`` of 1-D ``ids``:
    the distinct ids ascending, each id's position among them, and (asked for) their counts."""
    if ids.device.type != "cpu" or ids.dim() != 1 or len(ids) >= RADIX_SORT_FROM:
        return torch.unique(ids, return_inverse=True, return_counts=return_counts)
    found = np.unique(ids.numpy(), return_inverse=True, return_counts=return_counts)
    distinct, inverse = torch.from_numpy(found[0]), torch.from_numpy(found[1].reshape(-1).astype(np.int64, copy=False))
    if return_counts:
        return distinct, inverse, torch.from_numpy(found[2].astype(np.int64, copy=False))
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
    larger), smallest first, ties in no set order: ``values.sort().indices[:count]``. On the CPU
    numpy partitions, then sorts the ``count`` alone: 3.2 ms for the lowest 124k of 330k
    int64 scores (a 1% cache's victim reserve), where torch's sort of all of them took 12.6 on
    one thread and 8.0 on two (2-core Intel Xeon)."""
    if values.device.type != "cpu" or values.dim() != 1 or count >= len(values):
        return values.sort().indices[: max(count, 0)]
    if count <= 0:
        return torch.empty(0, dtype=torch.int64)
    found = values.numpy()
    lowest = np.argpartition(found, count - 1)[:count]
    return torch.from_numpy(lowest[np.argsort(found[lowest])])


def sum_by_index(indices: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """The distinct ``indices`` (ascending) and the float32 sum of ``rows`` at each: what
    coalescing a sparse gradient with these indices and values gives."""
    # torch's unique, not `unique`'s numpy path: what coalescing sorts with, so never slower than
    # it; numpy's was 2.4 vs 0.5 ms for 53k Zipf ids on an AMD EPYC (AVX-512), against the Intel
    # figures above.
    distinct, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    summed = torch.zeros(len(distinct), rows.shape[1], dtype=torch.float32, device=rows.device)
    return distinct, summed.index_add_(0, inverse.to(rows.device), rows.to(torch.float32))


def sum_stacked_rows(indices: Sequence[Tensor], rows: Sequence[Tensor], first_rows: Sequence[int], sizes: Sequence[int]) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Tables of one width laid end to end, table ``k``'s row ``i`` being row ``first_rows[k] + i``
    of the stack (``first_rows`` ascending): the distinct stack rows ``indices`` read (each
    ``indices[k]`` below ``sizes[k]``), ascending; the sum of ``rows`` at each; and per table its
    distinct own rows, in that order. One sort for all the tables, not one per table (26
    tables' coalescing was a tenth of a step across ranks)."""
    # Offsets added in one op, not one per table (26 kernels on CUDA).
    distinct, summed = sum_by_index(torch.cat(add_to_each(list(indices), list(first_rows))), torch.cat(list(rows)))
    return distinct, summed, split_stack_rows(distinct, first_rows, first_rows[-1] + sizes[-1])


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
