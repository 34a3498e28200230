"""The device directory's set operations in Triton kernels: where each id of a batch is cached
(`find_in_sets`), and for each missed id the way of its set it takes (`victim_ways`).

In torch ops both gather every id's whole set, ``(n, ways)`` elements an array and a batch of
``n`` ids (FBGEMM's 32 ways: 32 times the batch), and compare or sort each row. Here a program
reads the sets of a few ids and keeps them in registers.

`find_in_sets`: an id is cached where a way of its set holds it; its cell is that way's.

`victim_ways`: a miss of rank ``r`` among its batch's misses of one set takes the way of the
``r``-th lowest score among the set's ways, a held way never, and is admitted where the set has
more than ``r`` unheld ways. A program reads the sets of a few misses (taken in the order that
groups them by set, so that the programs past the misses return at once) and ranks each set's
ways by comparing them pairwise (score, then way: the order of a stable sort).

Written by hand because no library finds ids or chooses victims in a set-associative cache
for torch tensors (FBGEMM's ``lru_cache_populate`` is CUDA code of its own build).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_hotcache.kernels.triton_tbe import tl, triton

# Ids a program finds, and misses a program ranks the sets of.
_IDS_PER_PROGRAM = 8
_MISSES_PER_PROGRAM = 8


if triton is not None:

    @triton.jit
    def _find_in_sets_kernel(cell_ids, ids, looked_up, sets, hit_out, cell_out, n, ways, IDS: tl.constexpr, WAYS: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * IDS + tl.arange(0, IDS)
        look = tl.load(looked_up + i, mask=i < n, other=0) != 0
        if tl.max(look.to(tl.int32), 0) == 0:  # none of these ids is looked up
            return
        way = tl.arange(0, WAYS)
        cell = tl.load(sets + i, mask=look, other=0)[:, None] * ways + way[None, :]
        there = look[:, None] & (way[None, :] < ways)
        match = there & (tl.load(cell_ids + cell, mask=there, other=-1) == tl.load(ids + i, mask=look, other=0)[:, None])
        hit = tl.max(match.to(tl.int32), axis=1) > 0
        tl.store(hit_out + i, hit, mask=look & hit)
        tl.store(cell_out + i, tl.sum(tl.where(match, cell, 0), axis=1), mask=look & hit)

    @triton.jit
    def _victim_ways_kernel(
        cell_ids, scores, holders, next_reads, sets, ranks, misses, order, ways_out, admitted_out, n, ways,
        held, window_top, no_read,
        LOOKAHEAD: tl.constexpr, MISSES: tl.constexpr, WAYS: tl.constexpr,
    ):  # fmt: skip
        j = tl.program_id(0).to(tl.int64) * MISSES + tl.arange(0, MISSES)
        i = tl.load(order + j, mask=j < n, other=0)
        miss = tl.load(misses + i, mask=j < n, other=0) != 0
        if tl.max(miss.to(tl.int32), 0) == 0:  # the misses come first in ``order``: past them, nothing to do
            return
        rank = tl.load(ranks + i, mask=miss, other=0)
        way = tl.arange(0, WAYS)
        cell = tl.load(sets + i, mask=miss, other=0)[:, None] * ways + way[None, :]
        there = miss[:, None] & (way[None, :] < ways)
        held_ids = tl.load(cell_ids + cell, mask=there, other=-1)
        score = tl.where(held_ids < 0, -1, tl.load(scores + cell, mask=there, other=0))
        if LOOKAHEAD:  # a row an announced batch reads goes after the others, farthest read first
            ahead = tl.load(next_reads + cell, mask=there, other=no_read)
            score = tl.where((held_ids >= 0) & (ahead != no_read), window_top - ahead, score)
        taken = (tl.load(holders + cell, mask=there, other=0) > 0) | ~there  # ways past the set's too
        score = tl.where(taken, held, score)
        free = tl.sum(tl.where(score < held, 1, 0), axis=1)
        # Each way's place in its set's order: the ways of lower score, or of equal score and lower index, before it.
        mine, other = score[:, :, None], score[:, None, :]
        before = (other < mine) | ((other == mine) & (way[None, None, :] < way[None, :, None]))
        place = tl.sum(tl.where(before, 1, 0), axis=2)
        wanted = tl.minimum(rank, ways - 1)[:, None]
        chosen = tl.sum(tl.where(place == wanted, way[None, :], 0), axis=1)
        tl.store(ways_out + i, chosen.to(tl.int64), mask=miss)
        tl.store(admitted_out + i, rank < free, mask=miss)


def find_in_sets(cell_ids: Tensor, ids: Tensor, looked_up: Tensor, sets: Tensor, ways: int, trash: int) -> tuple[Tensor, Tensor]:
    """Whether each of ``ids`` (those ``looked_up``; each with its set) is held by a way of its
    set, ``cell_ids`` holding each cell's id, and its cell (``trash`` where not)."""
    n = ids.numel()
    hit = torch.zeros(n, dtype=torch.bool, device=ids.device)
    cell = torch.full((n,), trash, dtype=torch.int64, device=ids.device)
    if n:
        _find_in_sets_kernel[(triton.cdiv(n, _IDS_PER_PROGRAM),)](
            cell_ids, ids, looked_up, sets, hit, cell, n, ways, IDS=_IDS_PER_PROGRAM, WAYS=_ways_block(ways)
        )
    return hit, cell


def _ways_block(ways: int) -> int:
    return max(2, triton.next_power_of_2(ways))


def victim_ways(
    cell_ids: Tensor,
    scores: Tensor,
    holders: Tensor,
    next_reads: Tensor | None,
    sets: Tensor,
    ranks: Tensor,
    misses: Tensor,
    order: Tensor,
    ways: int,
    held: int,
    window_top: int,
    no_read: int,
) -> tuple[Tensor, Tensor]:
    """For each id (``sets``, ``ranks`` and ``misses`` one an id, on the device): the way of its
    set it takes and whether it is admitted (only for misses; 0 and False elsewhere). ``order``
    lists the ids with the misses first (a set's misses side by side, which then share the
    loads of their set). A way's score is ``scores[cell]``, -1 where ``cell_ids[cell] < 0`` (empty); with ``next_reads``
    ``window_top - next_reads[cell]`` where that is not ``no_read``; ``held`` where its
    ``holders`` are above 0."""
    n = sets.numel()
    way = torch.zeros(n, dtype=torch.int64, device=sets.device)
    admitted = torch.zeros(n, dtype=torch.bool, device=sets.device)
    if n == 0:
        return way, admitted
    _victim_ways_kernel[(triton.cdiv(n, _MISSES_PER_PROGRAM),)](
        cell_ids, scores, holders, next_reads if next_reads is not None else scores, sets, ranks, misses, order, way, admitted,
        n, ways, held, window_top, no_read,
        LOOKAHEAD=next_reads is not None, MISSES=_MISSES_PER_PROGRAM, WAYS=_ways_block(ways),
    )  # fmt: skip
    return way, admitted
