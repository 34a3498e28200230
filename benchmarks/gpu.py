"""DLRM training on one GPU: hotcache at budgets 1.0 / 0.1 / 0.01 against all tables in HBM and FAE's CPU lookup.

DLRM (dim 128, row-wise Adagrad on the tables, Adam on the dense layers) on
SyntheticCTRDataModule at ``--scale`` (1.0: the Criteo Kaggle cardinalities, 33.8M rows,
17.3 GB of fp32 rows at dim 128) trains ``--steps`` steps of ``--batch-size`` under each
strategy, every run a process of its own, ``--rounds`` times over; the median round is
reported. Per run: samples/s between the end of the warm-up steps and the last step (set-up,
table init and profiling excluded); the cache's hit rate and the bytes its rows (with their
optimizer state) moved host -> device and back per step over the same steps (the batches'
own transfer, the same for every strategy, is not counted), and whether the caches were still
filling then (fewer rows evicted than fetched: the table marks the hit rate with ``*``; the
first ``--profile-batches`` steps read the profiled rows, all static at 10%, so a 10% cache
fills only after them, by ~step 65 at scale 1.0); how long a step waited, on
average, for hotcache's prefetch thread to stage its batch (0: staging keeps up), and that
thread's own time per batch (waiting for the reader thread, which reads it from the loader and
announces it; staging it, wall and CPU) and the reader's time announcing it; the peak device memory
(``torch.cuda.max_memory_allocated``, CUDA only) and the run's peak host RSS.

* ``auto``: Lightning's plain strategy, every table on the device (needs them to fit).
* ``hotcache@b``: device budget ``b`` of the tables' bytes (grown to the minimum the batches
  in flight need, as the fractional presets do), stats from the first ``--profile-batches``.

* ``cpu-lookup``: FAE's baseline, the CPU-GPU hybrid FAE measures itself against: tables in
  host memory, looked up and updated by the CPU (the zoo's row-wise optimizer on sparse
  gradients), dense layers on the device; each step the pooled embeddings cross to the
  device and their gradients back (counted as its host<->device bytes). No strategy places a
  collection on the host while the dense part runs on the device (``torchrec`` needs FBGEMM's
  CUDA kernels for its host/UVM placements), so `HostLookupDLRM` here does it by hand.
  ``hotcache`` with ``cache_policy="static"`` is FAE itself (hot rows on the device).

The data: ``--data memory`` (the default) draws the training batches before ``fit``, with
``--num-workers`` processes, and serves them from memory, as a loader of a preprocessed
dataset in memory serves them (TorchRec's Criteo loaders read memory-mapped arrays). The
synthetic teacher costs ~50 ms of CPU a batch of 8,192: drawn during training (``--data
live``, the loader's workers, as every run before 2026-11-27 drew them) it keeps several
cores busy at these speeds, beside the training loop and hotcache's staging threads. Both
modes train on the same batches in the same order.

Tables larger than the GPU: ``--device-memory GIB`` caps the memory each run may take on the
GPU (``torch.cuda.set_per_process_memory_fraction``; the GPU machines here have more GPU memory
than host memory and disk for tables, so the tables cannot simply outgrow the card). A run that
does not fit (``auto`` holding every table) is reported as such (``does_not_fit``), not as a
failure of the benchmark.

``--switch-interval SECONDS`` sets Python's thread switch interval in each run: every torch
call hotcache's staging threads make hands the GIL over, and taking it back from a thread
that runs Python can wait up to that interval (5 ms by default; see benchmarks/README.md,
"The GIL"), so an A/B of it measures how much the threads and the training loop wait for
each other.

``--pieces`` also times the pieces of staging (`benchmarks/pieces.py`: the reader's
announcement, the prefetch thread's acquire: look-ups, victims, eviction, host reads,
installs, write-backs landed) per batch of the timed steps, printed as a second table
(``pieces_ms_per_batch``): on a GPU host that work is compiled loops and row copies, which
torch.profiler does not see.

Under the lookahead policy a run draws its window's batches (64 at batches of 8,192) beyond
``--steps``: the loader reads them ahead, and with a batch a step the window would empty
over the last steps, the timed ones (every lookahead figure before 2026-11-29 was timed so,
the window shrinking to one batch and no batch announced in the timed steps).

``--profile-steps N`` runs the chosen strategies once each, in this process, and prints
torch.profiler's key averages of N steps after the warm-up (by device time, then host time)
instead of timing them; it writes no results.

Prints a table and writes benchmarks/results/gpu.json.

    python benchmarks/gpu.py [--scale 1.0] [--batch-size 8192] [--steps 200] [--rounds 3] [--strategies auto hotcache@0.1]
    python benchmarks/gpu.py --scale 1.0 --device-memory 8 --strategies auto hotcache@0.1   # tables larger than the GPU
    python benchmarks/gpu.py --strategies auto hotcache@0.01 hotcache@0.01+lookahead   # the lookahead policy
    python benchmarks/gpu.py --strategies auto hotcache@0.01+lookahead hotcache@0.01+lookahead+2threads   # staging on 2 threads against 1
    python benchmarks/gpu.py --device cpu --scale 0.001 --steps 5 --rounds 1   # smoke mode, seconds on a CPU
    python benchmarks/gpu.py --device cpu --scale 0.001 --batch-size 64 --dim 16 --kernel pytorch   # host time a step, on a CPU
    python benchmarks/gpu.py --precision fp32 --strategies auto hotcache@0.1   # without TF32 matmuls (default: tf32, as users run)

``--kernel`` picks hotcache's device-tier kernel (``auto``: FBGEMM's fused one where it trains
exactly, else Triton's on CUDA; ``triton``: the Triton TBE against FBGEMM's in another run; each
run records which ran). On a CPU, ``--kernel pytorch`` with tiny batches and
tables times the host's share of the path a GPU without FBGEMM's CUDA build runs: the step's
compute is then negligible, so a step's time is its Python, dispatch and staging.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from clock import StepClock, cache_counters, hit_rate_text, print_filling_note, still_filling, timed_trainer
from pieces import PieceClock, print_pieces, window_ms_per_batch
from report import add_ratios, rounds_of_jobs, write_report

from torch import Tensor
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from typing_extensions import override

from datamodules import SyntheticCTRDataModule
from datamodules.base import BatchSource, Split
from lightning_hotcache import HotCacheStrategy
from lightning_hotcache.cache.lookahead import default_lookahead_batches
from lightning_hotcache.callbacks.metrics import staging_totals
from lightning_hotcache.embedding import hot_cold_modules
from lightning_hotcache._ops.switches import Switch
from models import DLRM

RESULTS = Path(__file__).parent / "results"
BUDGETS = (1.0, 0.1, 0.01)


class HostLookupDLRM(DLRM):
    """DLRM whose tables stay in host memory and are looked up there (FAE's CPU-GPU baseline).

    Lightning moves the whole model to the device; the tables go back to the host when fit
    starts, the batches' sparse features never leave it, and the pooled embeddings cross to
    the device (autograd's copy brings their gradient back for the CPU's row-wise update)."""

    @override
    def on_fit_start(self) -> None:
        self.sparse_arch.to("cpu")
        super().on_fit_start()

    @override
    def transfer_batch_to_device(self, batch: Batch, device: torch.device, dataloader_idx: int) -> Batch:
        moved = super().transfer_batch_to_device(batch, device, dataloader_idx)
        return dataclasses.replace(moved, sparse_features=batch.sparse_features)

    @override
    def embed(self, sparse_features: KeyedJaggedTensor) -> Tensor:
        return super().embed(sparse_features).to(self.device)


class DrawnBatches:
    """A split's batches, drawn once from ``live`` (by ``workers`` forked processes, 0: here)
    and served from memory; page-locked where CUDA is, as the loader's own pinning leaves them
    (pinning a pinned tensor again copies nothing). Serves the ranges the loader reads: batches
    of ``batch_size`` from sample 0, one process."""

    def __init__(self, live: BatchSource, batch_size: int, workers: int) -> None:
        self._len = len(live)
        bounds = [(start, min(start + batch_size, self._len)) for start in range(0, self._len, batch_size)]
        if workers:
            # One thread each, as a DataLoader's workers: OpenMP is not fork-safe once used.
            with multiprocessing.get_context("fork").Pool(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
                batches = pool.starmap(live.batch, bounds)
        else:
            batches = [live.batch(*bound) for bound in bounds]
        pin = torch.cuda.is_available()
        self._batches = {bound: batch.pin_memory() if pin else batch for bound, batch in zip(bounds, batches)}

    def __len__(self) -> int:
        return self._len

    def batch(self, start: int, stop: int) -> Batch:
        try:
            return self._batches[(start, stop)]
        except KeyError:
            raise KeyError(f"samples [{start}, {stop}) are not a drawn batch: DrawnBatches serves one process's batches of the drawn size") from None


class DrawnAheadDataModule(SyntheticCTRDataModule):
    """`SyntheticCTRDataModule` whose training batches are `DrawnBatches` (drawn at
    construction by ``drawing_workers`` processes); the loader itself runs no workers."""

    def __init__(self, drawing_workers: int, **kwargs: Any) -> None:
        super().__init__(num_workers=0, **kwargs)
        self._train = DrawnBatches(super().source("train"), self.batch_size, drawing_workers)

    @override
    def source(self, split: Split) -> BatchSource:
        return self._train if split == "train" else super().source(split)


def _hotcache(args: argparse.Namespace, budget: float, policy: str = "lfu", staging_threads: int = 1, directory: str = "auto") -> HotCacheStrategy:
    """hotcache at ``budget``; ``directory="host"`` keeps the caches' directory on the host on
    CUDA too (its switch, set for this run's process: each run is a process of its own)."""
    if directory == "host":
        os.environ[Switch.DEVICE_DIRECTORY.variable] = "0"
    return HotCacheStrategy(
        device_budget=budget, profile_batches=args.profile_batches, grow_budget_to_minimum=True, cache_policy=policy, kernel=args.kernel,
        staging_threads=staging_threads,
    )  # fmt: skip


def strategies(args: argparse.Namespace) -> dict[str, Any]:
    """Name -> a maker of the strategy (each run builds its own). The ``+lookahead`` ones (the
    lookahead cache policy), the ``+2threads`` ones (a batch's caches staged side by side on
    two threads, where the strategy stages on one by default), the ``+eager`` ones (the step
    not recorded in a CUDA graph) and the ``+hostdir`` ones (on CUDA the caches' directory on
    the host, staged by the prefetch thread, where it is in GPU memory by default) and ``auto+fp32``
    and ``auto+bf16-mixed`` (that ``--precision`` for the run) run only when named."""
    return {
        "auto": lambda: "auto",
        "auto+eager": lambda: "auto",  # the zoo model with cuda_graph=False (see `train`)
        # Under another --precision than the run's (see `main`): fp32 matmuls, bf16-mixed.
        **{f"auto+{p}": (lambda: "auto") for p in PRECISIONS if p != "tf32"},
        "cpu-lookup": lambda: "auto",  # with HostLookupDLRM (see `train`)
        **{f"hotcache@{b:g}": (lambda b=b: _hotcache(args, b)) for b in BUDGETS},
        **{f"hotcache@{b:g}+lookahead": (lambda b=b: _hotcache(args, b, "lookahead")) for b in BUDGETS[1:]},
        **{f"hotcache@{b:g}+2threads": (lambda b=b: _hotcache(args, b, staging_threads=2)) for b in BUDGETS[1:]},
        **{f"hotcache@{b:g}+lookahead+2threads": (lambda b=b: _hotcache(args, b, "lookahead", 2)) for b in BUDGETS[1:]},
        **{f"hotcache@{b:g}+eager": (lambda b=b: _hotcache(args, b)) for b in BUDGETS[1:]},  # cuda_graph=False (see `train`)
        **{f"hotcache@{b:g}+hostdir": (lambda b=b: _hotcache(args, b, directory="host")) for b in BUDGETS[1:]},
    }


class GraphCounts(pl.Callback):
    """The model's step graph's counts at the end of training (the graph goes with the fit)."""

    counts: dict[str, Any] | None = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        graph = pl_module.step_graph
        if graph is not None:
            self.counts = {"captures": graph.captures, "replays": graph.replays, "eager_steps": graph.eager_steps, "refused": graph.eager_reason}


def _all_threads() -> dict[str, Any]:
    """torch.profiler settings that record every thread's ops (the prefetch thread stages while
    the training thread steps), where this torch has the option (2.7 on)."""
    try:
        return {"experimental_config": torch.profiler._ExperimentalConfig(profile_all_threads=True)}
    except TypeError:
        return {}


class ProfileSteps(pl.Callback):
    """torch.profiler over ``steps`` training steps from batch ``start``, every thread's ops
    (where torch can); prints the key averages and, on CUDA, the device's busy time a step (its
    kernels' own time, summed) beside the steps' wall time: how much of a step the GPU works."""

    def __init__(self, start: int, steps: int, device: str) -> None:
        self.start, self.steps, self.device = start, steps, device
        self.profiler: torch.profiler.profile | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, **_all_threads())
            self.profiler.__enter__()
            self.began = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != self.start + self.steps - 1 or self.profiler is None:
            return
        if self.device == "cuda":
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - self.began) * 1e3 / self.steps
        self.profiler.__exit__(None, None, None)
        averages = self.profiler.key_averages()
        if self.device == "cuda":
            # The kernels' own events: a CPU op's device time is its kernels' again.
            kernels = [event for event in averages if event.device_type == torch.autograd.DeviceType.CUDA]
            busy_ms = sum(event.self_device_time_total for event in kernels) / 1e3 / self.steps
            print(f"# GPU busy {busy_ms:.2f} ms of {wall_ms:.2f} ms a step ({100 * busy_ms / wall_ms:.0f}%), under the profiler", flush=True)
        sort_keys = ("self_device_time_total", "self_cpu_time_total") if self.device == "cuda" else ("self_cpu_time_total",)
        for key in sort_keys:
            print(f"# {self.steps} steps from batch {self.start}, by {key}")
            print(averages.table(sort_by=key, row_limit=25, max_name_column_width=60), flush=True)


def _cap_device_memory(args: argparse.Namespace) -> int | None:
    """Cap this process' GPU memory at ``--device-memory`` GiB; the cap in bytes (None: none)."""
    if args.device_memory is None:
        return None
    cap = int(args.device_memory * 2**30)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    return cap


def _does_not_fit(error: BaseException, cap: int | None) -> dict[str, Any]:
    keys = ("hit_rate", "fetched_rows_per_step", "evicted_rows_per_step", "caches_filling", "eviction_began_at_step", "h2d_bytes_per_step", "d2h_bytes_per_step", "staging_waits_per_step",
            "staging_wait_ms_per_step", "reading_ms_per_batch", "staging_ms_per_batch", "staging_cpu_ms_per_batch", "announcing_ms_per_batch",
            "device_peak_bytes", "peak_rss_mib")  # fmt: skip
    return {
        "samples_per_s": float("nan"), **dict.fromkeys(keys), "device_memory_cap_bytes": cap,
        "does_not_fit": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}",
    }  # fmt: skip


class EvictionStart(pl.Callback):
    """The first training step after which a cache had evicted a row (None: none did), read
    from the host directory's counters (no wait for the device): steps timed from there on are
    the steady state, where every fetched row evicts one."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.step is None and cache_counters(pl_module)["evicted_rows"] > 0:
            self.step = trainer.global_step


# --precision -> (torch's float32 matmul precision, Lightning's precision)
PRECISIONS = {"tf32": ("high", "32-true"), "fp32": ("highest", "32-true"), "bf16-mixed": ("high", "bf16-mixed")}


def train(strategy: Any, args: argparse.Namespace, host_lookup: bool = False, graphed: bool = True) -> dict[str, Any]:
    cap = _cap_device_memory(args)
    try:
        return _train(strategy, args, host_lookup, graphed) | {"device_memory_cap_bytes": cap}
    except torch.OutOfMemoryError as error:
        return _does_not_fit(error, cap)


def _train(strategy: Any, args: argparse.Namespace, host_lookup: bool, graphed: bool) -> dict[str, Any]:
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    matmuls, precision = PRECISIONS[args.precision]
    torch.set_float32_matmul_precision(matmuls)
    began = time.perf_counter()
    pl.seed_everything(0)
    # Under the lookahead policy the loader reads the window's batches ahead of the step: with
    # no more batches than steps, the window would empty over the last of them, the timed ones.
    window = default_lookahead_batches(args.batch_size) if getattr(strategy, "cache_policy", None) == "lookahead" else 0
    data = {"scale": args.scale, "embedding_dim": args.dim, "batch_size": args.batch_size,
            "num_train_samples": args.batch_size * (args.steps + 1 + window), "shuffle": False}  # fmt: skip
    if args.data == "memory":
        dm: SyntheticCTRDataModule = DrawnAheadDataModule(args.num_workers, **data)
    else:
        dm = SyntheticCTRDataModule(num_workers=args.num_workers, **data)
    # Deferred tables: hotcache writes the rows straight into their tiers (the full tables are
    # never a second copy in host memory); auto materializes them, with the same rows.
    model_class = HostLookupDLRM if host_lookup else DLRM
    model = model_class(
        dm.tables, dm.num_dense_features, defer_table_init=True, embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05},
        cuda_graph=graphed and not host_lookup,  # the host lookup's copies to the device are no graph's
    )  # fmt: skip
    pieces = PieceClock() if args.pieces else None
    clock = StepClock(args.warmup, probe=lambda: cache_counters(model) | staging_totals(trainer) | (pieces.probe() if pieces else {}))
    trainer = timed_trainer(strategy, args.steps, clock, accelerator=args.device, precision=precision)
    eviction, graph_counts = EvictionStart(), GraphCounts()
    trainer.callbacks += [eviction, graph_counts]
    if args.profile_steps:
        trainer.callbacks.append(ProfileSteps(args.warmup, args.profile_steps, args.device))
    with pieces or contextlib.nullcontext():
        trainer.fit(model, dm)
    steps = args.steps - args.warmup
    piece_ms = window_ms_per_batch(clock, steps)  # each step stages one batch
    moved = {key: clock.at_end[key] - clock.at_start[key] for key in clock.at_end}
    if host_lookup:  # the pooled embeddings to the device, their gradients back, every step
        pooled = args.batch_size * sum(len(t.feature_names) for t in dm.tables) * args.dim * 4
        moved["h2d_bytes"] = moved["d2h_bytes"] = pooled * steps
    out: dict[str, Any] = {
        "samples_per_s": clock.samples_per_s,
        "precision": args.precision,  # the run's (``auto+bf16-mixed`` and ``auto+fp32`` change it)
        "hit_rate": moved["hits"] / moved["lookups"] if moved["lookups"] else None,
        "fetched_rows_per_step": moved["fetched_rows"] / steps,
        "evicted_rows_per_step": moved["evicted_rows"] / steps,
        "caches_filling": still_filling(moved),
        "eviction_began_at_step": eviction.step,
        # The training step's CUDA graph: recorded (captures), replayed and eager steps; None
        # where the fit stepped eagerly throughout (cuda_graph=False, a strategy it does not run under).
        "step_graph": graph_counts.counts,
        "h2d_bytes_per_step": moved["h2d_bytes"] / steps,
        "d2h_bytes_per_step": moved["d2h_bytes"] / steps,
        # Steps whose batch the prefetch thread had not staged in time, and the wait per step.
        "staging_waits_per_step": moved["staging_waits"] / steps,
        "staging_wait_ms_per_step": 1e3 * moved["staging_wait_s"] / steps,
        # The prefetch thread's time per batch it staged: waiting for the reader thread, staging
        # it (wall), and its own CPU time in staging (far below the wall time: it waited); and
        # the reader thread's time announcing it (wall).
        **{f"{key}_ms_per_batch": 1e3 * moved[f"{key}_s"] / moved["staged_batches"] if moved["staged_batches"] else None
           for key in ("reading", "staging", "staging_cpu", "announcing")},  # fmt: skip
        "device_peak_bytes": torch.cuda.max_memory_allocated() if args.device == "cuda" else None,
        # ru_maxrss is in KiB on Linux: the whole process' peak, i.e. this run's.
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
        "table_rows": sum(t.num_embeddings for t in dm.tables),
        "table_bytes": sum(t.num_embeddings * t.embedding_dim * 4 for t in dm.tables),
        # Where a run's time goes besides the timed steps (a GPU check's stages have limits):
        # drawing the batches, building the model, tables into their tiers, profiling; then the
        # warm-up steps.
        "setup_s": clock.first_batch_at - began,
        "warmup_s": clock.start - clock.first_batch_at,
    }
    if piece_ms is not None:
        out["pieces_ms_per_batch"] = piece_ms
    plan = getattr(trainer.strategy, "plan", None)
    if plan is not None:
        out["budget_bytes"] = plan.budget_bytes
        out["cache_device_bytes"] = sum(m.device_bytes() for m in hot_cold_modules(model).values())
        out["kernels"] = sorted({m.kernel_note for m in hot_cold_modules(model).values()})
        out["staging"] = trainer.strategy.staging_note  # inline or on threads, and why
    return out


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def _thread_ms(r: dict[str, Any]) -> str:
    if r.get("staging_ms_per_batch") is None:
        return "-"
    return f"{r['reading_ms_per_batch']:.1f}, {r['staging_ms_per_batch']:.1f} ({r['staging_cpu_ms_per_batch']:.1f}), {r['announcing_ms_per_batch']:.1f}"


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print(
        f"{'strategy':<16}{'samples/s':>12}{'x auto':>8}{'x cpu-lookup':>14}{'hit rate':>10}{'H2D MiB/step':>14}{'D2H MiB/step':>14}"
        f"{'staging wait ms/step':>22}{'thread ms/batch: read, stage (CPU), announce':>46}{'device peak MiB':>17}{'cache MiB':>11}{'peak RSS MiB':>14}  rounds"
    )
    for name, r in results.items():
        if "does_not_fit" in r:
            print(f"{name:<16}{'does not fit':>12}  {r['does_not_fit']}")
            continue
        hit = hit_rate_text(r)
        print(
            f"{name:<16}{r['samples_per_s']:>12,.0f}{r['x_auto']:>8.2f}{r['x_cpu-lookup']:>14.2f}{hit:>10}{_mib(r['h2d_bytes_per_step']):>14}"
            f"{_mib(r['d2h_bytes_per_step']):>14}{r['staging_wait_ms_per_step']:>22.2f}{_thread_ms(r):>46}{_mib(r['device_peak_bytes']):>17}"
            f"{_mib(r.get('cache_device_bytes')):>11}"
            f"{r['peak_rss_mib']:>14,.0f}  {' '.join(f'{x:,.0f}' for x in r['rounds'])}"
        )
    print_filling_note(results)
    for name, r in results.items():
        if r.get("eviction_began_at_step") is not None:
            print(f"{name}: eviction began at step {r['eviction_began_at_step']}; the timed steps start after the warm-up")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="table sizes as a fraction of Criteo Kaggle's")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, help="steps before the timed ones (default: 20, or half of --steps when fewer)")
    parser.add_argument("--data", choices=("memory", "live"), default="memory",
                        help="memory: the training batches drawn before fit, served from memory; live: drawn by the loader's workers while training")
    parser.add_argument("--num-workers", type=int, help="processes drawing the batches (default: 12 on CUDA, 0 on CPU)")
    parser.add_argument("--profile-batches", type=int, default=20, help="batches hotcache profiles to plan")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every strategy; the median is reported")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--precision", choices=tuple(PRECISIONS), default="tf32",
                        help="tf32: float32 with TF32 matmuls, as users run (torch.set_float32_matmul_precision('high')); fp32: without; bf16-mixed: Lightning's")
    parser.add_argument("--kernel", choices=("auto", "fbgemm", "triton", "pytorch"), default="auto",
                        help="hotcache's device-tier kernel (each run records which ran); pytorch on a CPU: the path of a GPU without FBGEMM's CUDA build")
    parser.add_argument("--strategies", nargs="+", help="a subset to run, in this order (default: all but the +lookahead ones; auto is the baseline)")
    parser.add_argument("--device-memory", type=float, help="cap each run's GPU memory at this many GiB (CUDA only)")
    parser.add_argument("--switch-interval", type=float,
                        help="Python's thread switch interval in seconds for each run (sys.setswitchinterval; default: Python's 0.005)")
    parser.add_argument("--profile-steps", type=int, default=0, help="profile this many steps after the warm-up instead")
    parser.add_argument("--pieces", action="store_true", help="also time staging's pieces (benchmarks/pieces.py), per batch of the timed steps")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # one run in this process; prints its JSON
    args = parser.parse_args(argv)
    if args.device_memory is not None and (args.device != "cuda" or not args.device_memory > 0):
        parser.error(f"--device-memory caps CUDA memory: it needs --device cuda and a positive size; got {args.device_memory}")
    if args.profile_steps < 0:
        parser.error(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.switch_interval is not None and not args.switch_interval > 0:
        parser.error(f"--switch-interval is seconds, > 0 (e.g. 0.0005), got {args.switch_interval}")
    if args.warmup is None:
        args.warmup = min(20, args.steps // 2)
    if args.num_workers is None:
        # One process draws ~60k synthetic samples/s at batch 8192: a GPU step must not wait on it.
        args.num_workers = 12 if args.device == "cuda" else 0
    if args.profile_steps and args.warmup + args.profile_steps > args.steps:
        parser.error(f"--profile-steps {args.profile_steps} after {args.warmup} warm-up steps needs --steps >= {args.warmup + args.profile_steps}")
    if not 0 < args.warmup < args.steps:
        parser.error(f"--warmup must be in [1, --steps - 1] so that some steps are timed; got {args.warmup} of {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device; on a CPU run the smoke mode: --device cpu --scale 0.001 --steps 5 --rounds 1")
    unknown = set(args.strategies or ()) - set(strategies(args))
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {list(strategies(args))}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    runs = strategies(args)
    if args.job:
        args.precision = next((p for p in PRECISIONS if args.job.endswith(f"+{p}")), args.precision)
        result = train(runs[args.job](), args, host_lookup=args.job == "cpu-lookup", graphed=not args.job.endswith("+eager"))
        print(json.dumps(result))
        return result
    # In the order named: a run cut off by a time limit (the GPU check's stages) loses the last ones.
    chosen = list(dict.fromkeys(args.strategies)) if args.strategies else [name for name in runs if "+" not in name]
    if args.profile_steps:  # in this process, so that the tables reach the output
        for name in chosen:
            print(f"## {name}", flush=True)
            train(runs[name](), args, host_lookup=name == "cpu-lookup", graphed=not name.endswith("+eager"))
        return {}
    settings = [
        "--scale", str(args.scale), "--dim", str(args.dim), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--profile-batches", str(args.profile_batches), "--device", args.device,
        "--num-workers", str(args.num_workers), "--data", args.data, "--kernel", args.kernel, "--precision", args.precision,
        *(["--pieces"] if args.pieces else []),
        *(["--device-memory", str(args.device_memory)] if args.device_memory is not None else []),
        *(["--switch-interval", str(args.switch_interval)] if args.switch_interval is not None else []),
    ]  # fmt: skip
    def partial(done: dict[str, Any]) -> None:  # written after each run: a check cut off by its time limit keeps them
        add_ratios(done, ("auto", "cpu-lookup"))
        write_report("gpu", args, done, echo=False, partial=True)

    results = rounds_of_jobs(__file__, settings, chosen, args.rounds, after_each=partial)
    add_ratios(results, ("auto", "cpu-lookup"))
    print_table(results)
    print_pieces(results, "pieces_ms_per_batch")
    return write_report("gpu", args, results)


if __name__ == "__main__":
    main()
