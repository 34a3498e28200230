"""One CUDA graph a training step: the replay logic on a CPU, through the stand-in for CUDA's graphs.

`StandInGraphs` "replays" by running the recorded step function again, refusing the host reads a
CUDA capture refuses and requiring the captured ops at the captured shapes, so these tests check
what is around the graph (static copies refilled, a graph recorded again for a new shape, eager
steps where the shapes differ or the capture is refused) and that the zoo's step is what a graph
can record: the same ops at the same shapes whatever the batch's ids.
"""

from __future__ import annotations

import functools
import re

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer, forced_staging, tiny_synthetic
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch

from lightning_hotcache import HotCacheStrategy
from lightning_hotcache.embedding import hot_cold_modules
from lightning_hotcache._ops.switches import Switch
from lightning_hotcache._ops import step_graph
from lightning_hotcache._ops.graph_batches import TorchRecBatches
from lightning_hotcache._ops.guards import NonFiniteLossError
from lightning_hotcache._ops.step_graph import HostReadInGraph, StandInGraphs, StepGraph
from lightning_hotcache.optim import rowwise
from models import MODEL_REGISTRY, CTRModel, create_model


def batch(dense: torch.Tensor, ids: list[int], lengths: list[int] | None = None) -> Batch:
    lengths = lengths or [1] * len(ids)
    features = KeyedJaggedTensor(
        keys=["f"], values=torch.tensor(ids), lengths=torch.tensor(lengths), length_per_key=[len(ids)], stride=len(lengths)
    )
    return Batch(dense_features=dense, sparse_features=features, labels=torch.zeros(len(lengths)))


class Adder:
    """A step that adds what the batch holds into a weight: a replay on stale inputs shows."""

    def __init__(self) -> None:
        self.weight = torch.zeros(4)

    def __call__(self, b: Batch) -> torch.Tensor:
        self.weight.add_(b.dense_features.sum(0))
        self.weight[0].add_(b.sparse_features.values().sum())
        return self.weight.sum().reshape(1)


def graph_of(step, warmup: int = 2) -> tuple[StepGraph, StandInGraphs]:
    graphs = StandInGraphs()
    return StepGraph(step, TorchRecBatches(), graphs, touched=lambda: [step.weight], warmup=warmup), graphs


def test_each_replay_steps_its_own_batch() -> None:
    graphed, eager = Adder(), Adder()
    graph, graphs = graph_of(graphed)
    generator = torch.Generator().manual_seed(0)
    for k in range(6):
        b = batch(torch.rand(3, 4, generator=generator), [k, 2 * k, 3])
        if graph.run(b) is None:
            graphed(b)  # the caller's eager step
        eager(b)
        assert torch.equal(graphed.weight, eager.weight), k
    assert (graph.eager_steps, graph.captures, graph.replays) == (1, 1, 4)
    assert graphs.replays == 4


def test_the_outputs_are_the_graphs_static_ones() -> None:
    step = Adder()
    graph, _ = graph_of(step, warmup=1)
    first = graph.run(batch(torch.ones(2, 4), [1, 1]))
    second = graph.run(batch(torch.ones(2, 4), [1, 1]))
    assert second is first and torch.equal(second, step.weight.sum().reshape(1))


def test_a_one_off_shape_steps_eagerly_and_a_lasting_one_is_recorded_again() -> None:
    step = Adder()
    graph, _ = graph_of(step, warmup=2)
    full, short = (lambda: batch(torch.ones(3, 4), [1, 2, 3])), (lambda: batch(torch.ones(2, 4), [1, 2]))
    results = [graph.run(b()) is not None for b in (full, full, full, short, full, short, short, short)]
    # full: eager, captured, replayed; the short one eagerly; full replayed; short twice in a row: recorded anew.
    assert results == [False, True, True, False, True, False, True, True]
    assert (graph.captures, graph.replays) == (2, 3)
    assert graph.run(full()) is None  # one graph is kept: the full batches' was dropped


def test_a_multi_hot_batch_of_other_lengths_is_another_shape() -> None:
    layout = TorchRecBatches()
    a = batch(torch.ones(2, 4), [1, 2, 3], lengths=[1, 2])
    b = batch(torch.ones(2, 4), [1, 2, 3], lengths=[2, 1])
    c = batch(torch.ones(2, 4), [1, 2, 3, 4], lengths=[2, 2])
    assert layout.signature(a) == layout.signature(b) != layout.signature(c)
    static = layout.static_copy(a)
    layout.refill(static, b)
    assert torch.equal(static.sparse_features.lengths(), b.sparse_features.lengths())
    assert torch.equal(static.sparse_features.offsets(), b.sparse_features.offsets())
    assert static.sparse_features.values().data_ptr() != b.sparse_features.values().data_ptr()


def test_a_capture_the_step_refuses_changes_nothing_and_every_step_is_eager_after() -> None:
    class ReadsTheHost(Adder):
        def __call__(self, b: Batch) -> torch.Tensor:
            self.weight.add_(1.0)
            if self.weight.sum() > 0:  # a host read of a device value: a CUDA capture refuses it
                self.weight.add_(1.0)
            return self.weight

    step = ReadsTheHost()
    graph, _ = graph_of(step, warmup=1)
    assert graph.run(batch(torch.ones(2, 4), [1, 2])) is None
    assert torch.equal(step.weight, torch.zeros(4))  # what the refused capture wrote is put back
    assert "HostReadInGraph" in graph.eager_reason and "aten::_local_scalar_dense" in graph.eager_reason
    assert graph.run(batch(torch.ones(2, 4), [1, 2])) is None and graph.captures == 0


class Marks:
    """A step that marks the rows its batch reads: by writing a Python value through an index
    (on CUDA a copy from the host first), or with ``index_fill_`` (a kernel's argument)."""

    def __init__(self, by_index_fill: bool) -> None:
        self.weight, self.by_index_fill = torch.zeros(4), by_index_fill

    def __call__(self, b: Batch) -> torch.Tensor:
        if self.by_index_fill:
            self.weight.index_fill_(0, b.sparse_features.values(), 1.0)
        else:
            self.weight[b.sparse_features.values()] = 1.0
        return self.weight.sum().reshape(1)


def test_a_python_value_written_by_indexing_is_refused_as_a_copy_from_the_host() -> None:
    one = batch(torch.zeros(2, 4), [1, 2])
    refused, _ = graph_of(Marks(by_index_fill=False), warmup=1)
    assert refused.run(one) is None and "writes a host value into a tensor (aten::index_put_" in refused.eager_reason
    assert "(at test_step_graph.py:" not in refused.eager_reason  # the line named is the project's, not a test's
    recorded, _ = graph_of(Marks(by_index_fill=True), warmup=1)
    assert recorded.run(one) is not None and recorded.eager_reason is None


def test_a_refusal_names_the_line_of_the_library_that_read_the_host() -> None:
    from lightning_hotcache.cache.device_directory import DeviceDirectory

    directory = DeviceDirectory(torch.zeros(0, dtype=torch.int64), 4, "lru", {"weight": torch.zeros(4, 2)}, {"weight": torch.zeros(10, 2)})

    class Flushes(Adder):  # whole-table work, which finds the dirty rows on the host
        def __call__(self, b: Batch) -> torch.Tensor:
            directory.flush()
            return super().__call__(b)

    graph, _ = graph_of(Flushes(), warmup=1)
    assert graph.run(batch(torch.zeros(2, 4), [1, 2])) is None
    assert re.search(r"aten::nonzero.* \(at device_directory\.py:\d+, flush\)$", graph.eager_reason), graph.eager_reason


def test_a_refusal_names_the_first_error_not_the_one_the_capture_raises_as_it_ends() -> None:
    from lightning_hotcache._ops.step_graph import refusal_reason

    try:
        try:
            torch.zeros(2).reshape(3)  # the error inside the capture
        except RuntimeError:
            raise RuntimeError("operation failed due to a previous error during capture")  # what CUDA's capture_end raises then
    except RuntimeError as error:
        reason = refusal_reason(error)
    assert reason.startswith("RuntimeError: shape '[3]' is invalid") and "previous error" not in reason


def test_a_step_whose_ops_change_between_replays_is_caught() -> None:
    class Grows(Adder):
        calls = 0

        def __call__(self, b: Batch) -> torch.Tensor:
            Grows.calls += 1
            return self.weight.add_(torch.ones(4 - Grows.calls % 2).sum())  # another shape every other call

    graph, _ = graph_of(Grows(), warmup=1)
    assert graph.run(batch(torch.ones(2, 4), [1, 2])) is not None
    with pytest.raises(HostReadInGraph, match="other ops or shapes than it was captured with"):
        graph.run(batch(torch.ones(2, 4), [1, 2]))


# ------------------------------------------------------------------ the zoo's step in a graph


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> StandInGraphs:
    """CUDA's graphs replaced by the stand-in on the CPU, and the row-wise step on CUDA's path
    (rows sorted with repeats kept, no count the host must learn), which the graph records."""
    graphs = StandInGraphs()
    monkeypatch.setattr(step_graph, "graphs_for", lambda device: graphs)
    monkeypatch.setattr(rowwise, "SORTS_WITH_REPEATS_ON", frozenset({"cuda", "cpu"}))
    return graphs


def fit(name: str = "dlrm", graphed: bool = True, data: dict | None = None, **options) -> tuple[CTRModel, pl.Trainer]:
    trainer_options = {k: options.pop(k) for k in ("gradient_clip_val", "val_check_interval", "callbacks", "max_steps", "default_root_dir", "enable_checkpointing", "precision") if k in options}
    pl.seed_everything(0)
    dm = tiny_synthetic(**{"num_train_samples": 1000, "batch_size": 96, "num_val_samples": 192, **(data or {})})  # a short last batch
    model = create_model(name, dm.tables, dm.num_dense_features, cuda_graph=graphed, **options)
    if any(isinstance(c, ModelCheckpoint) for c in trainer_options.get("callbacks", [])):
        trainer_options["enable_checkpointing"] = True
    trainer = cpu_trainer(max_epochs=2, log_every_n_steps=4, **trainer_options)
    trainer.fit(model, dm)
    return model, trainer


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("dlrm", {}),
        ("deepfm", {"embedding_optimizer": {"name": "adam", "lr": 0.01}, "embedding_l2": 1e-4, "gradient_clip_val": 0.5}),
        ("dcn", {"embedding_optimizer": {"name": "sgd", "lr": 0.1}, "val_check_interval": 0.5}),
        ("dlrm", {"precision": "bf16-mixed"}),
    ],
)
def test_a_graphed_fit_trains_what_the_eager_fit_trains(stand_in: StandInGraphs, name: str, options: dict) -> None:
    expected, expected_trainer = fit(name, graphed=False, **dict(options))
    model, trainer = fit(name, **dict(options))
    # 11 batches an epoch, the last short: each epoch's short batch steps eagerly and is not
    # recorded; the graph recorded at the third step serves every full batch after it.
    assert stand_in.captures == 1 and stand_in.replays == 2 * 10 - 3
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    state, expected_state = model.embedding_optimizer.state_tensors(), expected.embedding_optimizer.state_tensors()
    assert len(state) == len(expected_state) and all(torch.equal(a, b) for a, b in zip(state, expected_state))
    dense, expected_dense = trainer.optimizers[0].state_dict(), expected_trainer.optimizers[0].state_dict()
    torch.testing.assert_close(dense["state"], expected_dense["state"], rtol=0, atol=0)
    assert trainer.callback_metrics["train/loss"] == expected_trainer.callback_metrics["train/loss"]


def test_a_graphed_fit_resumed_mid_epoch_trains_what_a_straight_run_trains(stand_in: StandInGraphs, tmp_path: Path) -> None:
    expected, _ = fit(graphed=False)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=7, save_top_k=-1, save_last=False)
    fit(callbacks=[saver], max_steps=14, default_root_dir=str(tmp_path))
    pl.seed_everything(0)
    dm = tiny_synthetic(num_train_samples=1000, batch_size=96, num_val_samples=192)
    model = create_model("dlrm", dm.tables, dm.num_dense_features)
    cpu_trainer(max_epochs=2, log_every_n_steps=4).fit(model, dm, ckpt_path=str(tmp_path / "epoch=0-step=7.ckpt"))
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_the_steps_ops_keep_their_shapes_over_batches_of_other_ids(stand_in: StandInGraphs) -> None:
    # Every id the first table's row 0, then every id distinct: a step that sized anything by
    # the distinct rows (unique, nonzero, a count on the host) would change shape between them,
    # which the stand-in's replay refuses as a CUDA graph would replay stale kernels.
    pl.seed_everything(0)
    dm = tiny_synthetic(batch_size=32)
    model = create_model("dlrm", dm.tables, dm.num_dense_features)
    cpu_trainer(max_steps=1).fit(model, dm)  # places the model for a fit; then step by hand
    model._fit_tables = model.embedding_parameters()
    graph = StepGraph(model._graphed_step, TorchRecBatches(), stand_in, touched=model._graphed_step_writes, warmup=1)
    model._graph_grads = [(p, torch.zeros_like(p)) for p in model.dense_parameters()]
    b = next(iter(dm.train_dataloader()))
    keys, rows = b.sparse_features.keys(), [t.num_embeddings for t in dm.tables]

    def with_ids(values: torch.Tensor) -> Batch:
        features = KeyedJaggedTensor(keys=keys, values=values, lengths=b.sparse_features.lengths(), length_per_key=b.sparse_features.length_per_key(), stride=32)
        return Batch(dense_features=b.dense_features, sparse_features=features, labels=b.labels)

    same = with_ids(torch.zeros_like(b.sparse_features.values()))
    distinct = with_ids(torch.cat([torch.arange(32) % r for r in rows]))
    assert graph.run(same) is not None and graph.run(distinct) is not None and graph.run(same) is not None
    assert stand_in.replays == 2


def test_a_non_finite_loss_under_the_graph_stops_the_fit_before_a_checkpoint_has_it(stand_in: StandInGraphs, tmp_path: Path) -> None:
    class PoisonAt(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 5:
                batch.dense_features[0, 0] = float("nan")

    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    with pytest.raises(NonFiniteLossError, match=r"at step 5 \(batch 5 of its epoch\).*a step late"):
        fit(callbacks=[PoisonAt(), saver], default_root_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("*.ckpt"))[-1] == "epoch=0-step=5.ckpt"  # the steps before it only
    assert stand_in.replays >= 3  # it was a replayed step


def dlrm_fit(strategy, **trainer_options) -> tuple[CTRModel, pl.Trainer]:
    pl.seed_everything(0)
    dm = tiny_synthetic(num_train_samples=52, batch_size=8, num_val_samples=8, num_embeddings_cap=800)  # a short last batch
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05})
    trainer = cpu_trainer(strategy=strategy, max_epochs=1, log_every_n_steps=4, **trainer_options)
    trainer.fit(model, dm)
    return model, trainer


@functools.cache
def _auto_fit_with_a_validation_mid_epoch() -> dict[str, torch.Tensor]:
    """`auto`'s weights after `dlrm_fit` with a validation mid-epoch: what each graphed hotcache
    fit below must train (fitted once for them all)."""
    model, _ = dlrm_fit("auto", val_check_interval=0.5)
    return model.state_dict()


@pytest.mark.parametrize(
    ("threads", "policy"),
    [(False, "static"), pytest.param(False, "lookahead", marks=pytest.mark.full), pytest.param(True, "static", marks=pytest.mark.full)],
    ids=["inline", "inline-lookahead", "reader+prefetch-threads"],
)
def test_a_graphed_hotcache_fit_trains_what_auto_trains(threads: bool, policy: str, stand_in: StandInGraphs, monkeypatch) -> None:
    # hotcache's step in the graph: the caches' directory in device memory (CUDA's default,
    # switched on here; the Triton kernels in the interpreter), staged inline as on CUDA by
    # default, or on a reader and a prefetch thread asked for, under the static policy (FAE:
    # every batch's misses leave when it is released, so each replay writes rows back), rows
    # read from the host in place, a validation mid-epoch between them; against `auto`
    # (graphed too, its own path). Under lookahead the loader announces batches to the window in
    # device memory outside the graph, and each replay retires one on the device.
    monkeypatch.setenv(Switch.DEVICE_DIRECTORY.variable, "1")
    # The tables count as large, so that the default would be a prefetch thread, as on CUDA: with
    # the directory on the device the default stages inline.
    monkeypatch.setattr("lightning_hotcache.planner.plan.LARGE_TABLES_BYTES", 0)
    expected = _auto_fit_with_a_validation_mid_epoch()
    replays = stand_in.replays
    strategy = forced_staging(
        reader_thread=threads, prefetch_thread=True if threads else None, prefetch_depth=1, device_budget=0.001, profile_batches=2,
        cache_policy=policy, kernel="triton", grow_budget_to_minimum=True,
    )  # fmt: skip
    model, _ = dlrm_fit(strategy, val_check_interval=0.5)
    assert strategy.uses_prefetch_thread == strategy.uses_reader_thread == threads and stand_in.replays - replays >= 3, (stand_in.replays, model.step_graph)
    module = next(iter(hot_cold_modules(model).values()))
    directory = module._caches[next(iter(module.layout.stacks))].on_device
    counters = directory.counters()
    assert counters["from_host_rows"] + counters["fetched_rows"] > 0
    assert counters["evicted_rows"] > 0 or policy != "static"  # FAE's misses leave at every release
    if policy == "lookahead":  # every training batch announced, and retired by its step (replays too)
        assert directory.announced == 7 and int(directory.retired) == 7
    torch.testing.assert_close(model.state_dict(), expected, rtol=1e-5, atol=1e-5)
    assert module._staging.in_flight == [] and len(module._staging._checked) <= 2  # no Python state a replay would miss


class SaysWhy(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.graph, self.reason = pl_module._step_graph, pl_module._why_the_step_is_not_graphed()


class OwnStep(MODEL_REGISTRY["dlrm"]):  # a user's subclass with a training_step of its own
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"model": {"cuda_graph": False}}, "cuda_graph=False"),
        ({"model": {"non_finite_loss": "skip"}}, "non_finite_loss='skip'"),
        ({"trainer": {"accumulate_grad_batches": 2}}, "accumulate_grad_batches=2"),
        ({"trainer": {"precision": "64-true"}}, "precision='64-true'"),
        ({"trainer": {"strategy": "hotcache_stand_in"}}, "its caches' directory is on the host"),
        ({"subclass": True}, "OwnStep.training_step overrides CTRModel's"),
    ],
)
def test_a_step_that_cannot_be_graphed_steps_eagerly_and_says_why(stand_in: StandInGraphs, settings: dict, reason: str) -> None:
    pl.seed_everything(0)
    dm = tiny_synthetic(num_train_samples=256, batch_size=64)
    cls = OwnStep if settings.get("subclass") else type(create_model("dlrm", dm.tables, dm.num_dense_features))
    model = cls(dm.tables, dm.num_dense_features, **settings.get("model", {}))
    trainer_settings = dict(settings.get("trainer", {}))
    if trainer_settings.get("strategy") == "hotcache_stand_in":
        trainer_settings["strategy"] = HotCacheStrategy(device_budget=1.0, profile_batches=1)
    says = SaysWhy()
    cpu_trainer(max_epochs=1, callbacks=[says], **trainer_settings).fit(model, dm)
    assert says.graph is None and reason in says.reason
    assert stand_in.captures == 0
