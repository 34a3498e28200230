"""Micro-benchmark: one embedding training step (lookup, backward, row-wise update).

Compares, in one run on the same batches, HotColdEmbeddingBagCollection at several device
budgets with two baselines:

* ``fused``: torchrec's FusedEmbeddingBagCollection (FBGEMM's fused CPU kernel: forward,
  backward and the optimizer in one op), the fastest thing TorchRec offers on CPU;
* ``plain``: torchrec's EmbeddingBagCollection with sparse gradients and our
  RowWiseOptimizer (the ``auto``/``ddp`` path of the zoo models).

Data: SyntheticCTRDataModule (26 Criteo-shaped Zipf features). Stats for the planner come
from batches *before* the timed ones. Prints a table and JSON; writes
benchmarks/results/cache_micro.json.

    python benchmarks/cache_micro.py [--scale 0.05] [--batch-size 2048] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch
import torchrec
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

from datamodules import SyntheticCTRDataModule
from lightning_hotcache import HotColdEmbeddingBagCollection, HotColdPlanner, RowWiseOptimizer, RowWiseOptimizerConfig
from lightning_hotcache.profiling import profile_batches
from lightning_hotcache.rowwise import use_sparse_gradients

RESULTS = Path(__file__).parent / "results"


def machine() -> dict[str, object]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrec": torchrec.__version__ if hasattr(torchrec, "__version__") else "1.8.0",
        "commit": commit,
    }


def time_steps(step: Callable[[KeyedJaggedTensor, torch.Tensor], None], batches, grads, warmup: int) -> float:
    """Median seconds per step after ``warmup`` steps."""
    times = []
    for i, (kjt, grad) in enumerate(zip(batches, grads)):
        start = time.perf_counter()
        step(kjt, grad)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.05, help="Criteo Kaggle cardinalities x scale")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile-batches", type=int, default=50)
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.1, 0.01])
    parser.add_argument("--prefetch-depth", type=int, default=1)
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
    config = RowWiseOptimizerConfig(name="sgd", lr=0.05)
    stats = profile_batches(profile, dm.tables, progress=False)
    rows = sum(t.num_embeddings for t in dm.tables)

    results: dict[str, dict[str, float]] = {}

    fused = FusedEmbeddingBagCollection(tables=dm.tables, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.05}, device=torch.device("cpu"))

    def fused_step(kjt, grad):
        fused(kjt).values().backward(grad)

    results["fused"] = {"step_ms": 1e3 * time_steps(fused_step, timed, grads, args.warmup)}
    del fused

    plain = EmbeddingBagCollection(tables=dm.tables)
    plain_opt = RowWiseOptimizer(use_sparse_gradients(plain), config)

    def plain_step(kjt, grad):
        plain(kjt).values().backward(grad)
        plain_opt.step()

    results["plain"] = {"step_ms": 1e3 * time_steps(plain_step, timed, grads, args.warmup)}

    for budget in args.budgets:
        plan = HotColdPlanner(budget, config, prefetch_depth=args.prefetch_depth, cache_policy="lfu").plan(dm.tables, stats)
        module = HotColdEmbeddingBagCollection.from_ebc(plain, plan, config, cache_policy="lfu")
        pending = list(timed)
        staged = 0

        def hot_step(kjt, grad):
            nonlocal staged
            # Keep `prefetch_depth` batches staged ahead, as the strategy's prefetcher does.
            while staged < min(len(pending), pending.index(kjt) + 1 + args.prefetch_depth):
                module.prefetch(pending[staged])
                staged += 1
            module(kjt).values().backward(grad)

        for cache in module.caches.values():
            cache.counters.reset()
        step_ms = 1e3 * time_steps(hot_step, timed, grads, args.warmup)
        lookups = sum(c.counters.lookups for c in module.caches.values())
        hits = sum(c.counters.hits for c in module.caches.values())
        fetched = sum(c.counters.fetched_rows for c in module.caches.values())
        results[f"hotcache@{budget:g}"] = {
            "step_ms": step_ms,
            "hit_rate": hits / lookups,
            "expected_hit_rate": sum(t.expected_hit_rate * stats.num_lookups[t.name] for t in plan.tables)
            / sum(stats.num_lookups.values()),
            "fetched_rows_per_step": fetched / len(timed),
            "device_mib": plan.device_bytes / 2**20,
        }
        del module

    for name, r in results.items():
        r["speed_vs_fused"] = results["fused"]["step_ms"] / r["step_ms"]
        r["speed_vs_plain"] = results["plain"]["step_ms"] / r["step_ms"]

    report = {
        "benchmark": "cache_micro",
        "machine": machine(),
        "settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows, "tables": len(dm.tables), "optimizer": "sgd", "policy": "lfu"},
        "results": results,
    }
    print(f"{'path':<16}{'ms/step':>10}{'x fused':>9}{'x plain':>9}{'hit rate':>10}{'fetched/step':>14}")
    for name, r in results.items():
        hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else "-"
        fetched = f"{r['fetched_rows_per_step']:.0f}" if "fetched_rows_per_step" in r else "-"
        print(f"{name:<16}{r['step_ms']:>10.2f}{r['speed_vs_fused']:>9.2f}{r['speed_vs_plain']:>9.2f}{hit:>10}{fetched:>14}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
