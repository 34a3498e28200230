"""Bytes each rank sends and receives per training step from 1 to 1024 ranks, for DLRM at
the Criteo Kaggle cardinalities: the communication model of `lightning_hotcache.planner.traffic`
(designs and formulas there) on the synthetic data's exact access law, a table, JSON and a
plot; ``--validate`` compares the model with loopback bytes measured for 2 and 4 gloo
processes (benchmarks/scaling.py's jobs, each in its own network namespace so that no other
process's loopback traffic is counted; needs ``unshare``). It also reports how far the
profile-based estimate (what `hotcache plan --world-size N` uses) is from the exact law.

    python benchmarks/scaling_model.py [--scale 1.0] [--dim 128] [--batch-size 8192] [--budget 0.1] [--validate]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from lightning_hotcache.planner.traffic import (
    TableLoad,
    Workload,
    hotcache,
    model_table,
    torchrec_table_wise,
    workload_from_stats,
)

if TYPE_CHECKING:
    from datamodules import SyntheticCTRDataModule
    from lightning_hotcache import AccessStats, HotColdPlan

RESULTS = Path(__file__).parent / "results"
WORLD_SIZES = tuple(2**k for k in range(11))  # 1, 2, 4, ..., 1024


# ----------------------------------------------------------------------------- benchmark
def zipf_rank_probabilities(rows: int, exponent: float) -> np.ndarray:
    """P(rank = r), r < rows, of `datamodules.synthetic.zipf_ranks`: rank ``floor(x) - 1`` for
    ``x`` on ``[1, rows + 1)`` with CDF ``F(x) = expm1(s ln x) / expm1(s ln(rows + 1))``, s = 1 - exponent."""
    edges = np.arange(1, rows + 2, dtype=np.float64)  # rank r is x in [r + 1, r + 2)
    log_n = math.log(rows + 1.0)
    if abs(exponent - 1.0) < 1e-9:
        cdf = np.log(edges) / log_n
    else:
        s = 1.0 - exponent
        cdf = np.expm1(s * np.log(edges)) / math.expm1(s * log_n)
    return np.diff(cdf)


def synthetic_workload(
    dm: SyntheticCTRDataModule, plan: HotColdPlan, state_width: int, dense_params: int, bins: int = 4096
) -> Workload:
    """The exact access law of `SyntheticCTRDataModule` (Zipf ranks scattered over ids by a
    bijection), rows grouped by ``bins`` geometric rank ranges (probabilities within a group
    differ by under 1% at 10M rows) and by the plan's static flag."""
    g = dm.generator
    tables = []
    for f, config in enumerate(dm.tables):
        n = int(g.rows[f])
        probability = zipf_rank_probabilities(n, g.zipf_exponent)
        static = np.zeros(n, dtype=bool)
        static_ids = plan.table(config.name).static_ids.astype(np.int64)
        # id = (mult * rank + offset) mod n, so rank = (id - offset) / mult mod n.
        static[(static_ids - int(g.offset[f])) * pow(int(g.mult[f]), -1, n) % n if n > 1 else static_ids] = True
        group = np.minimum((np.log1p(np.arange(n)) / math.log1p(n) * bins).astype(np.int64), bins - 1) * 2 + static
        rows = np.bincount(group, minlength=2 * bins).astype(np.float64)
        mass = np.bincount(group, weights=probability, minlength=2 * bins)
        kept = rows > 0
        tables.append(
            TableLoad(
                config.name, config.embedding_dim, len(config.feature_names), (int(g.bag_sizes[f]) + 1) / 2,
                mass[kept] / rows[kept], rows[kept], (np.arange(2 * bins) % 2 == 1)[kept],
                plan.table(config.name).cache_slots,
            )  # fmt: skip
        )
    return Workload(tuple(tables), dm.batch_size, state_width, dense_params)


def profile_and_plan(
    dm: SyntheticCTRDataModule, budget: float, world_size: int, batches: int
) -> tuple[AccessStats, HotColdPlan, int, int]:
    """What `HotCacheStrategy` does before training (as benchmarks/scaling.py configures it):
    profile the first ``batches`` training batches and plan. Returns stats, plan, optimizer
    state floats per row and the model's dense parameters."""
    from lightning_hotcache import HotColdPlanner
    from lightning_hotcache.planner.profiling import profile_batches
    from models import DLRM

    model = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                 defer_table_init=True)  # fmt: skip
    optimizer = model.embedding_optimizer_config
    dm.setup("fit")
    stats = profile_batches(dm.train_dataloader(), dm.tables, batches, progress=False)
    # The strategy's planner: prefetch depth 1, plus the batch Lightning's fetcher holds and a validation batch.
    planner = HotColdPlanner(budget, optimizer, world_size=world_size, prefetch_depth=3, cache_policy="lfu")
    state_width = sum(optimizer.state_widths(dm.tables[0].embedding_dim).values())
    return stats, planner.plan(dm.tables, stats), state_width, sum(p.numel() for p in model.dense_parameters())


def measure_loopback(strategy: str, procs: int, args: argparse.Namespace) -> float:
    """Bytes per step that all processes of one benchmarks/scaling.py job sent each other,
    read off the loopback counter of a network namespace of the job's own."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise RuntimeError("--validate needs `unshare` and `ip` (util-linux, iproute2) to count one job's bytes alone.")
    from scaling import namespace_wrapper

    job = [
        sys.executable, str(Path(__file__).with_name("scaling.py")), "--scale", str(args.validate_scale),
        "--dim", str(args.validate_dim), "--batch-size", str(args.validate_batch_size), "--steps",
        str(args.validate_steps), "--warmup", str(args.validate_warmup), "--job", f"{strategy} x{procs}",
    ]  # fmt: skip
    out = subprocess.run([*namespace_wrapper(procs, None), *job], check=True, stdout=subprocess.PIPE, text=True).stdout
    lines = out.strip().splitlines()
    if not lines:
        raise RuntimeError(f"{' '.join(job)} printed no result")
    return json.loads(lines[-1])["sent_kib_per_step"] * 1024


# benchmarks/scaling.py's strategies, the design that models each, and its device budget.
VALIDATION_JOBS = (("torchrec", torchrec_table_wise, 1.0), ("hotcache@1", hotcache, 1.0), ("hotcache@0.1", hotcache, 0.1))


def validate(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Modelled vs measured bytes per rank per step, for 2 and 4 gloo processes (measured now,
    or taken from the validation of the report ``args.measured``)."""
    from datamodules import SyntheticCTRDataModule

    earlier = None
    if args.measured is not None:
        previous = json.loads(args.measured.read_text())["results"]["validation"] or []
        earlier = {(r["strategy"], r["procs"]): r["measured_bytes_per_rank"] for r in previous}

    rows = []
    for procs in (2, 4):
        dm = SyntheticCTRDataModule(scale=args.validate_scale, embedding_dim=args.validate_dim,
                                    batch_size=args.validate_batch_size, shuffle=False)  # fmt: skip
        for strategy, design, budget in VALIDATION_JOBS:
            # scaling.py's hotcache jobs profile 20 batches; the torchrec model needs no plan.
            stats, plan, state_width, dense = profile_and_plan(dm, budget, procs, batches=20)
            w = workload_from_stats(stats, plan, args.validate_batch_size, state_width, dense)
            modelled = design(w, procs).send_bytes_per_rank
            if earlier is None:
                measured = measure_loopback(strategy, procs, args) / procs
            elif (strategy, procs) in earlier:
                measured = earlier[(strategy, procs)]
            else:
                raise ValueError(f"{args.measured} has no measurement of {strategy} x{procs}: run with --validate.")
            rows.append({"strategy": strategy, "design": design.__name__, "procs": procs, "modelled_bytes_per_rank": modelled,
                         "measured_bytes_per_rank": measured, "error": modelled / measured - 1})  # fmt: skip
            print(f"validate {strategy} x{procs}: modelled {modelled / 2**10:,.0f} KiB, "
                  f"measured {measured / 2**10:,.0f} KiB per rank per step ({modelled / measured - 1:+.1%})", flush=True)  # fmt: skip
    return rows


def estimator_check(stats_w: Workload, exact_w: Workload, world_sizes: Sequence[int]) -> dict[str, Any]:
    """How far the profile-based estimate is from the exact law: distinct rows read per step
    (all tables) by one rank and by all ranks, and each design's bytes, as ratios."""
    def union(w: Workload, n: int) -> float:
        return sum(t.expected_unique(w.lookups(t, n)) for t in w.tables)

    by_stats, exact = model_table(stats_w, world_sizes), model_table(exact_w, world_sizes)
    return {
        "unique_rows_ratio": {str(n): union(stats_w, n) / union(exact_w, n) for n in world_sizes},
        "bytes_ratio": {
            d: {str(n): by_stats[d][str(n)]["send_bytes_per_rank"] / exact[d][str(n)]["send_bytes_per_rank"]
                for n in world_sizes if n > 1}
            for d in exact
        },  # fmt: skip
    }


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, by_n in results.items():
        ns = [int(n) for n in by_n if int(n) > 1]  # N = 1 sends nothing: no place on a log axis
        ax.plot(ns, [by_n[str(n)]["send_bytes_per_rank"] / 2**20 for n in ns], marker="o", markersize=3, label=name)
        if name == "torchrec_table_wise":
            busiest = [by_n[str(n)]["max_send_bytes_per_rank"] / 2**20 for n in ns]
            ax.plot(ns, busiest, linestyle="--", color=ax.lines[-1].get_color(), label=f"{name} (busiest rank)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("MiB sent (= received) per rank per step")
    ax.set_title(title, fontsize="medium")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from report import write_report

    from datamodules import SyntheticCTRDataModule

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="times the Criteo Kaggle cardinalities")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8192, help="samples per rank per step")
    parser.add_argument("--budget", type=float, default=0.1, help="device budget, a fraction of the tables' bytes")
    parser.add_argument("--profile-batches", type=int, default=20)
    parser.add_argument("--max-ranks", type=int, default=1024)
    parser.add_argument("--validate", action="store_true", help="also measure 2 and 4 gloo processes (minutes)")
    parser.add_argument("--validate-scale", type=float, default=0.1)
    parser.add_argument("--validate-dim", type=int, default=16)
    parser.add_argument("--validate-batch-size", type=int, default=2048)
    parser.add_argument("--validate-steps", type=int, default=16)
    parser.add_argument("--validate-warmup", type=int, default=6)
    parser.add_argument("--measured", type=Path, help="validate against the measurements in this earlier report")
    parser.add_argument("--out", type=Path, default=RESULTS / "scaling_model.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "scaling_model.png")
    args = parser.parse_args()
    world_sizes = [n for n in WORLD_SIZES if n <= args.max_ranks]

    dm = SyntheticCTRDataModule(scale=args.scale, embedding_dim=args.dim, batch_size=args.batch_size, shuffle=False)
    stats, plan, state_width, dense = profile_and_plan(dm, args.budget, max(world_sizes), args.profile_batches)
    exact = synthetic_workload(dm, plan, state_width, dense)
    results = model_table(exact, world_sizes)
    names = list(results)
    print(f"MiB sent (= received) per rank per step; busiest rank's in brackets where it differs\n{'N':>5}"
          + "".join(f"{n:>24}" for n in names))  # fmt: skip
    for n in world_sizes:
        cells = []
        for name in names:
            r = results[name][str(n)]
            busiest = r["max_send_bytes_per_rank"]
            extra = f" ({busiest / 2**20:,.0f})" if busiest > 1.01 * r["send_bytes_per_rank"] else ""
            cells.append(f"{r['send_bytes_per_rank'] / 2**20:,.1f}{extra}")
        print(f"{n:>5}" + "".join(f"{c:>24}" for c in cells))
    top, eight = results["hotcache"][str(max(world_sizes))], results["hotcache"]["8"]
    targets = {
        "hotcache_le_torchrec_table_wise": top["send_bytes_per_rank"]
        <= results["torchrec_table_wise"][str(max(world_sizes))]["send_bytes_per_rank"],
        "hotcache_max_over_8_ranks": top["send_bytes_per_rank"] / eight["send_bytes_per_rank"],
    }
    print(f"targets at N = {max(world_sizes)}: {targets}")
    check = estimator_check(workload_from_stats(stats, plan, args.batch_size, state_width, dense), exact, world_sizes)
    print(f"profile-based estimate / exact law, distinct rows per step: {check['unique_rows_ratio']}")
    report = {
        "designs": results,
        "targets": targets,
        "rows_of_whole_tables": sum(t.num_embeddings for t in exact.tables if t.on_device),
        "estimator_check": check,
        "validation": validate(args) if args.validate or args.measured else None,
    }
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(results, args.plot, f"DLRM dim {args.dim}, {args.batch_size} samples/rank, scale {args.scale}, budget {args.budget}")
    write_report("scaling_model", args, report, world_sizes=world_sizes)


if __name__ == "__main__":
    main()
