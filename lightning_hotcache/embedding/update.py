"""Updates: how the rows a training batch read get the row-wise step, and when they unlock.

- `FusedUpdate` (FBGEMM, one process): the kernel's backward steps the rows; a post-hook on
  its autograd node unlocks them once it has (not when the output is freed: autograd frees
  it before the TBE's own backward runs, and a prefetch thread could then evict rows about
  to be updated).
- `SummingUpdate` (PyTorch, one process): the lookup's backward hands over the output's
  gradient; each device table (a width) sums its rows' gradients (staging found the distinct
  rows on the host: no sort, no sparse tensor) and applies the rule.
- `OwnersUpdate` (either kernel, several processes): before the lookup, the other ranks'
  rows the batch reads are fetched from their owners; in backward every read row's gradient
  goes to its owner, which applies the ranks' mean, one device table (one width) at a time
  (`OwnedRows`): the step's ops do not grow with the number of tables.

A one-process update takes no lock in backward: the batch's rows are locked, so staging (maybe
on a prefetch thread) neither evicts nor overwrites them while they are stepped, and once the
step is queued `Staging.finish` marks them changed and unlocks them, then or at the lock's next
holder; a row unlocked after its step was queued is copied off or overwritten only behind it
(on the same stream). Across ranks the exchange and the owners' updates run under the lock.
"""

from __future__ import annotations

import abc
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from lightning_hotcache.cache.exchange import (
    Routed,
    RowSharding,
    RowsInFlight,
    fetch_rows,
    route_to_owners,
    send_rows_along,
)
from lightning_hotcache.cache.owned_rows import OwnedRows
from lightning_hotcache._ops.sorting import sum_bag_rows, sum_rows_by_index
from lightning_hotcache.embedding.batch import StagedBatch, concat_spans, runs_of
from lightning_hotcache.embedding.layout import Layout
from lightning_hotcache.embedding.staging import Staging
from lightning_hotcache.kernels import triton_tbe
from lightning_hotcache.optim.rowwise import SORTS_WITH_REPEATS_ON, RowWiseOptimizerConfig, step_read_rows


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
    def __init__(self, staging: Staging) -> None:
        self.staging = staging

    def before_lookup(self, staged: StagedBatch) -> None:
        pass

    def attach(self, staged: StagedBatch, output: Tensor) -> None:
        self.staging.keep(staged, output)
        # Marked here, not when the hook below finishes the batch: should the hook not come,
        # the TBE's backward updates the rows anyway, and `release_abandoned` unlocks them.
        with self.staging.locked():
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
        self.staging.finish(staged, changed=False)  # marked at attach


class _UpdateInBackward(abc.ABC):
    """One process, an update applied in the lookup's backward, which hands over the output's
    gradient (`on_output_gradient`): each device table's rows (a width: its stack and its whole
    tables) stepped from it, then the batch's rows marked changed and unlocked."""

    sums_gradients = False  # whether staging finds the batch's distinct rows for `_step`

    def __init__(
        self,
        layout: Layout,
        tables: list[dict[str, Tensor]],
        staging: Staging,
        optimizer: RowWiseOptimizerConfig,
        is_weighted: bool,
        host_tables: list[dict[str, Tensor] | None] | None = None,
    ) -> None:
        self.tables = tables
        # Each device table's host arrays where its cache's directory is in device memory (None
        # for the others): a row read from the host is stepped there, in place (`TritonUpdate`).
        self.host_tables = host_tables or [None] * len(tables)
        self.staging = staging
        self.optimizer = optimizer
        self.is_weighted = is_weighted
        self._features = [_TableFeatures.of(layout, k, table["weight"].device) for k, table in enumerate(tables)]
        self._states = [{key: array for key, array in table.items() if key != "weight"} for table in tables]
        if self.sums_gradients:  # staging finds the batch's distinct rows for the update
            staging.sums_gradients = True
            # On CUDA the distinct rows are found on the device, off the host's critical path:
            # sorted with repeats kept, as the zoo's row step sorts there (one list of such devices).
            staging.sorts_reads_on_device = tables[0]["weight"].device.type in SORTS_WITH_REPEATS_ON

    def before_lookup(self, staged: StagedBatch) -> None:
        pass

    def attach(self, staged: StagedBatch, output: Tensor) -> None:
        self.staging.keep(staged, output)

    def settle(self) -> None:
        """Every update is applied in backward: nothing waits."""

    def on_output_gradient(self, staged: StagedBatch, grad: Tensor) -> None:
        for k, table in enumerate(self.tables):
            self._step(k, table, staged, grad)
        self.staging.finish(staged)  # changed: written back on eviction

    @abc.abstractmethod
    def _step(self, k: int, table: dict[str, Tensor], staged: StagedBatch, grad: Tensor) -> None:
        """Step device table ``k``'s rows that ``staged`` read, from the output's gradient ``grad``."""


class SummingUpdate(_UpdateInBackward):
    """PyTorch: each device table's rows get the rule from their summed gradient. Staging found
    the batch's distinct rows and each value's place among them on the host (`TableReads`), so
    a width's step is a fixed number of ops (its values' gradient rows summed at their distinct
    rows, `sum_bag_rows`; gather-step-scatter) with no sort, no sparse tensor and nothing for
    the host to wait on."""

    sums_gradients = True

    def _step(self, k: int, table: dict[str, Tensor], staged: StagedBatch, grad: Tensor) -> None:
        reads = staged.reads[k]
        summed = self._features[k].summed_gradients(staged.ours, grad, self.is_weighted, reads.inverse, len(reads.rows))
        step_read_rows(self.optimizer, table["weight"], self._states[k], reads.rows, summed, reads.segment)


class TritonUpdate(_UpdateInBackward):
    """Triton: each device table's rows are stepped by the Triton TBE's backward
    (`triton_tbe.backward_step`): the width's values sorted once on the device and each
    distinct row stepped in the kernel from its summed gradient. Staging finds no distinct rows
    for it. A row read from the host (``host_tables``) is stepped there, in place."""

    def _step(self, k: int, table: dict[str, Tensor], staged: StagedBatch, grad: Tensor) -> None:
        ours, config, features = staged.ours, self.optimizer, self._features[k]
        per_bag, bag_lengths = features.bag_gradients(ours, grad)
        spans = features.value_spans(ours)
        weights = concat_spans(ours.weights(), spans).to(grad.device, torch.float32) if self.is_weighted else None
        host = self.host_tables[k] or {}
        triton_tbe.backward_step(
            table["weight"], per_bag, concat_spans(staged.indices, spans), torch.cat([bag_lengths.new_zeros(1), bag_lengths.cumsum(0)]),
            config.name, config.lr, config.eps, self._states[k], features.bag_mean(ours.stride()), weights,
            host_weight=host.get("weight"), host_state=host, betas=(config.beta1, config.beta2),
        )  # fmt: skip


@dataclass(frozen=True)
class _TableFeatures:
    """Where the features of one device table are in a batch and in the module's output, for
    the gradient row of every value they read (what ``embedding_bag``'s sparse backward forms,
    and FBGEMM's backward before it updates)."""

    features: list[int]  # ascending: the order staging puts the table's values in
    runs: list[tuple[int, int]]  # the features as runs of adjacent ones (a run's values are one view)
    # The features' output columns, feature after feature (None: contiguous), and whether each
    # pools by mean (None: none does; `all_mean`: all do): on the gradient's device, made once,
    # as a step's copy from the host would wait for the device.
    columns: Tensor | None
    first_column: int
    dim: int
    mean: Tensor | None
    all_mean: bool

    @classmethod
    def of(cls, layout: Layout, table: int, device: torch.device) -> "_TableFeatures":
        features = [k for k, t in enumerate(layout.device_table_of_feature()) if t == table]
        dim = layout.table_of[layout.features[features[0]]].embedding_dim
        columns = [c for f in features for c in range(layout.columns[f], layout.columns[f] + dim)]
        contiguous = columns == list(range(columns[0], columns[0] + len(columns)))
        mean = [layout.table_of[layout.features[f]].pooling == PoolingType.MEAN for f in features]
        return cls(
            features, runs_of(features), None if contiguous else torch.tensor(columns, device=device), columns[0], dim,
            torch.tensor(mean, device=device) if any(mean) else None, all(mean),
        )  # fmt: skip

    def bag_gradients(self, ours: KeyedJaggedTensor, grad: Tensor) -> tuple[Tensor, Tensor]:
        """The gradient of each of these features' bags in ``ours``, feature-major as the values
        come, (bags, dim), from the output's gradient ``grad`` (batch, sum of dims); and the bags' lengths."""
        batch, count = ours.stride(), len(self.features)
        if self.columns is None:
            per_bag = grad[:, self.first_column : self.first_column + count * self.dim]
        else:
            per_bag = grad.index_select(1, self.columns)
        per_bag = per_bag.reshape(batch, count, self.dim).transpose(0, 1).reshape(count * batch, self.dim)
        bag_lengths = concat_spans(ours.lengths(), [(a * batch, b * batch) for a, b in self.runs]).to(grad.device)
        return per_bag, bag_lengths

    def value_spans(self, ours: KeyedJaggedTensor) -> list[tuple[int, int]]:
        """Where these features' values are in ``ours`` (one span per run of adjacent features)."""
        bounds = ours.offset_per_key()
        return [(bounds[a], bounds[b]) for a, b in self.runs]

    def bag_mean(self, batch: int) -> Tensor | None:
        """Per bag, whether it pools by mean (None: none does)."""
        return None if self.mean is None else self.mean.repeat_interleave(batch, output_size=len(self.features) * batch)

    def summed_gradients(self, ours: KeyedJaggedTensor, grad: Tensor, is_weighted: bool, inverse: Tensor, num_rows: int) -> Tensor:
        """The summed gradient row of each of the ``num_rows`` distinct rows these features read
        in ``ours`` (``inverse``: each value's, features end to end), from the output's gradient
        ``grad`` (batch, sum of dims): a value's gradient row is its bag's (times its weight)."""
        per_bag, bag_lengths = self.bag_gradients(ours, grad)
        spans = self.value_spans(ours)
        if self.mean is not None:
            scale = bag_lengths.clamp(min=1).to(grad.dtype).reciprocal()  # as embedding_bag: times 1 / size
            if not self.all_mean:
                scale = torch.where(self.bag_mean(ours.stride()), scale, 1.0)
            per_bag = per_bag * scale[:, None]
        weights = concat_spans(ours.weights(), spans).to(grad.device, grad.dtype) if is_weighted else None
        return sum_bag_rows(per_bag, bag_lengths, inverse, num_rows, weights)


@dataclass(frozen=True)
class _DeviceTableReads:
    """What a forward across ranks keeps for backward, per device table."""

    inverse: Tensor  # distinct row of each value its features read
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
        optimizer: RowWiseOptimizerConfig,
        sharding: RowSharding,
        is_weighted: bool,
    ) -> None:
        self.owned = owned
        self.staging = staging
        self.optimizer = optimizer
        self.sharding = sharding
        self.is_weighted = is_weighted
        self._features = [_TableFeatures.of(layout, k, o.storage["weight"].device) for k, o in enumerate(owned)]
        self._pending: tuple[_Reads, list[Tensor], RowsInFlight] | None = None  # see `on_output_gradient`
        staging.sums_gradients = True

    def before_lookup(self, staged: StagedBatch) -> None:
        """Fetch the current weights of the other ranks' rows the batch reads (one exchange for
        all device tables), and keep each read row's key, and the fetch's route, for backward."""
        with self.staging.locked():  # owners serve and install rows that other batches' staging may evict
            self._fetch_remote_rows(staged)

    def _fetch_remote_rows(self, staged: StagedBatch) -> None:
        self.settle()  # the previous step's update, before any row is read
        reads, requests, remote_rows = [], [], []
        for owned, table_reads in zip(self.owned, staged.reads):
            distinct = table_reads.rows
            regions = owned.regions_of_rows(distinct)
            keys = owned.keys_of_rows(distinct, regions)
            remote = ~self.sharding.owned(keys)
            reads.append(_DeviceTableReads(table_reads.inverse, keys, remote))
            requests.append(keys[remote])
            remote_rows.append((distinct[remote], regions[remote]))
        route = route_to_owners(requests, self.sharding)
        fetched = fetch_rows(route, [o.serve for o in self.owned], [o.width for o in self.owned], self.sharding)
        for owned, weights, keys, (rows, regions) in zip(self.owned, fetched, requests, remote_rows):
            owned.storage["weight"][rows] = weights
            stacks = len(owned.stacks)
            per_region = torch.bincount(regions, minlength=stacks + len(owned.wholes)).tolist()
            for cache, count in zip(owned.wholes, per_region[stacks:]):
                cache.counters.fetched_rows += count
            for k, stack in enumerate(owned.stacks):
                if per_region[k]:
                    stack.count_fetched(owned.ids_in_stack(keys[regions == k], k))
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
        with self.staging.locked():
            reads: _Reads = staged.exchange
            summed = []
            for read, features in zip(reads.tables, self._features):
                rows = features.summed_gradients(staged.ours, grad, self.is_weighted, read.inverse, len(read.keys))
                summed.append(rows.mul_(1 / self.sharding.world))  # DDP's average
            in_flight = send_rows_along(reads.route, [rows[read.remote] for read, rows in zip(reads.tables, summed)], self.sharding)
            self.settle()  # two backwards in a row (no forward between) apply in order
            self._pending = (reads, summed, in_flight)
            # Unlocking now is safe: an owned row evicted before `settle` is written back as it
            # is and then updated where it lives (host store, or the slot it was fetched back to).
            self.staging.finish(staged, changed=False)  # the owners mark what they update

    def settle(self) -> None:
        """Apply the update still on its way (see `on_output_gradient`), if any."""
        with self.staging.locked():
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
