"""On a CUDA device: hotcache learns what auto learns there for every zoo model, and its
checkpoints load on a machine without a GPU; the GPU path (PyTorch's kernel) is the one that
ran, stays within its budget, makes as many host syncs per step for 26 tables as for 8, stages
rows through pinned buffers, resumes exactly, and 2 GPUs learn what 1 learns; `auto`'s tables
looked up in one autograd node give TorchRec's output and gradients there, with no host sync.

On CUDA the strategy stages batches on its prefetch thread by default, so every hotcache
case here runs with it. Marked ``cuda`` and skipped without a CUDA device: `make gpu-check`
runs them on the lent GPU machine (``pytest -m cuda``). The cases and the check are test_strategy's, on CUDA.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer, tiny_synthetic
from torchrec import KeyedJaggedTensor
from test_strategy import OPTIMIZER, assert_hotcache_matches_auto, data, fit, stats_paths  # noqa: F401 (stats_paths: a fixture)

from launch import train
from test_step_ops import CountsPerStep, _batches, _module, _ops_per_step, device_reads_per_step

from lightning_hotcache import HotCacheStrategy
from lightning_hotcache._ops.step_graph import WARMUP_STEPS
from lightning_hotcache.cache.host import HostStore
from lightning_hotcache.cache.upload import RowUpload, batch_to_device
from lightning_hotcache.embedding import hot_cold_modules
from lightning_hotcache._ops.switches import Switch
from models import DLRM, MODEL_REGISTRY

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = {"accelerator": "cuda", "devices": 1}
CASES = list(itertools.product(sorted(MODEL_REGISTRY), [1.0, 0.1, "minimum"], ["lfu", "lru", "static", "lookahead"]))
TESTS = Path(__file__).parent

# Runs in a process that sees no GPU, as on a CPU-only machine: the plain model validates
# from the checkpoint under `auto` and prints its metrics.
VALIDATE_ON_CPU = """
import json, sys
import torch
from conftest import cpu_trainer, tiny_synthetic
from test_strategy import data
from models import create_model

assert not torch.cuda.is_available()
dm = data()
model = create_model("dlrm", dm.tables, dm.num_dense_features)
print(json.dumps(cpu_trainer().validate(model, dm, ckpt_path=sys.argv[1], verbose=False)[0]))
"""


class _Baselines(dict):
    """Each model's `auto` run on CUDA (state dict, metrics), fitted when first asked for:
    `make gpu-check` runs a few models' cases, not every model's."""

    def __missing__(self, name: str) -> tuple[dict, dict]:
        model, _, metrics = fit(name, "auto", **CUDA)
        self[name] = (model.state_dict(), metrics)
        return self[name]


@pytest.fixture(scope="module")
def cuda_baselines() -> dict[str, tuple[dict, dict]]:
    return _Baselines()


class _CountCudaSyncs:
    """Host synchronizations made over a block, as CUDA's sync debug mode reports them (a
    warning each), by any thread but the library's staging threads: theirs (waiting for a copy
    they queued) hold up no step, and `test_step_ops`'s CPU counters see one thread too."""

    def __enter__(self) -> "_CountCudaSyncs":
        torch.cuda.synchronize()
        self._catching = warnings.catch_warnings()
        self._catching.__enter__()
        warnings.simplefilter("always")
        self._records: list[Warning | str] = []

        def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
            # Every thread's but the library's own staging threads (named hotcache-*), which wait
            # on purpose: the step's backward runs on autograd's device thread, whose waits count.
            if not threading.current_thread().name.startswith("hotcache-"):
                self._records.append(message)

        warnings.showwarning = record  # restored by catch_warnings on exit
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catching.__exit__(*exc)

    @property
    def count(self) -> int:
        return sum("synchroniz" in str(message) for message in self._records)


def test_gpu_path_logs_its_kernel_and_keeps_within_the_budget(caplog, stats_paths) -> None:
    strategy = HotCacheStrategy(device_budget=0.1, stats_path=str(stats_paths["dlrm"]))
    with caplog.at_level(logging.INFO):
        model, trainer, _ = fit("dlrm", strategy, **CUDA)
    # FBGEMM's CUDA build is not on the lent machine: the Triton TBE runs, the caches' directory
    # in GPU memory, and says so.
    assert "hotcache embedding kernel (sparse_arch.embedding_bag_collection): triton TBE" in caplog.text
    modules = hot_cold_modules(model).values()
    assert modules and all(m.kernel_note.startswith("triton") and "cache directory in device memory" in m.kernel_note for m in modules)
    assert {t.device.type for m in modules for cache in m.caches.values() for t in cache.slots.values()} == {"cuda"}
    assert sum(m.device_bytes() for m in modules) <= trainer.strategy.plan.budget_bytes
    split = [cache for m in modules for cache in m.caches.values() if not cache.identity]
    assert split and all(cache.group.on_device is not None for cache in split)


def test_gpu_path_step_of_a_staged_batch_waits_for_no_device() -> None:
    few = _ops_per_step(8, kernel="pytorch", counter_type=_CountCudaSyncs, device="cuda", staged_ahead=True)
    many = _ops_per_step(26, kernel="pytorch", counter_type=_CountCudaSyncs, device="cuda", staged_ahead=True)
    print(f"host syncs per steady-state step of a staged batch on CUDA (pytorch path): {few} for 8 tables, {many} for 26")
    assert few == many == 0


def test_gpu_path_device_directory_step_waits_for_no_device() -> None:
    # The caches' directory in GPU memory (the Triton path's default): a checked batch's step (its
    # rows found and admitted, read and stepped where they live, its cells released) reads nothing
    # back, as its CUDA graph needs.
    few = _ops_per_step(8, kernel="triton", counter_type=_CountCudaSyncs, device="cuda", staged_ahead=True)
    many = _ops_per_step(26, kernel="triton", counter_type=_CountCudaSyncs, device="cuda", staged_ahead=True)
    print(f"host syncs per steady-state step on CUDA (device directory, Triton): {few} for 8 tables, {many} for 26")
    assert few == many == 0


def test_whole_training_step_syncs_once() -> None:
    # The GPU issue's "host syncs a step, in all: <= 1": the non-finite-loss guard's copy of the
    # loss; the logged loss and the callbacks' figures reach the progress bar from the host.
    steps = device_reads_per_step(DLRM, _CountCudaSyncs, **CUDA)
    print(f"host syncs per whole training step on CUDA (hotcache, pytorch path, prefetch thread): {steps}")
    assert len(steps) >= 6 and max(steps) <= 1, steps


def test_gpu_path_staging_a_host_batch_waits_for_no_device() -> None:
    # The directory is on the host: staging (misses, victims, write-backs) reads nothing back.
    module = _module(26, kernel="pytorch", device="cuda")
    for step, batch in enumerate(_batches(26, steps=10, seed=0)):
        arriving = batch.to(torch.device("cuda"))
        with _CountCudaSyncs() as syncs:
            module.prefetch(batch, arrives_as=arriving)
        assert syncs.count == 0, f"staging step {step} waited for the device"
        module(arriving).values().sum().backward()
    assert sum(c.counters.written_back_rows for c in module.caches.values()) > 0


def test_gpu_path_moving_a_staged_batch_waits_for_no_device() -> None:
    # The prefetch thread moves each training batch: neither a pinned batch (the zoo's data
    # loaders pin on CUDA) nor a pageable one may make it wait for the step in flight.
    batch = next(iter(data().train_dataloader())).pin_memory()
    features = batch.sparse_features
    pageable = dataclasses.replace(  # clones are not page-locked
        batch, dense_features=batch.dense_features.clone(), labels=batch.labels.clone(),
        sparse_features=KeyedJaggedTensor(features.keys(), features.values().clone(), lengths=features.lengths().clone()),
    )  # fmt: skip
    assert batch.dense_features.is_pinned() and not pageable.dense_features.is_pinned()
    for pinned, host in ((True, batch), (False, pageable)):
        with _CountCudaSyncs() as syncs:  # a blocking copy counts, queued work or not
            moved = batch_to_device(host, torch.device("cuda"))
        assert syncs.count == 0, f"moving a {'pinned' if pinned else 'pageable'} batch waited for the device"
        assert torch.equal(moved.dense_features.cpu(), batch.dense_features)
        assert torch.equal(moved.sparse_features.values().cpu(), batch.sparse_features.values())


def test_gpu_path_stages_rows_through_pinned_buffers_not_pinned_tables() -> None:
    host = HostStore("t", 1000, 8, {"momentum": 1})
    host.load("weight", torch.randn(1000, 8))
    upload = RowUpload(torch.device("cuda"))
    for ids in ([3, 1, 999], [5, 5, 7], list(range(0, 1000, 2))):  # the last outgrows the first buffer
        ids = torch.tensor(ids)
        with _CountCudaSyncs() as syncs:
            rows = upload.gather(host, ids)
        assert syncs.count == 0, "staging rows made the host wait for the device"
        torch.testing.assert_close(rows["weight"].cpu(), host.weight[ids])
        assert rows["momentum"].device.type == "cuda"
    assert not host.weight.is_pinned() and upload.pinned_bytes() > 0


def test_gpu_path_resumes_exactly(tmp_path) -> None:
    resume = ["--accelerator=cuda", "--train-samples=1024", "--shuffle", "--steps=10", "--resume-from", "2", "6"]
    runs = train(tmp_path, 1, 128, "rowwise_adagrad", "hotcache", "--big-tables", "--device-budget=0.05", *resume)
    steps, weights = runs.pop(None)
    assert steps == 10 and set(runs) == {2, 6}
    for step, (resumed_steps, resumed_weights) in runs.items():
        assert resumed_steps == steps, f"resumed from step {step}"
        torch.testing.assert_close(resumed_weights, weights, msg=lambda m: f"resumed from step {step}: {m}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("strategy", ["hotcache", "ddp"])
def test_gpu_path_two_gpus_match_one_with_their_batches_together(tmp_path, strategy: str) -> None:
    """NCCL: hotcache's row exchange on its own group beside DDP's all-reduces, checkpoint
    gathers on the GPU, an uneven epoch end and validation."""
    common = ["--accelerator=cuda", "--big-tables", "--device-budget=0.05", "--train-samples=2624", "--steps=11",
              "--val-samples=1100"]  # fmt: skip
    two = train(tmp_path, 2, 128, "rowwise_adagrad", strategy, *common)
    one = train(tmp_path, 1, 256, "rowwise_adagrad", "auto", *common)
    assert two["world_size"] == 2
    torch.testing.assert_close(two["state_dict"], one["state_dict"], rtol=1e-5, atol=1e-5)
    assert two["val"]["val/logloss"] == pytest.approx(one["val"]["val/logloss"], rel=1e-5)


@pytest.mark.parametrize("policy", ["lfu", "lookahead"])
def test_gpu_path_staged_side_by_side_matches_auto(policy: str, stats_paths, cuda_baselines, monkeypatch) -> None:
    """Two staging threads on the host directory (the device directory stages on the device, one
    stack a width): each thread's copies on the prefetch thread's stream, learning what `auto`
    learns on CUDA."""
    monkeypatch.setenv(Switch.DEVICE_DIRECTORY.variable, "0")
    strategy = HotCacheStrategy(
        device_budget=0.001, grow_budget_to_minimum=True, stats_path=str(stats_paths["dlrm"]), cache_policy=policy, staging_threads=2
    )
    with pytest.warns(UserWarning, match="planning with the minimum"):
        model, _, metrics = fit("dlrm", strategy, **CUDA)
    modules = hot_cold_modules(model).values()
    assert all("staged side by side by 2 threads" in m.kernel_note for m in modules), [m.kernel_note for m in modules]
    torch.testing.assert_close(model.state_dict(), cuda_baselines["dlrm"][0], rtol=1e-5, atol=1e-5)
    assert metrics["val/logloss"] == pytest.approx(cuda_baselines["dlrm"][1]["val/logloss"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(("name", "budget", "policy"), CASES)
def test_hotcache_matches_auto_on_cuda(name, budget, policy, stats_paths, cuda_baselines) -> None:
    assert_hotcache_matches_auto(name, budget, policy, stats_paths[name], cuda_baselines[name], **CUDA)


def test_checkpoint_written_on_cuda_loads_without_a_gpu(tmp_path, stats_paths) -> None:
    strategy = HotCacheStrategy(device_budget=0.1, stats_path=str(stats_paths["dlrm"]))
    _, trainer, metrics = fit("dlrm", strategy, **CUDA)
    assert any(not t.on_device for t in trainer.strategy.plan.tables), "split tables are gathered from both tiers"
    # On CUDA the caches keep their directory in device memory by default and each batch's
    # forward stages it there: no prefetch or reader thread runs.
    assert all(m.stages_on_the_device for m in hot_cold_modules(trainer.lightning_module).values())
    assert not trainer.strategy.uses_prefetch_thread and not trainer.strategy.uses_reader_thread
    trainer.save_checkpoint(tmp_path / "cuda.ckpt")
    path = os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", VALIDATE_ON_CPU, str(tmp_path / "cuda.ckpt")],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path},
        cwd=TESTS, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    on_cpu = json.loads(done.stdout.strip().splitlines()[-1])
    # The same weights, evaluated by CPU kernels instead of CUDA ones.
    assert on_cpu["val/auc"] == pytest.approx(metrics["val/auc"], abs=1e-4)


class _PlacementDuringFit(pl.Callback):
    """The device types of the sparse and over arch's parameters at the first training batch."""

    def __init__(self) -> None:
        self.devices: dict[str, set[str]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if not self.devices:
            self.devices = {
                name: {p.device.type for p in getattr(pl_module, name).parameters()} for name in ("sparse_arch", "over_arch")
            }


def test_cpu_lookup_baseline_keeps_the_tables_on_the_host_and_learns_what_auto_learns(cuda_baselines) -> None:
    # benchmarks/gpu.py's FAE baseline: its figures mean something only if the CPU really
    # looks the rows up, and it trains the same model.
    sys.path.append(str(TESTS.parent / "benchmarks"))
    from gpu import HostLookupDLRM

    pl.seed_everything(0)
    dm = data()
    model = HostLookupDLRM(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    placement = _PlacementDuringFit()  # Lightning's teardown moves the model back to the CPU after fit
    cpu_trainer(strategy="auto", max_epochs=1, callbacks=[placement], **CUDA).fit(model, dm)
    assert placement.devices == {"sparse_arch": {"cpu"}, "over_arch": {"cuda"}}
    expected = {key: value.cpu() for key, value in cuda_baselines["dlrm"][0].items()}
    torch.testing.assert_close({key: value.cpu() for key, value in model.state_dict().items()}, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stacked", [False, True], ids=["tables apart", "tables stacked"])
def test_plain_tables_in_one_node_are_torchrecs_and_wait_for_no_device(stacked: bool) -> None:
    # `auto`'s lookup (the zoo's models under auto/ddp): one autograd node over TorchRec's tables,
    # one `embedding_bag` for all where they are one stack (the zoo's).
    from torchrec import EmbeddingBagCollection

    from datamodules import SyntheticCTRDataModule
    from lightning_hotcache.embedding.torchrec_lookup import pooled_in_one_node
    from lightning_hotcache.optim.rowwise import use_sparse_gradients
    from lightning_hotcache.optim.stacked_tables import stack_tables, stacked_rows

    dm = SyntheticCTRDataModule(scale=0.001, num_embeddings_cap=500, batch_size=256, embedding_dim=16)
    features = dm.source("train").batch(0, 256).sparse_features.to(torch.device("cuda"))
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=dm.tables, device=torch.device("cuda"))
    use_sparse_gradients(ebc)
    if stacked:
        stack_tables(ebc)
    assert (stacked_rows(list(ebc.parameters())) is not None) == stacked
    reference = EmbeddingBagCollection(tables=dm.tables, device=torch.device("cuda"))
    reference.load_state_dict(ebc.state_dict())
    use_sparse_gradients(reference)
    upstream = torch.randn(256, 16 * len(dm.tables), device="cuda")
    # A first step of a batch's shape makes the lookup's index tensors (copied up once, a wait);
    # the steps after it reuse them.
    pooled_in_one_node(ebc, features).backward(upstream)
    ebc.zero_grad(set_to_none=True)
    with _CountCudaSyncs() as syncs:
        pooled = pooled_in_one_node(ebc, features)
        pooled.backward(upstream)
    assert syncs.count == 0
    expected = reference(features).values()
    expected.backward(upstream)
    assert torch.equal(pooled, expected)
    for name, bag in ebc.embedding_bags.items():
        want = reference.embedding_bags[name].weight.grad
        assert torch.equal(bag.weight.grad._indices(), want._indices()) and torch.equal(bag.weight.grad._values(), want._values())


def test_a_zoo_model_moved_to_the_gpu_keeps_its_tables_stacked_and_trains_as_on_the_cpu() -> None:
    # `module.to("cuda")` moves each parameter apart; the zoo's models move each stack whole.
    from lightning_hotcache.optim.stacked_tables import stacked_rows
    from models import DLRM

    dm = tiny_synthetic()
    dm.setup("fit")
    torch.manual_seed(0)
    model = DLRM(tables=dm.tables, num_dense_features=dm.num_dense_features)
    reference = copy.deepcopy(model)
    model.cuda()
    weights = list(model.sparse_arch.embedding_bag_collection.parameters())
    stack = stacked_rows(weights)
    assert stack is not None and stack.is_cuda
    batch = dm.source("train").batch(0, 64)
    got = model(batch.dense_features.cuda(), batch.sparse_features.to(torch.device("cuda")))
    torch.testing.assert_close(got.cpu(), reference(batch.dense_features, batch.sparse_features), rtol=1e-4, atol=1e-5)
    model.cpu()
    assert stacked_rows(weights) is not None and not stacked_rows(weights).is_cuda


class _TableGradientsAtTheStep(pl.Callback):
    """Each step's table gradients as the row-wise step finds them (`.grad`; None when the
    lookup handed its rows over as one piece)."""

    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor | None]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self.grads.append([p.grad for p in pl_module.embedding_parameters()])


@pytest.mark.parametrize("name", ["dlrm", "deepfm"])
def test_auto_on_cuda_hands_its_gradient_rows_over_and_learns_what_the_cpu_learns(name: str) -> None:
    # `auto` on a GPU: the lookup's gradient rows reach the row-wise step as one piece (no
    # sparse .grad per table: host time on the step's critical path), and the model learns
    # what a CPU fit learns, to float rounding.
    seen = _TableGradientsAtTheStep()
    on_gpu, _, _ = fit(name, "auto", callbacks=[seen], **CUDA)
    on_cpu, _, _ = fit(name, "auto")
    assert seen.grads and all(grad is None for grads in seen.grads for grad in grads)
    got = {key: value.cpu() for key, value in on_gpu.state_dict().items()}
    torch.testing.assert_close(got, on_cpu.state_dict(), rtol=1e-4, atol=1e-5)


def test_the_zoos_lazy_adam_in_the_triton_kernel_learns_what_its_pytorch_step_learns(monkeypatch) -> None:
    # `auto` on a GPU: a stack of the zoo's tables pooled by the Triton TBE and stepped by lazy
    # Adam in its kernel, against the same fit with the tables on embedding_bag and the row step in
    # torch ops (test_triton_tbe compares them in Triton's interpreter).
    adam = {"name": "adam", "lr": 0.01}
    in_the_kernel, _, _ = fit("dlrm", "auto", optimizer=adam, **CUDA)
    monkeypatch.setenv(Switch.PLAIN_TABLES_TRITON.variable, "0")
    by_torch_ops, _, _ = fit("dlrm", "auto", optimizer=adam, **CUDA)
    torch.testing.assert_close(in_the_kernel.state_dict(), by_torch_ops.state_dict(), rtol=1e-5, atol=1e-5)


def _graphed_fit(
    graphed: bool, counter: pl.Callback | None = None, hotcache: bool = False, precision: str = "32-true", policy: str = "lfu"
) -> tuple[pl.LightningModule, dict]:
    """A DLRM fit under `auto`, or ``hotcache`` at 2% under ``policy`` (the caches' directory in GPU memory)."""
    pl.seed_everything(0)
    dm = tiny_synthetic(num_train_samples=64 * 60 + 40, batch_size=64)  # 60 full batches and a short one
    model = DLRM(dm.tables, dm.num_dense_features, cuda_graph=graphed, **({"embedding_optimizer": OPTIMIZER} if hotcache else {}))
    counts: dict = {}

    class Counts(pl.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            graph = pl_module.step_graph
            counts.update({} if graph is None else {"captures": graph.captures, "replays": graph.replays, "refused": graph.eager_reason})

    callbacks = [Counts()] + ([counter] if counter is not None else [])
    strategy = HotCacheStrategy(device_budget=0.02, profile_batches=4, grow_budget_to_minimum=True, cache_policy=policy) if hotcache else "auto"
    cpu_trainer(strategy=strategy, max_epochs=1, log_every_n_steps=1000, callbacks=callbacks, precision=precision, **CUDA).fit(model, dm)
    return model, counts


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_graphed_step_on_cuda_trains_what_the_eager_step_trains(precision: str) -> None:
    eager, _ = _graphed_fit(False, precision=precision)
    graphed, counts = _graphed_fit(True, precision=precision)
    print(f"the step's CUDA graph over 61 steps: {counts}")
    assert counts == {"captures": 1, "replays": 60 - WARMUP_STEPS, "refused": None}  # the short batch steps eagerly
    tolerance = 1e-6 if precision == "32-true" else 1e-3  # bf16 matmuls: their kernels may differ on the graph's stream
    torch.testing.assert_close(graphed.state_dict(), eager.state_dict(), rtol=tolerance, atol=tolerance)


def test_the_graphed_step_on_cuda_waits_for_no_later_step() -> None:
    # Between logging steps a replayed step's host reads are the previous step's loss flag
    # only (an event behind that step): the host runs a step ahead of the GPU.
    counting = CountsPerStep(_CountCudaSyncs)
    _graphed_fit(True, counting)
    steady = counting.counts[5:-2]
    print(f"host syncs per replayed step on CUDA: {steady}")
    assert steady and max(steady) <= 1, steady


def test_gpu_path_triton_reads_and_steps_mapped_host_rows_as_it_does_device_rows() -> None:
    # The kernels alone, before any collection: rows in page-locked host memory mapped for the
    # GPU (as the device directory keeps them), read by the forward and stepped in place by the
    # row-wise Adagrad backward, give what the same kernels give on rows in GPU memory.
    from lightning_hotcache.cache.host_mapping import check_the_kernels_read, map_for_devices
    from lightning_hotcache.kernels import triton_tbe

    generator = torch.Generator().manual_seed(0)
    host = {"weight": torch.randn(1000, 64, generator=generator), "momentum": torch.zeros(1000)}
    device = {key: array.cuda() for key, array in host.items()}
    for array in host.values():
        map_for_devices(array)
    check_the_kernels_read(host["weight"], torch.device("cuda"))
    ids = torch.randint(0, 1000, (4096,), generator=generator).cuda()
    offsets = torch.arange(0, 4097, 4, device="cuda")
    grad = torch.randn(1024, 64, generator=generator).cuda()
    slots, slot_momentum = torch.zeros(1, 64, device="cuda"), torch.zeros(1, device="cuda")
    for rows in (host, device):
        for _ in range(3):
            locations = triton_tbe.location_of_host_row(ids)
            out = triton_tbe.pooled(slots, locations, offsets, host_weight=rows["weight"])
            triton_tbe.backward_step(slots, grad, locations, offsets, "rowwise_adagrad", 0.05, 1e-8, {"momentum": slot_momentum},
                                     host_weight=rows["weight"], host_state=rows)  # fmt: skip
        rows["out"] = out.cpu()
    torch.cuda.synchronize()
    for key in ("out", "weight", "momentum"):
        torch.testing.assert_close(host[key], device[key].cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_gpu_path_device_directory_reads_and_steps_host_rows_in_place_as_the_host_directory_trains(optimizer, monkeypatch) -> None:
    # The directory in GPU memory, host rows mapped (cudaHostRegister) and read and stepped in
    # place by the Triton kernels, against the host directory's staged copies on the same GPU; its
    # ids found and victims chosen by the compiled `set_kernels`, and by the torch ops they replace.
    def trained(directory: str, set_kernels: bool = True) -> tuple[dict, dict]:
        monkeypatch.setenv(Switch.DEVICE_DIRECTORY.variable, "1" if directory == "device" else "0")
        monkeypatch.setenv(Switch.SET_KERNELS.variable, "1" if set_kernels else "0")
        module = _module(8, kernel="triton", device="cuda", optimizer=optimizer)
        assert ("cache directory in device memory" in module.kernel_note) == (directory == "device")
        for batch in _batches(8, steps=12, seed=0):
            module(batch.to(torch.device("cuda"))).values().square().sum().backward()
        counts = {} if directory == "host" else next(iter(module._caches.values())).on_device.counters()
        state = {f"{n}.{k}": array for n, arrays in module.optimizer_state().items() for k, array in arrays.items()}
        return module.state_dict() | state, counts

    on_device, counts = trained("device")
    by_torch_ops, torch_ops_counts = trained("device", set_kernels=False)
    on_host, _ = trained("host")
    print(f"device directory over 12 steps: {counts}")
    assert counts["from_host_rows"] > 0 and counts["written_back_rows"] > 0  # host rows read in place, victims written back
    assert counts == torch_ops_counts  # the same cells: the same hits, reads and write-backs
    torch.testing.assert_close(by_torch_ops, on_device, rtol=0, atol=0)
    for key, value in on_host.items():
        torch.testing.assert_close(on_device[key], value, rtol=1e-6, atol=1e-6, msg=key)


def test_gpu_path_keeps_the_host_directory_where_host_rows_cannot_be_mapped(monkeypatch) -> None:
    from lightning_hotcache.cache.host_mapping import HostMappingError
    from lightning_hotcache.embedding import collection

    def refuse(arrays, device):
        raise HostMappingError("cudaHostRegister refused (a test)")

    monkeypatch.setattr(collection, "map_all_for_devices", refuse)
    module = _module(8, kernel="triton", device="cuda")
    assert "cache directory on the host (cudaHostRegister refused (a test))" in module.kernel_note
    assert module.why_not_graphable() is not None
    for batch in _batches(8, steps=3, seed=0):
        module(batch.to(torch.device("cuda"))).values().sum().backward()


@pytest.mark.parametrize("policy", ["lfu", "lookahead"])
def test_the_graphed_hotcache_step_on_cuda_trains_what_its_eager_step_trains(policy: str) -> None:
    # Under lookahead the loader announces each batch to the window in GPU memory outside the
    # graph (its ids from pinned memory, without a wait), and each replay reads the window.
    eager, _ = _graphed_fit(False, hotcache=True, policy=policy)
    graphed, counts = _graphed_fit(True, hotcache=True, policy=policy)
    print(f"hotcache's step CUDA graph over 61 steps: {counts}")
    assert counts == {"captures": 1, "replays": 60 - WARMUP_STEPS, "refused": None}
    torch.testing.assert_close(graphed.state_dict(), eager.state_dict(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("policy", ["lfu", "lookahead"])
def test_the_graphed_hotcache_step_on_cuda_waits_for_no_later_step(policy: str) -> None:
    counting = CountsPerStep(_CountCudaSyncs)
    _graphed_fit(True, counting, hotcache=True, policy=policy)
    steady = counting.counts[5:-2]
    print(f"host syncs per replayed hotcache step on CUDA: {steady}")
    assert steady and max(steady) <= 1, steady
