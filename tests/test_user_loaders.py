"""A user's own DataLoader trains under hotcache exactly as under `auto` (one process)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer, tiny_synthetic
from torch.utils.data import DataLoader

from lightning_hotcache import HotCacheStrategy
from lightning_hotcache.profiling import profile_batches
from models import DLRM

OPTIMIZER = {"name": "rowwise_adagrad", "lr": 0.05}


def user_batches() -> tuple[list, object]:
    dm = tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=1024, batch_size=64)
    dm.setup("fit")
    return list(dm.train_dataloader()), dm


class Recorder(pl.Callback):
    """The first dense value of every training batch, in the order the model saw them."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(float(batch.dense_features[0, 0]))


def fit(strategy, shuffle: bool) -> tuple[DLRM, list[float]]:
    batches, dm = user_batches()
    pl.seed_everything(0)
    model = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    loader = DataLoader(batches, batch_size=None, shuffle=shuffle)
    recorder = Recorder()
    cpu_trainer(strategy=strategy, max_epochs=2, callbacks=[recorder]).fit(model, train_dataloaders=loader)
    return model, recorder.seen


@pytest.fixture(scope="module")
def stats_path(tmp_path_factory) -> str:
    batches, dm = user_batches()
    path = tmp_path_factory.mktemp("stats") / "stats.npz"
    profile_batches(batches, dm.tables).save(path)
    return str(path)


@pytest.mark.parametrize("shuffle", [False, True], ids=["in_order", "shuffled"])
@pytest.mark.parametrize("stats", ["profiled_from_loader", "from_file"])
def test_user_dataloader_keeps_its_order_and_matches_auto(shuffle, stats, stats_path) -> None:
    # Before: hotcache could not profile a loader given to fit(), and in one process
    # Lightning's injected DistributedSampler reshuffled an unshuffled loader.
    expected, expected_order = fit("auto", shuffle)
    given = {"stats_path": stats_path} if stats == "from_file" else {"profile_batches": 4}
    model, order = fit(HotCacheStrategy(device_budget=0.05, **given), shuffle)
    assert order == expected_order
    if not shuffle:
        batches, _ = user_batches()
        assert order[: len(batches)] == [float(b.dense_features[0, 0]) for b in batches]
    torch.testing.assert_close(model.state_dict(), expected.state_dict(), rtol=1e-5, atol=1e-6)



def test_torchrec_strategy_keeps_a_user_loader_as_auto_does() -> None:
    expected, expected_order = fit("auto", shuffle=True)
    model, order = fit("torchrec", shuffle=True)
    assert order == expected_order
    torch.testing.assert_close(
        model.state_dict()["over_arch.model.1.weight"], expected.state_dict()["over_arch.model.1.weight"], rtol=1e-5, atol=1e-6
    )
