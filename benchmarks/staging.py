"""Host staging of GPU-sized batches: what the prefetch thread's host work costs a batch.

On a GPU a step waits for the prefetch thread (gpu.py's staging wait) when staging a batch
on the host takes longer than the device's step. This measures that host work on its own:
DLRM's Criteo-shaped batches (26 features, the Kaggle cardinalities x ``--scale``, batch
``--batch-size``) are staged one after another into a `HotColdEmbeddingBagCollection` (the
PyTorch path, row-wise Adagrad) at each budget, and each is finished as a step finishes it
(its rows marked changed and unlocked, so evictions write them back) without the lookup and
update, which are the device's work. Reported: the median milliseconds of a batch's staging
(all its host work), and of its two parts on the training's two threads: the reader's
(announcing the batch: checking, ordering and deduplicating its ids; under lookahead, the
window's books too) and the prefetch thread's (acquiring its rows: the directory, victims,
fetches, write-backs); the hit rate and the rows fetched a batch. With a core for each
thread, the prefetch thread's time bounds a batch.

While it stages, ``--forked-workers`` idle processes forked after the module is built stay
alive, as a DataLoader's workers do in training: memory they share with the parent is
copy-on-write, so they are part of what a write-back costs (the host arrays are kept out of
them: `lightning_hotcache.cache.host_arrays`).

``--lookahead K`` stages under the lookahead cache policy, each batch announced K batches
ahead of its staging, as the strategy's loader does (otherwise just before).

``--beside-python`` stages every other timed batch while a thread stands in for the training
loop on a GPU host: it runs Python, calling torch with a tiny op every ``--python-gap-us``
microseconds (Lightning's loop, autograd and the model make ~1,000 calls in ~10 ms of Python
a step). Both threads need the GIL: staging's torch calls each hand it over and take it back.
The batches staged beside it are reported apart (``beside_python``) with their ratio to the
ones staged alone: interleaved, so the machine's drift hits both alike. Give each thread a
core: on 2 cores run it with ``OMP_NUM_THREADS=1``.

``--device cuda`` stages into a module on the GPU, as training does. On ``--device cpu`` the
rows are in host memory, and the module is given the directory a CUDA module keeps: the dense
id map (`make_slot_map` with ``budgeted=False``), write-backs that land once a later acquire
finds them copied (a CPU cache's land when evicted), and no distinct reads per device table
from the host (on CUDA the device finds them, `sorted_reads`). So any machine measures the host's
share of GPU staging; compare budgets and commits within one run, or on one machine.

    python benchmarks/staging.py [--scale 1.0] [--dim 128] [--budgets 0.1 0.01] [--batches 30] [--forked-workers 4] [--lookahead 64]
    OMP_NUM_THREADS=1 python benchmarks/staging.py --scale 0.3 --dim 64 --budgets 0.01 --batches 60 --beside-python
    python benchmarks/staging.py --budgets 0.01 --lookahead 64 --pieces   # and where a batch's time goes (benchmarks/pieces.py)
    python benchmarks/staging.py --budgets 0.01 --staging-threads 1 2 --rounds 3   # one thread against two, alternated
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import threading
import time
from pathlib import Path
from typing import Iterator

import torch
from pieces import PieceClock, per_batch_ms, print_pieces
from report import median_round, write_report
from torchrec import KeyedJaggedTensor

from datamodules import SyntheticCTRDataModule
from lightning_hotcache import AccessStats, HotColdEmbeddingBagCollection, HotColdPlanner, RowWiseOptimizerConfig
from lightning_hotcache.cache import slot_map
from lightning_hotcache.planner.profiling import profile_batches

RESULTS = Path(__file__).parent / "results"
OPTIMIZER = RowWiseOptimizerConfig(name="rowwise_adagrad", lr=0.05)


def as_on_cuda(module: HotColdEmbeddingBagCollection) -> None:
    """Give a CPU module the host work of a CUDA module's staging (see the module's docstring)."""
    for cache in module._staging.caches.values():  # the device caches (a stack of tables is one)
        if not cache.identity:
            static = cache.id_of_slot[: cache.num_static]
            cache.slot_map = slot_map.make_slot_map(cache.num_embeddings, static, len(cache.id_of_slot), cache.books, budgeted=False)
            cache.defers_write_backs = True
    module._staging.sums_gradients = False


class PythonLoop:
    """A thread standing in for a training loop's host side while switched `on`: Python
    holding the GIL, with a tiny torch call (which hands the GIL over) every ``gap_us``."""

    def __init__(self, gap_us: float) -> None:
        self.gap = gap_us * 1e-6
        self.calls = 0
        self._running, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="python-loop", daemon=True)

    def _loop(self) -> None:
        x = torch.zeros(4)
        while not self._stop.is_set():
            if not self._running.wait(timeout=0.05):
                continue
            deadline = time.perf_counter() + self.gap
            while time.perf_counter() < deadline:  # Python only: the GIL held
                pass
            x.add_(1)
            self.calls += 1

    def on(self) -> None:
        self._running.set()

    def off(self) -> None:
        self._running.clear()

    def __enter__(self) -> "PythonLoop":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._running.set()
        self._thread.join()


def stage_batches(
    args: argparse.Namespace, budget: float, dm: SyntheticCTRDataModule, stats: AccessStats, batches: list[KeyedJaggedTensor],
    threads: int = 1,
) -> dict[str, float]:  # fmt: skip
    policy = "lookahead" if args.lookahead else "lfu"
    planner = HotColdPlanner(budget, OPTIMIZER, prefetch_depth=1, cache_policy=policy, device=args.device, grow_budget_to_minimum=True,
                             lookahead_batches=args.lookahead)  # fmt: skip
    plan = planner.plan(dm.tables, stats)
    module = HotColdEmbeddingBagCollection(
        dm.tables, plan, OPTIMIZER, device=args.device, cache_policy=policy, kernel="pytorch", staging_threads=threads
    )
    for cache in module._staging.caches.values():  # every host page written once, as table init does, before timing
        for array in [] if cache.host is None else cache.host.arrays.values():
            array.fill_(0.01)
    if args.device == "cpu":
        as_on_cuda(module)
    staging, device = module._staging, torch.device(args.device)

    def totals() -> tuple[int, int, int]:  # lookups, hits, rows fetched, over every table so far
        counters = [table.counters for table in module.caches.values()]
        return sum(c.lookups for c in counters), sum(c.hits for c in counters), sum(c.fetched_rows for c in counters)

    announcing, staging_seconds, fetched, lookups, hits = [], [], [], 0, 0
    loop = PythonLoop(args.python_gap_us) if args.beside_python else None
    pieces, pieces_at_warmup = PieceClock() if args.pieces else None, {}
    with idle_forked_processes(args.forked_workers), loop or contextlib.nullcontext(), pieces or contextlib.nullcontext():
        # The window, before the first batch is staged: announced once the workers are forked,
        # as the loader's batches are.
        for features in batches[: args.lookahead]:
            staging.announce(features)
        for k, features in enumerate(batches[: args.batches]):
            if pieces is not None and k == args.warmup:
                pieces_at_warmup = pieces.seconds()
            before = totals()
            arriving = features.to(device)
            if args.device == "cuda":
                torch.cuda.synchronize()
            beside = loop is not None and k % 2 == 1
            if beside:
                loop.on()
            started = time.perf_counter()
            staging.announce(batches[k + args.lookahead])  # the reader thread's part
            announced = time.perf_counter()
            staged = staging.stage(features, arrives_as=arriving, announced=True)  # the prefetch thread's
            announcing.append(announced - started)
            staging_seconds.append(time.perf_counter() - announced)
            staging.finish(staged, changed=True)
            if beside:
                loop.off()
            if k >= args.warmup:
                after = totals()
                lookups, hits = lookups + after[0] - before[0], hits + after[1] - before[1]
                fetched.append(after[2] - before[2])
    timed = range(args.warmup, args.batches)
    alone = [k for k in timed if loop is None or k % 2 == 0]
    out = {
        **_timings(announcing, staging_seconds, alone),
        "hit_rate": hits / lookups,
        "fetched_rows_per_batch": statistics.mean(fetched),
        "budget_bytes": plan.budget_bytes,
    }
    if pieces is not None:  # every timed batch, beside Python or not
        out["pieces_ms_per_batch"] = per_batch_ms(pieces_at_warmup, pieces.seconds(), args.batches - args.warmup)
    if loop is not None:
        beside = _timings(announcing, staging_seconds, [k for k in timed if k % 2 == 1])
        out["beside_python"] = beside | {"x_alone": beside["staging_ms_per_batch"] / out["staging_ms_per_batch"], "python_calls": loop.calls}
    return out


def _timings(announcing: list[float], staging_seconds: list[float], batches: list[int]) -> dict[str, float]:
    """Median milliseconds of ``batches``' staging, and of its reader and prefetch parts; and the
    prefetch part's mean, which counts the work done every few batches (the victim reserve's
    scan) that the median leaves out, as a run's throughput does."""
    return {
        "staging_ms_per_batch": 1e3 * statistics.median(announcing[k] + staging_seconds[k] for k in batches),
        "reader_ms_per_batch": 1e3 * statistics.median(announcing[k] for k in batches),
        "prefetch_ms_per_batch": 1e3 * statistics.median(staging_seconds[k] for k in batches),
        "prefetch_mean_ms_per_batch": 1e3 * statistics.mean(staging_seconds[k] for k in batches),
    }


@contextlib.contextmanager
def idle_forked_processes(count: int) -> Iterator[None]:
    """``count`` processes forked on entry that wait until the block ends: a DataLoader's
    workers, forked once the module's arrays exist and alive through training."""
    fork = multiprocessing.get_context("fork")
    released = fork.Event()
    workers = [fork.Process(target=released.wait) for _ in range(count)]
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        released.set()
        for worker in workers:
            worker.join()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="table sizes as a fraction of Criteo Kaggle's")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.01])
    parser.add_argument("--batches", type=int, default=30, help="batches staged per budget (the median of those after --warmup)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--profile-batches", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--forked-workers", type=int, default=4, help="idle processes forked while staging, as DataLoader workers")
    parser.add_argument("--lookahead", type=int, default=0, help="stage under the lookahead policy with this window (batches); 0: LFU")
    parser.add_argument("--beside-python", action="store_true",
                        help="stage every other timed batch beside a thread running Python, as a training loop does (reported apart)")
    parser.add_argument("--python-gap-us", type=float, default=10.0, help="--beside-python's Python between two of its torch calls, in microseconds")
    parser.add_argument("--pieces", action="store_true", help="also time staging's pieces (benchmarks/pieces.py) and report them")
    parser.add_argument("--staging-threads", type=int, nargs="+", default=[1],
                        help="stage with each of these numbers of threads (the strategy's staging_threads), in turn, every budget")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the runs this many times, alternated (each run's round with the median prefetch part reported)")
    parser.add_argument("--out", type=Path, default=RESULTS / "staging.json")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.batches:
        parser.error(f"--warmup must be in [0, --batches - 1] so that some batches are timed; got {args.warmup} of {args.batches}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    if min(args.staging_threads) < 1 or args.rounds < 1:
        parser.error(f"--staging-threads and --rounds must be >= 1, got {args.staging_threads} and {args.rounds}")
    if args.lookahead < 0:
        parser.error(f"--lookahead must be >= 0, got {args.lookahead}")
    if args.beside_python and args.batches - args.warmup < 2:
        parser.error("--beside-python alternates the timed batches: it needs --batches at least --warmup + 2")
    if not args.python_gap_us > 0:
        parser.error(f"--python-gap-us must be > 0, got {args.python_gap_us}")
    count = args.profile_batches + args.batches + args.lookahead
    dm = SyntheticCTRDataModule(scale=args.scale, embedding_dim=args.dim, batch_size=args.batch_size, num_train_samples=args.batch_size * count)
    source = dm.source("train")
    drawn = [source.batch(i * args.batch_size, (i + 1) * args.batch_size) for i in range(count)]
    stats = profile_batches(drawn[: args.profile_batches], dm.tables, progress=False)
    batches = [b.sparse_features for b in drawn[args.profile_batches :]]
    runs = {
        f"hotcache@{budget:g}" + ("" if threads == 1 else f"+{threads}threads"): (budget, threads)
        for budget in args.budgets
        for threads in args.staging_threads
    }
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for _ in range(args.rounds):  # alternated, so that the machine's drift hits every run alike
        for name, (budget, threads) in runs.items():
            rounds[name].append(stage_batches(args, budget, dm, stats, batches, threads))
    # The round whose prefetch part (a GPU step's bound) is the median, every round's figure beside it.
    results = {name: median_round(got, "prefetch_ms_per_batch") for name, got in rounds.items()}
    print(f"{'run':<26}{'staging ms/batch':>18}{'reader ms':>11}{'prefetch ms':>13}{'(mean)':>8}{'hit rate':>10}{'fetched rows/batch':>20}")
    for name, r in results.items():
        print(f"{name:<26}{r['staging_ms_per_batch']:>18.2f}{r['reader_ms_per_batch']:>11.2f}{r['prefetch_ms_per_batch']:>13.2f}"
              f"{r['prefetch_mean_ms_per_batch']:>8.2f}{r['hit_rate']:>10.3f}{r['fetched_rows_per_batch']:>20,.0f}")  # fmt: skip
        if "beside_python" in r:
            b = r["beside_python"]
            print(f"{'  beside Python':<26}{b['staging_ms_per_batch']:>18.2f}{b['reader_ms_per_batch']:>11.2f}{b['prefetch_ms_per_batch']:>13.2f}"
                  f"   x{b['x_alone']:.2f} of alone")  # fmt: skip
    print_pieces(results, "pieces_ms_per_batch")
    return write_report("staging", args, results)


if __name__ == "__main__":
    main()
