"""A run resumed from a checkpoint learns exactly what the uninterrupted run learns, wherever
the checkpoint was taken: mid-epoch, on the epoch's last batch, or at the epoch's end.

The uninterrupted run saves a checkpoint at every position it passes; each resumed run must
end with its step count and weights. Four batches per epoch: step 4 is the last batch of
epoch 0, step 6 is mid-epoch 1 (so a shuffled run must draw epoch 1's order there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer, exactness_matrix, forced_staging, tiny_synthetic
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hotcache import HotCacheStrategy
from lightning_hotcache.embedding import hot_cold_modules
from models import CTRModel, create_model
from launch import planned

# Checkpoint files the uninterrupted run writes (ModelCheckpoint's "{step}"/"end-{epoch}" names).
POSITIONS = {"mid_epoch": "step=6.ckpt", "last_batch": "step=4.ckpt", "epoch_end": "end-epoch=0.ckpt"}
# "hotcache": FBGEMM's fused kernel named (`auto` takes it on CUDA with FBGEMM's CUDA build; on
# a CPU row-wise Adagrad takes the PyTorch path). "hotcache/pytorch+thread": PyTorch's
# embedding_bag with staging on the prefetch thread in one process, what a CUDA run without
# FBGEMM's CUDA kernels gets by default. "hotcache/lookahead":
# the lookahead policy with a window of 2 of an epoch's 4 batches, so a mid-epoch checkpoint
# falls with batches announced and not yet staged; "+2threads": the same with each width's
# split tables in two caches staged side by side.
STRATEGIES = ["auto", "torchrec", "hotcache", "hotcache/pytorch+thread", "hotcache/lookahead", "hotcache/lookahead+2threads"]


def _strategy(name: str) -> str | HotCacheStrategy:
    # A budget below the tables' size, so rows really move between the cache and the host store.
    if name == "hotcache/pytorch+thread":
        return forced_staging(reader_thread=True, device_budget=0.05, profile_batches=2, kernel="pytorch", prefetch_thread=True)
    if name.startswith("hotcache/lookahead"):
        threads = 2 if name.endswith("+2threads") else 1
        return HotCacheStrategy(device_budget=0.05, profile_batches=2, cache_policy="lookahead", lookahead_batches=2, staging_threads=threads)
    return HotCacheStrategy(device_budget=0.05, profile_batches=2, kernel="fbgemm") if name == "hotcache" else name


def _fit(
    strategy: str,
    max_epochs: int,
    shuffle: bool,
    ckpt_path: Path | None = None,
    callbacks: Sequence[pl.Callback] = (),
    **trainer_kwargs: Any,
) -> tuple[CTRModel, pl.Trainer]:
    pl.seed_everything(0)
    # Tables up to ~100k rows against batches of 64, so a small budget splits them.
    dm = tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=4 * 64, batch_size=64, shuffle=shuffle)
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer={"name": "rowwise_adagrad"})
    trainer = cpu_trainer(
        strategy=_strategy(strategy),
        max_epochs=max_epochs,
        limit_val_batches=0,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        **trainer_kwargs,
    )
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model, trainer


def _weights(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    return trainer.strategy.lightning_module_state_dict()  # torchrec's sharded tables gathered


@dataclass
class Uninterrupted:
    state_dict: dict[str, torch.Tensor]
    global_step: int
    checkpoints: Path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int, bool], Uninterrupted]:
    """The uninterrupted run of each setting (trained once per module), with its checkpoints."""
    runs: dict[tuple[str, int, bool], Uninterrupted] = {}

    def run(strategy: str, max_epochs: int, shuffle: bool) -> Uninterrupted:
        key = (strategy, max_epochs, shuffle)
        if key not in runs:
            directory = tmp_path_factory.mktemp(f"{strategy.replace('/', '-')}-{max_epochs}-{shuffle}")
            callbacks = [
                ModelCheckpoint(directory, "{step}", every_n_train_steps=2, save_top_k=-1),
                ModelCheckpoint(directory, "end-{epoch}", save_top_k=-1, save_on_train_epoch_end=True),
            ]
            model, trainer = _fit(strategy, max_epochs, shuffle, callbacks=callbacks)
            if strategy.startswith("hotcache"):
                assert any(not t.on_device for t in trainer.strategy.plan.tables), "some table is split"
            if strategy.endswith("+2threads"):
                assert all("side by side by 2 threads" in m.kernel_note for m in hot_cold_modules(model).values())
            assert set(POSITIONS.values()) <= {p.name for p in directory.iterdir()}
            runs[key] = Uninterrupted(_weights(trainer), trainer.global_step, directory)
        return runs[key]

    return run


RUNS = {"2epochs": (2, False), "3epochs-shuffled": (3, True)}  # (max_epochs, shuffle)


@pytest.mark.parametrize(
    ("strategy", "run", "position"),
    exactness_matrix(
        ["strategy", "run", "position"], together={"position": list(POSITIONS), "run": list(RUNS)}, apart={"strategy": STRATEGIES}
    ),
)
def test_resumed_run_equals_uninterrupted(strategy: str, run: str, position: str, uninterrupted: Callable[..., Uninterrupted]) -> None:
    max_epochs, shuffle = RUNS[run]
    expected = uninterrupted(strategy, max_epochs, shuffle)
    _, trainer = _fit(strategy, max_epochs, shuffle, ckpt_path=expected.checkpoints / POSITIONS[position])
    assert trainer.global_step == expected.global_step
    torch.testing.assert_close(_weights(trainer), expected.state_dict)


@pytest.mark.parametrize(
    ("saved_by", "resumed_by"), [("torchrec", "auto"), ("torchrec", "hotcache"), ("auto", "torchrec"), ("hotcache", "torchrec")]
)
def test_resumed_under_another_strategy_equals_uninterrupted(
    saved_by: str, resumed_by: str, uninterrupted: Callable[..., Uninterrupted]
) -> None:
    """Every strategy saves the row-wise state in one format, TorchRec's fused optimizer too
    (its momentum gathered from its kernels' shards, and put back into them), so a run saved
    mid-epoch under one resumes under another and learns what the uninterrupted run learns (to
    float rounding: the strategies sum a batch's duplicate ids in other orders). Before, a
    TorchRec checkpoint held no momentum: resumed anywhere, row-wise Adagrad restarted."""
    expected = uninterrupted("auto", 2, False)
    saved = uninterrupted(saved_by, 2, False)
    _, trainer = _fit(resumed_by, 2, False, ckpt_path=saved.checkpoints / POSITIONS["mid_epoch"])
    assert trainer.global_step == expected.global_step
    torch.testing.assert_close(_weights(trainer), expected.state_dict, rtol=1e-5, atol=1e-5)


def test_reloaded_loader_resumes_after_the_last_batch(uninterrupted: Callable[..., Uninterrupted]) -> None:
    """With reload_dataloaders_every_n_epochs Lightning asks for the loader again once it has
    closed the restored epoch (FitLoop.reset), before the epoch loop's own reset."""
    expected = uninterrupted("auto", 3, True)  # reloading draws the same batches
    _, trainer = _fit(
        "auto", 3, True, ckpt_path=expected.checkpoints / POSITIONS["last_batch"], reload_dataloaders_every_n_epochs=1
    )
    assert trainer.global_step == expected.global_step
    torch.testing.assert_close(_weights(trainer), expected.state_dict)


TWO_PROCESS_RESUMES = {  # launched with the other two-process runs (tests/launch.py)
    strategy: planned("test_two_processes_resume_exactly", 2, 128, "rowwise_adagrad", strategy, *options,
                      "--train-samples=1024", "--shuffle", "--steps=12", "--resume-from", "4", "6")
    for strategy, options in [("ddp", []), ("torchrec", []), ("hotcache", ["--big-tables", "--device-budget=0.05"])]
}  # fmt: skip


@pytest.mark.parametrize("strategy", list(TWO_PROCESS_RESUMES))
def test_two_processes_resume_exactly(trained, strategy: str) -> None:
    """Two gloo processes under max_steps, 4 shuffled batches per rank and epoch: resumed on
    the last batch of epoch 0 (step 4) and mid-epoch 1 (step 6), each rank's sampler serves
    the rest of the uninterrupted run's batches."""
    runs = {step: run for step, run in trained(TWO_PROCESS_RESUMES[strategy]).items() if step != "dir"}
    steps, weights = runs.pop(None)
    assert steps == 12 and set(runs) == {4, 6}
    for step, (resumed_steps, resumed_weights) in runs.items():
        assert resumed_steps == steps, f"resumed from step {step}"
        torch.testing.assert_close(resumed_weights, weights, msg=lambda m: f"resumed from step {step}: {m}")


def test_resuming_mid_epoch_with_another_global_batch_is_refused_with_the_arithmetic(
    uninterrupted: Callable[..., Uninterrupted], tmp_path: Path
) -> None:
    # Issue 29 item 11: the resume point is counted in global batches, so 2 processes x B resumed
    # as 1 x B trained 1,025 samples of an 897-sample epoch. Here 1 x 64 resumed as 1 x 32.
    run = uninterrupted("auto", 2, False)
    pl.seed_everything(0)
    dm = tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=4 * 64, batch_size=32, shuffle=False)
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer={"name": "rowwise_adagrad"})
    trainer = cpu_trainer(max_epochs=2, limit_val_batches=0)
    message = r"saved 2 global batches of 64 samples \(128 samples\) into epoch 1; this run's global batches have 32"
    with pytest.raises(ValueError, match=message + r".*batch_size x processes = 64"):
        trainer.fit(model, dm, ckpt_path=run.checkpoints / POSITIONS["mid_epoch"])
    # From an epoch's end, any global batch goes on from the next epoch's first sample.
    cpu_trainer(max_epochs=2, limit_val_batches=0).fit(model, dm, ckpt_path=run.checkpoints / POSITIONS["epoch_end"])
