"""Data-parallel scaling on this CPU: 1, 2 and 4 processes (gloo), hotcache vs torchrec.

DLRM (row-wise Adagrad on the tables, Adam on the dense layers) on SyntheticCTRDataModule at
``--scale`` times the Criteo Kaggle cardinalities, ``--batch-size`` samples per process per
step (weak scaling: N processes train a global batch N times as large). Every (strategy,
processes) pair runs in its own job, launched by Lightning as ``Trainer(devices=N)`` would be
by a user, with the cores split evenly between the processes. Reported: global samples/s
over the steps after ``--warmup`` (median of ``--rounds`` rounds over all jobs), and the
bytes the processes sent each other per step, read from the loopback interface's counter
(``/proc/net/dev``), which every gloo message between local processes crosses: an outside
measure, the same for both strategies.
Writes benchmarks/results/scaling.json.

    python benchmarks/scaling.py [--scale 0.1] [--dim 16] [--batch-size 2048] [--steps 60] [--rounds 3] [--world-sizes 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from clock import StepClock
from report import median_round, write_report

from datamodules import SyntheticCTRDataModule
from lightning_hotcache import HotCacheStrategy  # importing the package registers "torchrec" too
from models import DLRM

RESULTS = Path(__file__).parent / "results"
# "/pytorch": the device tier on PyTorch's embedding_bag, the path every run of several
# processes took before FBGEMM's kernel did the lookup there too (same exchange, same bytes).
STRATEGIES = ("torchrec", "hotcache@1", "hotcache@0.1", "hotcache@0.1/pytorch")


def loopback_bytes() -> int:
    """Bytes sent on the loopback interface so far, by every process of this network namespace."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # transmit bytes
    raise RuntimeError("No loopback interface in /proc/net/dev.")


def make_strategy(name: str, procs: int) -> Any:
    if name == "torchrec":
        return "torchrec"
    budget, _, kernel = name.split("@")[1].partition("/")
    return HotCacheStrategy(
        device_budget=float(budget), profile_batches=20, process_group_backend="gloo", kernel=kernel or "auto"
    )


def run_job(args: argparse.Namespace) -> dict[str, Any] | None:
    """One (strategy, processes) job; rank 0 returns the results (other ranks None)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.procs))
    pl.seed_everything(0)
    dm = SyntheticCTRDataModule(
        scale=args.scale, embedding_dim=args.dim, batch_size=args.batch_size, shuffle=False,
        num_train_samples=args.batch_size * args.procs * (args.steps + 20), num_val_samples=args.batch_size,
    )  # fmt: skip
    model = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05})
    clock = StepClock(args.warmup, probe=loopback_bytes)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.procs, strategy=make_strategy(args.strategy, args.procs), max_steps=args.steps,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
    )  # fmt: skip
    trainer.fit(model, dm)
    if trainer.global_rank != 0:
        return None
    steps = args.steps - args.warmup
    # Each rank timed its own samples; the ranks move in lockstep, so the job did procs x as many.
    return {
        "samples_per_s": clock.samples_per_s * args.procs,
        "sent_kib_per_step": (clock.at_end - clock.at_start) / 1024 / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=2048, help="samples per process per step")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every job; the median is reported")
    parser.add_argument("--strategy", choices=STRATEGIES, help="run one job (used by the driver)")
    parser.add_argument("--procs", type=int, default=1, help="processes of that job")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4], help="processes of the jobs (1 first)")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES), help="jobs to run")
    parser.add_argument("--out", type=Path, default=RESULTS / "scaling.json")
    args = parser.parse_args()

    if args.strategy:
        result = run_job(args)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        return
    # Lightning launches the other ranks itself; stale rendezvous settings would misdirect them.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    # Rounds over all jobs, so slow drift of this shared machine hits them alike; the median
    # round counts.
    rounds: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for strategy in args.strategies:
            for procs in args.world_sizes:
                command = [sys.executable, __file__, *sys.argv[1:], "--strategy", strategy, "--procs", str(procs)]
                lines = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout.splitlines()
                result = json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT "):])
                rounds.setdefault(f"{strategy} x{procs}", []).append(result)
                print(f"{strategy} x{procs}: {result}", flush=True)
    results = {name: median_round(runs) for name, runs in rounds.items()}
    for strategy in args.strategies:
        for procs in args.world_sizes:
            results[f"{strategy} x{procs}"]["x_one_process"] = (
                results[f"{strategy} x{procs}"]["samples_per_s"] / results[f"{strategy} x{args.world_sizes[0]}"]["samples_per_s"]
            )
    print(f"{'strategy':<14}{'procs':>6}{'samples/s':>11}{'x 1 proc':>10}{'sent KiB/step':>15}  rounds")
    for name, r in results.items():
        strategy, procs = name.rsplit(" x", 1)
        print(f"{strategy:<14}{procs:>6}{r['samples_per_s']:>11.0f}{r.get('x_one_process', 1.0):>10.2f}"
              f"{r['sent_kib_per_step']:>15.1f}  {' '.join(f'{x:.0f}' for x in r['rounds'])}")  # fmt: skip
    write_report("scaling", args, results, cpus=os.cpu_count())


if __name__ == "__main__":
    main()
