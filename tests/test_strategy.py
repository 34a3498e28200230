"""Trainer(strategy="hotcache") learns exactly what strategy="auto" learns, for every zoo model."""

from __future__ import annotations

import copy
import itertools
import os
import pickle
import threading
from pathlib import Path
from typing import Iterator

import lightning.pytorch as pl
import pytest
import torch
from conftest import UserModel, cpu_trainer, exactness_matrix, forced_staging, mappings_at, tiny_synthetic
from lightning.pytorch.strategies import StrategyRegistry

import lightning_hotcache
from lightning_hotcache import AccessProfiler, HotColdPlanner, HotCacheStrategy, RowWiseOptimizerConfig
from lightning_hotcache._ops.switches import Switch
from lightning_hotcache._ops.background import BACKGROUND_NICE, background_priority_supported
from lightning_hotcache.cli import main, model_tables
from lightning_hotcache.embedding import hot_cold_modules
from lightning_hotcache.optim.rowwise import ROW_STATE_KEY
from lightning_hotcache.strategies.hotcache import _PrefetchingLoader
from models import MODEL_REGISTRY, CTRModel, create_model

OPTIMIZER = {"name": "rowwise_adagrad", "lr": 0.05}


def data(**overrides):
    # Tables up to ~100k rows against batches of 64, so small budgets really split them.
    settings = dict(scale=0.01, num_embeddings_cap=None, num_train_samples=1024, num_val_samples=512, batch_size=64)
    return tiny_synthetic(**{**settings, **overrides})


def fit(name: str, strategy, epochs: int = 1, optimizer: dict = OPTIMIZER, **trainer_kwargs) -> tuple[CTRModel, pl.Trainer, dict]:
    pl.seed_everything(0)
    dm = data()
    model = create_model(name, dm.tables, dm.num_dense_features, embedding_optimizer=optimizer)
    trainer = cpu_trainer(strategy=strategy, max_epochs=epochs, **trainer_kwargs)
    trainer.fit(model, dm)
    metrics = trainer.validate(model, dm, verbose=False)[0]
    return model, trainer, metrics


@pytest.fixture(scope="module")
def stats_paths(tmp_path_factory) -> dict[str, Path]:
    """Each zoo model's access stats, profiled on its own tables (first-order tables included)."""
    dm = data()
    folder = tmp_path_factory.mktemp("stats")
    paths = {}
    for name in MODEL_REGISTRY:
        profiler = AccessProfiler(model_tables(create_model(name, dm.tables, dm.num_dense_features)))
        for batch in dm.train_dataloader():
            profiler.observe(batch.sparse_features)
        paths[name] = folder / f"{name}.npz"
        profiler.stats().save(paths[name])
    return paths


@pytest.fixture(scope="module")
def stats_path(stats_paths) -> Path:
    return stats_paths["dlrm"]


@pytest.fixture(scope="module")
def baselines() -> dict[str, tuple[dict, dict]]:
    out = {}
    for name in MODEL_REGISTRY:
        model, _, metrics = fit(name, "auto")
        out[name] = (model.state_dict(), metrics)
    return out


def minimum_budget(stats_path: Path, depth: int = 1, device: str = "cpu") -> int:
    from lightning_hotcache.planner.profiling import AccessStats

    stats = AccessStats.load(stats_path)
    # The planner counts the batches in flight as the strategy does on ``device`` (a prefetch
    # thread on CUDA, none on CPU).
    planner = HotColdPlanner(1.0, RowWiseOptimizerConfig(**OPTIMIZER), prefetch_depth=depth, device=device)
    return planner.minimum_bytes(stats.tables, stats)


def assert_same_val_metrics(metrics: dict, expected: dict) -> None:
    """Validation metrics of two trainings whose weights agree to float rounding.

    The log loss is continuous in the weights and is held tight. The AUC is a rank statistic:
    on ``data()``'s 512 validation samples it moves in steps of one positive-negative pair
    (about 1.5e-5), so a rounding-level difference in the summation order (FBGEMM's kernel
    against PyTorch's, or another CPU's SIMD path) may swap a near-tied pair or two; it
    gets a few pairs' room, far below what a wrongly updated row would move it."""
    assert metrics["val/logloss"] == pytest.approx(expected["val/logloss"], rel=1e-5, abs=1e-6)
    assert metrics["val/auc"] == pytest.approx(expected["val/auc"], abs=1e-4)


CASES = exactness_matrix(
    ["name", "budget", "policy"],
    together={"budget": [1.0, 0.05, "minimum"], "policy": ["lfu", "lru", "static", "lookahead"]},
    apart={"name": sorted(MODEL_REGISTRY)},
)


@pytest.mark.parametrize(("name", "budget", "policy"), CASES)
def test_hotcache_matches_auto(name, budget, policy, stats_paths, baselines) -> None:
    assert_hotcache_matches_auto(name, budget, policy, stats_paths[name], baselines[name])


def assert_hotcache_matches_auto(
    name: str, budget: float | str, policy: str, stats_path: Path, baseline: tuple[dict, dict], **trainer_kwargs
) -> None:
    """hotcache at ``budget`` ("minimum": the least its batches in flight need) with ``policy``
    trains zoo model ``name`` to ``baseline`` (auto's state dict and metrics on the same device)."""
    device = trainer_kwargs.get("accelerator", "cpu")
    device_budget = minimum_budget(stats_path, device=device) if budget == "minimum" else budget
    strategy = HotCacheStrategy(device_budget=device_budget, stats_path=str(stats_path), cache_policy=policy)
    model, trainer, metrics = fit(name, strategy, **trainer_kwargs)
    assert hot_cold_modules(model), "the strategy swapped in hot/cold tables"
    if budget != 1.0:
        assert any(not t.on_device for t in trainer.strategy.plan.tables)
    expected_state, expected_metrics = baseline
    # Float tolerance only: duplicate ids sum in another order when rows sit in other slots,
    # and Adagrad magnifies that rounding on rows whose accumulated gradient is tiny.
    torch.testing.assert_close(model.state_dict(), expected_state, rtol=1e-5, atol=1e-5)
    assert_same_val_metrics(metrics, expected_metrics)


TRITON_FIT = dict(batch_size=16, num_train_samples=168, num_val_samples=16)  # Triton's interpreter runs a program at a time


@pytest.mark.parametrize(
    ("name", "budget", "policy", "directory"),
    # All `full`: in the fast suite test_step_graph's graphed hotcache fit trains a Triton fit on
    # the device directory against `auto`, and test_embedding_exactness the host directory's.
    [pytest.param("dlrm", 0.001, "lfu", "host", marks=pytest.mark.full), pytest.param("dlrm", 0.001, "lfu", "device", marks=pytest.mark.full),
     pytest.param("deepfm", 0.001, "lookahead", "host", marks=pytest.mark.full),
     pytest.param("fm", 1.0, "static", "device", marks=pytest.mark.full)],
)  # fmt: skip
def test_the_triton_kernel_trains_what_auto_trains(name, budget, policy, directory, tmp_path, monkeypatch) -> None:
    # On a CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest):
    # its lookups and in-kernel row steps through a fit with eviction, and validation; the
    # caches' directory in device memory (CUDA's default, switched on here; by default the
    # graphed fit of test_step_graph runs it against auto) or on the host.
    monkeypatch.setenv(Switch.DEVICE_DIRECTORY.variable, "1" if directory == "device" else "0")
    def trained(strategy) -> tuple[CTRModel, dict]:
        pl.seed_everything(0)
        dm = data(**TRITON_FIT)
        model = create_model(name, dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
        trainer = cpu_trainer(strategy=strategy, max_epochs=1)
        trainer.fit(model, dm)
        return model, trainer.validate(model, dm, verbose=False)[0]

    expected, expected_metrics = trained("auto")
    options = dict(device_budget=budget, profile_batches=2, cache_policy=policy, kernel="triton", grow_budget_to_minimum=True)
    # The device directory staged as on CUDA: a reader thread announces, a prefetch thread prefetches.
    strategy = forced_staging(reader_thread=True, prefetch_thread=True, **options) if directory == "device" else HotCacheStrategy(**options)
    model, metrics = trained(strategy)
    assert all(m.kernel_note.startswith("triton TBE") for m in hot_cold_modules(model).values())
    assert strategy.uses_reader_thread == (directory == "device")
    on_device = ["cache directory in device memory" in m.kernel_note for m in hot_cold_modules(model).values()]
    assert all(on_device) == (directory == "device" and budget != 1.0), on_device
    if budget != 1.0:
        assert sum(c.counters.evicted_rows for m in hot_cold_modules(model).values() for c in m.caches.values()) > 0
    torch.testing.assert_close(model.state_dict(), expected.state_dict(), rtol=1e-5, atol=1e-5)
    assert metrics["val/logloss"] == pytest.approx(expected_metrics["val/logloss"], rel=1e-5, abs=1e-6)


def test_the_triton_kernel_on_a_cpu_outside_the_interpreter_is_a_clear_error(stats_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    strategy = HotCacheStrategy(device_budget=0.05, stats_path=str(stats_path), kernel="triton")
    with pytest.raises(ValueError, match=r"kernel='triton' cannot run here: Triton's kernels run on CUDA devices .*Use kernel='auto'"):
        fit("dlrm", strategy)


@pytest.mark.parametrize("policy", ["lookahead", "lfu"])
def test_the_loader_announces_each_batch_ahead_of_staging(policy: str) -> None:
    from torchrec import KeyedJaggedTensor

    events: list[tuple[str, int]] = []

    class Module:  # records what the loader tells a hot/cold module
        input_features = {"f"}

        def reads(self, features: KeyedJaggedTensor, batch_index: int | None = None) -> bool:
            return True

        def announce(self, features: KeyedJaggedTensor) -> None:
            events.append(("announce", int(features.values()[0])))

    batches = [KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([i]), torch.tensor([1])) for i in range(5)]
    strategy = HotCacheStrategy(cache_policy=policy, lookahead_batches=2)
    for batch in _PrefetchingLoader(batches, strategy)._read_ahead([Module()]):  # type: ignore[list-item]
        events.append(("stage", int(batch.values()[0])))
    if policy == "lfu":  # each checked and deduplicated just before
        assert events == [(event, i) for i in range(5) for event in ("announce", "stage")]
        return
    # Batch i is staged once batch i + 2 is announced (the last ones when the loader ends).
    assert events == [("announce", 0), ("announce", 1), ("announce", 2), ("stage", 0), ("announce", 3), ("stage", 1),
                      ("announce", 4), ("stage", 2), ("stage", 3), ("stage", 4)]  # fmt: skip
    for bad in (0, -1):
        with pytest.raises(ValueError, match=r"lookahead_batches must be at least 1"):
            HotCacheStrategy(cache_policy="lookahead", lookahead_batches=bad)
    with pytest.raises(ValueError, match="needs prefetch_depth >= 1"):
        HotCacheStrategy(cache_policy="lookahead", prefetch_depth=0)


def test_profiles_when_no_stats_and_logs_cache_metrics() -> None:
    _, trainer, _ = fit("dlrm", HotCacheStrategy(device_budget=0.1, profile_batches=4), epochs=1)
    plan = trainer.strategy.plan
    assert plan is not None and any(not t.on_device for t in plan.tables)
    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    trainer = cpu_trainer(strategy=HotCacheStrategy(device_budget=0.1, profile_batches=4), max_steps=3)
    trainer.fit(model, dm)
    assert 0.0 <= float(trainer.callback_metrics["cache/hit_rate"]) <= 1.0
    assert "cache/h2d_bytes_per_sample" in trainer.callback_metrics
    # Issue 29 item 19: the staging wrapper Lightning keeps as the train dataloader recursed forever
    # in copy and unpickling (its __getattr__ ran before it had a loader to forward to).
    copied = copy.copy(trainer.train_dataloader)
    assert copied.loader is trainer.train_dataloader.loader and len(copied) == len(trainer.train_dataloader)
    bare = pickle.loads(pickle.dumps(_PrefetchingLoader([1, 2], strategy=None)))  # type: ignore[arg-type]
    assert bare.loader == [1, 2] and not hasattr(bare, "sampler")


@pytest.mark.parametrize("shards", [False, True], ids=["gathered", "sharded"])
def test_resume_matches_straight_through_and_loads_under_auto(tmp_path, stats_path, shards) -> None:
    def strategy() -> HotCacheStrategy:
        return HotCacheStrategy(device_budget=0.05, stats_path=str(stats_path), cache_policy="lru", checkpoint_shards=shards)

    straight, _, _ = fit("dlrm", strategy(), epochs=2)

    pl.seed_everything(0)
    dm = data()
    first = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    trainer = cpu_trainer(strategy=strategy(), max_epochs=1)
    trainer.fit(first, dm)
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    checkpoint = torch.load(tmp_path / "epoch1.ckpt", weights_only=True)
    assert checkpoint["hotcache_plan"]["budget_bytes"] > 0
    if shards:  # split tables live in the rank file, not in the checkpoint
        split = [t.name for t in trainer.strategy.plan.tables if not t.on_device]
        assert not any(k.endswith(f"{split[0]}.weight") for k in checkpoint["state_dict"])
        assert len(list(tmp_path.glob("epoch1.ckpt.*.rank0-of-1"))) == 1
        consolidated = main(["consolidate", str(tmp_path / "epoch1.ckpt"), "--out", str(tmp_path / "plain.ckpt")])
        torch.testing.assert_close(consolidated["state_dict"], first.state_dict())
        checkpoint = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    assert all("momentum" in s for s in checkpoint[lightning_hotcache.optim.rowwise.ROW_STATE_KEY].values())

    pl.seed_everything(0)
    resumed = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    cpu_trainer(strategy=strategy(), max_epochs=2).fit(resumed, dm, ckpt_path=tmp_path / "epoch1.ckpt")
    torch.testing.assert_close(resumed.state_dict(), straight.state_dict(), rtol=1e-5, atol=1e-6)

    hot_metrics = cpu_trainer(strategy=strategy()).validate(first, dm, verbose=False)[0]
    plain = create_model("dlrm", dm.tables, dm.num_dense_features)
    # The same checkpoint (consolidated, when sharded) evaluates under the plain strategy.
    plain_checkpoint = tmp_path / ("plain.ckpt" if shards else "epoch1.ckpt")
    plain_metrics = cpu_trainer().validate(plain, dm, ckpt_path=plain_checkpoint, verbose=False)[0]
    assert plain_metrics["val/auc"] == pytest.approx(hot_metrics["val/auc"], abs=1e-6)


def test_presets_are_registered_and_build_the_strategy() -> None:
    for name, (_, init_args) in lightning_hotcache.STRATEGY_PRESETS.items():
        assert name in StrategyRegistry
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, HotCacheStrategy)
        for key, value in init_args.items():
            assert getattr(strategy, key) == value


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"cache_policy": "fifo"}, "Unknown cache policy 'fifo'"),
        ({"prefetch_depth": -1}, "prefetch_depth"),
        ({"profile_batches": 0}, "profile_batches"),
        ({"stats_path": "/nonexistent/stats.npz"}, "hotcache profile"),
    ],
)
def test_bad_options_are_clear_errors(kwargs, error) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match=error):
        HotCacheStrategy(**kwargs)


def test_budget_below_minimum_fails_before_training(stats_path) -> None:
    with pytest.raises(ValueError, match="the minimum is"):
        fit("dlrm", HotCacheStrategy(device_budget=1000, stats_path=str(stats_path)))


def test_model_without_tables_trains_unchanged() -> None:
    class Plain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=4)

    model = Plain()
    with pytest.warns(UserWarning, match="no torchrec EmbeddingBagCollection"):
        trainer = cpu_trainer(strategy="hotcache", max_steps=2)
        trainer.fit(model)
    assert trainer.global_step == 2 and trainer.strategy.plan is None


@pytest.mark.parametrize("name", sorted(MODEL_REGISTRY))
def test_torchrec_matches_auto(name, baselines, tmp_path) -> None:
    model, trainer, metrics = fit(name, "torchrec")
    expected_state, expected_metrics = baselines[name]
    gathered = trainer.strategy.lightning_module_state_dict()
    torch.testing.assert_close(gathered, expected_state, rtol=1e-5, atol=1e-5)
    assert_same_val_metrics(metrics, expected_metrics)
    if name == "dlrm":  # its checkpoint holds plain tables, so it evaluates under auto
        trainer.save_checkpoint(tmp_path / "torchrec.ckpt")
        dm = data()
        plain = create_model(name, dm.tables, dm.num_dense_features)
        plain_metrics = cpu_trainer().validate(plain, dm, ckpt_path=tmp_path / "torchrec.ckpt", verbose=False)[0]
        assert plain_metrics["val/auc"] == pytest.approx(metrics["val/auc"], abs=1e-6)
        # Saved after the fit (the model unwrapped), it holds the fused optimizer's momentum,
        # which is auto's row-wise Adagrad state.
        saved = torch.load(tmp_path / "torchrec.ckpt", weights_only=False)[ROW_STATE_KEY]
        auto_model, _, _ = fit(name, "auto")
        expected = {key: auto_model.embedding_optimizer.state[w] for key, w in auto_model._plain_table_weights().items()}
        assert set(saved) == set(expected) and all(set(saved[key]) == {"momentum"} for key in saved)
        torch.testing.assert_close({k: v["momentum"] for k, v in saved.items()}, {k: v["momentum"] for k, v in expected.items()})


@pytest.mark.parametrize("zoo", [True, False], ids=["zoo", "user-model"])
def test_a_model_left_sharded_by_a_torchrec_fit_is_refused_by_the_next_fit(zoo: bool) -> None:
    """After a fit, the torchrec strategy leaves TorchRec's sharded modules in the model; a
    second fit of it failed inside TorchRec (a ShardedTensor indexed) under torchrec, and under
    auto and hotcache found no tables and trained around them. Every strategy now refuses it
    with the way on: a new model from the checkpoint."""
    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features) if zoo else UserModel(dm.tables)
    cpu_trainer(strategy="torchrec", max_steps=2, limit_val_batches=0).fit(model, dm)
    for strategy in ("torchrec", "hotcache", "auto") if zoo else ("torchrec", "hotcache"):
        with pytest.raises(ValueError, match="TorchRec's sharded modules, left in it by an earlier fit.*ckpt_path"):
            cpu_trainer(strategy=strategy, max_steps=2, limit_val_batches=0).fit(model, dm)


def test_torchrec_refuses_rules_it_cannot_match() -> None:
    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer={"name": "adam"})
    with pytest.raises(ValueError, match="no row-lazy 'adam'"):
        cpu_trainer(strategy="torchrec", max_steps=1).fit(model, dm)


class _Killed(RuntimeError):
    pass


class _KillAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise _Killed(f"killed at step {self.step}")


@pytest.mark.parametrize("strategy", ["auto", "hotcache", pytest.param("hotcache-device-directory", marks=pytest.mark.full)])
def test_run_killed_mid_epoch_resumes_exactly(strategy, tmp_path, stats_path, monkeypatch) -> None:
    """Checkpoint every 5 steps, die at step 23 (epoch 2 of 16-batch epochs), resume from
    step 20: the replayed batches are the epoch's remaining ones and the tables end equal (with
    the caches' directory in device memory too: CUDA's default, its kernels here in Triton's
    interpreter)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if strategy == "hotcache-device-directory":
        monkeypatch.setenv(Switch.DEVICE_DIRECTORY.variable, "1")

    def make():
        if strategy == "auto":
            return "auto"
        kernel = "triton" if strategy == "hotcache-device-directory" else "auto"
        return HotCacheStrategy(device_budget=0.05, stats_path=str(stats_path), cache_policy="lfu", kernel=kernel)

    straight, _, _ = fit("dlrm", make(), epochs=2)

    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    every5 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    trainer = cpu_trainer(strategy=make(), max_epochs=2, enable_checkpointing=True, callbacks=[every5, _KillAt(23)])
    with pytest.raises(_Killed):
        trainer.fit(model, dm)

    pl.seed_everything(0)
    resumed = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    trainer = cpu_trainer(strategy=make(), max_epochs=2)
    trainer.fit(resumed, dm, ckpt_path=tmp_path / "epoch=1-step=20.ckpt")
    assert trainer.global_step == 32
    torch.testing.assert_close(resumed.state_dict(), straight.state_dict(), rtol=1e-5, atol=1e-5)


def test_waits_for_the_prefetch_thread_are_counted() -> None:
    import queue

    from lightning_hotcache.strategies.hotcache import StagingWaits, _next_item

    waits = StagingWaits()
    ready: queue.Queue = queue.Queue()
    ready.put("staged in time")
    assert _next_item(ready, waits) == "staged in time"
    assert (waits.batches, waits.seconds) == (0, 0.0)
    threading.Timer(0.05, ready.put, args=("staged late",)).start()
    assert _next_item(ready, waits) == "staged late"
    assert waits.batches == 1 and waits.seconds >= 0.04


def test_a_background_thread_hands_on_its_items_in_order_and_its_error_and_stops_when_closed() -> None:
    from lightning_hotcache.strategies.hotcache import _in_thread

    def names() -> Iterator[str]:
        yield threading.current_thread().name
        yield "second"
        raise ValueError("a bad batch")

    items = _in_thread(names(), depth=1, name="hotcache-test")
    assert next(items) == "hotcache-test" and next(items) == "second"
    with pytest.raises(ValueError, match="a bad batch"):
        next(items)

    closed = threading.Event()

    def endless() -> Iterator[int]:
        try:
            n = 0
            while True:
                yield n
                n += 1
        finally:
            closed.set()

    items = _in_thread(endless(), depth=2, name="hotcache-test")
    assert [next(items) for _ in range(5)] == [0, 1, 2, 3, 4]
    items.close()  # stops the thread, which closes its generator
    assert closed.is_set() and not any(t.name == "hotcache-test" for t in threading.enumerate())


@pytest.mark.parametrize("strategy", ["hotcache", "auto"])
def test_no_row_copy_helper_thread_outlives_a_fit(strategy, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a host with cores to spare, large row copies start helper threads (`host_rows`):
    # the hotcache strategy's teardown and the zoo model's on_fit_end end them.
    from lightning_hotcache._ops.host_rows import SPLIT_VALUES, put_rows

    monkeypatch.setenv("LIGHTNING_HOTCACHE_COPY_THREADS", "3")
    put_rows(torch.zeros(4 * SPLIT_VALUES // 64, 64), torch.arange(3 * SPLIT_VALUES // 64), torch.ones(3 * SPLIT_VALUES // 64, 64))
    assert [t.name for t in threading.enumerate()].count("hotcache-row-copy_0") == 1
    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    chosen = HotCacheStrategy(device_budget=0.1, profile_batches=4) if strategy == "hotcache" else "auto"
    cpu_trainer(strategy=chosen, max_steps=2).fit(model, dm)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("hotcache-row-copy")]


@pytest.mark.parametrize(("thread", "reader"), [(True, True), (True, False), (False, False)], ids=["thread+reader", "thread", "inline"])
def test_cache_metrics_log_staging_waits_where_a_prefetch_thread_stages(thread, reader) -> None:
    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    strategy = forced_staging(reader_thread=reader, device_budget=0.1, profile_batches=4, prefetch_thread=thread)
    announcing = _LoggedEveryStep("cache/announcing_ms")
    trainer = cpu_trainer(strategy=strategy, max_steps=4, log_every_n_steps=1, callbacks=[announcing])
    trainer.fit(model, dm)
    assert strategy.uses_reader_thread == reader
    assert ("cache/staging_wait_ms" in trainer.callback_metrics) == ("cache/staging_ms" in trainer.callback_metrics) == thread
    work = strategy.staging_work
    if thread:
        assert 0.0 <= float(trainer.callback_metrics["cache/staging_waits"]) <= 1.0
        assert 0.0 < float(trainer.callback_metrics["cache/staging_cpu_ms"]) <= float(trainer.callback_metrics["cache/staging_ms"]) + 1.0
        # The thread's time per batch: every batch it staged (beyond the 4 steps' own: those
        # queued, and one staged waiting for room in the queue), each with a reading and a
        # staging time, CPU time within the wall time.
        assert 4 <= work.batches <= 4 + strategy.prefetch_depth + 1
        # (the two clocks are read a moment apart: a thread that never waits may show a hair more CPU)
        assert work.reading_seconds > 0 and 0 < work.staging_cpu_seconds <= work.staging_seconds + 1e-3
        # Logged at every step: what was announced since the last log (the reader may run
        # ahead and have announced the last batches before the last step's log).
        assert work.announcing_seconds > 0 and max(announcing.values) > 0
        # The reader and prefetch threads end with the epoch (max_steps cut it short).
        assert not [t.name for t in threading.enumerate() if t.name.startswith("hotcache-")]
    else:
        assert strategy.staging_waits.batches == 0 and work.batches == 0


class _LoggedEveryStep(pl.Callback):
    """The values a metric had at each training batch's end."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.name in trainer.callback_metrics:
            self.values.append(float(trainer.callback_metrics[self.name]))

    def on_train_end(self, trainer, pl_module) -> None:
        self.on_train_batch_end(trainer, pl_module, None, None, 0)


class _SeesPrefetchThread(pl.Callback):
    seen = False
    seen_reader = False
    wrapped_in_ddp = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import threading

        from torch.nn.parallel import DistributedDataParallel

        self.seen |= any(t.name == "hotcache-prefetch" for t in threading.enumerate())
        self.seen_reader |= any(t.name == "hotcache-reader" for t in threading.enumerate())
        self.wrapped_in_ddp |= isinstance(trainer.strategy.model, DistributedDataParallel)


@pytest.mark.parametrize("kernel", ["fbgemm", "pytorch"])
@pytest.mark.parametrize(("thread", "reader"), [(True, True), (True, False), (False, False)], ids=["thread+reader", "thread", "inline"])
def test_prefetch_thread_and_inline_staging_match_auto(thread, reader, kernel, stats_path, baselines) -> None:
    # kernel="pytorch" with both threads in one process is what a CUDA machine without
    # FBGEMM's CUDA build runs by default.
    import threading

    watcher = _SeesPrefetchThread()
    strategy = forced_staging(
        reader_thread=reader, device_budget=0.05, stats_path=str(stats_path), prefetch_thread=thread, prefetch_depth=2, kernel=kernel
    )
    model, trainer, _ = fit("dlrm", strategy, callbacks=[watcher])
    assert (watcher.seen, watcher.seen_reader) == (thread, reader)
    assert not watcher.wrapped_in_ddp  # one process: nothing for DDP to reduce, as under auto
    assert all(m.kernel_note.startswith(kernel) for m in hot_cold_modules(model).values())
    assert not any(t.name == "hotcache-prefetch" for t in threading.enumerate())  # shut down cleanly
    torch.testing.assert_close(model.state_dict(), baselines["dlrm"][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("thread", "policy"), [(False, "lfu"), (True, "lfu"), (False, "lookahead")], ids=["inline", "thread", "lookahead"])
def test_validation_in_mid_epoch_at_the_minimum_budget_trains_as_auto(thread: bool, policy: str, stats_path, baselines) -> None:
    """Validation every 5 steps: its batches are staged and released while training batches
    wait staged ahead. They hold their rows only while they are read (a watermark of released
    tickets kept them locked until the training batches ahead were done: the 8 validation
    batches overflowed a cache sized for the batches in flight, "a batch needs 210 rows that
    are not on the device, but only 118 of 2652 dynamic cache slots are free"), and the
    training learns what it learns without them."""
    strategy = HotCacheStrategy(
        device_budget=0.001, grow_budget_to_minimum=True, stats_path=str(stats_path), prefetch_thread=thread, cache_policy=policy
    )
    with pytest.warns(UserWarning, match="planning with the minimum"):
        model, trainer, metrics = fit("dlrm", strategy, val_check_interval=5)
    assert any(not t.on_device for t in trainer.strategy.plan.tables)
    assert all(c.num_locked() == 0 for m in hot_cold_modules(model).values() for c in m.caches.values())
    torch.testing.assert_close(model.state_dict(), baselines["dlrm"][0], rtol=1e-5, atol=1e-5)
    assert_same_val_metrics(metrics, baselines["dlrm"][1])


@pytest.mark.parametrize(("thread", "policy"), [(False, "lfu"), (True, "lookahead")], ids=["inline-lfu", "thread-lookahead"])
def test_staging_threads_train_as_auto(thread: bool, policy: str, stats_path, baselines) -> None:
    """Each width's split tables in two caches, staged side by side (`staging_threads=2`), at
    the minimum budget: the same weights and metrics as `auto`, every row unlocked after."""
    strategy = HotCacheStrategy(
        device_budget=0.001, grow_budget_to_minimum=True, stats_path=str(stats_path), prefetch_thread=thread, cache_policy=policy,
        staging_threads=2,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="planning with the minimum"):
        model, trainer, metrics = fit("dlrm", strategy)
    modules = hot_cold_modules(model).values()
    assert all("staged side by side by 2 threads" in m.kernel_note for m in modules), [m.kernel_note for m in modules]
    assert all(c.num_locked() == 0 for m in modules for c in m.caches.values())
    assert not [t.name for t in threading.enumerate() if t.name.startswith("hotcache-staging")]  # none outlives the fit
    # The staging threads' CPU time was counted for whoever staged (the prefetch thread's
    # `cache/staging_cpu_ms` adds its own).
    assert sum(sum(m._staging.side_by_side._helper_cpu.values()) for m in modules) > 0
    if thread:
        assert trainer.strategy.staging_work.staging_cpu_seconds > 0
    torch.testing.assert_close(model.state_dict(), baselines["dlrm"][0], rtol=1e-5, atol=1e-5)
    assert_same_val_metrics(metrics, baselines["dlrm"][1])


class _HostArraysOutsideWorkers(pl.Callback):
    """Whether, once the loader's workers are forked, the module's large host arrays are kept
    out of them (the ``dc`` VmFlag), and which workers the loader started."""

    def __init__(self) -> None:
        self.flags: list[bool] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        if self.flags:
            return
        for module in hot_cold_modules(pl_module).values():
            for cache in module.caches.values():
                for array in [] if cache.host is None else cache.host.arrays.values():
                    if array.numel() * array.element_size() >= 2 << 20:
                        self.flags.append("dc" in mappings_at(array)[1])


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps (not Linux)")
def test_forked_loader_workers_train_exactly_without_the_host_arrays(stats_path, baselines) -> None:
    """DataLoader workers are forked once the strategy built the host stores, which they do
    not get (`cache/host_arrays.py`): a worker that read one would crash the fit. With the
    prefetch thread and two workers, hotcache learns what auto learned without workers."""
    watcher = _HostArraysOutsideWorkers()
    strategy = forced_staging(reader_thread=True, device_budget=0.05, stats_path=str(stats_path), prefetch_thread=True)
    pl.seed_everything(0)
    dm = data(num_workers=2)
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    cpu_trainer(strategy=strategy, max_epochs=1, callbacks=[watcher]).fit(model, dm)
    assert watcher.flags and all(watcher.flags), "host stores of 2 MiB or more are kept out of forked workers"
    torch.testing.assert_close(model.state_dict(), baselines["dlrm"][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [{}, {"prefetch_thread": True, "reader_thread": True}], ids=["inline", "thread+reader"])
def test_bad_ids_found_on_the_prefetch_thread_surface_in_training(threads) -> None:
    from torchrec import EmbeddingBagConfig

    pl.seed_everything(0)
    dm = data()
    tables = [EmbeddingBagConfig(**{**t.__dict__, "num_embeddings": 1}) if t.name == "t_cat_2" else t for t in dm.tables]
    model = create_model("dlrm", tables, dm.num_dense_features)
    with pytest.raises(ValueError, match="Feature 'cat_2' of table 't_cat_2' has id"):
        cpu_trainer(strategy=forced_staging(device_budget=1.0, **threads), max_steps=2).fit(model, dm)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("hotcache-")]


@pytest.mark.parametrize("strategy", ["hotcache", "torchrec", "auto"])
def test_a_finished_fit_leaves_nothing_alive(strategy) -> None:
    # Sweeps and notebooks fit many models in one process: each must be freed after its fit.
    import gc
    import weakref

    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    trainer = cpu_trainer(strategy=strategy, max_steps=3, limit_val_batches=0)
    trainer.fit(model, dm)
    tables = [weakref.ref(t) for t in model.parameters()] + [weakref.ref(m) for m in hot_cold_modules(model).values()]
    del model, trainer, dm  # the datamodule keeps a reference to its trainer
    gc.collect()
    assert not [ref for ref in tables if ref() is not None]


def test_profiling_leaves_the_global_rngs_to_no_later_garbage_collection(tmp_path, monkeypatch) -> None:
    """Profiling reads the loader with the global RNGs restored afterwards. The restore once
    lived in a generator's cleanup, so a profile left unfinished in a reference cycle (here:
    the traceback of a fit that failed right after profiling, its disk full) reset the RNGs
    whenever the garbage collector reached it, e.g. while a later model drew its weights."""
    import errno
    import gc
    import os

    def disk_full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", disk_full)
    def fit_that_fails_after_profiling() -> None:
        pl.seed_everything(0)
        dm = data()
        model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
        strategy = HotCacheStrategy(device_budget=0.1, profile_batches=2, host_storage=str(tmp_path / "rows"))
        with pytest.raises(OSError, match="too little disk") as raised:  # at the host files, after profiling
            cpu_trainer(strategy=strategy, max_steps=1).fit(model, dm)
        assert raised.value.errno == errno.ENOSPC  # `raised` and its traceback's frames: a cycle left to the collector

    fit_that_fails_after_profiling()
    torch.manual_seed(1234)  # any later state: nothing may set it back
    later = torch.random.get_rng_state()
    gc.collect()
    assert torch.equal(torch.random.get_rng_state(), later)


@pytest.mark.parametrize("strategy", ["hotcache", "torchrec"])
@pytest.mark.parametrize("accumulation", ["trainer", "scheduler"])
def test_gradient_accumulation_is_refused_where_rows_step_in_backward(strategy: str, accumulation: str) -> None:
    # Rows stepped on every micro-batch (fused backward, hooks) trained another model than `auto`'s
    # accumulation (row-wise Adagrad tables 0.31 apart): refused, with the batch size to use instead.
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    kwargs = {"accumulate_grad_batches": 4} if accumulation == "trainer" else {
        "callbacks": [GradientAccumulationScheduler({0: 1, 2: 4})]
    }  # fmt: skip
    trainer = cpu_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0, **kwargs)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=4 .*4x larger batch size"):
        trainer.fit(model, dm)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cpu_trainer(strategy=strategy, **kwargs).validate(model, dm, verbose=False)  # evaluation accumulates nothing
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_to_torchrec_during_a_fit_is_refused_and_a_deep_copy_is_the_way() -> None:
    # Issue 29 item 8: from a callback mid-fit, the next step failed with advice about sparse gradients.
    from lightning_hotcache import to_torchrec

    class ExportMidFit(pl.Callback):
        def __init__(self) -> None:
            self.copy: torch.nn.Module | None = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 1:
                with pytest.raises(RuntimeError, match="this fit is still training them.*copy.deepcopy"):
                    to_torchrec(pl_module)
                self.copy = copy.deepcopy(pl_module)

    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    callback = ExportMidFit()
    cpu_trainer(strategy=HotCacheStrategy(device_budget=0.1, profile_batches=4), max_steps=4, callbacks=[callback]).fit(model, dm)
    assert hot_cold_modules(model) and callback.copy is not None and not hot_cold_modules(callback.copy)
    assert to_torchrec(model) is model and not hot_cold_modules(model)  # after the fit


def test_torchrec_hands_its_ddp_settings_to_the_dense_ddp_and_unwraps_after_fit() -> None:
    # Issue 29 item 18: the settings were kept on the strategy and TorchRec's defaults used instead
    # (static_graph forced on), and the model stayed wrapped in DistributedModelParallel after fit.
    from torch.nn.parallel import DistributedDataParallel

    from lightning_hotcache import TorchRecStrategy

    class InspectDenseDDP(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            ddp = trainer.strategy.model._dmp_wrapped_module
            assert isinstance(ddp, DistributedDataParallel)
            self.settings = (ddp.find_unused_parameters, ddp.static_graph, ddp.bucket_bytes_cap)

    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    inspect = InspectDenseDDP()
    strategy = TorchRecStrategy(find_unused_parameters=True, bucket_cap_mb=5)
    trainer = cpu_trainer(strategy=strategy, max_steps=2, limit_val_batches=0, callbacks=[inspect])
    trainer.fit(model, dm)
    assert inspect.settings == (True, False, 5 * 2**20)
    assert trainer.model is model


@pytest.mark.parametrize(
    "settings", [{"start_method": "spawn"}, {"ddp_comm_hook": lambda state, bucket: None}, {"model_averaging_period": 4}]
)
def test_torchrec_refuses_ddp_settings_it_cannot_honour(settings: dict) -> None:
    from lightning_hotcache import TorchRecStrategy

    with pytest.raises(ValueError, match=f"torchrec strategy cannot honour {next(iter(settings))}="):
        TorchRecStrategy(**settings)


@pytest.mark.skipif(not background_priority_supported(), reason="per-thread priority is Linux's")
@pytest.mark.parametrize("background", [None, False], ids=["default", "step_priority"])
def test_staging_threads_run_at_background_priority_on_the_cpu(background, monkeypatch) -> None:
    from lightning_hotcache.embedding.collection import HotColdEmbeddingBagCollection

    seen: dict[str, set[int]] = {}

    def recorded(method):
        def record(self, *args, **kwargs):
            seen.setdefault(threading.current_thread().name, set()).add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return method(self, *args, **kwargs)

        return record

    monkeypatch.setattr(HotColdEmbeddingBagCollection, "prefetch", recorded(HotColdEmbeddingBagCollection.prefetch))
    monkeypatch.setattr(HotColdEmbeddingBagCollection, "announce", recorded(HotColdEmbeddingBagCollection.announce))
    step_priority = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    strategy = forced_staging(reader_thread=True, step_priority=background is False, device_budget=0.1, profile_batches=4, prefetch_thread=True)
    cpu_trainer(strategy=strategy, max_steps=3).fit(model, dm)
    staging = BACKGROUND_NICE if background is None else step_priority
    assert strategy.stages_in_background == (background is None)
    assert seen == {"hotcache-reader": {staging}, "hotcache-prefetch": {staging}}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == step_priority


@pytest.mark.parametrize(
    ("settings", "note"),
    [
        ({}, "inline on the training loop, 1 batch ahead"),
        ({"prefetch_thread": True, "prefetch_depth": 3}, "on a prefetch thread at background priority, 3 batches ahead"),
        ({"prefetch_thread": True, "reader_thread": True, "step_priority": True, "prefetch_depth": 1},
         "on a prefetch thread and a reader thread at the step's priority, 1 batch ahead"),
        ({"prefetch_thread": True, "prefetch_depth": 0}, "by each batch's own forward (prefetch_depth=0: nothing staged ahead)"),
        ({"staging_threads": 2}, "inline on the training loop, 1 batch ahead, 2 caches side by side"),
    ],
    ids=["inline", "thread", "thread+reader", "nothing-ahead", "inline+2threads"],
)  # fmt: skip
def test_the_log_says_how_batches_are_staged(settings, note, caplog) -> None:
    if not background_priority_supported() and "background" in note:
        pytest.skip("per-thread priority is Linux's")
    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    with caplog.at_level("INFO"):
        cpu_trainer(strategy=forced_staging(device_budget=0.1, profile_batches=4, **settings), max_steps=1).fit(model, dm)
    assert f"hotcache staging: {note}" in caplog.text


@pytest.mark.full  # the default's choice is held in the fast suite by test_step_graph's graphed hotcache fit
@pytest.mark.parametrize("prefetch_thread", [None, True], ids=["default", "thread-asked-for"])
def test_caches_with_their_directory_on_the_device_stage_on_the_training_loop(prefetch_thread, monkeypatch, caplog) -> None:
    # As on CUDA: the default would stage on a prefetch thread (here the tables count as large),
    # but with every cache's directory in device memory forward stages each batch on the device,
    # so by default no thread runs; one asked for still does (it checks the batches' ids ahead).
    monkeypatch.setattr("lightning_hotcache.planner.plan.LARGE_TABLES_BYTES", 0)
    monkeypatch.setenv(Switch.DEVICE_DIRECTORY.variable, "1")
    seen: set[str] = set()

    class Threads(pl.Callback):
        def on_train_batch_start(self, *args) -> None:
            seen.update(t.name for t in threading.enumerate() if t.name.startswith("hotcache-"))

    pl.seed_everything(0)
    dm = data(num_train_samples=256)
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    strategy = HotCacheStrategy(device_budget=0.1, profile_batches=2, kernel="triton", prefetch_thread=prefetch_thread)
    with caplog.at_level("INFO"):
        cpu_trainer(strategy=strategy, max_steps=2, callbacks=[Threads()]).fit(model, dm)
    assert all(module.stages_on_the_device for module in hot_cold_modules(model).values())
    if prefetch_thread is None:
        assert not seen and not strategy.uses_prefetch_thread
        assert "hotcache staging: inline on the training loop, 3 batches ahead; each batch's rows found and admitted on the device" in caplog.text
    else:
        assert seen == {"hotcache-prefetch"} and "hotcache staging: on a prefetch thread" in caplog.text


@pytest.mark.parametrize("strategy", ["hotcache", "torchrec"])
def test_gradient_accumulation_turned_on_mid_fit_is_refused_before_a_row_steps(strategy: str) -> None:
    # A callback that sets accumulate_grad_batches at an epoch start (as Lightning's scheduler
    # does) trained silently: the check ran at fit start only.
    class AccumulateFromEpochOne(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            if trainer.current_epoch == 1:
                trainer.accumulate_grad_batches = 2

    def tables_of(model) -> dict[str, torch.Tensor]:  # torchrec's sharded tables: one local shard each
        state = model.state_dict()
        return {k: (v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).clone() for k, v in state.items() if "embedding" in k}

    class Snapshot(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.tables = tables_of(pl_module)

    pl.seed_everything(0)
    dm = data()
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    snapshot = Snapshot()
    trainer = cpu_trainer(strategy=strategy, max_epochs=2, limit_val_batches=0, callbacks=[AccumulateFromEpochOne(), snapshot])
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2 .*2x larger batch size"):
        trainer.fit(model, dm)
    assert trainer.current_epoch == 1 and snapshot.tables
    after = tables_of(trainer.lightning_module)
    for key, value in snapshot.tables.items():  # no row stepped in the refused epoch
        assert torch.equal(after[key], value), key
