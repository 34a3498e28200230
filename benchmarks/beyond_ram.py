"""Tables larger than RAM: hotcache over memory-mapped host files vs a plain mmap EmbeddingBag.

DLRM (SGD on the tables, Adam on the dense layers) on SyntheticCTRDataModule at ``--scale``
times the Criteo Kaggle cardinalities, embedding dim ``--dim``; the defaults make 84.4M rows,
40 GiB of float32 rows, 1.7x this machine's RAM. Two variants, each in its own process (so
its peak memory is its own), one after the other:

* ``mmap``: the baseline. Every table is a memory-mapped file (``np.memmap``) used directly
  as the EmbeddingBag's weight; the sparse update writes into the mapping, and the OS page
  cache is the only cache (4 KiB pages, so a hot row brings its cold neighbours along, and
  each fault reads up to 128 KiB around it).
* ``mmap_random``: the same, tuned: the mappings are advised MADV_RANDOM (one page per
  fault), as hotcache's own host files are.
* ``hotcache``: ``HotCacheStrategy(host_storage=<dir>)`` with a device budget (here: memory
  for cached rows and their bookkeeping) of ``--cache-fraction`` of RAM; the model declares
  its tables deferred (``defer_table_init``), so no table is ever whole in memory.
* ``hotcache_lookahead``: the same under ``cache_policy="lookahead"``, whose announced batches
  also have their coming misses paged in from the files ahead of staging
  (`lightning_hotcache.cache.read_ahead`); ``hotcache_lookahead_no_read_ahead`` the same with
  that turned off (``LIGHTNING_HOTCACHE_READ_AHEAD=0``): the read-ahead's A/B.

Both start from the same initial rows (`initial_rows`, one seed), written to files in
``--dir``; the files are made durable and dropped from the page cache before training, and
deleted after each run (the disk holds one copy at a time). Reported: samples/s over the
steps after ``--warmup``, peak resident memory split into anonymous (the process's own: the
cache, the model, the batches) and file-backed pages (page cache mapped into the process,
which the OS reclaims under pressure), and the bytes the process read from and wrote to disk
in the timed steps (and the rows read ahead). ``--variants`` runs some of them, ``--rounds``
times over in turn. Writes benchmarks/results/beyond_ram.json.

    python benchmarks/beyond_ram.py [--scale 2.5] [--dim 128] [--batch-size 2048] [--steps 40] [--dir DIR]
    python benchmarks/beyond_ram.py --variants hotcache_lookahead hotcache_lookahead_no_read_ahead --rounds 2 --steps 150 --warmup 70
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from clock import StepClock, cache_counters
from report import add_ratios, rounds_of_jobs, write_report
from torch import nn

from datamodules import SyntheticCTRDataModule
from lightning_hotcache import HotCacheStrategy
from lightning_hotcache.cache.host import map_rows
from lightning_hotcache.cache.lookahead import MAX_DEFAULT_WINDOW_BATCHES
from lightning_hotcache.embedding.table_init import initial_rows
from models import DLRM

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("mmap", "mmap_random", "hotcache", "hotcache_lookahead", "hotcache_lookahead_no_read_ahead")


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class MemorySampler:
    """Peaks of this process's resident memory (``/proc/self/status``), sampled on a thread."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile")

    def __init__(self, interval_s: float = 0.05) -> None:
        self.peak = dict.fromkeys(self.FIELDS, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)

    def _read(self) -> dict[str, int]:
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in self.FIELDS:
                out[key] = int(value.split()[0]) * 1024
        return out

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            for key, value in self._read().items():
                self.peak[key] = max(self.peak[key], value)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def disk_io() -> dict[str, int]:
    """Bytes this process made the storage layer read and write (``/proc/self/io``)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read_bytes": int(fields["read_bytes"]), "write_bytes": int(fields["write_bytes"])}


class DropPageCache(pl.Callback):
    """At the start of training, make the table files durable and drop them from the page
    cache, so both variants start with the same (empty) cache however they were written."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        drop_from_page_cache(list(self.directory.rglob("*.f32")))


def drop_from_page_cache(files: list[Path]) -> None:
    """Make ``files`` durable and drop their pages from the page cache: the next read is from disk."""
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def mmap_tables(model: DLRM, directory: Path, advise_random: bool) -> None:
    """Give each deferred table a memory-mapped weight holding its initial rows (the baselines)."""
    directory.mkdir(parents=True, exist_ok=True)
    collection = model.sparse_arch.embedding_bag_collection
    for table in collection.embedding_bag_configs():
        path, shape = directory / f"{table.name}.f32", (table.num_embeddings, table.embedding_dim)
        array = map_rows(path, *shape) if advise_random else np.memmap(path, np.float32, "w+", shape=shape)
        weight = torch.from_numpy(array)
        for start, rows in initial_rows(table, model.table_init_seed):
            weight[start : start + len(rows)] = rows
        collection.embedding_bags[table.name].weight = nn.Parameter(weight)


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    pl.seed_everything(0)
    torch.set_num_threads(args.threads)
    directory = args.dir / args.job
    lookahead = args.job.startswith("hotcache_lookahead")
    if args.job.endswith("no_read_ahead"):
        os.environ["LIGHTNING_HOTCACHE_READ_AHEAD"] = "0"  # read before the first announcement
    dm = SyntheticCTRDataModule(
        scale=args.scale, embedding_dim=args.dim, batch_size=args.batch_size, shuffle=False,
        # Under lookahead the loader reads a window of batches past the last step.
        num_train_samples=args.batch_size * (args.steps + args.profile_batches + (MAX_DEFAULT_WINDOW_BATCHES if lookahead else 0)),
        num_val_samples=args.batch_size,
    )  # fmt: skip
    model = DLRM(dm.tables, dm.num_dense_features, defer_table_init=True, embedding_optimizer={"name": "sgd", "lr": 0.05})
    rows = sum(t.num_embeddings for t in dm.tables)
    if args.job.startswith("mmap"):
        mmap_tables(model, directory, advise_random=args.job == "mmap_random")
        strategy: Any = "auto"
    else:
        budget = int(args.cache_fraction * ram_bytes())
        strategy = HotCacheStrategy(device_budget=budget, host_storage=str(directory), profile_batches=args.profile_batches,
                                    cache_policy="lookahead" if lookahead else "lfu")  # fmt: skip
    clock = StepClock(args.warmup, probe=lambda: {**disk_io(), **cache_counters(model)})
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[DropPageCache(directory), clock],
    )  # fmt: skip
    with MemorySampler() as memory:
        trainer.fit(model, dm)
    start, end = clock.at_start, clock.at_end
    out: dict[str, Any] = {
        "samples_per_s": clock.samples_per_s,
        "table_gib": rows * args.dim * 4 / 2**30,
        "peak_rss_gib": memory.peak["VmRSS"] / 2**30,
        "peak_anon_gib": memory.peak["RssAnon"] / 2**30,
        "peak_file_gib": memory.peak["RssFile"] / 2**30,
        "disk_read_mib_per_step": (end["read_bytes"] - start["read_bytes"]) / 2**20 / (args.steps - args.warmup),
        "disk_write_mib_per_step": (end["write_bytes"] - start["write_bytes"]) / 2**20 / (args.steps - args.warmup),
    }
    plan = getattr(trainer.strategy, "plan", None)
    if plan is not None:
        delta = {key: end[key] - start[key] for key in ("lookups", "hits", "fetched_rows", "read_ahead_rows")}
        out["cache_gib"] = plan.device_bytes / 2**30
        out["hit_rate"] = delta["hits"] / delta["lookups"]
        out["fetched_rows_per_step"] = delta["fetched_rows"] / (args.steps - args.warmup)
        out["read_ahead_rows_per_step"] = delta["read_ahead_rows"] / (args.steps - args.warmup)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=2.5)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--profile-batches", type=int, default=50)
    parser.add_argument("--cache-fraction", type=float, default=0.25, help="hotcache's memory cache, as a fraction of RAM")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/hotcache-beyond-ram"))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="the variants to run (default: all)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every variant, in turn; the median is reported")
    parser.add_argument("--job", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant in this process; prints its JSON
    parser.add_argument("--out", type=Path, default=RESULTS / "beyond_ram.json")
    args = parser.parse_args(argv)

    if args.job:
        directory = args.dir / args.job
        shutil.rmtree(directory, ignore_errors=True)
        try:
            result = run_variant(args)
        finally:
            shutil.rmtree(directory, ignore_errors=True)  # the disk holds one variant's files at a time
        print(json.dumps(result))
        return
    settings = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in
                ("scale", "dim", "batch_size", "steps", "warmup", "profile_batches", "cache_fraction", "threads", "dir")]  # fmt: skip
    names = [variant for variant in VARIANTS if variant in args.variants]
    results = rounds_of_jobs(__file__, settings, names, args.rounds)
    add_ratios(results, ("mmap", "mmap_random", "hotcache_lookahead_no_read_ahead"))
    table_gib = next(iter(results.values()))["table_gib"]
    print(f"RAM {ram_bytes() / 2**30:.1f} GiB, tables {table_gib:.1f} GiB")
    print(f"{'variant':<34}{'samples/s':>10}{'x mmap':>8}{'x random':>9}{'x no RA':>9}{'peak RSS':>10}{'anon':>8}{'file':>8}"
          f"{'read MiB/step':>15}{'write MiB/step':>16}{'hit rate':>10}{'RA rows/step':>14}")  # fmt: skip
    for name, r in results.items():
        paired = r.get("x_hotcache_lookahead_no_read_ahead_paired", float("nan"))
        print(
            f"{name:<34}{r['samples_per_s']:>10.0f}{r['x_mmap']:>8.2f}{r['x_mmap_random']:>9.2f}{paired:>9.2f}"
            f"{r['peak_rss_gib']:>9.1f}G{r['peak_anon_gib']:>7.1f}G"
            f"{r['peak_file_gib']:>7.1f}G{r['disk_read_mib_per_step']:>15.1f}{r['disk_write_mib_per_step']:>16.1f}"
            f"{r.get('hit_rate', float('nan')):>10.3f}{r.get('read_ahead_rows_per_step', 0):>14.0f}"
        )
    write_report("beyond_ram", args, results, ram_gib=ram_bytes() / 2**30)


if __name__ == "__main__":
    main()
