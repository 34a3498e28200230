"""HotCacheStrategy: ``Trainer(strategy="hotcache")`` trains any model with hybrid embeddings.

On setup it finds every torchrec EmbeddingBagCollection in the LightningModule (at any
depth), loads access stats or profiles the first training batches, plans which rows stay
on the device within ``device_budget``, and swaps each collection for a
`HotColdEmbeddingBagCollection` with the same tables, weights and row-wise optimizer rule
(``model.embedding_optimizer_config`` when the model has one). The model's code does not
change. While training, the training dataloader is wrapped so that the rows of the next
``prefetch_depth`` batches are staged ahead of the step that reads them.

Checkpoints hold the full tables under the plain keys (a hotcache checkpoint loads into the
same model under ``strategy="auto"``), the row-wise optimizer state in the strategy-neutral
`ROW_STATE_KEY` format, and the plan.

Processes are launched and the dense layers reduced exactly as by Lightning's DDPStrategy
(``devices``, ``num_nodes``, torchrun, SLURM; gloo on CPU, NCCL on GPUs); one process runs
the module unwrapped, as ``auto`` does, with no collective in its step. Host stores are
sharded round-robin across ranks and each rank caches the rows its batches read (hot rows
on every rank); a forward fetches the current copies of the other ranks' rows it reads
from their owners, and in backward each row's gradient goes to its owner, which applies the
ranks' mean (see `lightning_hotcache.embedding.update.OwnersUpdate`): N ranks x batch B learn
what 1 rank x N*B learns. Checkpoints gather the shards into whole tables,
or, with ``checkpoint_shards=True`` (tables too large to gather on one rank), each rank
writes its own shard file beside the checkpoint (`lightning_hotcache.checkpoint.files`: written so
that a kill mid-save leaves the previous or the new checkpoint whole); `consolidate_checkpoint`
(or ``hotcache consolidate``) turns such a checkpoint into a plain one.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from typing_extensions import override

from lightning_hotcache._compat import fit_train_dataloader, is_wrapping_checkpoint_io
from lightning_hotcache.strategies.accumulation import refuse_gradient_accumulation, refuse_gradient_accumulation_now
from lightning_hotcache._ops.background import background_priority_supported, run_at_background_priority
from lightning_hotcache.cache import check_cache_policy
from lightning_hotcache.cache.lookahead import default_lookahead_batches
from lightning_hotcache.cache.fused import check_kernel_choice
from lightning_hotcache.cache.side_by_side import check_staging_threads
from lightning_hotcache.cache.upload import batch_to_device
from lightning_hotcache.checkpoint.files import (
    SHARDS_KEY,
    AtomicCheckpointIO,
    consolidated,
    main_file_crc32,
    new_save_id,
    remove_shards,
    shard_contents,
    shard_path,
    write_atomically,
)
from lightning_hotcache.distributed.collectives import broadcast_from_rank_zero
from lightning_hotcache.embedding import HotColdEmbeddingBagCollection, hot_cold_modules
from lightning_hotcache.distributed.even_batches import check_even_batches
from lightning_hotcache.distributed.global_batch import BatchShare
from lightning_hotcache._ops.guards import finite_loss_or_skip
from lightning_hotcache._ops.host_rows import release_helpers
from lightning_hotcache.strategies.like_auto import LikeAutoInOneProcess, loader_rngs_restored
from lightning_hotcache.planner.plan import (
    Budget,
    HotColdPlan,
    HotColdPlanner,
    StatsNeededError,
    StagingChoice,
    resolve_budget,
    staging_choice,
    tables_bytes,
)
from lightning_hotcache.strategies.precision import refuse_half_true_precision
from lightning_hotcache.planner.profiling import AccessStats, profile_batches, run_batch_size
from lightning_hotcache.optim.rowwise import ROW_STATE_KEY, RowWiseOptimizerConfig
from lightning_hotcache.embedding.table_init import deferred_tables_left_out_of_moves, draw_seed, is_deferred
from lightning_hotcache.strategies.torchrec import refuse_sharded_tables

PLAN_KEY = "hotcache_plan"


class _PrefetchingLoader:
    """Iterates a training dataloader, staging the rows of the next ``depth`` batches.

    Batches are moved to the device here (the loop's own transfer then finds them there),
    so the rows a step reads are resident before the step starts. A model whose
    ``on_before_batch_transfer`` rewrites the sparse features would not match what was
    staged; forward then says so. With ``prefetch_thread`` the staging runs on a background
    thread, overlapping the model's dense compute (torch ops release the GIL), and with a
    reader thread (CUDA's default) the batches are read and announced on another; staging runs
    no collective (across processes it reads only the rank's own rows; other ranks' rows
    come in forward), so this holds across processes too. Outside
    training mode (sanity checks, validation) batches pass through untouched.

    A stateful loader (one with ``state_dict``/``load_state_dict``, which Lightning saves in
    checkpoints and loads on resume: torchdata's ``StatefulDataLoader``) is read ahead of the
    step, so its own state is that of the batches read ahead. Its state is therefore taken
    right after each batch is read, and ``state_dict()`` here returns the one of the last
    batch handed to the loop: a checkpoint resumes at the batch after the trained step.
    """

    def __init__(self, loader: Iterable[Any], strategy: "HotCacheStrategy") -> None:
        self.loader = loader
        self.strategy = strategy
        # A stateful loader's state after each batch read ahead and not yet handed to the loop
        # (appended by whichever thread reads), and the state after the last one handed over.
        self._states_read: deque[Any] = deque()
        self._state_handed: Any = None
        self._warned_of_unread_features = False

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # sampler, dataset, batch_size... as Lightning expects
        # Through __dict__: while copy or pickle rebuild this object, `loader` is not set yet, and
        # `self.loader` would call this method again, forever.
        if "loader" not in self.__dict__:
            raise AttributeError(name)
        found = getattr(self.__dict__["loader"], name)
        return self._state_of_handed_batches if name == "state_dict" else found

    def _state_of_handed_batches(self) -> Any:
        """The loader's state as of the last batch the loop got (its own outside staging)."""
        return self.loader.state_dict() if self._state_handed is None else self._state_handed  # type: ignore[attr-defined]

    @property
    def _stateful(self) -> bool:
        return callable(getattr(self.loader, "state_dict", None))

    def __iter__(self) -> Iterator[Any]:
        modules = list(hot_cold_modules(self.strategy.lightning_module).values())
        self._states_read.clear()
        self._state_handed = None
        if not modules or not self.strategy.lightning_module.training or self.strategy.prefetch_depth == 0:
            yield from self.loader
            return
        for module in modules:  # an epoch cut short (limit_train_batches, max_steps) leaves some staged
            module.clear_prefetched()
        staged = self._staged_in_background(modules) if self.strategy.uses_prefetch_thread else self._staged_inline(modules)
        stateful = self._stateful
        with contextlib.closing(staged):
            for batch in staged:
                if stateful:  # read (and its state taken) before it was staged
                    self._state_handed = self._states_read.popleft()
                yield batch

    def _read_ahead(self, modules: list[HotColdEmbeddingBagCollection]) -> Iterator[Any]:
        """The loader's batches, each announced to the modules first (its ids checked, ordered
        and deduplicated there, `Staging.announce`); under the lookahead policy handed on
        ``window_batches`` batches later, so that the caches evict by the batches to come."""
        ahead = self.strategy.window_batches if self.strategy.cache_policy == "lookahead" else 0
        window: deque[Any] = deque()
        stateful = self._stateful
        for n, batch in enumerate(self._batches_the_loop_takes()):
            if stateful:
                self._states_read.append(self.loader.state_dict())  # type: ignore[attr-defined]
            started = time.perf_counter()
            for features in _features_of(batch):
                for module in modules:
                    if module.reads(features, n):
                        module.announce(features)
                self._warn_once_of_unread_features(features, modules)
            self.strategy.staging_work.announcing_seconds += time.perf_counter() - started
            window.append(batch)
            if len(window) > ahead:
                yield window.popleft()
        yield from window

    def _warn_once_of_unread_features(self, features: KeyedJaggedTensor, modules: list[HotColdEmbeddingBagCollection]) -> None:
        if self._warned_of_unread_features:
            return
        unread = set(features.keys()) - set().union(*(m.input_features for m in modules))
        if unread:
            self._warned_of_unread_features = True
            rank_zero_warn(f"The training batches' sparse features {sorted(unread)} are looked up by no table of the model: they are ignored.")

    def _batches_the_loop_takes(self) -> Iterator[Any]:
        """The loader's batches, no more than its length: Lightning's loop stops asking at the
        length, and a further ``next`` can draw from the loader's generators (a RandomSampler
        draws its next permutation then), which the next epoch's order would show."""
        try:
            length = len(self.loader)  # type: ignore[arg-type]
        except TypeError:  # an iterable without a length: the loop reads it to its end too
            return iter(self.loader)
        return itertools.islice(self.loader, length)

    def _moved(self, batches: Iterator[Any]) -> Iterator[tuple[Any, Any]]:
        """Each of ``batches`` and its move to the device: the ids are staged from the host
        batch (the caches' directories are there), the moved batch is what forward will get."""
        # A plain move (one that leaves the host free: `batch_to_device`), not
        # strategy.batch_to_device: that runs the module's transfer hooks,
        # which mark the module as inside a hook and would break `self.log` on the training
        # thread. The loop runs the hooks itself afterwards, on a batch already in place.
        for batch in batches:
            yield batch, batch_to_device(batch, self.strategy.root_device)

    def _stage(self, batch: Any, moved: Any, modules: list[HotColdEmbeddingBagCollection]) -> Any:
        for features, arriving in zip(_features_of(batch), _features_of(moved)):
            for module in modules:
                if module.reads(features):
                    module.prefetch(features, arrives_as=arriving, announced=True)
        return moved

    def _staged_inline(self, modules: list[HotColdEmbeddingBagCollection]) -> Iterator[Any]:
        ahead: deque[Any] = deque()
        depth = self.strategy.prefetch_depth  # chosen once (`staging_choice`), not per batch
        for batch, moved in self._moved(self._read_ahead(modules)):
            ahead.append(self._stage(batch, moved, modules))
            if len(ahead) > depth:
                yield ahead.popleft()
        yield from ahead

    def _staged_in_background(self, modules: list[HotColdEmbeddingBagCollection]) -> Iterator[Any]:
        # With a reader thread, two threads beside training: the reader takes each batch from
        # the loader, announces it (its per-id preparation) and moves it to the device, and the
        # prefetch thread stages it (acquires its rows): a batch's preparation overlaps the
        # staging of the one before, which on a GPU host was the step's bound at small budgets.
        # The reader runs one batch ahead (under the lookahead policy, one past the window).
        read = self._moved(self._read_ahead(modules))
        background = self.strategy.stages_in_background
        if self.strategy.uses_reader_thread:
            read = _in_thread(read, depth=1, name="hotcache-reader", background=background)
        yield from _in_thread(self._staged(read, modules), depth=self.strategy.prefetch_depth, name="hotcache-prefetch",
                              waits=self.strategy.staging_waits, background=background)  # fmt: skip

    def _staged(self, batches: Iterator[Any], modules: list[HotColdEmbeddingBagCollection]) -> Iterator[Any]:
        """``batches`` staged one by one, the time each took counted in `HotCacheStrategy.staging_work`."""
        with contextlib.closing(batches):  # type: ignore[type-var]  # a generator: closing it stops its thread
            while True:
                started = time.perf_counter()
                item = next(batches, _END)
                if item is _END:
                    return
                read, cpu, helped = time.perf_counter(), time.thread_time(), _helper_cpu(modules)
                staged = self._stage(*item, modules)
                cpu = time.thread_time() - cpu + _helper_cpu(modules) - helped
                self.strategy.staging_work.add(read - started, time.perf_counter() - read, cpu)
                yield staged


def _helper_cpu(modules: list[HotColdEmbeddingBagCollection]) -> float:
    return sum(module.staging_helper_cpu_seconds() for module in modules)


def _in_thread(
    items: Iterator[Any], depth: int, name: str, waits: "StagingWaits | None" = None, background: bool = False
) -> Iterator[Any]:
    """``items``, produced on a thread of their own at most ``depth`` ahead of this generator's
    consumer; with ``background``, at the lowest CPU priority (`run_at_background_priority`).
    An error raised there is raised here; closing this generator stops the thread, which
    closes ``items`` (a generator) there. A wait for an item counts in ``waits``."""
    ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            if background:
                run_at_background_priority()
            with contextlib.closing(items):  # type: ignore[type-var]
                for item in items:
                    while not stop.is_set():
                        try:
                            ready.put(item, timeout=0.05)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
            ready.put(_END)
        except BaseException as err:  # handed to the consumer, which raises it
            ready.put(_Failed(err))

    worker = threading.Thread(target=work, name=name, daemon=True)
    worker.start()
    try:
        while (item := _next_item(ready, waits)) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # unblock a worker waiting on a full queue
            with contextlib.suppress(queue.Empty):
                ready.get(timeout=0.05)
        worker.join()


def _next_item(ready: "queue.Queue[Any]", waits: "StagingWaits | None") -> Any:
    """The thread's next item; a wait for it counts in ``waits``."""
    try:
        return ready.get_nowait()
    except queue.Empty:
        started = time.perf_counter()
        item = ready.get()
        if waits is not None:
            waits.add(time.perf_counter() - started)
        return item


@dataclass
class StagingWaits:
    """Training batches the loop had to wait for, because the prefetch thread had not staged
    them yet, and the seconds it waited: where steps wait, the host's staging (the caches'
    work) bounds training, not the device."""

    batches: int = 0
    seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.batches += 1
        self.seconds += seconds


@dataclass
class StagingWork:
    """What the prefetch thread spent per batch: waiting for the reader thread (the loader,
    and announcing the batch: checking, ordering and deduplicating its ids), and staging,
    in wall time and in CPU time (the thread's own and, with ``staging_threads``, its staging
    threads'); and the time announcing took, wall (on the
    reader thread where there is one; inline staging counts it too). Staging whose wall time
    far exceeds its CPU time waited (for the GIL, the module's lock, a copy's event) rather
    than worked (the thread works its share of a parallel op, so that counts; on several
    staging threads the CPU time may exceed the wall time)."""

    batches: int = 0
    reading_seconds: float = 0.0
    staging_seconds: float = 0.0
    staging_cpu_seconds: float = 0.0
    announcing_seconds: float = 0.0

    def add(self, reading: float, staging: float, staging_cpu: float) -> None:
        self.batches += 1
        self.reading_seconds += reading
        self.staging_seconds += staging
        self.staging_cpu_seconds += staging_cpu


_END = object()


@dataclass
class _Failed:
    error: BaseException


def _load_row_state(path: str, module: HotColdEmbeddingBagCollection, saved: Mapping[str, Any]) -> None:
    """Row-wise optimizer state of ``module`` (at ``path``) from a checkpoint's `ROW_STATE_KEY`."""
    module.load_optimizer_state({t: saved[f"{path}.{t}"] for t in module.caches if f"{path}.{t}" in saved})


def _features_of(batch: Any) -> list[KeyedJaggedTensor]:
    """The KeyedJaggedTensors in ``batch``. TorchRec's ``Batch`` (and the zoo's share of one)
    directly: the generic walk deep-copies a dataclass's shell to rebuild it, three times a
    batch, on the staging threads beside the training loop's Python (a user's subclass, which
    may hold more, still takes the walk)."""
    if type(batch) in (Batch, BatchShare):
        return [batch.sparse_features]
    found: list[KeyedJaggedTensor] = []
    apply_to_collection(batch, KeyedJaggedTensor, found.append)
    return found


class HotCacheStrategy(LikeAutoInOneProcess):
    """Hybrid embeddings: hot rows on the device, the rest in a host store behind a cache.

    Args:
        device_budget: device memory for embedding rows, optimizer state and cache
            bookkeeping: bytes, a size like ``"2GB"``, a fraction in (0, 1] of the tables'
            bytes, or ``"auto"`` (half the free device memory). An int is bytes: ``1`` is
            refused (``1.0`` is the whole tables), and so is growing one far below the minimum.
        stats_path: access stats from ``hotcache profile``; without them the first
            ``profile_batches`` training batches are profiled when the plan needs stats.
            They must be for the model's tables and this run's batch size.
        plan_path: a plan from ``hotcache plan --out`` to train with as it is, instead of
            planning: it must be for the model's tables, this run's world size, cache policy,
            batches in flight and batch size, and fit ``device_budget`` (with ``"auto"``, the
            budget it was planned for).
        profile_batches: training batches to profile when there are no stats.
        cache_policy: ``lfu``, ``lru``, ``static`` (FAE: hot rows only, misses staged per batch)
            or ``lookahead`` (the loader reads training batches ahead; a cache evicts the rows
            none of them reads first, by LFU, then the row read farthest ahead).
        host_storage: ``"memory"`` or a directory for memory-mapped host tables.
        prefetch_depth: training batches whose rows are staged ahead of the current one.
            Default (`staging_choice`): 3 where the strategy chooses the prefetch thread on a
            CPU (large tables), else 1.
        lookahead_batches: with ``cache_policy="lookahead"``, training batches read ahead of
            staging, whose ids (only) the caches see. Default (`default_lookahead_batches`):
            131,072 samples' worth, within [64, 256] batches (256 of 256 or 512 samples, 64
            of 2,048 or more): on Zipf traces, the window that closed most of the hit-rate gap
            between LFU and Belady's optimum (benchmarks/README.md, hit_rate). The plan counts
            its host memory.
        prefetch_thread: stage on a background thread. Default (`staging_choice`): on CUDA
            devices, where the host's bookkeeping then overlaps the GPU's compute; on a CPU
            only for tables of `LARGE_TABLES_BYTES` or more on two cores or more. Small steps
            leave a CPU thread too little idle time, and with a thread the cache's counters
            depend on timing, so runs no longer repeat them. On a CPU the thread (and the
            DataLoader workers it starts) runs at the lowest priority, in the cores the step
            leaves idle instead of preempting its ops' threads; on CUDA the batches are also
            read and their ids prepared on a reader thread beside it. Where every collection's
            caches keep their directory in device memory (CUDA's default), no thread by
            default: forward's device ops stage each batch.
        staging_threads: threads that stage a batch's caches at once (each width's split
            tables are then stacked in that many caches, of about equal dynamic slots, each
            with a directory of its own; see `lightning_hotcache.cache.side_by_side`).
        cache_metrics: add a `CacheMetrics` callback (hit rates, traffic) unless one is there.
        kernel: the device tier's kernel: ``"auto"`` (FBGEMM's fused table-batched kernel
            where it trains exactly, except row-wise Adagrad on a CPU, where PyTorch's measured
            faster; else, on CUDA, the Triton TBE (`lightning_hotcache.kernels.triton_tbe`);
            else PyTorch's; the log says which and why), ``"fbgemm"`` or ``"triton"`` (fail if
            it cannot run) or ``"pytorch"``.
        checkpoint_shards: save split tables as one file per rank (``<ckpt>.<id>.rank<r>-of-<n>``,
            the id tying them to their main file) instead of gathering them into the
            checkpoint. Loading one copies each rank's rows from the memory-mapped shard files
            piece by piece, on any number of ranks: no table is made whole in memory (a
            ``LightningModule.on_load_checkpoint`` sees a split table's arrays as
            `RoundRobinRows`, whose ``whole()`` is the tensor).
        grow_budget_to_minimum: when ``device_budget`` is below the minimum the batches in
            flight need, plan with that minimum (and warn) instead of failing; the fractional
            presets (``hotcache_10pct``, ``hotcache_1pct``) set it, so they fit tables of any size.
        **kwargs: DDPStrategy options (process_group_backend, timeout, DDP arguments, ...).
    """

    strategy_name = "hotcache"
    # A model's deferred (meta) tables are left to this strategy, which writes their rows
    # straight into their tiers (see `lightning_hotcache.embedding.table_init`).
    initializes_deferred_tables = True

    def __init__(
        self,
        device_budget: Budget = "auto",
        stats_path: str | None = None,
        plan_path: str | None = None,
        profile_batches: int = 100,
        cache_policy: str = "lfu",
        host_storage: str = "memory",
        prefetch_depth: int | None = None,
        lookahead_batches: int | None = None,
        prefetch_thread: bool | str | None = None,
        staging_threads: int = 1,
        cache_metrics: bool = True,
        checkpoint_shards: bool = False,
        kernel: str = "auto",
        grow_budget_to_minimum: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_cache_policy(cache_policy)
        check_kernel_choice(kernel)
        if prefetch_depth is not None and prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}.")
        if lookahead_batches is not None and lookahead_batches < 1:
            raise ValueError(f"lookahead_batches must be at least 1, got {lookahead_batches}.")
        if cache_policy == "lookahead" and prefetch_depth == 0:
            raise ValueError("cache_policy='lookahead' reads batches ahead of staging: it needs prefetch_depth >= 1.")
        if profile_batches < 1:
            raise ValueError(f"profile_batches must be >= 1, got {profile_batches}.")
        check_staging_threads(staging_threads)
        if prefetch_thread is not None and not isinstance(prefetch_thread, bool):  # str: to name it, not jsonargparse's union
            raise ValueError(
                f"prefetch_thread must be true, false or null (null: chosen by the device and the tables' size), got {prefetch_thread!r}."
            )
        if host_storage != "memory" and Path(host_storage).exists() and not Path(host_storage).is_dir():
            raise NotADirectoryError(
                f"host_storage {host_storage} is a file; give a directory (created if missing) or 'memory'."
            )
        if stats_path is not None and not Path(stats_path).is_file():
            raise FileNotFoundError(f"stats_path {stats_path} does not exist; make it with `hotcache profile`.")
        if plan_path is not None and not Path(plan_path).is_file():
            raise FileNotFoundError(f"plan_path {plan_path} does not exist; make it with `hotcache plan --out`.")
        if plan_path is not None and stats_path is not None:
            raise ValueError("Give plan_path or stats_path, not both: a plan from `hotcache plan` is already made from stats.")
        if device_budget != "auto":  # its form, now: a CLI run builds the model before setup needs the bytes
            resolve_budget(device_budget, total_bytes=1)
        self.device_budget = device_budget
        self.grow_budget_to_minimum = grow_budget_to_minimum
        self.stats_path = stats_path
        self.plan_path = plan_path
        self.profile_batches = profile_batches
        self.cache_policy = cache_policy
        self.host_storage = host_storage
        self.prefetch_depth_setting = prefetch_depth  # None: `staging_choice` decides at setup
        self.lookahead_batches = lookahead_batches
        # The window the loader keeps: lookahead_batches, or the default for the run's batches (set up with the modules).
        self.window_batches = lookahead_batches or default_lookahead_batches(None)
        self.prefetch_thread = prefetch_thread
        self.staging_threads = staging_threads
        self._table_bytes = 0  # the model's tables, set at setup: what the staging defaults depend on
        self.cache_metrics = cache_metrics
        self.checkpoint_shards = checkpoint_shards
        self.kernel = kernel
        self.plan: HotColdPlan | None = None
        self.staging_waits = StagingWaits()  # running totals; `CacheMetrics` logs them per step
        self.staging_work = StagingWork()  # running totals of the prefetch thread's time

    @property
    def uses_prefetch_thread(self) -> bool:
        """Whether training batches are staged on a prefetch thread: as `staging_choice` chose,
        except by default where every collection keeps its caches' directory in device memory
        (`HotColdEmbeddingBagCollection.stages_on_the_device`): there a batch's rows are found
        and admitted by its forward's device ops, and staging ahead only checks its ids, which
        the training loop does one batch ahead, as ``auto`` reads its batches."""
        return self._staging.thread and not (self.prefetch_thread is None and self._every_collection_stages_on_the_device)

    @property
    def _every_collection_stages_on_the_device(self) -> bool:
        modules = hot_cold_modules(self.lightning_module).values() if self.lightning_module is not None else ()
        return bool(modules) and all(module.stages_on_the_device for module in modules)

    @property
    def prefetch_depth(self) -> int:
        return self._staging.depth

    @property
    def _staging(self) -> StagingChoice:
        return staging_choice(self.prefetch_thread, self.prefetch_depth_setting, self.root_device, self._table_bytes)

    @property
    def stages_in_background(self) -> bool:
        """Whether the staging threads run at background priority (`lightning_hotcache._ops.background`):
        on a CPU, where the step's ops take every core and a thread at the step's priority
        preempts one of them mid-op; on CUDA staging's pace bounds the step."""
        return background_priority_supported() and self.root_device.type == "cpu"

    @property
    def staging_note(self) -> str:
        """How training batches are staged, for the log: where, how far ahead, at what priority."""
        if self.prefetch_depth == 0:
            return "by each batch's own forward (prefetch_depth=0: nothing staged ahead)"
        ahead = f"{self.prefetch_depth} batch{'es' if self.prefetch_depth != 1 else ''} ahead"
        ahead += f", {self.staging_threads} caches side by side" if self.staging_threads > 1 else ""
        if not self.uses_prefetch_thread:
            on_the_device = "; each batch's rows found and admitted on the device by its forward"
            return f"inline on the training loop, {ahead}" + (on_the_device if self._every_collection_stages_on_the_device else "")
        threads = "a prefetch thread" + (" and a reader thread" if self.uses_reader_thread else "")
        priority = "at background priority" if self.stages_in_background else "at the step's priority"
        return f"on {threads} {priority}, {ahead}"

    @property
    def uses_reader_thread(self) -> bool:
        """Whether batches are read and announced on a thread of their own beside the prefetch
        thread: on CUDA, where a batch's per-id preparation then overlaps the staging of the
        one before; not on a CPU, where a third busy thread takes a core from the step."""
        return self.uses_prefetch_thread and self.root_device.type == "cuda"

    def why_the_step_is_not_graphed(self) -> str | None:
        """Why a zoo model's training step cannot be recorded in a CUDA graph under this
        strategy (None where it can): every collection's caches must keep their directory in
        device memory, so that a step reads nothing back from the device."""
        for path, module in hot_cold_modules(self.lightning_module).items():
            refusal = module.why_not_graphable()
            if refusal is not None:
                return f"hotcache's {path or 'collection'}: {refusal}"
        return None

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_sharded_tables(self.lightning_module, f"strategy={self.strategy_name!r}")
        if any(isinstance(m, (EmbeddingBagCollection, HotColdEmbeddingBagCollection)) for m in self.lightning_module.modules()):
            refuse_gradient_accumulation(trainer, self.strategy_name)
            refuse_half_true_precision(trainer, f"strategy={self.strategy_name!r}")
        self._install_hot_cold_embeddings(trainer)
        super().setup(trainer)
        if self.cache_metrics and self.plan is not None:
            from lightning_hotcache.callbacks.metrics import CacheMetrics

            if not any(isinstance(cb, CacheMetrics) for cb in trainer.callbacks):
                trainer.callbacks.append(CacheMetrics())

    @override
    def configure_ddp(self) -> None:
        # One process has nothing to reduce. DistributedDataParallel would still broadcast the
        # buffers every forward and copy every dense gradient into buckets, all-reduce them
        # with itself and copy them back: per-step work (and on CUDA kernels and an NCCL call)
        # that `auto`, the baseline, does not do. Lightning's DDPStrategy runs an unwrapped
        # module as it runs `auto`'s.
        if self.world_size > 1:
            super().configure_ddp()

    def _install_hot_cold_embeddings(self, trainer: pl.Trainer) -> None:
        model = self.lightning_module
        assert model is not None
        if installed := hot_cold_modules(model):  # a second fit with the same model
            for module in installed.values():
                module.lock_host_storage()
            return
        collections = {n: m for n, m in model.named_modules() if isinstance(m, EmbeddingBagCollection)}
        if not collections:
            rank_zero_warn(f"{type(model).__name__} has no torchrec EmbeddingBagCollection; hotcache changes nothing.")
            return
        tables = [t for m in collections.values() for t in m.embedding_bag_configs()]
        self._table_bytes = tables_bytes(tables)
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"hotcache needs unique table names across the model's collections; got {names}.")
        optimizer = getattr(model, "embedding_optimizer_config", None) or RowWiseOptimizerConfig()
        # Deferred (meta) tables are initialized where their rows live, from one seed for all
        # ranks: the model's ``table_init_seed`` when it has one (CTRModel draws it when it
        # declares the tables, so they are the same under every strategy).
        seed = None
        if any(map(is_deferred, collections.values())):
            seed = getattr(model, "table_init_seed", None)
            seed = self.broadcast(draw_seed() if seed is None else seed)
        failure: Exception | None = None
        try:  # planning and each rank's folder are checked on every rank, before the next collective
            self.plan = self._make_plan(trainer, tables, optimizer)
            storage = self._rank_storage()
        except Exception as err:
            failure = err
        self._stop_every_rank_if_one_failed(failure, "plan its tables")
        if self.world_size > 1:
            # Ranks profiled different batches; they must share one plan (their row exchanges
            # must match), so rank 0's wins.
            self.plan = HotColdPlan.from_dict(self.broadcast(self.plan.to_dict()), self.plan.sharding_plan)
        rank_zero_info(f"hotcache plan:\n{self.plan}")
        # A group of our own, so the row exchanges (forward and backward) never interleave with DDP's
        # bucket all-reduces on the default group.
        group = dist.new_group() if self.world_size > 1 else None
        for path, collection in collections.items():
            if self.world_size > 1 and not is_deferred(collection):
                # Every rank installs rank 0's rows (as DDP gives every rank rank 0's dense
                # weights): each rank keeps its own share of them, and ranks seeded apart
                # would otherwise train one table made of several initializations.
                broadcast_from_rank_zero(collection.parameters())
            try:  # a rank's host storage may refuse (a lock, the disk): every rank stops, naming it
                hot = HotColdEmbeddingBagCollection.from_ebc(
                    collection, self.plan, optimizer, self.root_device, self.cache_policy,  # type: ignore[arg-type]
                    storage, group, seed, self.kernel, self.staging_threads,
                )  # fmt: skip
            except Exception as err:
                failure = err
            self._stop_every_rank_if_one_failed(failure, f"build the tables of {path}")
            rank_zero_info(f"hotcache embedding kernel ({path}): {hot.kernel_note}")
            model.set_submodule(path, hot)
        rank_zero_info(f"hotcache staging: {self.staging_note}")  # once the collections say where they stage

    def _make_plan(self, trainer: pl.Trainer, tables: list[Any], optimizer: RowWiseOptimizerConfig) -> HotColdPlan:
        """This rank's plan: the plan file's, checked, or one planned from stats or a profile."""
        saved = HotColdPlan.load(self.plan_path) if self.plan_path is not None else None
        # With a plan file, "auto" leaves the budget to the plan (`hotcache plan --budget` chose it).
        budget = saved.budget_bytes if saved is not None and self.device_budget == "auto" else self.device_budget
        # The run's batch size, read once (from the loader's first batches) by whatever needs it.
        default_window = self.cache_policy == "lookahead" and self.lookahead_batches is None
        needs_batch_size = saved is not None or self.stats_path is not None or default_window
        batch_size = self._run_batch_size(trainer) if needs_batch_size else None
        if default_window:
            self.window_batches = default_lookahead_batches(batch_size)
        planner = HotColdPlanner(
            budget, optimizer, world_size=self.world_size, prefetch_depth=self.prefetch_depth,
            cache_policy=self.cache_policy, device=self.root_device, grow_budget_to_minimum=self.grow_budget_to_minimum,
            prefetch_thread=self._staging.thread, lookahead_batches=self.window_batches,
        )  # fmt: skip
        if saved is not None:
            planner.check_plan(saved, tables, batch_size)
            return planner.with_this_runs_bytes(saved, tables)
        else:
            stats = AccessStats.load(self.stats_path, tables) if self.stats_path else None
            try:
                plan = planner.plan(tables, stats, batch_size if stats is not None else None)
            except StatsNeededError:
                plan = None  # profiled below, outside the handler: a planner error then is not shown "during handling" of this
            if plan is None:
                with self._training_batches(trainer) as batches:
                    plan = planner.plan(tables, profile_batches(batches, tables, self.profile_batches))
            return plan

    def _stop_every_rank_if_one_failed(self, failure: Exception | None, what: str) -> None:
        """Raise ``failure`` here, and on every other rank an error naming this rank and it:
        one rank leaving alone would leave the others waiting in their next collective."""
        if self.world_size == 1:
            if failure is not None:
                raise failure
            return
        failed = self.all_gather(torch.tensor([failure is not None], dtype=torch.int32, device=self.root_device)).flatten()
        if bool(failed.any()):
            first = int(failed.nonzero()[0, 0])
            why = self.broadcast(None if failure is None else f"{type(failure).__name__}: {failure}", src=first)
            if failure is not None:
                raise failure
            raise RuntimeError(f"Rank {first} could not {what}, so no rank goes on. {why}")

    def _rank_storage(self) -> str:
        # Memory-mapped host tables: one directory per rank, each holding that rank's shard.
        if self.host_storage == "memory" or self.world_size == 1:
            return self.host_storage
        folder = Path(self.host_storage) / f"rank{self.global_rank}"
        # host_storage itself may be a link the user made (to a fast disk); the per-rank folder
        # is ours, and a link planted there would redirect the table files and the lock.
        if folder.is_symlink():
            raise ValueError(
                f"{folder} is a symlink; hotcache makes each rank's folder inside host_storage itself and refuses "
                "links there (a planted link would make training write wherever it points). Remove it, or give "
                "host_storage on the disk you want."
            )
        return str(folder)

    def _run_batch_size(self, trainer: pl.Trainer) -> int | None:
        """Samples in the fit's full training batches (None without training data): what stats
        or a plan made elsewhere must have been made for."""
        if fit_train_dataloader(trainer) is None:
            return None
        with self._training_batches(trainer) as batches:
            return run_batch_size(batches)

    @contextlib.contextmanager
    def _training_batches(self, trainer: pl.Trainer) -> Iterator[Iterator[KeyedJaggedTensor]]:
        """The sparse features of the fit's training batches, for profiling, read with the
        global RNGs and the loader's own generators put back on exit.

        Iterating a loader draws from the global RNGs or the loader's own generator (its
        workers' base seed, a RandomSampler's permutation); profiling must leave training what
        `auto` would see. A
        context manager, so the RNGs go back when the reading ends: restored in a generator's
        cleanup instead, an unfinished read in a reference cycle (a failed fit's traceback)
        set them back whenever the garbage collector reached it, in the middle of later work.
        """
        loader = fit_train_dataloader(trainer)
        if loader is None:
            raise ValueError(
                "hotcache needs access stats to plan, and the fit has no training data to profile: pass stats_path "
                "(from `hotcache profile`), or fit with a datamodule or train_dataloaders."
            )
        with loader_rngs_restored(loader):
            batches = (features for batch in loader for features in _features_of(batch))
            try:
                yield batches
            finally:
                batches.close()  # the loader's iterator goes now, not at the next collection

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.plan is not None:  # a callback may turn accumulation on mid-fit; no row has stepped yet
            refuse_gradient_accumulation_now(self.lightning_module.trainer, self.strategy_name)
        output = super().training_step(*args, **kwargs)
        model = self.lightning_module
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if isinstance(loss, torch.Tensor) and not getattr(model, "checks_non_finite_loss", False):
            # Any model's NaN loss stops here, before its backward updates rows in place.
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", -1)
            finite_loss_or_skip(loss, model.trainer, batch_idx, "raise")
        return output

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        if hot_cold_modules(self.lightning_module):
            check_even_batches(dataloader, self.world_size, self.strategy_name)
        return _PrefetchingLoader(dataloader, self)

    # ----------------------------------------------------------- checkpoints
    @contextlib.contextmanager
    def _split_tables_in_checkpoint(self) -> Iterator[None]:
        """While saving with ``checkpoint_shards``, split tables stay out of the state dict and
        row state (their rows go to the rank files instead of being gathered)."""
        modules = hot_cold_modules(self.lightning_module).values()
        for module in modules:
            module.gather_split_tables = not self.checkpoint_shards
        try:
            yield
        finally:
            for module in modules:
                module.gather_split_tables = True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        with self._split_tables_in_checkpoint():
            return super().lightning_module_state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        modules = hot_cold_modules(self.lightning_module)
        if modules:
            assert self.plan is not None
            checkpoint[PLAN_KEY] = self.plan.to_dict()
            with self._split_tables_in_checkpoint():
                checkpoint[ROW_STATE_KEY] = {
                    f"{path}.{table}": arrays for path, m in modules.items() for table, arrays in m.optimizer_state().items()
                }
        save_id = None
        if modules and self.checkpoint_shards:
            save_id = self.broadcast(new_save_id(checkpoint["global_step"]))  # one id for every rank's shard
            shards, rows = {}, {}
            for path, m in modules.items():
                for table, arrays in m.host_shards().items():
                    shards[f"{path}.{table}"] = arrays
                    rows[f"{path}.{table}"] = m.caches[table].num_embeddings
            checkpoint[SHARDS_KEY] = {
                "id": save_id, "world_size": self.world_size, "num_embeddings": rows, "crc32": True,  # shards checked
                # Only rank 0 writes the main file.
                "main_crc32": main_file_crc32(checkpoint) if self.is_global_zero else None,
            }  # fmt: skip
            # Every rank writes its own shard; the main file (rank 0's) only once all are in
            # place, so that no main file is ever without its shards (see lightning_hotcache.checkpoint.files).
            target = shard_path(filepath, save_id, self.global_rank, self.world_size)
            target.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(shard_contents(save_id, self.global_rank, self.world_size, shards), target)
            self.barrier("hotcache shards saved")
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.is_global_zero:  # the main file no longer refers to the previous save's shards
            remove_shards(filepath, keep=save_id)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            remove_shards(filepath)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        # As Lightning's default, but syncing what it writes (see AtomicCheckpointIO); a user's
        # checkpoint_io is kept, and a wrapping one (AsyncCheckpointIO) gets ours unless it wraps one.
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif is_wrapping_checkpoint_io(self._checkpoint_io) and self._checkpoint_io.checkpoint_io is None:
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if SHARDS_KEY not in checkpoint:
            return checkpoint
        # Split tables stay in their shard files' pieces, loaded piece by piece (`load_model_state_dict`).
        # Each rank verifies the checksums of every world_size-th shard (one rank: all of them),
        # so each shard file is read once for them, not once per rank; the ranks then agree
        # before any row is copied, so a damaged shard stops every rank, each naming it.
        failure: Exception | None = None
        try:
            checkpoint = consolidated(
                checkpoint, checkpoint_path, in_pieces=True, checks=lambda shard: shard % self.world_size == self.global_rank,
                show_progress=self.is_global_zero,
            )  # fmt: skip
        except Exception as err:  # raised after the ranks agree: one rank leaving alone would hang the others
            failure = err
        self._stop_every_rank_if_one_failed(failure, f"load {checkpoint_path}")
        return checkpoint

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Rows are restored into the tiers that setup builds. Before setup, a deferred model's
        # tables are still on the meta device, where loading a checkpoint's rows is a no-op (and
        # the install would then draw fresh rows): the trained tables would be lost in silence.
        return True

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict)
        saved = checkpoint.get(ROW_STATE_KEY, {})
        for path, module in hot_cold_modules(self.lightning_module).items():
            _load_row_state(path, module, saved)

    @override
    def teardown(self) -> None:
        # Lightning tears down after a failed fit too, so the host storage lock goes on every exit path.
        for module in hot_cold_modules(self.lightning_module).values() if self.lightning_module else []:
            try:
                module.clear_prefetched()
                module.flush()
            finally:
                module.release_staging_threads()
                module.release_host_storage()
        release_helpers()  # the row copies' helper threads: none outlives the fit
        with deferred_tables_left_out_of_moves(self.lightning_module):
            super().teardown()
