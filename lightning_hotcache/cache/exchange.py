"""Rows across data-parallel ranks: who owns which row, and the collectives that move rows.

Host stores are sharded round-robin: row ``i`` lives in the host store of rank
``i % world`` at local index ``i // world``. Every rank runs the same sequence of
collectives (one exchange of missing rows per staged batch, one gather of gradient rows per
backward, each covering all tables, so their cost does not grow with the number of tables),
which holds because ranks stage and train the same number of batches.

Written on torch.distributed directly (all_to_all_single, all_gather): TorchRec's
collectives move pooled embeddings between table shards, not raw rows and optimizer state
between caches and host stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class RowSharding:
    """This rank's place among ``world`` ranks sharing tables through ``group``."""

    rank: int = 0
    world: int = 1
    group: Any = None

    def owned(self, ids: Tensor) -> Tensor:
        return ids % self.world == self.rank

    def local(self, ids: Tensor) -> Tensor:
        return ids // self.world

    def num_local(self, num_embeddings: int) -> int:
        return len(range(self.rank, num_embeddings, self.world))


def exchange_table_rows(
    requests: Sequence[Tensor], serves: Sequence[Callable[[Tensor], Tensor]], widths: Sequence[int], sharding: RowSharding
) -> list[Tensor]:
    """Rows of several tables from their owners, in three collectives however many tables.

    ``requests[t]``: ids of table ``t`` this rank wants; ``serves[t]`` answers a request for
    rows of table ``t`` this rank owns with ``(n, widths[t])`` floats. Returns the rows of
    ``requests[t]`` in request order. Every rank must call it with the same tables, with or
    without ids."""
    world, group, tables = sharding.world, sharding.group, range(len(requests))
    device = requests[0].device
    orders = [torch.argsort(ids % world, stable=True) for ids in requests]
    counts = torch.stack([torch.bincount(ids % world, minlength=world) for ids in requests], dim=1)  # (dst, table)
    recv_counts = torch.empty_like(counts)  # (src, table)
    dist.all_to_all_single(recv_counts, counts, group=group)
    sent, received = counts.tolist(), recv_counts.tolist()
    # Requests travel grouped by destination rank, then by table.
    by_owner = [ids[order].split(counts[:, t].tolist()) for t, (ids, order) in enumerate(zip(requests, orders))]
    send_ids = torch.cat([by_owner[t][dst] for dst in range(world) for t in tables])
    asked = torch.empty(int(recv_counts.sum()), dtype=send_ids.dtype, device=device)
    dist.all_to_all_single(asked, send_ids, list(map(sum, received)), list(map(sum, sent)), group=group)
    asked_parts = asked.split([received[src][t] for src in range(world) for t in tables])
    answers = []
    for t in tables:
        asked_t = torch.cat([asked_parts[src * len(tables) + t] for src in range(world)])
        answered = serves[t](asked_t).to(device, torch.float32)
        answers.append(answered.split([received[src][t] for src in range(world)]))
    send_rows = torch.cat([answers[t][src].reshape(-1) for src in range(world) for t in tables])
    floats_back = [sum(received[src][t] * widths[t] for t in tables) for src in range(world)]
    floats_in = [sum(sent[dst][t] * widths[t] for t in tables) for dst in range(world)]
    got = torch.empty(sum(floats_in), dtype=torch.float32, device=device)
    dist.all_to_all_single(got, send_rows, floats_in, floats_back, group=group)
    pieces = got.split([sent[dst][t] * widths[t] for dst in range(world) for t in tables])
    out = []
    for t, order in enumerate(orders):
        rows = torch.cat([pieces[dst * len(tables) + t].view(-1, widths[t]) for dst in range(world)])
        unsorted = torch.empty_like(rows)
        unsorted[order] = rows
        out.append(unsorted)
    return out


def all_gather_table_rows(parts: Sequence[tuple[Tensor, Tensor]], group: Any) -> list[tuple[Tensor, Tensor]]:
    """Every rank's ``(ids, rows)`` of each table, concatenated in rank order (sizes differ by
    rank), in three collectives however many tables there are. ``parts[t]`` is this rank's
    ids and float32 rows ``(n_t, width_t)`` of table ``t``; every rank passes the same tables
    in the same order."""
    world = dist.get_world_size(group)
    device = parts[0][0].device
    widths = [rows.shape[1] for _, rows in parts]
    counts = torch.tensor([len(ids) for ids, _ in parts], device=device)
    gathered_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(gathered_counts, counts, group=group)
    counts_of = [c.tolist() for c in gathered_counts]
    floats_of = [[n * w for n, w in zip(c, widths)] for c in counts_of]
    ids = torch.cat([ids for ids, _ in parts]).to(torch.int64)
    floats = torch.cat([rows.reshape(-1).to(torch.float32) for _, rows in parts])
    gathered_ids = _all_gather_padded(ids, max(map(sum, counts_of)), group)
    gathered_floats = _all_gather_padded(floats, max(map(sum, floats_of)), group)
    out_ids: list[list[Tensor]] = [[] for _ in parts]
    out_rows: list[list[Tensor]] = [[] for _ in parts]
    for rank in range(world):
        rank_ids = gathered_ids[rank][: sum(counts_of[rank])].split(counts_of[rank])
        rank_floats = gathered_floats[rank][: sum(floats_of[rank])].split(floats_of[rank])
        for t, width in enumerate(widths):
            out_ids[t].append(rank_ids[t])
            out_rows[t].append(rank_floats[t].view(-1, width))
    return [(torch.cat(i), torch.cat(r)) for i, r in zip(out_ids, out_rows)]


def _all_gather_padded(values: Tensor, longest: int, group: Any) -> list[Tensor]:
    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)
    padded[: len(values)] = values
    gathered = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, padded, group=group)
    return gathered


def gather_table(local: Tensor, num_embeddings: int, sharding: RowSharding) -> Tensor:
    """The whole table from every rank's round-robin shard (on every rank, on the CPU)."""
    width = local.shape[1]
    longest = len(range(0, num_embeddings, sharding.world))  # rank 0's shard is the largest
    padded = torch.zeros(longest, width, dtype=local.dtype)
    padded[: len(local)] = local
    parts = [torch.empty_like(padded) for _ in range(sharding.world)]
    dist.all_gather(parts, padded, group=sharding.group)
    full = torch.empty(num_embeddings, width, dtype=local.dtype)
    for rank, part in enumerate(parts):
        n = len(range(rank, num_embeddings, sharding.world))
        full[rank :: sharding.world] = part[:n]
    return full
