"""HotColdEmbeddingBagCollection: torchrec's EmbeddingBagCollection, with rows in a device cache.

Same input (KeyedJaggedTensor), same output (KeyedTensor), same ``state_dict`` keys as the
EmbeddingBagCollection it replaces. Each table's rows live in a `DeviceCache` (hot rows
pinned, others cached from a `HostStore`); a batch's ids become cache slots in `prefetch`
(ahead of time) or at the start of `forward`, and the lookup runs on slot ids. Where FBGEMM
can (see `FusedTables`), all tables' slots live in one table-batched embedding: one kernel
call per batch, and its backward applies the row-wise rule to the rows read, as TorchRec's
fused tables do; the batch's slots unlock in a post-hook on that kernel's autograd node, once
the rows are updated. There, in one process and for tables of one width, the split tables
share one stacked cache (`lightning_hotcache.cache.group`), so a step's bookkeeping does
not grow with the number of tables.
Otherwise the lookup is one ``embedding_bag`` per feature and, in backward, a hook on each
table's slot tensor applies the row-wise optimizer to the rows the batch read (duplicate
ids summed) and unlocks them.

Rules a caller must keep (Lightning's loops keep them): a training forward is followed by
its backward before the next training forward; training batches are forwarded in the
order they were prefetched. Forward in eval mode or under ``torch.no_grad()`` updates
nothing and may come between prefetched training batches.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor
from torchrec.modules.embedding_configs import PoolingType

from lightning_hotcache.cache import CachePolicy, DeviceCache, HostDirectory, HostStore
from lightning_hotcache.cache.device import acquire_all, apply_updates_across_ranks, refresh_remote_rows
from lightning_hotcache.cache.exchange import RowSharding
from lightning_hotcache.cache.fused import FusedTables, KernelChoice, check_kernel_choice, fused_unavailable
from lightning_hotcache.cache.group import StackedHostStores, TableInGroup
from lightning_hotcache.cache.slot_map import INT32_IDS_BELOW
from lightning_hotcache.guards import check_not_empty
from lightning_hotcache.planner import HotColdPlan
from lightning_hotcache.rowwise import RowWiseOptimizerConfig
from lightning_hotcache.table_init import draw_seed, initial_rows, is_deferred


_STACK = "<stacked split tables>"  # key of the stacked cache (see lightning_hotcache.cache.group)


@dataclass
class _StagedBatch:
    """A batch whose rows are resident and locked: the slot of every value, feature-major in
    the module's feature order (what FBGEMM's TBE reads)."""

    features: KeyedJaggedTensor  # as given (to recognize the batch in forward)
    ours: KeyedJaggedTensor  # its features of this module, in this module's order
    indices: Tensor  # slot of every value of `ours` (plus its cache's region start in a stacked TBE)
    tickets: dict[str, list[int]]  # cache key (table, or the stack) -> cache tickets to release
    read: list[tuple[DeviceCache, Tensor]]  # each cache's distinct slots the batch read (to mark updated, to refresh)
    output: weakref.ref[Tensor] | None = None  # alive while a backward may still come


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a method under the module's lock: a background thread may be staging batches."""

    @functools.wraps(method)
    def wrapper(self: "HotColdEmbeddingBagCollection", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def _gradient_hook(module: "HotColdEmbeddingBagCollection", table: str) -> Callable[[Tensor], None]:
    # A weak reference: the hook lives inside the cache's weight tensor, where the garbage
    # collector cannot see it, so a strong one would keep the module (and its tables) alive
    # after training, one leaked model per fit.
    module_ref = weakref.ref(module)

    def hook(weight: Tensor) -> None:
        module = module_ref()
        if module is not None:
            module._on_gradient(table, weight)

    return hook


def _fused_backward_hook(module: "HotColdEmbeddingBagCollection", staged: _StagedBatch) -> Callable[..., None]:
    module_ref = weakref.ref(module)  # weak for the reason given in `_gradient_hook`

    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        module = module_ref()
        if module is not None:
            module._on_fused_backward(staged)

    return hook


class _LookupForOwners(torch.autograd.Function):
    """Across ranks: the fused kernel's lookup, with a backward that hands the output's
    gradient to the module (`_on_backward_across_ranks`) instead of updating the rows read.

    FBGEMM's own backward would apply this rank's gradient to its copies; the ranks' mean
    gradient must be applied once, by each row's owner. ``anchor`` is a scalar that requires
    grad, so that autograd calls this backward (the TBE's weights take no part)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        anchor: Tensor,
        module: "HotColdEmbeddingBagCollection",
        staged: _StagedBatch,
        offsets: Tensor,
        weights: Tensor | None,
    ) -> Tensor:
        ctx.module, ctx.staged = module, staged
        assert module._fused is not None
        with torch.no_grad():
            return module._fused(staged.indices, offsets, weights)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        ctx.module._on_backward_across_ranks(ctx.staged, grad)
        return (None,) * 5


def _same_batch(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> bool:
    # Moving a batch to the device it is already on makes new KJT objects around the same
    # tensors, so compare storage, not identity.
    va, vb = a.values(), b.values()
    return a is b or (va.data_ptr() == vb.data_ptr() and va.shape == vb.shape and a.keys() == b.keys())


def _bag_offsets(features: KeyedJaggedTensor) -> Tensor:
    """Offsets of every bag, feature-major (what TBE reads). A batch built from lengths
    alone gets them from a torch ``cumsum``: KeyedJaggedTensor.offsets() would use an
    FBGEMM op that FBGEMM's CPU build lacks for CUDA tensors."""
    offsets = features.offsets_or_none()
    if offsets is not None:
        return offsets
    lengths = features.lengths()
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def _concat_spans(values: Tensor, spans: list[tuple[int, int]]) -> Tensor:
    """``values[a:b]`` for each span, end to end (a view when there is one span)."""
    return values[spans[0][0] : spans[0][1]] if len(spans) == 1 else torch.cat([values[a:b] for a, b in spans])


def _check_ids(features: KeyedJaggedTensor, tables: dict[str, EmbeddingBagConfig]) -> None:
    """Every id of every feature (each a key of ``tables``, feature -> table) within its
    table, checked in one pass over the batch's values (a check per feature costs a few small
    ops each, which add up across 26 features on every step); the first bad id is named."""
    values = features.values()
    if values.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"Features {features.keys()} have ids of dtype {values.dtype}; expected int32/int64.")
    if values.numel() == 0:
        return
    keys = features.keys()
    limits = torch.tensor([tables[k].num_embeddings for k in keys], device=values.device)
    per_value = torch.repeat_interleave(limits, torch.tensor(features.length_per_key(), device=values.device))
    bad = (values < 0) | (values >= per_value)
    if not bool(bad.any()):
        return
    position = int(bad.nonzero()[0])
    feature = keys[int((position >= torch.tensor(features.offset_per_key()[1:])).sum())]
    table = tables[feature]
    raise ValueError(
        f"Feature {feature!r} of table {table.name!r} has id {int(values[position])}, outside [0, "
        f"{table.num_embeddings}). Hash or clip ids into the table's range (or enlarge num_embeddings); no row "
        "was touched."
    )


class HotColdEmbeddingBagCollection(nn.Module):
    """Drop-in for ``torchrec.EmbeddingBagCollection`` whose rows live in a tiered cache.

    Args:
        tables: the tables, as for EmbeddingBagCollection (SUM or MEAN pooling).
        plan: which rows of each table are static on the device and how many cache slots it gets.
        optimizer: the row-wise rule applied in backward.
        device: where the cached rows live.
        cache_policy: ``lfu``, ``lru`` or ``static`` (see `DeviceCache`).
        host_storage: ``"memory"`` (RAM, pinned when CUDA is present) or a directory for
            memory-mapped host tables. The module locks the directory (see `HostDirectory`:
            one owner at a time, files made fresh) until `release_host_storage`.
        is_weighted: use the KJT's per-sample weights (SUM pooling), as torchrec's flag of that name.
        kernel: ``"fbgemm"``: the device tier is one FBGEMM table-batched embedding with the
            row-wise rule fused into backward (see `FusedTables`); ``"pytorch"``: one
            ``embedding_bag`` per feature and the update in a gradient hook; ``"auto"``:
            FBGEMM where it trains exactly (`fused_unavailable` says where not),
            else PyTorch. ``kernel_note`` says which runs and why.
        process_group: data-parallel ranks training the same tables (None: this process alone).
            Host stores are sharded round-robin across the ranks and each rank caches the rows
            its batches read (see `DeviceCache`); in backward the ranks all-gather the rows
            they read with their gradients, average them as DDP does, and every copy of each
            row (caches, owner's store) gets the same update. Every rank must make the same
            calls (forward, prefetch, state_dict) in the same order.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        plan: HotColdPlan,
        optimizer: RowWiseOptimizerConfig | None = None,
        device: torch.device | str | None = None,
        cache_policy: CachePolicy = "lfu",
        host_storage: str | Path = "memory",
        is_weighted: bool = False,
        process_group: Any = None,
        kernel: KernelChoice = "auto",
    ) -> None:
        super().__init__()
        check_kernel_choice(kernel)
        self._is_weighted = is_weighted
        self.process_group = process_group
        # False while a strategy saves split tables shard by shard instead of gathering them.
        self.gather_split_tables = True
        # Staging (possibly on a prefetch thread), forward and the backward update all change
        # the caches; one re-entrant lock keeps them from interleaving.
        self._lock = threading.RLock()
        self._tables = list(tables)
        self.optimizer = optimizer or RowWiseOptimizerConfig()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.plan = plan
        plan.check_tables(self._tables, whole_model=False)  # one plan covers all of a model's collections
        for table in self._tables:
            if table.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"Table {table.name!r}: pooling {table.pooling} is not supported (SUM or MEAN).")
        self.host_directory = None if str(host_storage) == "memory" else HostDirectory(host_storage)
        pin = self.device.type == "cuda"
        sharding = RowSharding()
        if process_group is not None:
            sharding = RowSharding(dist.get_rank(process_group), dist.get_world_size(process_group), process_group)
        self._sharding = sharding
        self._features = [f for t in self._tables for f in t.feature_names]
        self._feature_table = {f: t for t in self._tables for f in t.feature_names}
        slot_counts = {
            t.name: DeviceCache.num_slots(t.num_embeddings, plan.table(t.name).static_ids, plan.table(t.name).cache_slots)
            for t in self._tables
        }
        hosts = {}
        for table in self._tables:
            if not plan.table(table.name).on_device:
                widths = self.optimizer.state_widths(table.embedding_dim)
                rows = sharding.num_local(table.num_embeddings)
                hosts[table.name] = HostStore(table.name, rows, table.embedding_dim, widths, self.host_directory, pin)
        reason = self._why_not_fused(kernel, min(slot_counts.values()))
        # Where the fused kernel runs (one process) on tables of one width, the split tables are
        # stacked into one cache (lightning_hotcache.cache.group), so that a step's bookkeeping
        # is one set of ops, not one per table; the TBE then has one table holding the stack's
        # slots and, after them, every whole table's rows ("regions"), read by every feature.
        split = [t for t in self._tables if t.name in hosts]
        stacked = (
            reason is None
            and sharding.world == 1  # across ranks rows are sharded table by table (`RowSharding`), not by a stack's ids
            and len(split) > 0
            and len({t.embedding_dim for t in self._tables}) == 1
            and sum(t.num_embeddings for t in split) < INT32_IDS_BELOW
        )
        keys = ([_STACK] if stacked else []) + [t.name for t in self._tables if not (stacked and t.name in hosts)]
        if stacked:
            slot_counts[_STACK] = sum(slot_counts[t.name] for t in split)
        # Where each cache's slots start in its TBE table (all 0 without a stack: a TBE table each).
        self._region_start = dict(zip(keys, np.cumsum([0] + [slot_counts[k] for k in keys]).tolist() if stacked else [0] * len(keys)))
        self._fused = None if reason is not None else self._fused_tables([slot_counts[k] for k in keys], stacked)
        self._value_base: Tensor | None = None  # see the stack below
        # Every cache that locks rows, by key: the stack, and each table not in it.
        self._ticket_caches: dict[str, DeviceCache] = {}
        self.caches: dict[str, DeviceCache | TableInGroup] = {}
        if stacked:
            assert self._fused is not None
            starts = np.cumsum([0] + [t.num_embeddings for t in split]).tolist()
            table_plans = [plan.table(t.name) for t in split]
            stack = DeviceCache(
                f"stack of {', '.join(t.name for t in split)}",
                starts[-1],
                split[0].embedding_dim,
                self.optimizer,
                torch.cat([torch.as_tensor(p.static_ids, dtype=torch.int64) + start for p, start in zip(table_plans, starts)]),
                sum(p.cache_slots for p in table_plans),
                cache_policy,
                StackedHostStores([hosts[t.name] for t in split], starts),  # type: ignore[arg-type]
                self.device,
                storage=self._region(_STACK, slot_counts[_STACK]),
                segment_starts=starts,
            )
            self._ticket_caches[_STACK] = stack
            self.kernel_note += f", {len(split)} split table(s) stacked in one cache"
            first_id = {f: start for t, start in zip(split, starts) for f in t.feature_names}
            # Added to every value of a feature: the stack reads global ids (a table's id plus
            # the rows of the tables before it); a whole table's slots sit at its region's start.
            region = {t.name: self._region_start[t.name] for t in self._tables if t.name not in hosts}
            self._value_base = torch.tensor([first_id.get(f, region.get(self._feature_table[f].name, 0)) for f in self._features])
            for k, table in enumerate(split):
                self.caches[table.name] = TableInGroup(stack, k, starts[k], hosts[table.name])
        for table in self._tables:
            if table.name in self.caches:
                continue
            table_plan = plan.table(table.name)
            cache = DeviceCache(
                table.name,
                table.num_embeddings,
                table.embedding_dim,
                self.optimizer,
                torch.as_tensor(table_plan.static_ids, dtype=torch.int64),
                table_plan.cache_slots,
                cache_policy,
                hosts.get(table.name),
                self.device,
                sharding,
                None if self._fused is None else self._region(table.name, slot_counts[table.name]),
            )
            if self._fused is None:
                cache.weight.requires_grad_(True)
                cache.weight.register_post_accumulate_grad_hook(_gradient_hook(self, table.name))
            self.caches[table.name] = self._ticket_caches[table.name] = cache
        self.caches = {t.name: self.caches[t.name] for t in self._tables}  # in table order
        # Features each cache reads, in the order the TBE reads them.
        key_of = {f: _STACK if stacked and t.name in hosts else t.name for f, t in self._feature_table.items()}
        # Positions in this module's feature order of the features each cache reads (the TBE's order).
        self._cache_positions = {key: [k for k, f in enumerate(self._features) if key_of[f] == key] for key in self._ticket_caches}
        # Where each feature's pooled rows start in the output's columns.
        self._column_start = np.cumsum([0] + [self._feature_table[f].embedding_dim for f in self._features]).tolist()
        # Makes autograd call `_LookupForOwners.backward` (not a parameter: nothing trains it).
        self._grad_anchor = torch.zeros((), requires_grad=True)
        # Across ranks, gradients wait here until every table's has arrived, so that the rows
        # of all tables travel in one exchange, not one per table.
        self._pending_gradients: dict[str, Tensor] = {}
        self._queue: deque[_StagedBatch] = deque()
        self._in_flight: list[_StagedBatch] = []

    def _why_not_fused(self, kernel: KernelChoice, fewest_slots: int) -> str | None:
        """Why the device tier cannot be FBGEMM's fused kernel here (None: it can); sets `kernel_note`."""
        if kernel == "pytorch":
            reason: str | None = "kernel='pytorch' was chosen"
        elif fewest_slots == 0:
            reason = "a table has no device rows"
        else:
            reason = fused_unavailable(self._tables, self.optimizer, self.device)
        if reason is not None and kernel == "fbgemm":
            raise ValueError(f"kernel='fbgemm' cannot train these tables exactly here: {reason}. Use kernel='auto'.")
        if reason is not None:
            self.kernel_note = f"pytorch embedding_bag ({reason})"
        elif self._sharding.world == 1:
            self.kernel_note = "fbgemm TBE, optimizer fused"
        else:
            self.kernel_note = "fbgemm TBE lookup, each row's owner applies the ranks' mean gradient"
        return reason

    def _fused_tables(self, slot_counts: list[int], stacked: bool) -> FusedTables:
        """One TBE: one table holding every cache's slots (with a stack), else a table per table."""
        dims = [t.embedding_dim for t in self._tables]
        index = {t.name: k for k, t in enumerate(self._tables)}
        table_of_feature = [index[self._feature_table[f].name] for f in self._features]
        pooling = self._tables[0].pooling
        if stacked:
            stack_map = [0] * len(self._features)
            return FusedTables([sum(slot_counts)], dims[:1], stack_map, pooling, self.optimizer, self.device, table_of_feature)
        return FusedTables(slot_counts, dims, table_of_feature, pooling, self.optimizer, self.device)

    def _region(self, key: str, num_slots: int) -> dict[str, Tensor]:
        """Views of one cache's slots in the TBE's memory."""
        assert self._fused is not None
        table = 0 if _STACK in self._region_start else list(self._region_start).index(key)
        start = self._region_start[key]
        return {name: array[start : start + num_slots] for name, array in self._fused.storage(table).items()}

    @classmethod
    def from_ebc(
        cls,
        ebc: EmbeddingBagCollection,
        plan: HotColdPlan,
        optimizer: RowWiseOptimizerConfig | None = None,
        device: torch.device | str | None = None,
        cache_policy: CachePolicy = "lfu",
        host_storage: str | Path = "memory",
        process_group: Any = None,
        seed: int | None = None,
        kernel: KernelChoice = "auto",
    ) -> "HotColdEmbeddingBagCollection":
        """Replace ``ebc``: same tables, its current weights, rows placed by ``plan``. When
        ``ebc`` is deferred (declared on the meta device) its rows are initialized where they
        live, from ``seed`` (every rank must pass the same; None draws one), never all in memory."""
        module = cls(
            ebc.embedding_bag_configs(), plan, optimizer, device, cache_policy, host_storage, ebc.is_weighted(),
            process_group, kernel,
        )  # fmt: skip
        if is_deferred(ebc):
            module.initialize(draw_seed() if seed is None else seed)
        else:
            module.load_state_dict(ebc.state_dict())
        return module

    @_locked
    def initialize(self, seed: int) -> None:
        """Every table's initial rows (see `initial_rows`), written chunk by chunk into its tiers."""
        for table in self._tables:
            for start, rows in initial_rows(table, seed):
                self.caches[table.name].load_rows("weight", start, rows)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._tables)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def reads(self, features: KeyedJaggedTensor) -> bool:
        """Whether ``features`` has every feature this module looks up."""
        return set(self._feature_table) <= set(features.keys())

    # -------------------------------------------------------------- staging
    @_locked
    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Make a future batch's rows resident and lock them (call in forward order)."""
        self._queue.append(self._stage(features))

    @_locked
    def clear_prefetched(self) -> None:
        """Drop (and unlock) batches prefetched but never forwarded, e.g. when an epoch was cut short."""
        while self._queue:
            self._release(self._queue.popleft())

    def _stage(self, features: KeyedJaggedTensor) -> _StagedBatch:
        check_not_empty(features)
        ours = self._our_features(features)
        _check_ids(ours, self._feature_table)  # everything validated before any row is touched
        values = ours.values().to(self.device, torch.int64)
        bounds = ours.offset_per_key()
        if self._value_base is None:
            indices = values.clone()  # the caches' slots are written into it
        else:
            base = torch.repeat_interleave(self._value_base, torch.tensor(ours.length_per_key()), output_size=len(values))
            indices = values + base.to(self.device)
        # One acquire per cache (all its features' rows must be resident together), all caches
        # at once (their misses read before any is installed: see `acquire_all`).
        keys = list(self._ticket_caches)
        spans = {key: [(bounds[k], bounds[k + 1]) for k in self._cache_positions[key]] for key in keys}
        ids = [_concat_spans(indices if key == _STACK else values, spans[key]) for key in keys]  # the stack reads global ids
        acquired = acquire_all([self._ticket_caches[k] for k in keys], ids)
        tickets: dict[str, list[int]] = {}
        read = []
        for key, (cache_slots, ticket, distinct) in zip(keys, acquired):
            cache = self._ticket_caches[key]
            tickets[key] = [ticket]
            read.append((cache, distinct))
            if cache.identity:  # slot == id: `indices` holds it (at the region's start) already
                continue
            start = self._region_start[key]  # the kernel reads slots at their place in its table
            parts = (cache_slots + start if start else cache_slots).split([b - a for a, b in spans[key]])
            for (a, b), part in zip(spans[key], parts):
                indices[a:b] = part
        return _StagedBatch(features, ours, indices, tickets, read)

    def _our_features(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` restricted to this module's features, in its order (as given when it is)."""
        keys = features.keys()
        if keys == self._features:
            return features
        position = {f: k for k, f in enumerate(keys)}
        for feature in self._features:
            if feature not in position:
                table = self._feature_table[feature]
                raise KeyError(f"Feature {feature!r} of table {table.name!r} is missing from the batch (it has {keys}).")
        # By hand with torch ops, not KeyedJaggedTensor.permute: that is an FBGEMM op, which
        # the CPU build of FBGEMM (what a CUDA machine without FBGEMM's CUDA build has) lacks for CUDA tensors.
        order = [position[f] for f in self._features]
        batch, per_key = features.stride(), features.length_per_key()

        def in_our_order(flat: Tensor, sizes: int | list[int]) -> Tensor:
            parts = flat.split(sizes)
            return torch.cat([parts[k] for k in order])

        weights = features.weights_or_none()
        return KeyedJaggedTensor(
            keys=list(self._features),
            values=in_our_order(features.values(), per_key),
            lengths=in_our_order(features.lengths(), batch),
            weights=None if weights is None else in_our_order(weights, per_key),
            stride=batch,
        )

    def _release(self, staged: _StagedBatch) -> None:
        for key, tickets in staged.tickets.items():
            for ticket in tickets:
                self._ticket_caches[key].release(ticket)

    def _release_abandoned(self) -> None:
        # A training forward whose output is gone without its backward having come (e.g. a
        # skipped step) never gets one: its rows may be unlocked. One whose output is alive
        # stays locked. Called only from forward, never while a backward may be running.
        alive = []
        for staged in self._in_flight:
            if staged.output is not None and staged.output() is not None:
                alive.append(staged)
            else:
                self._release(staged)
        self._in_flight = alive

    # -------------------------------------------------------------- forward
    @_locked
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        self._release_abandoned()
        if self._queue and _same_batch(self._queue[0].features, features):
            staged = self._queue.popleft()
        elif self._queue and self.training and torch.is_grad_enabled():
            raise RuntimeError(
                "forward() got a different training batch than the next prefetched one; prefetch batches in the "
                "order they are forwarded."
            )
        else:  # not prefetched (or an evaluation batch between prefetched training batches)
            staged = self._stage(features)
        if self._sharding.world > 1:
            refresh_remote_rows(*zip(*staged.read))
        values = self._lookup_fused(staged) if self._fused is not None else self._lookup(staged)
        if torch.is_grad_enabled() and values.requires_grad:
            staged.output = weakref.ref(values)
            self._in_flight.append(staged)
            # In one process the fused backward updates every row read: write them back on eviction
            # (across ranks the owners' updates mark their rows).
            if self._fused is not None and self._sharding.world == 1:
                for cache, slots in staged.read:
                    cache.mark_updated(slots)
                # FBGEMM's lookup node updates the rows in its backward; its post-hook runs
                # once they are updated, and only then may they be evicted. Should another
                # node (a view) ever come after it, the rows wait for the next forward instead,
                # which comes after this backward for sure (`_release_abandoned`).
                if "Lookup" in values.grad_fn.name():
                    values.grad_fn.register_hook(_fused_backward_hook(self, staged))
        else:
            self._release(staged)
        return KeyedTensor(
            keys=self._features,
            length_per_key=[self._feature_table[f].embedding_dim for f in self._features],
            values=values,
        )

    def _lookup_fused(self, staged: _StagedBatch) -> Tensor:
        """All features in one FBGEMM call on slot ids (a KJT's offsets are feature-major bags, as TBE wants)."""
        assert self._fused is not None
        ours = staged.ours
        weights = ours.weights().to(self.device, torch.float32) if self._is_weighted else None
        offsets = _bag_offsets(ours).to(self.device, torch.int64)
        if self._sharding.world > 1 and torch.is_grad_enabled():
            return _LookupForOwners.apply(self._grad_anchor, self, staged, offsets, weights)
        return self._fused(staged.indices, offsets, weights)

    def _lookup(self, staged: _StagedBatch) -> Tensor:
        """One embedding_bag per feature on slot ids; the update comes in the gradient hooks."""
        ours = staged.ours
        offsets, bounds, batch = _bag_offsets(ours).to(self.device, torch.int64), ours.offset_per_key(), ours.stride()
        pooled = []
        for k, feature in enumerate(self._features):
            table = self._feature_table[feature]
            a, b = bounds[k], bounds[k + 1]
            pooled.append(
                nn.functional.embedding_bag(
                    staged.indices[a:b],
                    self._ticket_caches[table.name].weight,
                    offsets[k * batch : (k + 1) * batch + 1] - a,
                    mode="sum" if table.pooling == PoolingType.SUM else "mean",
                    sparse=True,
                    per_sample_weights=ours.weights()[a:b] if self._is_weighted else None,
                    include_last_offset=True,
                )
            )
        return torch.cat(pooled, dim=1)

    @_locked
    def _on_fused_backward(self, staged: _StagedBatch) -> None:
        """The fused kernel has updated ``staged``'s rows: unlock them."""
        self._release(staged)
        self._in_flight = [s for s in self._in_flight if s is not staged]

    @_locked
    def _on_backward_across_ranks(self, staged: _StagedBatch, grad: Tensor) -> None:
        """Across ranks on the fused kernel: the gradient of every row ``staged`` read, applied
        as the PyTorch path's is (`apply_updates_across_ranks`: each row's owner, the ranks'
        mean); then unlock."""
        slots, rows = self._row_gradients(staged, grad)
        apply_updates_across_ranks(list(self._ticket_caches.values()), slots, rows, self.optimizer)
        self._on_fused_backward(staged)

    def _row_gradients(self, staged: _StagedBatch, grad: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Per cache, the slot of every value ``staged`` read and its gradient row (repeats not
        summed), from the output's gradient ``grad`` (batch, sum of dims): what FBGEMM's
        backward forms before it updates, for a cache whose features are consecutive (a table's)."""
        ours = staged.ours
        batch, bounds, lengths = ours.stride(), ours.offset_per_key(), ours.lengths().to(grad.device)
        # The bag (feature-major, as TBE numbers them) of every value.
        bag_of_value = torch.repeat_interleave(torch.arange(len(lengths), device=grad.device), lengths, output_size=bounds[-1])
        scale = ours.weights().to(grad.device, grad.dtype) if self._is_weighted else None
        if self._tables[0].pooling == PoolingType.MEAN:  # one pooling for all (the fused kernel's condition)
            mean = 1.0 / lengths.clamp(min=1).to(grad.dtype)[bag_of_value]
            scale = mean if scale is None else scale * mean
        slots, rows = [], []
        for key, cache in self._ticket_caches.items():
            first, count = self._cache_positions[key][0], len(self._cache_positions[key])
            dim, a, b = cache.weight.shape[1], bounds[first], bounds[first + count]
            column = self._column_start[first]
            # The gradient of each of the table's bags, feature-major, then of each value read.
            per_bag = grad[:, column : column + count * dim].reshape(batch, count, dim).transpose(0, 1).reshape(-1, dim)
            read = per_bag[bag_of_value[a:b] - first * batch]
            rows.append(read if scale is None else read * scale[a:b, None])
            slots.append(staged.indices[a:b])
        return slots, rows

    @_locked
    def _on_gradient(self, table: str, weight: Tensor) -> None:
        """Backward of one table (a post-accumulate hook: the gradient is taken, not copied)."""
        grad, weight.grad = weight.grad, None
        if grad is None:
            return
        if self._sharding.world == 1:
            self._ticket_caches[table].apply_update(grad, self.optimizer)
            self._release_tables([table])
            return
        # Every table's pooled output is part of the one tensor forward returns, so a backward
        # that reaches one table reaches them all.
        self._pending_gradients[table] = grad
        if len(self._pending_gradients) == len(self.caches):
            self._apply_gathered_gradients()

    def _apply_gathered_gradients(self) -> None:
        """Across ranks: every table's step with the ranks' mean gradient, as DDP averages,
        each row updated by its owner; then the rows are unlocked."""
        grads = [self._pending_gradients[name] for name in self._ticket_caches]
        self._pending_gradients = {}
        # Uncoalesced (public .indices() would sort): the sum over repeats is made for all tables at once.
        slots, rows = [g._indices()[0] for g in grads], [g._values() for g in grads]
        apply_updates_across_ranks(list(self._ticket_caches.values()), slots, rows, self.optimizer)
        self._release_tables(list(self._ticket_caches))

    def _release_tables(self, tables: list[str]) -> None:
        # Every in-flight batch's gradient for these tables has now been applied.
        for staged in self._in_flight:
            for name in tables:
                for ticket in staged.tickets.pop(name, []):
                    self._ticket_caches[name].release(ticket)
        self._in_flight = [s for s in self._in_flight if s.tickets]

    # ---------------------------------------------------------- whole tables
    @_locked
    def flush(self) -> None:
        """Write every changed cached row back to its host store."""
        for cache in self._ticket_caches.values():
            cache.flush()

    def device_bytes(self) -> int:
        """Bytes the tables hold on the device now (see `DeviceCache.device_bytes`)."""
        return sum(cache.device_bytes() for cache in self._ticket_caches.values())

    def lock_host_storage(self) -> None:
        """Own the host storage directory again (after `release_host_storage`), e.g. for another fit."""
        if self.host_directory is not None:
            self.host_directory.acquire()

    def release_host_storage(self) -> None:
        """Let another run use the host storage directory; this module's rows stay readable."""
        if self.host_directory is not None:
            self.host_directory.release()

    @_locked
    def optimizer_state(self) -> dict[str, dict[str, Tensor]]:
        """Current row-wise optimizer state of every table: table -> state name -> (rows, width).
        Tables whose rows are split over host stores are left out while `gather_split_tables`
        is False (their state is in `host_shards`)."""
        return {
            name: {key: cache.full(key) for key in cache.slots if key != "weight"}
            for name, cache in self.caches.items()
            if cache.identity or self.gather_split_tables
        }

    @_locked
    def host_shards(self) -> dict[str, dict[str, Tensor]]:
        """This rank's host rows (round-robin shard) of every split table, current: table ->
        array name -> (local rows, width). No collective."""
        shards = {}
        for name, cache in self.caches.items():
            if cache.host is not None:
                cache.flush()
                shards[name] = dict(cache.host.arrays)
        return shards

    @_locked
    def load_optimizer_state(self, state: dict[str, dict[str, Tensor]]) -> None:
        for name, arrays in state.items():
            for key, values in arrays.items():
                self.caches[name].load_full(key, values)

    @_locked
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # The keys of the EmbeddingBagCollection this replaces, so checkpoints interchange.
        for name, cache in self.caches.items():
            if cache.identity or self.gather_split_tables:
                destination[f"{prefix}embedding_bags.{name}.weight"] = cache.full("weight")

    @_locked
    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        for table in self._tables:
            key = f"{prefix}embedding_bags.{table.name}.weight"
            if key not in state_dict:
                missing_keys.append(key)
                continue
            values = state_dict[key]
            expected = (table.num_embeddings, table.embedding_dim)
            if tuple(values.shape) != expected:
                error_msgs.append(f"{key}: shape {tuple(values.shape)} in the checkpoint, {expected} in the model.")
                continue
            self.caches[table.name].load_full("weight", values)


def hot_cold_modules(model: nn.Module) -> dict[str, HotColdEmbeddingBagCollection]:
    """Module path -> every HotColdEmbeddingBagCollection in ``model``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, HotColdEmbeddingBagCollection)}
