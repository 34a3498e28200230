"""Resuming a sharded checkpoint of memory-mapped tables: the memory the load takes, piece by piece against whole.

A run whose tables are larger than memory keeps them in memory-mapped files
(``host_storage``) and saves with ``checkpoint_shards=True``: each rank writes its host
shard beside the checkpoint. Resuming, the hotcache strategy hands each split table's arrays
on as the shard files' round-robin pieces, memory-mapped, which each rank copies into its
tiers (`lightning_hotcache.cache.exchange.RoundRobinRows`); before, every split table was
made whole in memory first (``whole``: `checkpoint.consolidated` with ``in_pieces=False``, as
every load did then). This saves a checkpoint of DLRM at ``--scale`` once (2 steps, a 1%
cache), then resumes it in a process of its own per variant, the checkpoint's files dropped
from the page cache first, and reports the peak anonymous memory (the process's own: what
cannot be paged out to the files) and file-backed memory of the resumed fit (its set-up,
tables written into fresh files, then the load: the fit ends at the checkpoint's step), and
the seconds the load took (reading the checkpoint and restoring the model). The variants must
restore the same rows (checked: each reports a checksum of its tables after the load).

    python benchmarks/resume_memory.py [--scale 0.25] [--dim 64] [--dir /tmp/resume_memory]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from beyond_ram import MemorySampler, drop_from_page_cache
from pieces import PieceClock
from report import job_in_process, write_report

import lightning_hotcache.strategies.hotcache as strategy_module
from datamodules import SyntheticCTRDataModule
from lightning_hotcache import HotCacheStrategy
from lightning_hotcache.checkpoint import files as checkpoint
from lightning_hotcache.embedding import hot_cold_modules
from models import DLRM

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("pieces", "whole")


def fit(args: argparse.Namespace, tables: Path, ckpt_path: Path | None = None) -> pl.Trainer:
    pl.seed_everything(0)
    dm = SyntheticCTRDataModule(scale=args.scale, embedding_dim=args.dim, batch_size=args.batch_size, num_train_samples=args.batch_size * 8,
                                shuffle=False)  # fmt: skip
    model = DLRM(dm.tables, dm.num_dense_features, defer_table_init=True, embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05})
    strategy = HotCacheStrategy(device_budget=0.01, host_storage=str(tables), checkpoint_shards=True, profile_batches=4, grow_budget_to_minimum=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, limit_val_batches=0, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return trainer


def tables_crc32(trainer: pl.Trainer) -> int:
    """One checksum of every table's rows and row-wise state after the load."""
    crc = 0
    for module in hot_cold_modules(trainer.lightning_module).values():
        crc = checkpoint.tensors_crc32(module.state_dict(), crc)
        crc = checkpoint.tensors_crc32(module.optimizer_state(), crc)
    return crc


def save(args: argparse.Namespace) -> dict[str, Any]:
    trainer = fit(args, args.dir / "tables-saved")
    trainer.save_checkpoint(args.dir / "saved.ckpt")
    shutil.rmtree(args.dir / "tables-saved")
    return {"table_bytes": sum(t.num_embeddings * t.embedding_dim * 4 for t in trainer.datamodule.tables)}


def resume(args: argparse.Namespace) -> dict[str, Any]:
    if args.job == "whole":  # every split table made whole in memory first, as every load did before
        strategy_module.consolidated = lambda loaded, path, in_pieces=False, **options: checkpoint.consolidated(loaded, path, **options)
    # The load: reading the checkpoint, then restoring the model from it.
    loading = PieceClock((("load", HotCacheStrategy, "load_checkpoint"), ("load", HotCacheStrategy, "load_model_state_dict")))
    saved = args.dir / "saved.ckpt"
    drop_from_page_cache([saved, *saved.parent.glob(f"{saved.name}.*")])
    tables = args.dir / f"tables-{args.job}"
    with MemorySampler() as memory, loading:
        trainer = fit(args, tables, ckpt_path=saved)
    out = {
        "peak_anon_gib": memory.peak["RssAnon"] / 2**30,
        "peak_file_gib": memory.peak["RssFile"] / 2**30,
        "load_s": loading.seconds()["load"],
        "global_step": trainer.global_step,
        "tables_crc32": tables_crc32(trainer),
    }
    shutil.rmtree(tables)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.25, help="the Criteo Kaggle cardinalities times this")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/resume_memory"), help="scratch folder (tables twice, the checkpoint once)")
    parser.add_argument("--out", type=Path, default=RESULTS / "resume_memory.json")
    # One process a job (the save, then each resume): a fit's process group and memory stay in it.
    parser.add_argument("--job", choices=("save", *VARIANTS), help=argparse.SUPPRESS)  # prints its JSON
    args = parser.parse_args(argv)
    if args.job:
        print(json.dumps(save(args) if args.job == "save" else resume(args)))
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    settings = ["--scale", str(args.scale), "--dim", str(args.dim), "--batch-size", str(args.batch_size), "--dir", str(args.dir)]
    saved, *runs = (job_in_process(__file__, settings, name) for name in ("save", *VARIANTS))
    results = dict(zip(VARIANTS, runs))
    table_bytes = saved["table_bytes"]
    shutil.rmtree(args.dir)
    if len({r["tables_crc32"] for r in results.values()}) != 1:
        raise RuntimeError(f"the variants restored different rows: {results}")
    print(f"{'variant':<10}{'peak anon GiB':>15}{'peak file GiB':>15}{'load s':>9}   ({table_bytes / 2**30:.2f} GiB of tables)")
    for name, r in results.items():
        print(f"{name:<10}{r['peak_anon_gib']:>15.2f}{r['peak_file_gib']:>15.2f}{r['load_s']:>9.1f}")
    write_report("resume_memory", args, results, table_bytes=table_bytes)


if __name__ == "__main__":
    main()
