"""Updates: how the rows a training batch read get the row-wise step, and when they unlock.

- `FusedUpdate` (FBGEMM, one process): the kernel's backward steps the rows; a post-hook on
  its autograd node unlocks them once it has (not when the output is freed: autograd frees
  it before the TBE's own backward runs, and a prefetch thread could then evict rows about
  to be updated).
- `SummingUpdate` (PyTorch, one process): the lookup's backward hands over the output's
  gradient; each cache sums its rows' gradients (staging knows the distinct rows: no sort, no
  sparse tensor) and applies the rule.
- `OwnersSummingUpdate` (PyTorch, several processes): the same sums, then each row's owner
  applies the ranks' mean gradient (one exchange for all caches).
- `OwnersUpdate` (FBGEMM, several processes): before the lookup, the other ranks' rows the
  batch reads are fetched from their owners; in backward every read row's gradient goes to
  its owner, which applies the ranks' mean, one device table (one width) at a time
  (`OwnedRows`): the step's ops do not grow with the number of tables.

Every update runs under the module's lock (a prefetch thread may be staging).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from lightning_hotcache.cache.device import DeviceCache
from lightning_hotcache.cache.exchange import (
    Routed,
    RowSharding,
    RowsInFlight,
    exchange_table_rows,
    fetch_rows,
    route_to_owners,
    send_rows_along,
    send_rows_to_owners,
)
from lightning_hotcache.cache.owned_rows import OwnedRows
from lightning_hotcache.sorting import sum_rows_by_index, unique
from lightning_hotcache.embedding.batch import StagedBatch, concat_spans
from lightning_hotcache.embedding.layout import Layout
from lightning_hotcache.embedding.staging import Staging
from lightning_hotcache.rowwise import RowWiseOptimizerConfig, step_read_rows


def _weak_call(obj: object, method: str) -> Callable[..., None]:
    # Weak: a hook lives inside a tensor (the cache's weights, or an autograd node), where the
    # garbage collector cannot see it, so a strong reference would keep the tables alive
    # after training, one leaked model per fit.
    ref = weakref.ref(obj)

    def call(*args: object) -> None:
        target = ref()
        if target is not None:
            getattr(target, method)(*args)

    return call


class FusedUpdate:
    def __init__(self, staging: Staging, lock: threading.RLock) -> None:
        self.staging = staging
        self.lock = lock

    def before_lookup(self, staged: StagedBatch) -> None:
        pass

    def attach(self, staged: StagedBatch, output: Tensor) -> None:
        self.staging.keep(staged, output)
        for cache, slots in staged.read:  # written back on eviction
            cache.mark_updated(slots)
        # Should another node (a view) ever come after the lookup's, the rows wait for the
        # next forward instead, which comes after this backward for sure (`release_abandoned`).
        if output.grad_fn is not None and "Lookup" in output.grad_fn.name():
            hook = _weak_call(self, "_updated")
            output.grad_fn.register_hook(lambda grad_inputs, grad_outputs: hook(staged))

    def settle(self) -> None:
        """Every update is applied in backward: nothing waits."""

    def _updated(self, staged: StagedBatch) -> None:
        with self.lock:
            self.staging.finish(staged)


class SummingUpdate:
    """PyTorch, one process: the lookup's backward hands over the output's gradient, and each
    cache's rows get the rule from their summed gradient. Staging knows the batch's distinct
    slots and each value's place among them (`CacheReads`), so a cache's step is a fixed
    number of ops (gradient rows of its values, one ``index_add_``, gather-step-scatter) with
    no sort, no sparse tensor and nothing for the host to wait on."""

    def __init__(
        self, layout: Layout, caches: dict[str, DeviceCache], staging: Staging, lock: threading.RLock, optimizer: RowWiseOptimizerConfig, is_weighted: bool
    ) -> None:
        self.caches = caches
        self.staging = staging
        self.lock = lock
        self.optimizer = optimizer
        self.is_weighted = is_weighted
        self._features = {key: _CacheFeatures.of(layout, key) for key in caches}
        staging.sums_gradients = True

    def before_lookup(self, staged: StagedBatch) -> None:
        pass

    def attach(self, staged: StagedBatch, output: Tensor) -> None:
        self.staging.keep(staged, output)

    def settle(self) -> None:
        """Every update is applied in backward: nothing waits."""

    def on_output_gradient(self, staged: StagedBatch, grad: Tensor) -> None:
        with self.lock:
            for key, cache in self.caches.items():
                reads = staged.reads[key]
                rows = self._features[key].value_gradients(staged.ours, grad, self.is_weighted)
                step_read_rows(self.optimizer, cache.weight, cache.slot_state, reads.rows, reads.inverse, rows)
                cache.mark_updated(reads.host_rows)
            self.staging.finish(staged)


class OwnersSummingUpdate(SummingUpdate):
    """PyTorch, several processes: the summed gradient of every row a rank read goes to the
    row's owner, which applies the ranks' mean (one exchange for all caches)."""

    def __init__(
        self, layout: Layout, caches: dict[str, DeviceCache], staging: Staging, lock: threading.RLock, optimizer: RowWiseOptimizerConfig, is_weighted: bool
    ) -> None:
        super().__init__(layout, caches, staging, lock, optimizer, is_weighted)
        self.sharding = next(iter(caches.values())).sharding

    @torch.no_grad()
    def before_lookup(self, staged: StagedBatch) -> None:
        """Fetch the current weights of the other ranks' rows the batch reads from their owners,
        in one exchange for all caches (every rank runs the previous backward, and so its
        owners' updates, before this forward)."""
        caches = [cache for cache, _ in staged.read]
        remote = [cache.remote_slots(slots) for cache, slots in staged.read]
        ids = [cache.ids_of_slots(r) for cache, r in zip(caches, remote)]
        rows = exchange_table_rows(ids, [c.serve_weights for c in caches], [c.weight.shape[1] for c in caches], self.sharding)
        for cache, r, i, w in zip(caches, remote, ids, rows):
            cache.weight[r.to(cache.device)] = w
            cache.count_fetched(i)

    def on_output_gradient(self, staged: StagedBatch, grad: Tensor) -> None:
        with self.lock:
            slots, summed = [], []
            for key in self.caches:
                reads = staged.reads[key]
                rows = self._features[key].value_gradients(staged.ours, grad, self.is_weighted)
                zeros = torch.zeros(len(reads.rows), rows.shape[1], dtype=torch.float32, device=rows.device)
                slots.append(reads.rows)
                summed.append(zeros.index_add_(0, reads.inverse, rows))
            self._owners_step(list(self.caches.values()), slots, summed)
            self.staging.finish(staged)

    @torch.no_grad()
    def _owners_step(self, caches: list[DeviceCache], slots: list[Tensor], rows: list[Tensor]) -> None:
        """One row-wise step with the ranks' mean gradient (DDP's average), this rank's gradient
        of ``caches[k]`` being ``rows[k]`` at ``slots[k]`` (repeats sum): each row's summed
        gradient goes to its owner (one exchange for all caches), which sums the ranks' rows and
        updates the row in its cache slot or, for rows not on its device, in its host store."""
        world = self.sharding.world
        parts = [
            (cache.ids_of_slots(distinct), summed / world)
            for cache, (distinct, summed) in zip(caches, sum_rows_by_index(slots, rows, [len(c.weight) for c in caches]))
        ]
        received = send_rows_to_owners(parts, self.sharding)
        totals = sum_rows_by_index([ids for ids, _ in received], [r for _, r in received], [c.num_embeddings for c in caches])
        for cache, (ids, total) in zip(caches, totals):
            at = cache.cached_slots(ids)
            cached = at >= 0
            cache.update_slots(at[cached], total[cached], self.optimizer)
            cache.update_host_rows(ids[~cached], total[~cached], self.optimizer)


@dataclass(frozen=True)
class _CacheFeatures:
    """Where one cache's features are in a batch and in the module's output, for the gradient
    row of every value they read (what ``embedding_bag``'s sparse backward forms)."""

    features: list[int]  # ascending: the order staging puts the cache's values in
    columns: Tensor | None  # the features' output columns, feature after feature (None: contiguous)
    first_column: int
    dim: int
    mean: Tensor | None  # per feature, whether it pools by mean (None: none does)

    @classmethod
    def of(cls, layout: Layout, key: str) -> "_CacheFeatures":
        features = layout.positions(key)
        dim = layout.table_of[layout.features[features[0]]].embedding_dim
        columns = [c for f in features for c in range(layout.columns[f], layout.columns[f] + dim)]
        contiguous = columns == list(range(columns[0], columns[0] + len(columns)))
        mean = [layout.table_of[layout.features[f]].pooling == PoolingType.MEAN for f in features]
        return cls(features, None if contiguous else torch.tensor(columns), columns[0], dim, torch.tensor(mean) if any(mean) else None)

    def value_gradients(self, ours: KeyedJaggedTensor, grad: Tensor, is_weighted: bool) -> Tensor:
        """The gradient row of each value of these features in ``ours``, features end to end,
        from the output's gradient ``grad`` (batch, sum of dims)."""
        batch, count = ours.stride(), len(self.features)
        if self.columns is None:
            per_bag = grad[:, self.first_column : self.first_column + count * self.dim]
        else:
            per_bag = grad.index_select(1, self.columns.to(grad.device))
        # Sample-major columns to feature-major bags, as the values come.
        per_bag = per_bag.reshape(batch, count, self.dim).transpose(0, 1).reshape(count * batch, self.dim)
        spans = [(ours.offset_per_key()[f], ours.offset_per_key()[f + 1]) for f in self.features]
        bag_lengths = concat_spans(ours.lengths(), [(f * batch, (f + 1) * batch) for f in self.features]).to(grad.device)
        if self.mean is not None:
            scale = bag_lengths.clamp(min=1).to(grad.dtype).reciprocal()  # as embedding_bag: times 1 / size
            if not bool(self.mean.all()):  # a host tensor
                scale = torch.where(self.mean.to(grad.device).repeat_interleave(batch, output_size=count * batch), scale, 1.0)
            per_bag = per_bag * scale[:, None]
        num_values = sum(b - a for a, b in spans)
        bag_of_value = torch.repeat_interleave(torch.arange(count * batch, device=grad.device), bag_lengths, output_size=num_values)
        rows = per_bag.index_select(0, bag_of_value)
        if is_weighted:
            rows = rows * concat_spans(ours.weights(), spans).to(grad.device, grad.dtype)[:, None]
        return rows


@dataclass(frozen=True)
class _DeviceTableReads:
    """What a forward across ranks keeps for backward, per device table."""

    values: Tensor | None  # positions of its features' values in the batch (None: all of them)
    inverse: Tensor  # distinct row of each of those values
    keys: Tensor  # key of each distinct row
    remote: Tensor  # which of them another rank owns (fetched from it, in this order)


@dataclass(frozen=True)
class _Reads:
    """What a forward across ranks keeps for backward: per device table its reads, and the
    route its fetch took, along which the gradients of the fetched rows go back."""

    tables: list[_DeviceTableReads]
    route: Routed


class OwnersUpdate:
    def __init__(
        self,
        layout: Layout,
        owned: list[OwnedRows],
        staging: Staging,
        lock: threading.RLock,
        optimizer: RowWiseOptimizerConfig,
        sharding: RowSharding,
        is_weighted: bool,
    ) -> None:
        self.owned = owned
        self.staging = staging
        self.lock = lock
        self.optimizer = optimizer
        self.sharding = sharding
        self.is_weighted = is_weighted
        self.mean = layout.table_of[layout.features[0]].pooling == PoolingType.MEAN  # one pooling (the kernel's condition)
        feature_table = layout.device_table_of_feature()
        num_features = len(layout.features)
        # Per device table: which features read it, and their output columns (one device
        # table: all of them, and the output needs no selection).
        self._features = [torch.tensor([t == k for t in feature_table]) for k in range(len(owned))]
        self._position = [torch.cumsum(f.long(), 0) - 1 for f in self._features]
        self._columns = [
            torch.cat([torch.arange(layout.columns[f], layout.columns[f + 1]) for f in range(num_features) if feature_table[f] == k])
            for k in range(len(owned))
        ]
        self._everything = len(owned) == 1
        self._pending: tuple[_Reads, list[Tensor], RowsInFlight] | None = None  # see `on_output_gradient`

    def before_lookup(self, staged: StagedBatch) -> None:
        """Fetch the current weights of the other ranks' rows the batch reads (one exchange for
        all device tables), and keep each read row's key, and the fetch's route, for backward."""
        self.settle()  # the previous step's update, before any row is read
        positions = self._value_positions(staged.ours)
        reads, requests, remote_rows = [], [], []
        for owned, values in zip(self.owned, positions):
            rows = staged.indices if values is None else staged.indices[values]
            distinct, inverse = unique(rows)
            regions = owned.regions_of_rows(distinct)
            keys = owned.keys_of_rows(distinct, regions)
            remote = ~self.sharding.owned(keys)
            reads.append(_DeviceTableReads(values, inverse, keys, remote))
            requests.append(keys[remote])
            remote_rows.append((distinct[remote], regions[remote]))
        route = route_to_owners(requests, self.sharding)
        fetched = fetch_rows(route, [o.serve for o in self.owned], [o.width for o in self.owned], self.sharding)
        for owned, weights, keys, (rows, regions) in zip(self.owned, fetched, requests, remote_rows):
            owned.storage["weight"][rows] = weights
            per_region = torch.bincount(regions, minlength=len(owned.wholes) + 1).tolist()
            for cache, count in zip(owned.wholes, per_region[1:]):
                cache.counters.fetched_rows += count
            if owned.stack is not None and per_region[0]:
                owned.stack.count_fetched(keys[regions == 0])
        staged.exchange = _Reads(reads, route)

    def attach(self, staged: StagedBatch, output: Tensor) -> None:
        self.staging.keep(staged, output)

    def on_output_gradient(self, staged: StagedBatch, grad: Tensor) -> None:
        """Backward: the ranks' mean gradient of every row ``staged`` read, on its way to the
        row's owner; the batch's rows unlock.

        The gradients of the rows fetched in forward go back along the fetch's route (one
        collective: the owners have their ids already), left running while the rest of the
        step (dense backward, DDP, optimizers, the next batch) goes on; each owner applies
        the sum in `settle`, which the next forward calls before it reads any row."""
        with self.lock:
            reads: _Reads = staged.exchange
            summed = []
            positions = [read.values for read in reads.tables]
            for read, value_rows in zip(reads.tables, self.value_gradients(staged.ours, grad, positions)):
                rows = torch.zeros(len(read.keys), value_rows.shape[1], dtype=torch.float32, device=value_rows.device)
                # DDP's average (``alpha`` of index_add_ would scale each add: 3x slower on CPU).
                summed.append(rows.index_add_(0, read.inverse, value_rows).mul_(1 / self.sharding.world))
            in_flight = send_rows_along(reads.route, [rows[read.remote] for read, rows in zip(reads.tables, summed)], self.sharding)
            self.settle()  # two backwards in a row (no forward between) apply in order
            self._pending = (reads, summed, in_flight)
            # Unlocking now is safe: an owned row evicted before `settle` is written back as it
            # is and then updated where it lives (host store, or the slot it was fetched back to).
            self.staging.finish(staged)

    def settle(self) -> None:
        """Apply the update still on its way (see `on_output_gradient`), if any."""
        with self.lock:
            if self._pending is None:
                return
            reads, summed, in_flight = self._pending
            self._pending = None
            received = in_flight.wait()
            keys = [torch.cat([read.keys[~read.remote], asked]) for read, asked in zip(reads.tables, reads.route.ids)]
            rows = [torch.cat([mine[~read.remote], got]) for read, mine, got in zip(reads.tables, summed, received)]
            totals = sum_rows_by_index(keys, rows, [o.num_keys for o in self.owned])
            for owned, (distinct, total) in zip(self.owned, totals):
                owned.apply(distinct, total, self.optimizer)

    def _value_positions(self, ours: KeyedJaggedTensor) -> list[Tensor | None]:
        if self._everything:
            return [None]
        feature = self._feature_of_value(ours)
        return [in_table.to(feature.device)[feature].nonzero().squeeze(1) for in_table in self._features]

    @staticmethod
    def _bag_of_value(ours: KeyedJaggedTensor, device: torch.device) -> Tensor:
        lengths = ours.lengths().to(device)
        return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=ours.offset_per_key()[-1])

    def _feature_of_value(self, ours: KeyedJaggedTensor) -> Tensor:
        return self._bag_of_value(ours, ours.values().device) // ours.stride()

    def value_gradients(self, ours: KeyedJaggedTensor, grad: Tensor, positions: list[Tensor | None]) -> list[Tensor]:
        """Per device table, the gradient row of every value of its features that ``ours``
        read (in batch order; repeats not summed), from the output's gradient ``grad`` (batch,
        sum of dims): what FBGEMM's backward forms before it updates. ``positions``: each
        device table's values in the batch (`_value_positions`, kept from forward)."""
        batch, lengths = ours.stride(), ours.lengths().to(grad.device)
        bag_of_value = self._bag_of_value(ours, grad.device)  # feature-major, as TBE numbers bags
        scale = ours.weights().to(grad.device, grad.dtype) if self.is_weighted else None
        if self.mean:
            mean = 1.0 / lengths.clamp(min=1).to(grad.dtype)[bag_of_value]
            scale = mean if scale is None else scale * mean
        # The output is sample-major: bag (feature f, sample b) is row b x features + f of the
        # gradient seen as (batch x features, dim), read in place, not transposed.
        feature, sample = bag_of_value // batch, bag_of_value % batch
        out = []
        for k, (owned, values) in enumerate(zip(self.owned, positions)):
            dim = owned.width
            if values is None:  # one device table: every value
                per_bag = grad.reshape(-1, dim)
                rows, value_scale = per_bag.index_select(0, sample * (grad.shape[1] // dim) + feature), scale
            else:
                per_bag = grad.index_select(1, self._columns[k].to(grad.device)).reshape(-1, dim)
                values = values.to(grad.device)
                position = self._position[k].to(grad.device)[feature[values]]
                rows = per_bag.index_select(0, sample[values] * len(self._columns[k]) // dim + position)
                value_scale = None if scale is None else scale[values]
            out.append(rows if value_scale is None else rows * value_scale[:, None])
        return out
