"""Train a zoo model on tiny synthetic data with N processes (gloo on CPU, NCCL on GPUs) and save its weights.

Run by the multi-process tests as a script, because Lightning's DDP launcher starts the other
ranks by re-running the command that started rank 0. ``ddp_train.py --runs PLAN.json`` runs
several trainings of one number of processes one after another in the same processes (each
in its own directory): a launch spends ~10 s importing before rank 0 starts the others, which
import again, so the tests launch the runs they compare with together (tests/launch.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from conftest import cpu_trainer, tiny_synthetic  # noqa: E402

from lightning_hotcache import HotCacheStrategy  # noqa: E402  (importing registers the strategies)
from lightning_hotcache.embedding import hot_cold_modules  # noqa: E402
from lightning_hotcache.distributed.global_batch import share_mean  # noqa: E402
from models import MODEL_REGISTRY, CTRModel, create_model  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dlrm")
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1, help="machines (under torchrun, one launch per node)")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--train-samples", type=int, default=4096)
    parser.add_argument("--val-samples", type=int, help="validate at each epoch's end on this many samples (default: none)")
    parser.add_argument("--shuffle", action="store_true", help="shuffle the training batches every epoch")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--optimizer", default="rowwise_adagrad")
    parser.add_argument("--strategy", default="ddp", help="strategy for more than one process")
    parser.add_argument("--device-budget", type=float, default=None, help="hotcache budget (fraction)")
    parser.add_argument("--big-tables", action="store_true", help="tables up to 100k rows, so budgets split them")
    parser.add_argument("--seed-per-rank", action="store_true", help="seed each rank apart (rank r: seed r)")
    parser.add_argument("--defer-tables", action="store_true", help="declare the tables on the meta device")
    parser.add_argument("--sharded-checkpoint", type=Path, help="hotcache: also save a checkpoint with per-rank shards")
    parser.add_argument("--prefetch-thread", action="store_true", help="hotcache: stage on a background thread")
    parser.add_argument("--kernel", default="auto", help="hotcache: the device tier's kernel (auto, fbgemm, pytorch)")
    parser.add_argument("--cache-policy", default="lfu", help="hotcache: the caches' policy")
    parser.add_argument("--staging-threads", type=int, default=1, help="hotcache: threads staging a batch's caches side by side")
    parser.add_argument(
        "--resume-from", type=int, nargs="+", help="checkpoint every 2 steps, then resume from these steps' checkpoints"
    )
    parser.add_argument("--resume-ckpt", type=Path, help="resume from this checkpoint (of a run with any number of processes)")
    parser.add_argument("--nan-at-step", type=int, help="poison one dense value of the last rank's batch at this step")
    parser.add_argument("--link-last-ranks-storage", action="store_true", help="hotcache: the last rank's host_storage folder a symlink")
    parser.add_argument("--manual-optimization", action="store_true", help="the model steps its optimizers itself")
    parser.add_argument("--predict-batches", type=int, help="predict this many batches of a plain DataLoader instead of fitting")
    parser.add_argument("--predict-to", type=Path, help="after the fit, predict the test split into this file (PredictionWriter)")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


class PoisonLastRank(pl.Callback):
    """NaN in one dense feature of the last rank's batch at one step: the other ranks' losses stay finite."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == trainer.world_size - 1:
            batch.dense_features[0, 0] = float("nan")


class ManualOptimization:
    """Mixed into a zoo model: its training step calls backward and the dense optimizer itself,
    as Lightning's manual optimization does (the tables' rule runs as in automatic mode)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx: int):
        optimizer = self.optimizers()
        logits, _ = self.logits_and_squared_norms(batch.dense_features, batch.sparse_features)
        loss = share_mean(self.loss_fn(logits, batch.labels), batch)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


class CountBatches(pl.Callback):
    """Training batches this process ran (a resumed fit runs only the rest)."""

    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, *args) -> None:
        self.count += 1


def check_non_finite_loss(args: argparse.Namespace) -> None:
    """Every rank stops at the poisoned step (none waits for the others in a collective):
    each writes the error it raised."""
    from lightning_hotcache._ops.guards import NonFiniteLossError

    try:
        fit(args, callbacks=[PoisonLastRank(args.nan_at_step)])
        error = "no error"
    except NonFiniteLossError as err:
        error = str(err)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    Path(f"{args.out}.rank{rank}").write_text(error)


def check_one_rank_refuses(args: argparse.Namespace) -> None:
    """Memory-mapped host storage whose last rank's folder is a symlink, which that rank
    refuses: every rank stops with that rank's message (none waits in a collective the refusing
    rank left), each writing the error it raised."""
    rows = Path("rows").resolve()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if rank == args.devices - 1:
        (rows / "elsewhere").mkdir(parents=True, exist_ok=True)
        (rows / f"rank{rank}").symlink_to(rows / "elsewhere")
    try:
        fit(args, host_storage=str(rows))
        error = "no error"
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    Path(f"{args.out}.rank{rank}").write_text(error)


def fit(
    args: argparse.Namespace, ckpt_path: Path | None = None, callbacks: Sequence[pl.Callback] = (), host_storage: str = "memory"
) -> tuple[pl.Trainer, CTRModel]:
    pl.seed_everything(int(os.environ.get("LOCAL_RANK", 0)) if args.seed_per_rank else 0)
    tables = {"scale": 0.01, "num_embeddings_cap": None} if args.big_tables else {}
    dm = tiny_synthetic(
        batch_size=args.batch_size, num_train_samples=args.train_samples, shuffle=args.shuffle,
        num_val_samples=args.val_samples or 2048, **tables,
    )  # fmt: skip
    model_class = MODEL_REGISTRY[args.model]
    if args.manual_optimization:
        model_class = type(f"Manual{model_class.__name__}", (ManualOptimization, model_class), {})
    model = model_class(
        dm.tables, dm.num_dense_features, embedding_optimizer={"name": args.optimizer}, defer_table_init=args.defer_tables
    )
    # hotcache runs in one process too when asked (e.g. to resume a run of several).
    processes = args.devices * args.num_nodes
    strategy = args.strategy if processes > 1 or args.strategy == "hotcache" else "auto"
    if strategy == "hotcache" and args.device_budget is not None:
        strategy = HotCacheStrategy(
            device_budget=args.device_budget, profile_batches=2, checkpoint_shards=args.sharded_checkpoint is not None,
            prefetch_thread=args.prefetch_thread, kernel=args.kernel, cache_policy=args.cache_policy,
            staging_threads=args.staging_threads, host_storage=host_storage,
        )
    trainer = cpu_trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.steps,
        limit_val_batches=1.0 if args.val_samples else 0,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=list(callbacks),
    )
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return trainer, model


def check_resume(args: argparse.Namespace) -> None:
    """The uninterrupted run, checkpointing every 2 steps, and a run resumed from each asked
    step: (global step, gathered weights) of each, by step (None: the uninterrupted run)."""
    directory = args.out.parent / f"{args.out.stem}-checkpoints"
    every2 = ModelCheckpoint(directory, "{step}", every_n_train_steps=2, save_top_k=-1)
    trainer, _ = fit(args, callbacks=[every2])
    runs = {None: (trainer.global_step, trainer.strategy.lightning_module_state_dict())}
    for step in args.resume_from:
        resumed, _ = fit(args, ckpt_path=directory / f"step={step}.ckpt")
        runs[step] = (resumed.global_step, resumed.strategy.lightning_module_state_dict())
    if trainer.is_global_zero:
        torch.save(runs, args.out)


def check_uneven_predict(args: argparse.Namespace) -> None:
    """``trainer.predict`` with a user's DataLoader of ``--predict-batches`` batches, which
    Lightning splits across the ranks without repeats: each rank writes the error it raised."""
    from torch.utils.data import DataLoader

    pl.seed_everything(0)
    dm = tiny_synthetic(batch_size=args.batch_size, scale=0.01, num_embeddings_cap=None)
    model = create_model(args.model, dm.tables, dm.num_dense_features)
    strategy = HotCacheStrategy(device_budget=args.device_budget, profile_batches=2) if args.device_budget else args.strategy
    trainer = cpu_trainer(strategy=strategy, devices=args.devices)
    source = dm.source("train")
    batches = [source.batch(k * args.batch_size, (k + 1) * args.batch_size) for k in range(args.predict_batches)]
    try:
        trainer.predict(model, DataLoader(batches, batch_size=None))
        error = "no error"
    except RuntimeError as err:
        error = str(err)
    Path(f"{args.out}.rank{trainer.global_rank}").write_text(error)


def run_all(plan: Path) -> None:
    """Each run of ``plan`` (name -> its directory and options) in its directory, in order; a
    run that raises leaves its traceback there (``error.rank<r>``) and the next one runs."""
    for spec in json.loads(plan.read_text()).values():
        os.chdir(spec["dir"])
        try:
            run(parse_args(spec["argv"]))
        except Exception:  # one failed comparison must not take the others' results with it
            rank = int(os.environ.get("LOCAL_RANK", 0))
            Path(f"error.rank{rank}").write_text(traceback.format_exc())


def main() -> None:
    if sys.argv[1:2] == ["--runs"]:
        run_all(Path(sys.argv[2]))
    else:
        run(parse_args())


def run(args: argparse.Namespace) -> None:
    if args.predict_batches is not None:
        check_uneven_predict(args)
        return
    if args.nan_at_step is not None:
        check_non_finite_loss(args)
        return
    if args.link_last_ranks_storage:
        check_one_rank_refuses(args)
        return
    if args.resume_from:
        check_resume(args)
        return
    counter = CountBatches()
    trainer, model = fit(args, ckpt_path=args.resume_ckpt, callbacks=[counter])
    if args.sharded_checkpoint is not None:
        trainer.save_checkpoint(args.sharded_checkpoint)
        trainer.save_checkpoint(args.sharded_checkpoint)  # over the first save: the shards of its every rank go
        trainer.strategy.checkpoint_shards = False
    if args.predict_to is not None:
        from lightning_hotcache import PredictionWriter

        trainer.callbacks.append(PredictionWriter(args.predict_to))
        trainer.predict(model, datamodule=trainer.datamodule, return_predictions=False)
    state = trainer.strategy.lightning_module_state_dict()  # sharded tables gathered
    # Rows this rank's host stores hold, and rows fetched into its caches (hotcache only).
    caches = [c for m in hot_cold_modules(model).values() for c in m.caches.values() if c.host is not None]
    host_rows = sum(c.host.num_embeddings for c in caches)
    table_rows = sum(c.num_embeddings for c in caches)
    fetched = sum(c.counters.fetched_rows for c in caches)
    kernels = sorted({m.kernel_note for m in hot_cold_modules(model).values()})
    if trainer.is_global_zero:
        torch.save(
            {"state_dict": state, "world_size": trainer.world_size, "host_rows": host_rows, "table_rows": table_rows,
             "fetched_rows": fetched, "batches_trained": counter.count, "kernels": kernels,
             "val": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")},
             "last_train_loss": float(trainer.callback_metrics.get("train/loss", float("nan")))},
            args.out,
        )  # fmt: skip


if __name__ == "__main__":
    try:
        main()
    finally:
        # Exiting with the process group alive lets gloo's worker threads outlive the
        # interpreter's finalization, which now and then aborts the process at exit
        # ("terminate called without an active exception"; pytorch/pytorch#179291).
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
