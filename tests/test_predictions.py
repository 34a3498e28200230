"""PredictionWriter: a predict run's scores in one file, in the data's order, from one process or several."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cpu_trainer, tiny_synthetic
from launch import planned
from torch.utils.data import DataLoader

from lightning_hotcache import HotCacheStrategy, PredictionWriter
from models import DLRM


def read_predictions(path: Path) -> torch.Tensor:
    if path.suffix == ".csv":
        header, *lines = path.read_text().splitlines()
        assert header == "prediction"
        return torch.tensor([float(line) for line in lines])
    if path.suffix == ".npy":
        return torch.from_numpy(np.load(path))
    return torch.load(path)


def trained_dlrm(strategy: object) -> tuple[DLRM, object]:
    dm = tiny_synthetic(scale=0.01, num_embeddings_cap=3000)
    torch.manual_seed(0)
    model = DLRM(dm.tables, dm.num_dense_features)
    cpu_trainer(max_steps=4, strategy=strategy).fit(model, dm)
    return model, dm


def split_tables() -> HotCacheStrategy:
    return HotCacheStrategy(device_budget=0.01, grow_budget_to_minimum=True, profile_batches=2)


@pytest.mark.parametrize("suffix", [".csv", ".npy", ".pt"])
@pytest.mark.parametrize("strategy", ["auto", "hotcache"])
def test_the_file_holds_what_predict_returns(strategy: str, suffix: str, tmp_path: Path) -> None:
    model, dm = trained_dlrm(split_tables() if strategy == "hotcache" else "auto")
    path = tmp_path / f"scores{suffix}"
    trainer = cpu_trainer(strategy=split_tables() if strategy == "hotcache" else "auto", callbacks=[PredictionWriter(path)])
    returned = torch.cat(trainer.predict(model, dm))
    assert len(returned) == dm.hparams.num_test_samples
    written = read_predictions(path)
    # The csv keeps 9 significant digits: every float32 back exactly.
    assert torch.equal(written, returned)
    assert not list(tmp_path.glob("*.tmp-*"))  # written under a temporary name, then renamed


def test_predictions_of_a_model_trained_under_hotcache_equal_auto(tmp_path: Path) -> None:
    hot, dm = trained_dlrm(split_tables())
    plain, _ = trained_dlrm("auto")
    for model, name in ((hot, "hot.pt"), (plain, "plain.pt")):
        cpu_trainer(strategy="auto", callbacks=[PredictionWriter(tmp_path / name)]).predict(model, dm, return_predictions=False)
    assert torch.equal(read_predictions(tmp_path / "hot.pt"), read_predictions(tmp_path / "plain.pt"))


def test_each_predict_dataloader_gets_a_file_of_its_own(tmp_path: Path) -> None:
    model, dm = trained_dlrm("auto")
    dm.setup("predict")
    source = dm.source("test")
    loaders = [DataLoader([source.batch(k * 256, (k + 1) * 256) for k in range(n)], batch_size=None) for n in (2, 3)]
    trainer = cpu_trainer(callbacks=[PredictionWriter(tmp_path / "scores.npy")])
    returned = trainer.predict(model, loaders)
    for index, batches in enumerate(returned):
        assert torch.equal(read_predictions(tmp_path / f"scores_{index}.npy"), torch.cat(batches))
    assert not (tmp_path / "scores.npy").exists()


def test_a_second_run_replaces_the_file(tmp_path: Path) -> None:
    model, dm = trained_dlrm("auto")
    path = tmp_path / "scores.csv"
    path.write_text("prediction\n0.5\n")
    cpu_trainer(callbacks=[PredictionWriter(path)], limit_predict_batches=2).predict(model, dm)
    assert len(read_predictions(path)) == 2 * dm.batch_size


def test_an_unknown_format_is_refused_naming_the_formats() -> None:
    with pytest.raises(ValueError, match=re.escape("PredictionWriter writes .csv, .npy, .pt files; 'scores.txt' has none")):
        PredictionWriter("scores.txt")


def test_a_missing_folder_is_refused_before_predicting(tmp_path: Path) -> None:
    model, dm = trained_dlrm("auto")
    seen = []
    model.predict_step = lambda batch, batch_idx: seen.append(batch_idx) or torch.zeros(1)  # type: ignore[method-assign]
    trainer = cpu_trainer(callbacks=[PredictionWriter(tmp_path / "missing" / "scores.csv")])
    with pytest.raises(FileNotFoundError, match="the output folder .*missing does not exist; create it first"):
        trainer.predict(model, dm)
    assert not seen


def test_predictions_of_another_shape_are_a_clear_error(tmp_path: Path) -> None:
    model, dm = trained_dlrm("auto")
    model.predict_step = lambda batch, batch_idx: {"p": torch.zeros(3)}  # type: ignore[method-assign]
    trainer = cpu_trainer(callbacks=[PredictionWriter(tmp_path / "scores.csv")])
    with pytest.raises(TypeError, match="predict_step should return a 1-D or 2-D tensor, but batch 0 returned dict"):
        trainer.predict(model, dm)
    assert not (tmp_path / "scores.csv").exists()


def test_rows_of_several_predictions_become_columns(tmp_path: Path) -> None:
    model, dm = trained_dlrm("auto")
    model.predict_step = lambda batch, batch_idx: torch.stack([batch.labels, 1 - batch.labels], 1)  # type: ignore[method-assign]
    path = tmp_path / "scores.csv"
    cpu_trainer(callbacks=[PredictionWriter(path)], limit_predict_batches=1).predict(model, dm)
    header, first, *_ = path.read_text().splitlines()
    assert header == "prediction_0,prediction_1"
    assert len(first.split(",")) == 2


TWO_PROCESSES = {
    strategy: planned("test_two_processes_write_the_one_process_order", 2, 128, "rowwise_adagrad", strategy, "--big-tables",
                      *(["--device-budget=0.05"] if strategy == "hotcache" else []), "--predict-to=predictions.csv")
    for strategy in ["hotcache", "ddp"]
}  # fmt: skip


@pytest.mark.parametrize("strategy", list(TWO_PROCESSES))
def test_two_processes_write_the_one_process_order(trained, strategy: str) -> None:
    run = trained(TWO_PROCESSES[strategy])
    written = read_predictions(run["dir"] / "predictions.csv")
    # The same weights in one process: each rank's share of each global batch, in rank order,
    # is the order one process reads the test split in.
    dm = tiny_synthetic(batch_size=256, scale=0.01, num_embeddings_cap=None)
    model = DLRM(dm.tables, dm.num_dense_features)
    model.load_state_dict(run["state_dict"])
    alone = torch.cat(cpu_trainer().predict(model, dm))
    assert written.shape == alone.shape == (dm.hparams.num_test_samples,)
    torch.testing.assert_close(written, alone, rtol=0, atol=1e-6)
