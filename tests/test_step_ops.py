"""A training step's op count does not grow with the number of tables.

Split tables of one width share one stacked cache and one device table, in one process and
across processes, so staging, lookup and update are the same few dozen tensor ops whether a
collection has 8 tables or 26 (cached one by one, 26 tables cost ~1,300 op calls a step).
Counted with a TorchDispatchMode over steady-state steps (caches already full, so that every
step evicts and fetches).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from test_exchange import _on_two_processes
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from lightning_hotcache.embedding import HotColdEmbeddingBagCollection
from lightning_hotcache.planner import HotColdPlan, TablePlan
from lightning_hotcache.rowwise import RowWiseOptimizerConfig

ROWS, DIM, BATCH, SLOTS = 2000, 8, 64, 160
# Extra ops allowed for 26 tables over 8: a handful of per-call constants, nothing per table.
SLACK = 8


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def _batches(num_tables: int, steps: int, seed: int) -> list[KeyedJaggedTensor]:
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        ids = np.minimum(rng.zipf(1.1, num_tables * BATCH * 2) - 1, ROWS - 1)
        batches.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=[f"f{k}" for k in range(num_tables)],
                values=torch.from_numpy(rng.permutation(ROWS)[ids]),
                lengths=torch.full((num_tables * BATCH,), 2, dtype=torch.int32),
            )
        )
    return batches


def _module(num_tables: int, process_group: object = None) -> HotColdEmbeddingBagCollection:
    tables = [EmbeddingBagConfig(name=f"t{k}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f{k}"]) for k in range(num_tables)]
    plans = [TablePlan(t.name, ROWS, DIM, np.arange(50), SLOTS, 0, 0.0) for t in tables]
    plan = HotColdPlan(plans, budget_bytes=1, prefetch_depth=0, cache_policy="lfu")
    torch.manual_seed(0)
    return HotColdEmbeddingBagCollection.from_ebc(
        EmbeddingBagCollection(tables=tables), plan, RowWiseOptimizerConfig("rowwise_adagrad"), process_group=process_group
    )


def _ops_per_step(num_tables: int, rank: int = 0, process_group: object = None) -> int:
    module = _module(num_tables, process_group)
    batches = _batches(num_tables, steps=10, seed=rank)
    counts = []
    for step, batch in enumerate(batches):
        counter = _CountOps()
        with counter:
            module(batch).values().sum().backward()
        if step >= 6:  # the caches are full by now: every step evicts
            counts.append(counter.count)
    assert sum(c.counters.evicted_rows for c in module.caches.values()) > 0
    return max(counts)


def test_step_ops_do_not_grow_with_tables_in_one_process() -> None:
    few, many = _ops_per_step(8), _ops_per_step(26)
    assert many - few <= SLACK, (few, many)


def _across_two_ranks(rank: int) -> None:
    few, many = _ops_per_step(8, rank, dist.group.WORLD), _ops_per_step(26, rank, dist.group.WORLD)
    assert many - few <= SLACK, (rank, few, many)


def test_step_ops_do_not_grow_with_tables_across_two_processes(tmp_path) -> None:
    _on_two_processes(_across_two_ranks, tmp_path)
