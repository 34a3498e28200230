"""Every rank must run as many batches: the strategies' forwards are collectives.

Under ``hotcache`` a forward fetches other ranks' rows from their owners, and under
``torchrec`` a sharded lookup is an all-to-all, so a rank with one batch fewer leaves the
others waiting in a collective forever. Lightning evens the ranks out for training and
validation (its DistributedSampler pads with repeated samples), but not for prediction
(``trainer.predict`` splits the samples without repeats) nor for a user's own sampler. The
project's datamodules split each global batch across the ranks (`BatchShare`), always alike.
Padding a user's loader ourselves would add predictions Lightning then returns, so an uneven
loader is refused before its first batch, on every rank at once, with what to do instead.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_hotcache.distributed import collectives


def check_even_batches(dataloader: Any, world_size: int, strategy_name: str) -> None:
    """Raise on every rank when the ranks' ``dataloader`` do not have as many batches (a
    collective: every rank calls it for the same loader). Loaders without a length pass."""
    if world_size == 1:
        return
    try:
        count = len(dataloader)
    except TypeError:
        count = -1
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    collectives.all_gather(counts, torch.tensor([count]))
    found = [int(c) for c in counts]
    if -1 in found or len(set(found)) == 1:
        return
    per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(found))
    raise RuntimeError(
        f"The ranks' dataloaders have different numbers of batches ({per_rank}). Under strategy="
        f"{strategy_name!r} every forward is a collective across the ranks (embedding rows are exchanged), so "
        "the ranks must run as many batches or the longer ones wait forever. Give every rank as many batches: a "
        "sampler that pads the last round (torch's DistributedSampler with drop_last=False, and "
        "Trainer(use_distributed_sampler=False)), drop_last=True, a datamodule of the zoo (its global batches are "
        "split across the ranks alike), or predict in one process."
    )
