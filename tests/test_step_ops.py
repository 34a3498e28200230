"""A training step's op count, and its host synchronizations, do not grow with the number of tables.

Split tables of one width share one stacked cache and one device table, in one process and
across processes, so staging, lookup and update are the same few dozen tensor ops whether a
collection has 8 tables or 26 (cached one by one, 26 tables cost ~1,300 op calls a step).
Counted with a TorchDispatchMode over steady-state steps (caches already full, so that every
step evicts and fetches).

Host synchronizations are what a CUDA step waits for: here, on CPU, every call that would
make one there (`_CountSyncPoints`), in the step of a batch staged ahead (staging works on
the host, on the prefetch thread, where the caches' directories are: its reads of host
tensors wait for nothing); test_cuda.py counts the real ones with CUDA's sync debug mode.
DESIGN.md ("On a GPU machine") states the number and where they are.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Callable

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_exchange import _on_two_processes
from conftest import cpu_trainer, tiny_synthetic
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from lightning_hotcache import CacheMetrics, HotCacheStrategy, SamplesPerSecond
from lightning_hotcache.embedding import HotColdEmbeddingBagCollection
from lightning_hotcache.embedding.batch import sorted_reads
from lightning_hotcache.planner.plan import HotColdPlan, TablePlan
from lightning_hotcache.optim.rowwise import RowWiseOptimizerConfig
from models import DLRM

ROWS, DIM, BATCH, SLOTS = 2000, 8, 64, 160
# Extra ops allowed for 26 tables over 8: a handful of per-call constants, nothing per table.
SLACK = 8
# Calls in the step of a staged batch that would wait for a CUDA device (see
# `_CountSyncPoints`): none from the cache on either path. FBGEMM's TBE makes 4 that the
# counter cannot tell from waits: it reads its iteration counter and feature dims, tensors it
# keeps on the host (``iter_cpu.item()``), which wait for nothing on CUDA either.
SYNC_POINTS_PER_STEP = {"pytorch": 0, "fbgemm": 4}


class _CountOps(TorchDispatchMode):
    """Ops that compute (views, such as a slice of each feature's ids, launch no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


class _CountSyncPoints(TorchFunctionMode):
    """Calls that would make the host wait for a CUDA device, counted on CPU (an upper bound:
    a host tensor's ``cpu()`` counts too). Reads of a tensor's values on the host (``item``,
    ``int()``, ``bool()``, ``tolist``, ``numpy``, ``cpu()``, ``.to("cpu")``) are seen here;
    ops whose output size depends on the data (``unique``, ``nonzero``, boolean mask
    indexing, ``repeat_interleave`` without ``output_size``) by `_DataDependentOps`."""

    HOST_READS = frozenset({"cpu", "tolist", "item", "numpy", "__int__", "__bool__", "__float__", "__index__"})

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self._ops = _DataDependentOps(self.calls)

    def __enter__(self) -> "_CountSyncPoints":
        super().__enter__()
        self._ops.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ops.__exit__(*exc)
        super().__exit__(*exc)

    @property
    def count(self) -> int:
        return sum(self.calls.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.HOST_READS or (name == "to" and "cpu" in (*args[1:], kwargs.get("device"))):
            self.calls[name] += 1
        return func(*args, **kwargs)


class _DataDependentOps(TorchDispatchMode):
    SIZED_BY_DATA = frozenset({"aten.nonzero.default", "aten._unique2.default", "aten.unique_dim.default",
                               "aten.unique_consecutive.default", "aten.masked_select.default"})  # fmt: skip

    def __init__(self, calls: Counter[str]) -> None:
        super().__init__()
        self.calls = calls
        self.on_host: Callable[[object], bool] = lambda value: False  # `_CountDeviceReads` tells

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = str(func)
        if args and self.on_host(args[0]):
            return func(*args, **kwargs)
        indices = args[1] if name.startswith(("aten.index.", "aten.index_put")) and len(args) > 1 else ()
        if (
            name in self.SIZED_BY_DATA
            or (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None)
            or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
        ):
            self.calls[name] += 1
        return func(*args, **kwargs)


class _CountDeviceReads(_CountSyncPoints):
    """`_CountSyncPoints` that tells host tensors from device ones on a CPU, as CUDA would: a
    tensor is on the host if it came from ``cpu()`` / ``to("cpu")``, or from a factory given no
    device (``torch.tensor(0.5)``), or from ops on such tensors alone; reading it waits for
    nothing. Everything else counts as the device's. For a whole training step, where the
    model's own tensors are on the device but its logged figures need not be."""

    FACTORIES = frozenset({"tensor", "as_tensor", "from_numpy", "zeros", "ones", "empty", "full", "arange"})

    def __init__(self, host: dict[int, weakref.ref[torch.Tensor]] | None = None) -> None:
        super().__init__()
        # The host tensors seen, by id (a tensor's == is elementwise); shared by counters in a
        # row, as a figure logged in one step is read in the next.
        self._host = {} if host is None else host
        self._ops.on_host = self._on_host

    def _on_host(self, value: object) -> bool:
        found = self._host.get(id(value)) if isinstance(value, torch.Tensor) else None
        return found is not None and found() is value

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = _tensors_in((args, kwargs))
        host_in = bool(tensors) and all(self._on_host(t) for t in tensors)
        if host_in and (name in self.HOST_READS or name == "to"):
            out = func(*args, **kwargs)  # a read of the host: waits for nothing
        else:
            out = super().__torch_function__(func, types, args, kwargs)
        made_on_host = name in self.FACTORIES and kwargs.get("device") is None and not tensors
        to_host = name == "cpu" or (name == "to" and "cpu" in (*args[1:], kwargs.get("device")))
        if host_in or made_on_host or to_host:
            self._host.update((id(t), weakref.ref(t)) for t in _tensors_in(out))
        return out


def _tensors_in(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors_in(item)]
    return []


def _batches(num_tables: int, steps: int, seed: int) -> list[KeyedJaggedTensor]:
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        ids = np.minimum(rng.zipf(1.1, num_tables * BATCH * 2) - 1, ROWS - 1)
        batches.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=[f"f{k}" for k in range(num_tables)],
                values=torch.from_numpy(rng.permutation(ROWS)[ids]),
                lengths=torch.full((num_tables * BATCH,), 2, dtype=torch.int32),
            )
        )
    return batches


def _module(
    num_tables: int,
    process_group: object = None,
    kernel: str = "auto",
    device: str = "cpu",
    whole_tables: bool = False,
    optimizer: str = "rowwise_adagrad",
) -> HotColdEmbeddingBagCollection:
    """``num_tables`` split tables, or with ``whole_tables`` every other one wholly on the device."""
    tables = [EmbeddingBagConfig(name=f"t{k}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f{k}"]) for k in range(num_tables)]
    whole = [whole_tables and k % 2 == 1 for k in range(num_tables)]
    plans = [TablePlan(t.name, ROWS, DIM, np.arange(ROWS if w else 50), 0 if w else SLOTS, 0, 0.0) for t, w in zip(tables, whole)]
    plan = HotColdPlan(plans, budget_bytes=1, prefetch_depth=0, cache_policy="lfu")
    torch.manual_seed(0)
    return HotColdEmbeddingBagCollection.from_ebc(
        EmbeddingBagCollection(tables=tables), plan, RowWiseOptimizerConfig(optimizer),
        device=device, process_group=process_group, kernel=kernel,
    )  # fmt: skip


def _ops_per_step(
    num_tables: int,
    rank: int = 0,
    process_group: object = None,
    kernel: str = "auto",
    counter_type: type = _CountOps,
    device: str = "cpu",
    staged_ahead: bool = False,
    whole_tables: bool = False,
    reads_sorted_on_device: bool = False,
) -> int:
    """The most of ``counter_type().count`` over steady-state steps (a context manager with a
    count); with ``staged_ahead`` each batch is staged from the host before its step is counted;
    ``reads_sorted_on_device``: the PyTorch path's reads found as on CUDA (`sorted_reads`)."""
    module = _module(num_tables, process_group, kernel, device, whole_tables)
    module._staging.sorts_reads_on_device = reads_sorted_on_device
    batches = _batches(num_tables, steps=10, seed=rank)
    counts = []
    for step, host_batch in enumerate(batches):
        batch = host_batch.to(torch.device(device))
        if staged_ahead:
            module.prefetch(host_batch, arrives_as=batch)
        counter = counter_type()
        with counter:
            module(batch).values().sum().backward()
        if step >= 6:  # the caches are full by now: every step evicts
            counts.append(counter.count)
    assert sum(c.counters.evicted_rows for c in module.caches.values()) > 0
    return max(counts)


@pytest.mark.parametrize("kernel", ["auto", "pytorch", "pytorch-sorted-reads"])
def test_step_ops_do_not_grow_with_tables_in_one_process(kernel: str) -> None:
    # On the PyTorch path too: one embedding_bag per cache (a stack of split tables), not per
    # feature; with the reads found on the device (CUDA's way), one sort per width, not per table.
    reads_on_device = kernel == "pytorch-sorted-reads"
    kernel = kernel.removesuffix("-sorted-reads")
    few = _ops_per_step(8, kernel=kernel, reads_sorted_on_device=reads_on_device)
    many = _ops_per_step(26, kernel=kernel, reads_sorted_on_device=reads_on_device)
    assert many - few <= SLACK, (few, many)


@pytest.mark.parametrize("kernel", ["auto", "pytorch"])
def test_step_ops_do_not_grow_with_tables_wholly_on_the_device(kernel: str) -> None:
    # A width's whole tables share its device table with its stack: one lookup and one update
    # for all of them, on both kernels.
    few, many = _ops_per_step(8, kernel=kernel, whole_tables=True), _ops_per_step(26, kernel=kernel, whole_tables=True)
    assert many - few <= SLACK, (few, many)


def _across_two_ranks(rank: int) -> None:
    few, many = _ops_per_step(8, rank, dist.group.WORLD), _ops_per_step(26, rank, dist.group.WORLD)
    assert many - few <= SLACK, (rank, few, many)


@pytest.mark.full  # one process is counted by default
def test_step_ops_do_not_grow_with_tables_across_two_processes(tmp_path) -> None:
    failures = _on_two_processes({"step ops": _across_two_ranks}, tmp_path)
    assert not failures, failures


@pytest.mark.parametrize("kernel", ["pytorch", "pytorch-sorted-reads", "fbgemm"])
def test_step_of_a_staged_batch_waits_for_no_device(kernel: str) -> None:
    reads_on_device = kernel == "pytorch-sorted-reads"
    kernel = kernel.removesuffix("-sorted-reads")
    few = _ops_per_step(8, kernel=kernel, counter_type=_CountSyncPoints, staged_ahead=True, reads_sorted_on_device=reads_on_device)
    many = _ops_per_step(26, kernel=kernel, counter_type=_CountSyncPoints, staged_ahead=True, reads_sorted_on_device=reads_on_device)
    assert few == many <= SYNC_POINTS_PER_STEP[kernel], (few, many)


def test_reads_sorted_on_the_device_wait_for_no_device() -> None:
    # What replaces the host's unique on CUDA: fixed-size ops only (unique would be sized by the data).
    rows = torch.from_numpy(np.random.default_rng(0).integers(0, 50, 1000))
    with _CountSyncPoints() as counter:
        sorted_reads(rows)
    assert counter.count == 0, counter.calls
    with _CountSyncPoints() as counter:
        torch.unique(rows, return_inverse=True)
    assert counter.count == 1  # and the counter sees it there


def test_sync_point_counter_sees_what_would_wait_for_a_device() -> None:
    ids = torch.tensor([3, 1, 3, 2])
    with _CountSyncPoints() as counter:
        ids.unique(), ids[ids > 1], int(ids.sum()), ids.tolist(), ids.to("cpu")
        torch.repeat_interleave(ids, ids, output_size=9)  # sized by the caller: no wait
        ids.masked_fill(ids > 2, 0), ids + 1
    assert counter.count == 5, counter.calls


class CountsPerStep(pl.Callback):
    """A counter (``make()``: a context manager with a ``count``) over each whole training step
    on the training thread, from one batch's start to the next's: forward, backward, both
    optimizers, Lightning's logging and progress-bar metrics."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.counts: list[int] = []
        self._counter: Any = None

    def _close(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.counts.append(self._counter.count)
            self._counter = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self._close()
        self._counter = self.make()
        self._counter.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self._close()


class LogsTheDeviceLoss(DLRM):
    """Logs its loss as Lightning users usually do: the device tensor, on the progress bar."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        self.log("train/device_loss", loss, prog_bar=True)
        return loss


def device_reads_per_step(model_class: type[DLRM], counter: Callable[[], Any], **trainer_kwargs: Any) -> list[int]:
    """``counter``'s count in each steady-state step of a DLRM fitted under hotcache (the
    PyTorch path, staged on the prefetch thread), with the package's callbacks logging."""
    dm = tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=640, batch_size=64)
    dm.setup("fit")
    strategy = HotCacheStrategy(device_budget=0.05, profile_batches=4, prefetch_thread=True, kernel="pytorch")
    counting = CountsPerStep(counter)
    trainer = cpu_trainer(**({"strategy": strategy, "max_epochs": 1, "callbacks": [counting, SamplesPerSecond(), CacheMetrics()]} | trainer_kwargs))
    pl.seed_everything(0)
    trainer.fit(model_class(dm.tables, dm.num_dense_features), datamodule=dm)
    return counting.counts[2:-1]  # after the first steps' set-up (caches, optimizer state), before validation


@pytest.mark.parametrize("model_class", [DLRM, LogsTheDeviceLoss])
def test_whole_training_step_reads_the_device_once(model_class: type[DLRM]) -> None:
    # The GPU issue's bound, "host syncs a step, in all: <= 1": the non-finite-loss guard's copy
    # of the loss. Before, the guard read it twice (nonzero, tolist), and Lightning read the
    # logged loss and every figure the callbacks logged (made device tensors) with `item()`
    # for the progress bar every step: 5 a step. A model that logs a device tensor on the
    # progress bar adds one, which the count sees. test_cuda.py counts the real ones.
    host: dict[int, weakref.ref[torch.Tensor]] = {}  # shared: a figure logged in one step is read in the next
    steps = device_reads_per_step(model_class, lambda: _CountDeviceReads(host))
    assert len(steps) >= 6
    assert max(steps) == (1 if model_class is DLRM else 2), steps
