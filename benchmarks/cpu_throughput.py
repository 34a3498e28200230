"""DLRM training throughput on this CPU at Criteo Kaggle cardinality: auto vs torchrec vs hotcache.

Each strategy trains the same DLRM (row-wise Adagrad on the tables, Adam on the dense
layers) on SyntheticCTRDataModule at ``--scale`` (default 1.0: 33.8M rows) for ``--steps`` steps, one
process, ``--rounds`` times over (each round in another rotation of the order); samples/s is measured between the end of
the warm-up steps and the last step (set-up, table init and profiling excluded), and the
median round is reported, with ratios to ``auto`` and to ``torchrec`` (the fused FBGEMM
baseline), and hotcache's hit rate and rows fetched and written back a step over the same
steps, the hit rate marked ``*`` where the caches were still filling then (fewer rows evicted
than fetched: at 10% the default window, steps 20-300, is half filling; ``--steps 520 --warmup
240`` times a full cache). Every run is a process of its own: its peak RSS is then that strategy's alone
(and memory one fit leaves behind, as TorchRec's CPU sharding does, cannot starve the next).
Prints a table and writes benchmarks/results/cpu_throughput.json.

    python benchmarks/cpu_throughput.py [--scale 1.0] [--dim 16] [--batch-size 2048] [--steps 300] [--rounds 3] [--strategies auto hotcache@1]
    python benchmarks/cpu_throughput.py --optimizer adam   # lazy Adam: auto vs hotcache's PyTorch path
    python benchmarks/cpu_throughput.py --optimizer sgd --strategies torchrec hotcache@0.1+fbgemm hotcache@0.1+pytorch
    python benchmarks/cpu_throughput.py --strategies torchrec hotcache@0.01 hotcache@0.01+lookahead
    python benchmarks/cpu_throughput.py --strategies hotcache@0.01 hotcache@0.01+lookahead --pieces   # and where staging's time goes (benchmarks/pieces.py)
    python benchmarks/cpu_throughput.py --strategies torchrec hotcache@0.01 hotcache@0.01+2threads   # staging on two threads
    python benchmarks/cpu_throughput.py --strategies torchrec hotcache@0.1 hotcache@0.01+lookahead --steps 600 --warmup 200 --interleave 20   # in turns (benchmarks/turns.py)
    python benchmarks/cpu_throughput.py --strategies torchrec hotcache@0.1 hotcache@0.1+inline --steps 600 --warmup 200 --interleave 20   # the staging default against inline

By default every strategy but the ``+lookahead`` (the lookahead cache policy), ``+inline``
(staging on the training loop), ``+thread`` (on the prefetch thread, one batch ahead;
``+thread+depth3`` three), ``+2threads`` (the split tables in two caches staged side by side:
``staging_threads=2``) and ``+fbgemm`` / ``+pytorch`` (the device tier's kernel named, not
chosen) ones runs; with no suffix, the strategy stages as it chooses (`staging_choice`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
from clock import StepClock, TurnClock, cache_counters, hit_rate_text, print_filling_note, still_filling, timed_trainer
from pieces import PieceClock, print_pieces, window_ms_per_batch
from report import add_ratios, rounds_of_jobs, write_report
from turns import Baton, jobs_in_turns, train_in_turns

from datamodules import SyntheticCTRDataModule
from lightning_hotcache import HotCacheStrategy  # importing the package registers "torchrec" too
from lightning_hotcache.callbacks.metrics import staging_totals
from models import DLRM

RESULTS = Path(__file__).parent / "results"


def train(strategy: Any, args: argparse.Namespace, baton: Baton | None = None) -> dict[str, Any]:
    pl.seed_everything(0)
    dm = SyntheticCTRDataModule(scale=args.scale, embedding_dim=args.dim, batch_size=args.batch_size,
                                num_train_samples=args.batch_size * (args.steps + 200), shuffle=False,
                                num_workers=args.num_workers)  # fmt: skip
    model = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer={"name": args.optimizer, "lr": 0.05})
    pieces = PieceClock() if args.pieces else None

    def probe() -> dict[str, Any]:
        return cache_counters(model) | staging_totals(trainer) | (pieces.probe() if pieces else {})

    clock = StepClock(args.warmup, probe) if baton is None else TurnClock(args.warmup, args.block, baton, probe)
    trainer = timed_trainer(strategy, args.steps, clock)
    with pieces or contextlib.nullcontext():
        trainer.fit(model, dm)
    steps = args.steps - args.warmup
    piece_ms = window_ms_per_batch(clock, steps)  # each step stages one batch
    moved = {key: clock.at_end[key] - clock.at_start[key] for key in clock.at_end}
    out = {
        "samples_per_s": clock.samples_per_s,
        # ru_maxrss is in KiB on Linux: the whole process' peak, i.e. this run's.
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
        "hit_rate": moved["hits"] / moved["lookups"] if moved["lookups"] else None,
        "fetched_rows_per_step": moved["fetched_rows"] / steps,
        "written_back_rows_per_step": moved["written_back_rows"] / steps,
        "caches_filling": still_filling(moved),
        # With the prefetch thread (`+thread`): steps whose batch was not staged in time. Inline
        # staging (the CPU's default) runs between steps, so every fetch is on the loop's path.
        "staging_waits_per_step": moved["staging_waits"] / steps,
        "staging_wait_ms_per_step": 1e3 * moved["staging_wait_s"] / steps,
    }
    if piece_ms is not None:
        out["pieces_ms_per_batch"] = piece_ms
    if isinstance(clock, TurnClock):
        out["blocks"] = clock.blocks
    plan = getattr(trainer.strategy, "plan", None)
    if plan is not None:
        out["device_mib"] = plan.device_bytes / 2**20
        out["budget_mib"] = plan.budget_bytes / 2**20
    return out


def _rows_moved(result: dict[str, Any]) -> str:
    """Rows fetched and written back a step (``-`` where no cache moved any)."""
    fetched, written = result.get("fetched_rows_per_step", 0), result.get("written_back_rows_per_step", 0)
    return "-" if not (fetched or written) else f"{fetched:,.0f} / {written:,.0f}"


def strategy_makers() -> dict[str, Callable[[], Any]]:
    """Name -> a maker of the strategy (each run builds its own)."""
    makers: dict[str, Callable[[], Any]] = {"auto": lambda: "auto", "torchrec": lambda: "torchrec"}
    # hotcache at 100%, 10% and 1% of the tables; with options too: the lookahead cache policy
    # (10% and 1%), staging as the strategy chooses it (no suffix), inline on the loop
    # ("+inline"), on the prefetch thread one batch ahead ("+thread") or three ("+thread+depth3"),
    # on two staging threads ("+2threads"), a kernel named (the device tier's, "auto" by default).
    staging: dict[str, dict[str, Any]] = {
        "": {}, "+inline": {"prefetch_thread": False}, "+thread": {"prefetch_thread": True, "prefetch_depth": 1},
        "+thread+depth3": {"prefetch_thread": True, "prefetch_depth": 3}, "+2threads": {"staging_threads": 2},
    }  # fmt: skip
    for budget in (1.0, 0.1, 0.01):
        for policy in ("", "+lookahead") if budget < 1 else ("",):
            for thread in staging if budget < 1 else ("", "+inline", "+thread"):
                for kernel in ("", "+fbgemm", "+pytorch"):
                    makers[f"hotcache@{budget:g}{policy}{thread}{kernel}"] = (
                        lambda b=budget, policy=policy, thread=thread, kernel=kernel: HotCacheStrategy(
                            device_budget=b, profile_batches=50, cache_policy="lookahead" if policy else "lfu",
                            kernel=kernel[1:] or "auto", **staging[thread],
                        )
                    )  # fmt: skip
    return makers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="the Criteo Kaggle cardinalities times this (1.0: 33.8M rows)")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every strategy; the median is reported")
    parser.add_argument("--optimizer", choices=("rowwise_adagrad", "sgd", "adam"), default="rowwise_adagrad",
                        help="the tables' row-wise rule; adam runs hotcache's PyTorch path (FBGEMM has no lazy Adam) "
                             "and not torchrec (its Adam is not row-lazy)")  # fmt: skip
    parser.add_argument("--strategies", nargs="+", help="a subset to run (default: all; auto is the baseline)")
    parser.add_argument("--num-workers", type=int, default=0,
                        help="DataLoader worker processes drawing the synthetic batches (0: the training loop draws them)")
    parser.add_argument("--pieces", action="store_true", help="also time staging's pieces (benchmarks/pieces.py), per batch of the timed steps")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_throughput.json")
    parser.add_argument("--interleave", type=int, default=0, metavar="STEPS",
                        help="run the strategies at once, taking turns of this many timed steps (benchmarks/turns.py): "
                             "figures paired within seconds, not rounds (instead of --rounds; at most three strategies at scale 1.0 in 24 GiB)")  # fmt: skip
    parser.add_argument("--job", help=argparse.SUPPRESS)  # one run in this process; prints its JSON
    parser.add_argument("--turns", type=Baton.parse, help=argparse.SUPPRESS)  # the job's place in the turns
    parser.add_argument("--block", type=int, default=0, help=argparse.SUPPRESS)  # timed steps a turn
    args = parser.parse_args(argv)

    runs = strategy_makers()
    if args.optimizer == "adam":
        del runs["torchrec"]
    unknown = set(args.strategies or ()) - set(runs)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {list(runs)}")
    if args.interleave:
        if args.rounds != parser.get_default("rounds"):
            parser.error("--interleave times every strategy once, in turns; drop --rounds")
        args.rounds = None  # the report's settings then say no rounds ran
    if args.job:
        if args.turns is None:
            print(json.dumps(train(runs[args.job](), args)))
        else:
            print(json.dumps(train_in_turns(args.turns, lambda: train(runs[args.job](), args, args.turns))))
        return
    chosen = [name for name in runs if name in args.strategies] if args.strategies else [name for name in runs if "+" not in name]
    settings = ["--scale", str(args.scale), "--dim", str(args.dim), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--optimizer", args.optimizer, "--num-workers", str(args.num_workers),
                *(["--pieces"] if args.pieces else [])]  # fmt: skip
    if args.interleave:
        results = jobs_in_turns(__file__, settings, chosen, args.interleave)
    else:
        results = rounds_of_jobs(__file__, settings, chosen, args.rounds)
    add_ratios(results, ("auto", "torchrec"))
    # "paired": the median over rounds of the ratio within a round (see report.add_ratios).
    print(f"{'strategy':<32}{'samples/s':>12}{'x auto':>9}{'x torchrec':>12}{'paired':>8}{'hit rate':>10}{'waits/step':>12}"
          f"{'wait ms/step':>14}{'rows in/out a step':>20}{'peak RSS MiB':>14}  {'blocks' if args.interleave else 'rounds'}")  # fmt: skip
    for name, r in results.items():
        paired = r.get("x_torchrec_paired", r.get("x_auto_paired", float("nan")))
        hit_rate = hit_rate_text(r)
        print(
            f"{name:<32}{r['samples_per_s']:>12.0f}{r['x_auto']:>9.2f}{r['x_torchrec']:>12.2f}{paired:>8.2f}{hit_rate:>10}"
            f"{r['staging_waits_per_step']:>12.2f}{r['staging_wait_ms_per_step']:>14.2f}{_rows_moved(r):>20}{r['peak_rss_mib']:>14.0f}"
            f"  {' '.join(f'{x:.0f}' for x in r['rounds'])}"
        )
    print_filling_note(results)
    print_pieces(results, "pieces_ms_per_batch")
    rows = sum(t.num_embeddings for t in SyntheticCTRDataModule(scale=args.scale).tables)
    write_report("cpu_throughput", args, results, rows=rows)

if __name__ == "__main__":
    main()
