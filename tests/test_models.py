"""The zoo: every model trains, learns, keeps the embedding/dense split, and checkpoints."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer, tiny_synthetic
from torchrec import EmbeddingBagConfig

from models import DLRM, MODEL_REGISTRY, CTRModel, create_model

MODEL_NAMES = sorted(MODEL_REGISTRY)


def _model(name: str, dm, **kwargs) -> CTRModel:
    return create_model(name, dm.tables, dm.num_dense_features, **kwargs)


def _embedding_weights(model: CTRModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "embedding_bags" in k}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_backward(name: str) -> None:
    dm = tiny_synthetic()
    model = _model(name, dm)
    batch = dm.source("train").batch(0, 32)
    logits = model(batch.dense_features, batch.sparse_features)
    assert logits.shape == (32,)
    model.loss_fn(logits, batch.labels).backward()
    assert all(p.grad is not None and p.grad.is_sparse for p in model.embedding_parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.dense_parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_validation_loss_goes_down(name: str) -> None:
    pl.seed_everything(0)
    dm = tiny_synthetic(num_train_samples=8192, shuffle=True)
    model = _model(name, dm, dense_lr=3e-3)
    before = cpu_trainer().validate(model, dm, verbose=False)[0]["val/logloss"]
    cpu_trainer(max_epochs=2).fit(model, dm)
    after = cpu_trainer().validate(model, dm, verbose=False)[0]
    assert after["val/logloss"] < before - 0.01
    assert after["val/auc"] > 0.6
    assert 0.6 < after["val/bayes_auc"] < 1.0


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_only_looked_up_rows_move(optimizer: str) -> None:
    dm = tiny_synthetic(num_train_samples=256)
    model = _model("dlrm", dm, embedding_optimizer={"name": optimizer, "lr": 0.1})
    before = _embedding_weights(model)
    batch = dm.source("train").batch(0, 256)
    cpu_trainer(max_steps=1).fit(model, dm)
    after = _embedding_weights(model)
    for config, feature in zip(dm.tables, batch.sparse_features.keys()):
        key = f"sparse_arch.embedding_bag_collection.embedding_bags.{config.name}.weight"
        looked_up = torch.zeros(config.num_embeddings, dtype=torch.bool)
        looked_up[batch.sparse_features[feature].values()] = True
        moved = (after[key] != before[key]).any(dim=1)
        assert torch.equal(moved, looked_up), config.name


def test_dense_optimizer_excludes_embeddings() -> None:
    dm = tiny_synthetic()
    model = _model("dlrm", dm)
    optimizer = model.configure_optimizers()
    in_dense = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_dense.isdisjoint(id(p) for p in model.embedding_parameters())
    assert len(in_dense) == len(model.dense_parameters()) > 0


def test_checkpoint_resume_matches_straight_through(tmp_path) -> None:
    """Plain path exactness: 2 epochs straight == 1 epoch, checkpoint, resume for 1 more
    (dense Adam state and row-wise Adagrad state both restored)."""
    dm = tiny_synthetic(num_train_samples=1024)

    def fresh() -> CTRModel:
        pl.seed_everything(0)
        return _model("dlrm", dm, embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.1})

    straight = fresh()
    cpu_trainer(max_epochs=2).fit(straight, dm)

    first = fresh()
    trainer = cpu_trainer(max_epochs=1)
    trainer.fit(first, dm)
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = fresh()
    cpu_trainer(max_epochs=2).fit(resumed, dm, ckpt_path=tmp_path / "epoch1.ckpt")

    torch.testing.assert_close(resumed.state_dict(), straight.state_dict(), rtol=1e-5, atol=1e-7)

    # The checkpoint also loads stand-alone (weights_only: plain hyperparameters only).
    loaded = DLRM.load_from_checkpoint(tmp_path / "epoch1.ckpt")
    torch.testing.assert_close(loaded.state_dict(), first.state_dict())
    assert loaded.embedding_optimizer_config.name == "rowwise_adagrad"


def test_bad_tables_are_clear_errors() -> None:
    mixed = [
        EmbeddingBagConfig(name="a", num_embeddings=10, embedding_dim=8, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", num_embeddings=10, embedding_dim=4, feature_names=["fb"]),
    ]
    with pytest.raises(ValueError, match="embedding_dim"):
        DLRM(mixed, 4)
    with pytest.raises(ValueError, match="at least one embedding table"):
        DLRM([], 4)
    with pytest.raises(ValueError, match="Unknown model"):
        create_model("wide_and_deep", mixed[:1], 4)


class _WidthFromAttribute(DLRM):
    """The usual PyTorch habit: set what the builders read after super().__init__()."""

    def __init__(self, tables, num_dense_features: int, head_width: int = 4, **kwargs) -> None:
        super().__init__(tables, num_dense_features, **kwargs)
        self.head_width = head_width
        self.head_dropout = torch.nn.Dropout(0.0)

    def build_over_arch(self, in_features: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(in_features, self.head_width), self.head_dropout,
                                   torch.nn.Linear(self.head_width, 1))  # fmt: skip


def test_subclass_builders_see_attributes_set_after_super_init(tmp_path) -> None:
    dm = tiny_synthetic()
    assert "head_width" in inspect.signature(_WidthFromAttribute).parameters
    model = _WidthFromAttribute(dm.tables, dm.num_dense_features, head_width=3)
    assert model.over_arch[0].out_features == 3 and model.over_arch[1] is model.head_dropout
    batch = dm.source("train").batch(0, 8)
    assert model(batch.dense_features, batch.sparse_features).shape == (8,)
    trainer = cpu_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(model, dm)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    loaded = _WidthFromAttribute.load_from_checkpoint(tmp_path / "model.ckpt")
    torch.testing.assert_close(loaded.state_dict(), model.state_dict())
