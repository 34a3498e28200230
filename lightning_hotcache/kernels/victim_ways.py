"""The device directory's choice of victims in one Triton kernel: for each missed id, the way of
its set it takes.

A miss of rank ``r`` among its batch's misses of one set takes the way of ``r``-th lowest score
among the set's ways, held ways (score `HELD`) never, and is admitted where the set has more
than ``r`` unheld ways. In torch ops that is a gather of every id's whole set (ids, scores,
holders, next reads: ``(n, ways)`` each, for every id of the batch, hit or not) and a sort of
each row; here one program reads the sets of a few misses (taken in the order that groups them
by set, so that the programs past the misses return at once), ranks each set's ways by comparing
them pairwise in registers (score, then way: the order of a stable sort), and writes the way
and whether it is admitted. Ids that did not miss read nothing.

Written by hand because no library chooses victims in a set-associative cache for torch
tensors (FBGEMM's ``lru_cache_populate`` is CUDA code of its own build).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_hotcache.kernels.triton_tbe import tl, triton

# Misses a program ranks the sets of.
_MISSES_PER_PROGRAM = 8


if triton is not None:

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
    loads of their set). A way's
    score is ``scores[cell]``, -1 where ``cell_ids[cell] < 0`` (empty); with ``next_reads``
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
        LOOKAHEAD=next_reads is not None, MISSES=_MISSES_PER_PROGRAM, WAYS=max(2, triton.next_power_of_2(ways)),
    )  # fmt: skip
    return way, admitted
