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
from typing import Any, Callable

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


def all_gather_rows(ids: Tensor, rows: Tensor, group: Any) -> tuple[Tensor, Tensor]:
    """Every rank's (ids, rows), concatenated in rank order (sizes differ by rank)."""
    world = dist.get_world_size(group)
    count = torch.tensor([ids.numel()], device=ids.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c.item()) for c in counts]
    longest = max(sizes)
    padded_ids = torch.zeros(longest, dtype=ids.dtype, device=ids.device)
    padded_rows = torch.zeros(longest, rows.shape[1], dtype=rows.dtype, device=rows.device)
    padded_ids[: ids.numel()] = ids
    padded_rows[: ids.numel()] = rows
    all_ids = [torch.empty_like(padded_ids) for _ in range(world)]
    all_rows = [torch.empty_like(padded_rows) for _ in range(world)]
    dist.all_gather(all_ids, padded_ids, group=group)
    dist.all_gather(all_rows, padded_rows, group=group)
    return torch.cat([a[:k] for a, k in zip(all_ids, sizes)]), torch.cat([r[:k] for r, k in zip(all_rows, sizes)])


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
