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

from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_exchange import _on_two_processes
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from lightning_hotcache.embedding import HotColdEmbeddingBagCollection
from lightning_hotcache.embedding.batch import sorted_reads
from lightning_hotcache.planner import HotColdPlan, TablePlan
from lightning_hotcache.rowwise import RowWiseOptimizerConfig

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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = str(func)
        indices = args[1] if name.startswith(("aten.index.", "aten.index_put")) and len(args) > 1 else ()
        if (
            name in self.SIZED_BY_DATA
            or (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None)
            or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
        ):
            self.calls[name] += 1
        return func(*args, **kwargs)


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
    num_tables: int, process_group: object = None, kernel: str = "auto", device: str = "cpu", whole_tables: bool = False
) -> HotColdEmbeddingBagCollection:
    """``num_tables`` split tables, or with ``whole_tables`` every other one wholly on the device."""
    tables = [EmbeddingBagConfig(name=f"t{k}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f{k}"]) for k in range(num_tables)]
    whole = [whole_tables and k % 2 == 1 for k in range(num_tables)]
    plans = [TablePlan(t.name, ROWS, DIM, np.arange(ROWS if w else 50), 0 if w else SLOTS, 0, 0.0) for t, w in zip(tables, whole)]
    plan = HotColdPlan(plans, budget_bytes=1, prefetch_depth=0, cache_policy="lfu")
    torch.manual_seed(0)
    return HotColdEmbeddingBagCollection.from_ebc(
        EmbeddingBagCollection(tables=tables), plan, RowWiseOptimizerConfig("rowwise_adagrad"),
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
