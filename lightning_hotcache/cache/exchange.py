"""Rows across data-parallel ranks: who owns which row, and the collectives that move rows.

Host stores are sharded round-robin: row ``i`` lives in the host store of rank
``i % world`` at local index ``i // world``, and that rank (its owner) is the only one that
updates it. Every rank runs the same sequence of collectives, each covering all tables so
that its cost does not grow with the number of tables: per forward the ids of the other
ranks' rows a batch reads go to their owners (`route_to_owners`) and their current rows come
back (`fetch_rows`); per backward the gradient rows of those rows go back along the same route
(`send_rows_along`), while the rest of the step goes on. That holds because ranks forward and
train the same number of batches.

Written on torch.distributed directly (all_to_all_single, all_gather): TorchRec's
collectives move pooled embeddings between table shards, not raw rows and gradient rows
between caches and their owners.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from lightning_hotcache.distributed import collectives
from lightning_hotcache._ops.sorting import group_by_owner


@dataclass(frozen=True)
class RowSharding:
    """This rank's place among ``world`` ranks sharing tables through ``group``."""

    rank: int = 0
    world: int = 1
    group: Any = None

    def owned(self, ids: Tensor) -> Tensor:
        return ids % self.world == self.rank

    def local(self, ids: Tensor) -> Tensor:
        return ids if self.world == 1 else ids // self.world  # one process: no op (no GIL hand-over on a staging thread)

    def num_local(self, num_embeddings: int) -> int:
        return len(range(self.rank, num_embeddings, self.world))


@dataclass(frozen=True)
class RoundRobinRows:
    """A whole array as ``len(pieces)`` ranks held it: piece ``s`` is rows ``s, s + S, s + 2S,
    ...`` of the array (``S`` pieces), as a sharded checkpoint's shard files keep a split table.
    Loaded piece by piece (`DeviceCache.load_full`), so that a table larger than memory never
    has to be whole in it; `whole` interleaves them into one tensor."""

    pieces: tuple[Tensor, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(len(piece) for piece in self.pieces), self.pieces[0].shape[1]

    def whole(self) -> Tensor:
        saved = len(self.pieces)
        full = torch.empty(self.shape, dtype=self.pieces[0].dtype)
        for s, piece in enumerate(self.pieces):
            full[s::saved] = piece
        return full


@dataclass(frozen=True)
class Routed:
    """Ids of several tables after one all-to-all to their owners (see `route_to_owners`): what
    a later exchange along the same route (`send_rows_along`) needs instead of the ids again."""

    orders: list[Tensor]  # per table: the permutation that groups its ids by owner
    sent: list[list[int]]  # [dst][table]: ids this rank sent
    received: list[list[int]]  # [src][table]: ids this rank got
    ids: list[Tensor]  # per table: the ids this rank got, in source-rank order


def route_to_owners(ids_of: Sequence[Tensor], sharding: RowSharding) -> Routed:
    """Send each table's ids to their owners: two all-to-alls (counts, then ids)."""
    world, group, tables = sharding.world, sharding.group, range(len(ids_of))
    device = ids_of[0].device
    owners = [ids % world for ids in ids_of]
    orders = [group_by_owner(owner, world) for owner in owners]
    counts = torch.stack([torch.bincount(owner, minlength=world) for owner in owners], dim=1)  # (dst, table)
    recv_counts = torch.empty_like(counts)  # (src, table)
    collectives.all_to_all_single(recv_counts, counts, group=group)
    sent, received = counts.tolist(), recv_counts.tolist()
    # Ids travel grouped by destination rank, then by table.
    by_owner = [ids[order].split(counts[:, t].tolist()) for t, (ids, order) in enumerate(zip(ids_of, orders))]
    send_ids = torch.cat([by_owner[t][dst] for dst in range(world) for t in tables])
    got = torch.empty(int(recv_counts.sum()), dtype=send_ids.dtype, device=device)
    collectives.all_to_all_single(got, send_ids, list(map(sum, received)), list(map(sum, sent)), group=group)
    parts = got.split([received[src][t] for src in range(world) for t in tables])
    return Routed(orders, sent, received, [torch.cat(parts[t :: len(tables)]) for t in tables])


class RowsInFlight:
    """An all-to-all of float rows still running (see `send_rows_along`); `wait` gives the rows."""

    def __init__(self, work: Any, sent: Tensor, got: Tensor, sizes: list[int], widths: Sequence[int]) -> None:
        self._work, self._got, self._sizes, self._widths = work, got, sizes, widths
        self._sent = sent  # kept alive until the collective is done

    def wait(self) -> list[Tensor]:
        """Per table the rows got, grouped by source rank."""
        if self._work is not None:
            self._work.wait()
        pieces = self._got.split(self._sizes)
        return [torch.cat(pieces[t :: len(self._widths)]).view(-1, w) for t, w in enumerate(self._widths)]


def _all_to_all_floats(
    rows: Sequence[Tensor],
    send_counts: list[list[int]],
    recv_counts: list[list[int]],
    widths: Sequence[int],
    group: Any,
    async_op: bool = False,
) -> RowsInFlight:
    """One all-to-all of float rows: ``rows[t]`` holds, grouped by destination rank,
    ``send_counts[dst][t]`` rows of width ``widths[t]``; gives per table the rows got,
    grouped by source rank (``recv_counts[src][t]`` each)."""
    world, tables = len(send_counts), range(len(rows))
    by_dst = [r.reshape(-1).split([send_counts[dst][t] * widths[t] for dst in range(world)]) for t, r in enumerate(rows)]
    send = torch.cat([by_dst[t][dst] for dst in range(world) for t in tables])
    floats_out = [sum(send_counts[dst][t] * widths[t] for t in tables) for dst in range(world)]
    floats_in = [sum(recv_counts[src][t] * widths[t] for t in tables) for src in range(world)]
    got = torch.empty(sum(floats_in), dtype=torch.float32, device=send.device)
    work = collectives.all_to_all_single(got, send, floats_in, floats_out, group=group, async_op=async_op)
    sizes = [recv_counts[src][t] * widths[t] for src in range(world) for t in tables]
    return RowsInFlight(work, send, got, sizes, widths)


def fetch_rows(
    routed: Routed, serves: Sequence[Callable[[Tensor], Tensor]], widths: Sequence[int], sharding: RowSharding
) -> list[Tensor]:
    """Rows of several tables from their owners, for requests routed by `route_to_owners`, in
    one collective however many tables. ``serves[t]`` answers a request for rows of table ``t``
    this rank owns with ``(n, widths[t])`` floats. Returns the rows of each table's request in
    request order. Every rank must call it with the same tables, with or without ids."""
    answers = [serves[t](asked).to(asked.device, torch.float32) for t, asked in enumerate(routed.ids)]
    # The answers go back the way the requests came: the counts swap roles.
    rows = _all_to_all_floats(answers, routed.received, routed.sent, widths, sharding.group).wait()
    out = []
    for got, order in zip(rows, routed.orders):
        unsorted = torch.empty_like(got)
        unsorted[order] = got
        out.append(unsorted)
    return out


def send_rows_along(routed: Routed, rows: Sequence[Tensor], sharding: RowSharding) -> RowsInFlight:
    """Rows for the ids of a routed request (``rows[t]`` in the order of the ids routed for
    table ``t``) to those ids' owners, in one collective (the ids went there already), left
    running: its `RowsInFlight.wait` gives per table the rows this rank got, in the order of
    ``routed.ids[t]``."""
    ordered = [r[order] for r, order in zip(rows, routed.orders)]
    return _all_to_all_floats(ordered, routed.sent, routed.received, [r.shape[1] for r in rows], sharding.group, async_op=True)


def gather_table(local: Tensor, num_embeddings: int, sharding: RowSharding) -> Tensor:
    """The whole table from every rank's round-robin shard (on every rank, on the CPU)."""
    width = local.shape[1]
    longest = len(range(0, num_embeddings, sharding.world))  # rank 0's shard is the largest
    padded = torch.zeros(longest, width, dtype=local.dtype)
    padded[: len(local)] = local
    parts = [torch.empty_like(padded) for _ in range(sharding.world)]
    collectives.all_gather(parts, padded, group=sharding.group)
    return RoundRobinRows(tuple(part[: len(range(rank, num_embeddings, sharding.world))] for rank, part in enumerate(parts))).whole()
