"""Micro-benchmark: one embedding training step (lookup, backward, row-wise update).

Compares, in one run on the same batches, HotColdEmbeddingBagCollection at several device
budgets with two baselines:

* ``fused``: torchrec's FusedEmbeddingBagCollection (FBGEMM's fused CPU kernel: forward,
  backward and the optimizer in one op), the fastest thing TorchRec offers on CPU;
* ``plain``: torchrec's EmbeddingBagCollection with sparse gradients and our
  RowWiseOptimizer, the module called;
* ``plain-one-node``: the same tables looked up as the zoo's models do under ``auto``/``ddp``
  (`pooled_in_one_node`: one autograd node for the collection);
* ``plain-stacked``: a copy of them laid out as the zoo's models lay them out (one stack of
  rows, `lightning_hotcache.optim.stacked_tables`), looked up the same way, the gradient rows handed
  to the optimizer as one piece as a fit's zoo model hands them (no ``.grad`` per table).

Data: SyntheticCTRDataModule (26 Criteo-shaped Zipf features). Stats for the planner come
from batches *before* the timed ones. Prints a table and JSON; writes
benchmarks/results/cache_micro.json.

    python benchmarks/cache_micro.py [--scale 0.05] [--batch-size 2048] [--steps 40] [--optimizer rowwise_adagrad]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from clock import rss_bytes
from report import write_report
from torchrec import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

from datamodules import SyntheticCTRDataModule
from lightning_hotcache import HotColdEmbeddingBagCollection, HotColdPlanner, RowWiseOptimizer, RowWiseOptimizerConfig
from lightning_hotcache.embedding.torchrec_lookup import pooled_in_one_node
from lightning_hotcache.planner.profiling import profile_batches
from lightning_hotcache.optim.rowwise import use_sparse_gradients
from lightning_hotcache.optim.stacked_tables import stack_tables

RESULTS = Path(__file__).parent / "results"


def time_interleaved(steps: dict[str, Callable[[int], None]], num_steps: int, warmup: int) -> dict[str, float]:
    """Median seconds per step of each path. Paths take turns step by step, so drift in the
    machine's speed (other load, page cache) hits them all alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(num_steps):
        for name, step in steps.items():
            start = time.perf_counter()
            step(i)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.2, help="Criteo Kaggle cardinalities x scale")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile-batches", type=int, default=50)
    parser.add_argument("--budgets", type=float, nargs="*", default=[1.0, 0.1, 0.01],
                        help="hotcache's device budgets (none: the baselines alone)")
    parser.add_argument("--prefetch-depth", type=int, default=1)
    parser.add_argument("--optimizer", choices=["sgd", "rowwise_adagrad"], default="sgd",
                        help="the row-wise rule of every path (cpu_throughput trains row-wise Adagrad)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cache_micro.json")
    args = parser.parse_args()

    dm = SyntheticCTRDataModule(scale=args.scale, embedding_dim=args.dim, batch_size=args.batch_size,
                                num_train_samples=args.batch_size * (args.profile_batches + args.steps))  # fmt: skip
    source = dm.source("train")
    bs = args.batch_size
    profile = [source.batch(i * bs, (i + 1) * bs) for i in range(args.profile_batches)]
    timed = [source.batch(i * bs, (i + 1) * bs).sparse_features for i in range(args.profile_batches, args.profile_batches + args.steps)]
    width = args.dim * len(dm.tables)
    grads = [torch.randn(bs, width, generator=torch.Generator().manual_seed(i)) / bs for i in range(args.steps)]
    config = RowWiseOptimizerConfig(name=args.optimizer, lr=0.05)
    stats = profile_batches(profile, dm.tables, progress=False)
    rows = sum(t.num_embeddings for t in dm.tables)

    steps: dict[str, Callable[[int], None]] = {}
    fused_rule = {"sgd": (torch.optim.SGD, {"lr": config.lr}), "rowwise_adagrad": (RowWiseAdagrad, {"lr": config.lr, "eps": config.eps})}
    rule, kwargs = fused_rule[args.optimizer]
    fused = FusedEmbeddingBagCollection(tables=dm.tables, optimizer_type=rule, optimizer_kwargs=kwargs, device=torch.device("cpu"))
    steps["fused"] = lambda i: fused(timed[i]).values().backward(grads[i])

    plain = EmbeddingBagCollection(tables=dm.tables)
    plain_opt = RowWiseOptimizer(use_sparse_gradients(plain), config)

    def plain_step(i: int) -> None:
        plain(timed[i]).values().backward(grads[i])
        plain_opt.step()

    steps["plain"] = plain_step
    # The same tables and optimizer as `plain`, stepped in turn. With tables of its own, allocated
    # after plain's, this path ran 0.84-0.94x plain in six runs, and plain 0.95x it with the two
    # swapped: where the pages of 26 tables (430 MB, rows read at random) landed decided.
    def one_node_step(i: int) -> None:
        pooled = pooled_in_one_node(plain, timed[i])
        assert pooled is not None, "the synthetic batches are the zoo's: the one-node path applies"
        pooled.backward(grads[i])
        plain_opt.step()

    steps["plain-one-node"] = one_node_step
    # The zoo's tables as they are: one stack of rows (`stack_tables`), so one `embedding_bag`
    # for every feature and one gather and write of the rows. Its own copy of the tables (two
    # layouts cannot share memory), so where their pages landed counts too (see above).
    stacked = copy.deepcopy(plain)
    stack_tables(stacked)
    stacked_opt = RowWiseOptimizer(list(stacked.parameters()), config)

    def stacked_step(i: int) -> None:
        pooled_in_one_node(stacked, timed[i], stacked_opt.add_row_gradients).backward(grads[i])
        stacked_opt.step()

    steps["plain-stacked"] = stacked_step

    # Memory each hotcache module added when built (its device tier and host store; this
    # CPU's "device" is host memory too, so RSS counts both).
    modules, plans, rss_after_build = {}, {}, {}
    for budget in args.budgets:
        name = f"hotcache@{budget:g}"
        # Planned as the strategy plans (its batches in flight); a budget below that minimum
        # grows to it, and the table shows the budget used.
        planner = HotColdPlanner(budget, config, prefetch_depth=args.prefetch_depth, cache_policy="lfu", grow_budget_to_minimum=True)
        plans[name] = planner.plan(dm.tables, stats)
        before = rss_bytes()
        modules[name] = HotColdEmbeddingBagCollection.from_ebc(plain, plans[name], config, cache_policy="lfu")
        rss_after_build[name] = rss_bytes() - before

        def hot_step(i: int, module: HotColdEmbeddingBagCollection = modules[name]) -> None:
            # Keep `prefetch_depth` batches staged ahead, as the strategy's prefetcher does.
            ahead = range(i, min(len(timed), i + 1 + args.prefetch_depth)) if i == 0 else [i + args.prefetch_depth]
            for j in ahead:
                if j < len(timed):
                    module.prefetch(timed[j])
            module(timed[i]).values().backward(grads[i])

        steps[name] = hot_step

    medians = time_interleaved(steps, len(timed), args.warmup)
    results: dict[str, dict[str, float]] = {name: {"step_ms": 1e3 * t} for name, t in medians.items()}
    for name, module in modules.items():
        counters = [c.counters for c in module.caches.values()]
        lookups = sum(c.lookups for c in counters)
        results[name].update(
            hit_rate=sum(c.hits for c in counters) / lookups,
            expected_hit_rate=sum(t.expected_hit_rate * stats.num_lookups[t.name] for t in plans[name].tables)
            / sum(stats.num_lookups.values()),
            fetched_rows_per_step=sum(c.fetched_rows for c in counters) / len(timed),
            device_mib=plans[name].device_bytes / 2**20,
            measured_device_mib=module.device_bytes() / 2**20,
            budget_mib=plans[name].budget_bytes / 2**20,
            rss_mib=rss_after_build[name] / 2**20,
        )

    for name, r in results.items():
        r["speed_vs_fused"] = results["fused"]["step_ms"] / r["step_ms"]
        r["speed_vs_plain"] = results["plain"]["step_ms"] / r["step_ms"]

    print(f"{'path':<16}{'ms/step':>10}{'x fused':>9}{'x plain':>9}{'hit rate':>10}{'fetched/step':>14}{'device MiB (budget)':>22}")
    for name, r in results.items():
        hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else "-"
        fetched = f"{r['fetched_rows_per_step']:.0f}" if "fetched_rows_per_step" in r else "-"
        device = f"{r['measured_device_mib']:.1f} ({r['budget_mib']:.1f})" if "budget_mib" in r else "-"
        print(
            f"{name:<16}{r['step_ms']:>10.2f}{r['speed_vs_fused']:>9.2f}{r['speed_vs_plain']:>9.2f}{hit:>10}{fetched:>14}"
            f"{device:>22}"
        )
    write_report("cache_micro", args, results, rows=rows, tables=len(dm.tables), optimizer=args.optimizer, policy="lfu")

if __name__ == "__main__":
    main()
