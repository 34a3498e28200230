"""Rows across data-parallel ranks: who owns which row, and the collectives that move rows.

Host stores are sharded round-robin: row ``i`` lives in the host store of rank
``i % world`` at local index ``i // world``. Every rank runs the same sequence of
collectives (one exchange per table per staged batch, one gather per table per backward),
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


def exchange_rows(ids: Tensor, serve: Callable[[Tensor], Tensor], width: int, sharding: RowSharding) -> Tensor:
    """Rows (``width`` floats each) of ``ids`` from their owners; ``serve`` answers the
    requests for rows this rank owns. Every rank must call it, with or without ids."""
    owner = ids % sharding.world
    order = torch.argsort(owner, stable=True)
    requested = ids[order]
    send_counts = torch.bincount(owner, minlength=sharding.world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=sharding.group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    asked = torch.empty(sum(recv), dtype=ids.dtype, device=ids.device)
    dist.all_to_all_single(asked, requested, recv, send, group=sharding.group)
    answered = serve(asked).to(ids.device, torch.float32)
    rows = torch.empty(len(ids), width, dtype=torch.float32, device=ids.device)
    dist.all_to_all_single(rows, answered.contiguous(), send, recv, group=sharding.group)
    out = torch.empty_like(rows)
    out[order] = rows
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
