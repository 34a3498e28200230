"""Data-parallel scaling on this CPU: 1, 2 and 4 processes (gloo), hotcache and ddp vs torchrec.

DLRM (row-wise Adagrad on the tables, Adam on the dense layers) on SyntheticCTRDataModule at
``--scale`` times the Criteo Kaggle cardinalities, ``--batch-size`` samples per process per
step (weak scaling: N processes train a global batch N times as large). Every (strategy,
processes) pair runs in its own job, launched by Lightning as ``Trainer(devices=N)`` would be
by a user, with the cores split evenly between the processes. Reported: global samples/s
over the steps after ``--warmup`` (median of ``--rounds`` rounds over all jobs, each round
in another order: see report.rounds_of_jobs), each job's ratio to torchrec at the same
number of processes (median rounds, and paired within rounds), and the bytes the processes
sent each other per step, read from the loopback interface's counter (``/proc/net/dev``),
which every gloo message between local processes crosses: an outside measure, the same for
both strategies.

Each job runs in a network namespace of its own (``unshare --net --map-root-user``, where
it works), so its loopback counter holds its bytes alone. ``--link-gbit X`` also shapes that
loopback to X Gbit/s per process (``tc qdisc add dev lo root tbf``): a job's processes share
the one qdisc, so it gets N x X. Writes benchmarks/results/scaling.json (``--out``).

    python benchmarks/scaling.py [--scale 0.1] [--dim 16] [--batch-size 2048] [--steps 60] [--rounds 3]
                                 [--world-sizes 1 2 4] [--link-gbit X]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from clock import StepClock
from report import rounds_of_jobs, write_report

from datamodules import SyntheticCTRDataModule
from lightning_hotcache import HotCacheStrategy  # importing the package registers "torchrec" too
from models import DLRM

RESULTS = Path(__file__).parent / "results"
# "/fbgemm": the lookup on FBGEMM's kernel, which `auto` took on a CPU until row-wise Adagrad
# moved to the PyTorch path there (same exchange, same bytes; benchmarks/README.md, "The device
# tier's kernel on a CPU").
# ``ddp``: Lightning's, every table replicated and averaged by the zoo's row-wise step (sparse_ddp).
STRATEGIES = ("torchrec", "hotcache@1", "hotcache@0.1", "hotcache@0.1/fbgemm", "ddp")


def loopback_bytes() -> int:
    """Bytes sent on the loopback interface so far, by every process of this network namespace."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # transmit bytes
    raise RuntimeError("No loopback interface in /proc/net/dev.")


def make_strategy(name: str, procs: int) -> Any:
    if name in ("torchrec", "ddp"):
        return name
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


def namespace_wrapper(procs: int, link_gbit: float | None) -> list[str]:
    """A command prefix that runs a job in a network namespace of its own, its loopback shaped
    to ``procs x link_gbit`` Gbit/s when given; none where ``unshare`` is not available."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        if link_gbit is not None:
            raise SystemExit("--link-gbit needs `unshare`, `ip` and `tc` (util-linux, iproute2).")
        return []
    setup = "ip link set lo up"
    if link_gbit is not None:
        setup += f" && tc qdisc add dev lo root tbf rate {procs * link_gbit * 1000:g}mbit burst 256kb latency 50ms"
    # Lightning launches the other ranks itself (stale rendezvous settings would misdirect
    # them), and gloo must use the namespace's only interface.
    env = ["env", "-u", "MASTER_ADDR", "-u", "MASTER_PORT", "-u", "WORLD_SIZE", "-u", "RANK", "-u", "LOCAL_RANK", "GLOO_SOCKET_IFNAME=lo"]
    return ["unshare", "--net", "--map-root-user", "sh", "-c", f'{setup} && exec "$@"', "sh", *env]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=2048, help="samples per process per step")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every job; the median is reported")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4], help="processes of the jobs")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES), help="jobs to run")
    parser.add_argument("--link-gbit", type=float, help="shape each job's loopback to this many Gbit/s per process")
    parser.add_argument("--out", type=Path, default=RESULTS / "scaling.json")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # "<strategy> x<procs>": one job in this process
    args = parser.parse_args()

    if args.job:
        args.strategy, procs = args.job.rsplit(" x", 1)
        args.procs = int(procs)
        result = run_job(args)
        if result is not None:
            print(json.dumps(result), flush=True)
        return
    if "torchrec" not in args.strategies:
        parser.error("torchrec is the baseline: keep it in --strategies")
    settings = ["--scale", str(args.scale), "--dim", str(args.dim), "--batch-size", str(args.batch_size),
                "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
    names = [f"{strategy} x{procs}" for procs in args.world_sizes for strategy in args.strategies]
    wrapper = lambda name: namespace_wrapper(int(name.rsplit(" x", 1)[1]), args.link_gbit)  # noqa: E731
    results = rounds_of_jobs(__file__, settings, names, args.rounds, wrapper)
    for name, r in results.items():
        procs = name.rsplit(" x", 1)[1]
        base = results[f"torchrec x{procs}"]
        r["x_torchrec"] = r["samples_per_s"] / base["samples_per_s"]
        r["x_torchrec_paired"] = statistics.median(a / b for a, b in zip(r["rounds"], base["rounds"], strict=True))
    link = "unshaped loopback" if args.link_gbit is None else f"loopback shaped to {args.link_gbit:g} Gbit/s per process"
    print(f"{link}; 'paired': the median over rounds of the ratio within a round")
    print(f"{'strategy':<22}{'procs':>6}{'samples/s':>11}{'x torchrec':>12}{'paired':>8}{'sent KiB/step':>15}  rounds")
    for name, r in results.items():
        strategy, procs = name.rsplit(" x", 1)
        print(f"{strategy:<22}{procs:>6}{r['samples_per_s']:>11.0f}{r['x_torchrec']:>12.2f}{r['x_torchrec_paired']:>8.2f}"
              f"{r['sent_kib_per_step']:>15.1f}  {' '.join(f'{x:.0f}' for x in r['rounds'])}")  # fmt: skip
    write_report("scaling", args, results, cpus=os.cpu_count(), link_gbit_per_process=args.link_gbit)


if __name__ == "__main__":
    main()
