"""A NaN/inf training loss never reaches embedding rows, dense weights or checkpoints."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer, tiny_synthetic
from torch.utils.data import DataLoader
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch

from lightning_hotcache import HotCacheStrategy
from lightning_hotcache.embedding import hot_cold_modules
from lightning_hotcache._ops.guards import NonFiniteLossError, finite_loss_or_skip
from models import DLRM

OPTIMIZER = {"name": "rowwise_adagrad", "lr": 0.05}
BAD_BATCH = 3


def batches(poisoned: bool = True) -> tuple[list[Batch], object]:
    dm = tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=512, batch_size=64)
    dm.setup("fit")
    out = list(dm.train_dataloader())
    if poisoned:
        out[BAD_BATCH].dense_features[5, 2] = float("nan")
    return out, dm


def strategies() -> list:
    return ["auto", "torchrec", HotCacheStrategy(device_budget=0.05, profile_batches=4)]


def fit(model_class: type[DLRM], strategy, data: list[Batch], dm, **model_kwargs) -> tuple[DLRM, pl.Trainer]:
    pl.seed_everything(0)
    model = model_class(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER, **model_kwargs)
    trainer = cpu_trainer(strategy=strategy, max_epochs=1)
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None))
    return model, trainer


def saved_state(trainer: pl.Trainer, tmp_path) -> dict[str, torch.Tensor]:
    """The model as its checkpoint holds it (plain tensors under every strategy)."""
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    return torch.load(tmp_path / "saved.ckpt", weights_only=True)["state_dict"]


def assert_all_finite(model: DLRM, state: dict[str, torch.Tensor]) -> None:
    for name, tensor in state.items():
        assert torch.isfinite(tensor).all(), name
    for module in hot_cold_modules(model).values():
        for table, arrays in module.optimizer_state().items():
            for key, array in arrays.items():
                assert torch.isfinite(array).all(), (table, key)


@pytest.mark.parametrize("strategy", strategies(), ids=["auto", "torchrec", "hotcache"])
def test_nan_loss_stops_before_anything_learns_from_it(strategy, tmp_path) -> None:
    data, dm = batches()
    pl.seed_everything(0)
    model = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    trainer = cpu_trainer(strategy=strategy, max_epochs=1)
    with pytest.raises(NonFiniteLossError, match=f"global step {BAD_BATCH} .*batch {BAD_BATCH}\\)"):
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None))
    # What it learned is exactly the clean batches before the bad one.
    clean, _ = fit(DLRM, "auto", batches(poisoned=False)[0][:BAD_BATCH], dm)
    state = saved_state(trainer, tmp_path)
    torch.testing.assert_close(state, clean.state_dict(), rtol=1e-5, atol=1e-6)
    assert_all_finite(model, state)


@pytest.mark.parametrize("strategy", strategies(), ids=["auto", "torchrec", "hotcache"])
def test_skip_option_trains_as_if_the_batch_was_not_there(strategy, tmp_path) -> None:
    data, dm = batches()
    with pytest.warns(UserWarning, match=f"Skipped the batch at global step {BAD_BATCH}"):
        model, trainer = fit(DLRM, strategy, data, dm, non_finite_loss="skip")
    without, _ = fit(DLRM, "auto", data[:BAD_BATCH] + data[BAD_BATCH + 1 :], dm)
    state = saved_state(trainer, tmp_path)
    torch.testing.assert_close(state, without.state_dict(), rtol=1e-5, atol=1e-6)
    assert_all_finite(model, state)


class Unguarded(DLRM):
    """A user's model whose training_step does not check its loss."""

    checks_non_finite_loss = False

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self.loss_fn(self(batch.dense_features, batch.sparse_features), batch.labels).mean()


def test_hotcache_checks_the_loss_of_any_model(tmp_path) -> None:
    data, dm = batches()
    pl.seed_everything(0)
    model = Unguarded(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    trainer = cpu_trainer(strategy=HotCacheStrategy(device_budget=0.05, profile_batches=4), max_epochs=1)
    with pytest.raises(NonFiniteLossError, match=f"global step {BAD_BATCH} .*batch {BAD_BATCH}\\)"):
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None))
    assert_all_finite(model, saved_state(trainer, tmp_path))


def test_skip_with_several_processes_is_refused_at_fit_start() -> None:
    # Issue 29 item 7: it stopped at the first NaN, hours in, with Lightning's refusal of a None step.
    _, dm = batches(poisoned=False)
    model = DLRM(dm.tables, dm.num_dense_features, non_finite_loss="skip")
    model.trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)  # not launched
    with pytest.raises(ValueError, match=r"non_finite_loss='skip' needs one process; this fit has 2"):
        model.setup("fit")
    model.setup("validate")  # evaluation skips nothing


def test_unknown_action_is_refused() -> None:
    _, dm = batches(poisoned=False)
    with pytest.raises(ValueError, match="non_finite_loss must be one of"):
        DLRM(dm.tables, dm.num_dense_features, non_finite_loss="ignore")


@pytest.mark.parametrize("strategy", ["auto", HotCacheStrategy(device_budget=0.05, profile_batches=2)], ids=["auto", "hotcache"])
def test_empty_batch_gets_a_clear_error(strategy) -> None:
    # Before: an IndexError from inside torchrec's KeyedJaggedTensor.to_dict.
    data, dm = batches(poisoned=False)
    full = data[0]
    empty = Batch(
        dense_features=full.dense_features[:0],
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=full.sparse_features.keys(), values=full.sparse_features.values()[:0], lengths=full.sparse_features.lengths()[:0]
        ),
        labels=full.labels[:0],
    )
    with pytest.raises(ValueError, match="empty batch"):
        fit(DLRM, strategy, data[:2] + [empty], dm)


def _two_ranks_with_nan_on_rank_1() -> SimpleNamespace:
    """What finite_loss_or_skip reads of a trainer of 2 processes whose rank 1 has a NaN loss."""
    strategy = SimpleNamespace(
        all_gather=lambda loss: torch.stack([loss, torch.full_like(loss, float("nan"))]),
        reduce_boolean_decision=lambda decision, all=True: True,  # rank 1's NaN
    )
    return SimpleNamespace(strategy=strategy, global_step=7, current_epoch=0, world_size=2)


def test_one_process_checks_its_loss_without_a_collective() -> None:
    # Under a DDP-family strategy the check gathered every rank's loss, in one process too:
    # a collective with itself each step (an NCCL call on CUDA) that `auto` does not make.
    strategy = HotCacheStrategy(device_budget=0.05, profile_batches=4)
    gathered = []
    strategy.all_gather = lambda tensor, *args, **kwargs: gathered.append(tensor) or tensor  # type: ignore[method-assign]
    data, dm = batches(poisoned=False)
    fit(DLRM, strategy, data, dm)
    assert gathered == []


def test_error_names_the_rank_whose_loss_is_not_finite() -> None:
    # Issue 23 item 10: before, rank 0 said "not finite (0.693...)", quoting its own finite loss.
    own_loss = torch.tensor(0.6931)
    with pytest.raises(NonFiniteLossError, match=r"not finite on rank 1 \(nan\) at global step 7 ") as raised:
        finite_loss_or_skip(own_loss, _two_ranks_with_nan_on_rank_1(), 3, "raise")  # type: ignore[arg-type]
    assert "0.693" not in str(raised.value)
    with pytest.warns(UserWarning, match=r"Skipped the batch at global step 7 .*not finite on rank 1 \(nan\)"):
        assert not finite_loss_or_skip(own_loss, _two_ranks_with_nan_on_rank_1(), 3, "skip")  # type: ignore[arg-type]
