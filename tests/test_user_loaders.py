"""A user's own DataLoader trains under hotcache exactly as under `auto` (one process)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer, tiny_synthetic
from torch.utils.data import DataLoader

from lightning_hotcache import HotCacheStrategy
from lightning_hotcache.planner.profiling import profile_batches
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


class PositionLoader:
    """A plain stateful loader (Lightning saves its ``state_dict`` in checkpoints and loads it on
    resume): it resumes at the batch its state names, as torchdata's StatefulDataLoader does."""

    def __init__(self, batches: list) -> None:
        self.batches = batches
        self.pos = 0
        self._resume_at = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        self.pos, self._resume_at = self._resume_at, 0
        while self.pos < len(self.batches):
            self.pos += 1
            yield self.batches[self.pos - 1]
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self._resume_at = state["pos"]


def stateful_loader(kind: str, batches: list):
    if kind == "plain":
        return PositionLoader(batches)
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    return stateful_dataloader.StatefulDataLoader(batches, batch_size=None, shuffle=False)


def fit_resumed_at(strategy_of, kind: str, tmp_path, resume_step: int) -> DLRM:
    """Two epochs with a checkpoint every 4 steps, then a new run resumed from ``resume_step``'s."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    batches, dm = user_batches()
    pl.seed_everything(0)
    model = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    trainer = cpu_trainer(strategy=strategy_of(), max_epochs=2, callbacks=[saver], enable_checkpointing=True)
    trainer.fit(model, train_dataloaders=stateful_loader(kind, batches))
    pl.seed_everything(0)
    resumed = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    recorder = Recorder()
    trainer = cpu_trainer(strategy=strategy_of(), max_epochs=2, callbacks=[recorder])
    trainer.fit(resumed, train_dataloaders=stateful_loader(kind, batches), ckpt_path=str(tmp_path / f"step={resume_step}.ckpt"))
    first_resumed = float(batches[resume_step % len(batches)].dense_features[0, 0])
    assert recorder.seen[0] == first_resumed, "the resumed run did not start at the batch after the checkpoint's step"
    return resumed


STAGING = {
    "inline": dict(),
    "thread_depth3": dict(prefetch_thread=True, prefetch_depth=3),
    "lookahead": dict(cache_policy="lookahead", lookahead_batches=64),
}


@pytest.mark.parametrize(
    "kind, staging", [("plain", "inline"), ("plain", "thread_depth3"), ("plain", "lookahead"), ("torchdata", "lookahead")]
)
def test_a_stateful_loader_resumes_at_the_batch_after_the_trained_step(kind, staging, tmp_path) -> None:
    # Lightning checkpoints a stateful loader's state_dict; hotcache reads the loader ahead of
    # the step (staging, lookahead), and once saved the state of the batches read ahead: batch
    # 12 never trained (depth 1), or the epoch trained again from batch 0 (lookahead drained it).
    batches, _ = user_batches()
    expected, _ = fit("auto", shuffle=False)
    strategy_of = lambda: HotCacheStrategy(device_budget=0.05, profile_batches=4, **STAGING[staging])  # noqa: E731
    model = fit_resumed_at(strategy_of, kind, tmp_path, resume_step=12)
    torch.testing.assert_close(model.state_dict(), expected.state_dict(), rtol=1e-5, atol=1e-6)


def fit_with_generator(strategy, num_workers: int, generator_of: str) -> tuple[DLRM, list[float]]:
    """A loader shuffled by a generator of its own (PyTorch's documented reproducible shuffling)."""
    from torch.utils.data import RandomSampler

    batches, dm = user_batches()
    pl.seed_everything(0)
    model = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    generator = torch.Generator().manual_seed(0)
    if generator_of == "loader":
        loader = DataLoader(batches, batch_size=None, shuffle=True, generator=generator, num_workers=num_workers)
    else:
        sampler = RandomSampler(batches, generator=generator)
        loader = DataLoader(batches, batch_size=None, sampler=sampler, num_workers=num_workers)
    recorder = Recorder()
    cpu_trainer(strategy=strategy, max_epochs=2, callbacks=[recorder]).fit(model, train_dataloaders=loader)
    return model, recorder.seen


@pytest.mark.parametrize(
    "num_workers, generator_of, stats",
    [(0, "loader", "profiled_from_loader"), (0, "sampler", "from_file"), (2, "loader", "from_file")],
)
def test_a_loader_with_its_own_generator_trains_in_autos_order(num_workers, generator_of, stats, stats_path) -> None:
    # Profiling and the batch size check iterate the loader before training; they restored the
    # global RNGs only, so the loader's own generator was one shuffle ahead of `auto`'s.
    expected, expected_order = fit_with_generator("auto", num_workers, generator_of)
    given = {"stats_path": stats_path} if stats == "from_file" else {"profile_batches": 4}
    model, order = fit_with_generator(HotCacheStrategy(device_budget=0.05, **given), num_workers, generator_of)
    assert order == expected_order
    torch.testing.assert_close(model.state_dict(), expected.state_dict(), rtol=1e-5, atol=1e-6)


def test_a_batch_without_a_feature_names_it_and_the_batch() -> None:
    # Issue 69 item 4: hotcache said "forward() got a different training batch than the next
    # prefetched one" (auto: KeyError: 'cat_25').
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    batches, dm = user_batches()

    def without_last_feature(batch: Batch) -> Batch:
        kjt = batch.sparse_features
        keep = kjt.keys()[:-1]
        lengths = kjt.lengths().view(len(kjt.keys()), -1)[:-1].flatten()
        values = kjt.values()[: int(lengths.sum())]
        return Batch(batch.dense_features, KeyedJaggedTensor(keep, values, lengths=lengths), batch.labels)

    broken = [*batches[:3], without_last_feature(batches[3]), *batches[4:]]
    pl.seed_everything(0)
    model = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    missing = batches[3].sparse_features.keys()[-1]
    with pytest.raises(KeyError, match=rf"training batch 3 of this epoch lacks the feature\(s\) \['{missing}'\]"):
        cpu_trainer(strategy=HotCacheStrategy(device_budget=0.05, profile_batches=2), max_epochs=1).fit(
            model, train_dataloaders=DataLoader(broken, batch_size=None)
        )


def test_a_feature_no_table_reads_is_warned_of_once() -> None:
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    batches, dm = user_batches()

    def with_extra_feature(batch: Batch) -> Batch:
        kjt = batch.sparse_features
        samples = kjt.stride()
        values = torch.cat([kjt.values(), torch.zeros(samples, dtype=kjt.values().dtype)])
        lengths = torch.cat([kjt.lengths(), torch.ones(samples, dtype=kjt.lengths().dtype)])
        return Batch(batch.dense_features, KeyedJaggedTensor([*kjt.keys(), "unknown"], values, lengths=lengths), batch.labels)

    pl.seed_everything(0)
    model = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    with pytest.warns(UserWarning, match=r"sparse features \['unknown'\] are looked up by no table") as warned:
        cpu_trainer(strategy=HotCacheStrategy(device_budget=0.05, profile_batches=2), max_steps=4).fit(
            model, train_dataloaders=DataLoader([with_extra_feature(b) for b in batches], batch_size=None)
        )
    assert sum("looked up by no table" in str(w.message) for w in warned) == 1
