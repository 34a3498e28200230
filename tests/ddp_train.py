"""Train a zoo model on tiny synthetic data with N CPU processes (gloo) and save its weights.

Run by tests/test_ddp.py as a script, because Lightning's DDP launcher starts the other
ranks by re-running the command that started rank 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import cpu_trainer, tiny_synthetic  # noqa: E402

from lightning_hotcache import HotCacheStrategy  # noqa: E402  (importing registers the strategies)
from lightning_hotcache.embedding import hot_cold_modules  # noqa: E402
from models import create_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dlrm")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--optimizer", default="rowwise_adagrad")
    parser.add_argument("--strategy", default="ddp", help="strategy for more than one process")
    parser.add_argument("--device-budget", type=float, default=None, help="hotcache budget (fraction)")
    parser.add_argument("--big-tables", action="store_true", help="tables up to 100k rows, so budgets split them")
    parser.add_argument("--sharded-checkpoint", type=Path, help="hotcache: also save a checkpoint with per-rank shards")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    pl.seed_everything(0)
    tables = {"scale": 0.01, "num_embeddings_cap": None} if args.big_tables else {}
    dm = tiny_synthetic(batch_size=args.batch_size, num_train_samples=4096, **tables)
    model = create_model(args.model, dm.tables, dm.num_dense_features, embedding_optimizer={"name": args.optimizer})
    strategy = args.strategy if args.devices > 1 else "auto"
    if strategy == "hotcache" and args.device_budget is not None:
        strategy = HotCacheStrategy(
            device_budget=args.device_budget, profile_batches=2, checkpoint_shards=args.sharded_checkpoint is not None
        )
    trainer = cpu_trainer(
        strategy=strategy,
        devices=args.devices,
        max_steps=args.steps,
        limit_val_batches=0,
    )
    trainer.fit(model, dm)
    if args.sharded_checkpoint is not None:
        trainer.save_checkpoint(args.sharded_checkpoint)
        trainer.strategy.checkpoint_shards = False
    state = trainer.strategy.lightning_module_state_dict()  # sharded tables gathered
    # Rows this rank's host stores hold, and rows fetched into its caches (hotcache only).
    caches = [c for m in hot_cold_modules(model).values() for c in m.caches.values() if c.host is not None]
    host_rows = sum(c.host.num_embeddings for c in caches)
    table_rows = sum(c.num_embeddings for c in caches)
    fetched = sum(c.counters.fetched_rows for c in caches)
    if trainer.is_global_zero:
        torch.save(
            {"state_dict": state, "world_size": trainer.world_size, "host_rows": host_rows, "table_rows": table_rows,
             "fetched_rows": fetched},
            args.out,
        )  # fmt: skip


if __name__ == "__main__":
    main()
