"""HotColdEmbeddingBagCollection: torchrec's EmbeddingBagCollection, with rows in a device cache.

Same input (KeyedJaggedTensor), same output (KeyedTensor), same ``state_dict`` keys as the
EmbeddingBagCollection it replaces. Each table's rows live in a `DeviceCache` (hot rows
pinned, others cached from a `HostStore`); the split tables of one width share one stacked
cache (`lightning_hotcache.cache.group`), so that a step's bookkeeping does not grow with the
number of tables.

The module is a facade over three parts chosen once, when it is built, from the kernel
(FBGEMM's fused TBE where it trains exactly; on CUDA without it, the Triton TBE of
`lightning_hotcache.kernels.triton_tbe`; else PyTorch's ``embedding_bag``) and the number of
processes:

    forward = staging (`Staging`)  ->  lookup (`lookup.py`)  ->  update attached (`update.py`)

On CUDA the Triton path's caches keep their directory in device memory, their host rows mapped
into the GPU's address space (`DirectoryStaging`: the batch's rows admitted at the step, host
rows read and stepped in place, the step capturable in a CUDA graph); elsewhere, and for what
the device directory does not serve (memory-mapped host storage, several processes), the host
directory (`Staging`).

| kernel  | processes | lookup               | update                                         |
|---------|-----------|----------------------|------------------------------------------------|
| fbgemm  | 1         | `FusedLookup`        | `FusedUpdate`: the kernel's backward           |
| fbgemm  | several   | `LookupForOwners`    | `OwnersUpdate`: owners step a width's rows     |
| pytorch | 1         | `EmbeddingBagLookup` | `SummingUpdate`: rows summed, a width at once  |
| pytorch | several   | `EmbeddingBagLookup` | `OwnersUpdate`, as FBGEMM's                    |
| triton  | 1         | `EmbeddingBagLookup` | `TritonUpdate`: the kernel steps each row      |
| triton  | several   | `EmbeddingBagLookup` | `OwnersUpdate`, as FBGEMM's                    |

(The Triton lookup pools with `triton_tbe.pooled`.)

Where the rows live (`Layout`) is decided alongside; nothing in a step tests the
configuration again.

Rules a caller must keep (Lightning's loops keep them): a training forward is followed by
its backward before the next training forward; training batches are forwarded in the
order they were prefetched. Forward in eval mode or under ``torch.no_grad()`` updates
nothing and may come between prefetched training batches.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor
from torchrec.modules.embedding_configs import PoolingType
from tqdm.auto import tqdm

from lightning_hotcache.cache import CachePolicy, DeviceCache, HostDirectory, HostStore
from lightning_hotcache.cache.exchange import RowSharding
from lightning_hotcache.cache.fused import FusedTables, KernelChoice, check_kernel_choice, fused_unavailable
from lightning_hotcache.kernels import triton_tbe
from lightning_hotcache.cache.group import TableInGroup
from lightning_hotcache.cache.host_arrays import new_array
from lightning_hotcache.cache.host_mapping import HostMappingError, map_all_for_devices
from lightning_hotcache.cache.lookahead import DEFAULT_WINDOW_BATCHES
from lightning_hotcache.cache.owned_rows import OwnedRows
from lightning_hotcache.cache.side_by_side import check_staging_threads
from lightning_hotcache.embedding.layout import Layout, build_layout
from lightning_hotcache.embedding.lookup import EmbeddingBagLookup, FusedLookup, LookupForOwners
from lightning_hotcache.embedding.device_staging import DirectoryStaging
from lightning_hotcache.embedding.staging import Staging
from lightning_hotcache._ops.switches import Switch, setting
from lightning_hotcache.embedding.update import FusedUpdate, OwnersUpdate, SummingUpdate, TritonUpdate
from lightning_hotcache.planner.plan import HotColdPlan
from lightning_hotcache._ops.progress import byte_bar
from lightning_hotcache.optim.rowwise import RowWiseOptimizerConfig
from lightning_hotcache.optim.stacked_tables import allocate_stacked
from lightning_hotcache.embedding.table_init import draw_seed, initial_rows_of, is_deferred


def plain_collection(
    tables: list[EmbeddingBagConfig], is_weighted: bool, state: dict[str, Tensor], device: torch.device | str = "cpu"
) -> EmbeddingBagCollection:
    """A TorchRec EmbeddingBagCollection of ``tables`` on ``device``, holding ``state`` (its
    tables one stack of rows where they can be: `lightning_hotcache.optim.stacked_tables`)."""
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=is_weighted, device=torch.device("meta"))
    # No throwaway initialization of tables about to be overwritten.
    if not allocate_stacked(ebc, torch.device(device)):
        ebc = ebc.to_empty(device=device)
    ebc.load_state_dict(state)
    return ebc


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a method under the module's lock (`Staging.locked`): a background thread may be
    staging batches."""

    @functools.wraps(method)
    def wrapper(self: "HotColdEmbeddingBagCollection", *args: Any, **kwargs: Any) -> Any:
        with self._staging.locked():
            return method(self, *args, **kwargs)

    return wrapper


def _whole_tables(method: Callable[..., Any]) -> Callable[..., Any]:
    """`_locked`, for work on whole tables: an update still on its way (across ranks, see
    `OwnersUpdate.settle`) lands first, and every finished batch's rows are marked changed
    (`Staging.locked`), so the method reads and writes current rows."""

    @functools.wraps(method)
    def wrapper(self: "HotColdEmbeddingBagCollection", *args: Any, **kwargs: Any) -> Any:
        with self._staging.locked():
            self._update.settle()
            return method(self, *args, **kwargs)

    return wrapper


class HotColdEmbeddingBagCollection(nn.Module):
    """Drop-in for ``torchrec.EmbeddingBagCollection`` whose rows live in a tiered cache.

    Args:
        tables: the tables, as for EmbeddingBagCollection (SUM or MEAN pooling).
        plan: which rows of each table are static on the device and how many cache slots it gets.
        optimizer: the row-wise rule applied in backward.
        device: where the cached rows live.
        cache_policy: ``lfu``, ``lru``, ``static`` or ``lookahead`` (see `DeviceCache`).
        host_storage: ``"memory"`` (RAM; misses reach a GPU through small pinned buffers) or a directory for
            memory-mapped host tables. The module locks the directory (see `HostDirectory`:
            one owner at a time, files made fresh) until `release_host_storage`.
        is_weighted: use the KJT's per-sample weights (SUM pooling), as torchrec's flag of that name.
        kernel: ``"fbgemm"``: the device tier is FBGEMM's table-batched embedding with the
            row-wise rule fused into backward (see `FusedTables`); ``"pytorch"``: one
            ``embedding_bag`` per width and pooling, the update in its backward; ``"auto"``:
            FBGEMM where it trains exactly (`fused_unavailable` says where not), except for
            row-wise Adagrad on a CPU, where PyTorch's measured faster; else, on CUDA, the
            Triton TBE (``"triton"`` forces it: on a CPU only under ``TRITON_INTERPRET=1``);
            else PyTorch. ``kernel_note`` says which runs and why.
        process_group: data-parallel ranks training the same tables (None: this process alone).
            Host stores are sharded round-robin across the ranks, each rank caches the rows
            its batches read, and each row's owner applies the ranks' mean gradient to it
            (see `OwnersUpdate`); a forward first fetches the current copies of the other
            ranks' rows it reads. Every rank must make the same calls (forward, prefetch,
            state_dict) in the same order.
        staging_threads: threads that stage a batch's caches at once. In one process each
            width's split tables are then stacked in up to this many caches (of about equal
            dynamic slots, in the width's one device table), each staged on a thread of its own
            (see `lightning_hotcache.cache.side_by_side`). No effect where the caches' directory
            is in device memory (one cache a width there, admitted on the device).
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
        staging_threads: int = 1,
    ) -> None:
        super().__init__()
        check_kernel_choice(kernel)
        check_staging_threads(staging_threads)
        self._is_weighted = is_weighted
        self.process_group = process_group
        # False while a strategy saves split tables shard by shard instead of gathering them.
        self.gather_split_tables = True
        self._tables = list(tables)
        self.optimizer = optimizer or RowWiseOptimizerConfig()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.plan = plan
        plan.check_tables(self._tables, whole_model=False)  # one plan covers all of a model's collections
        for table in self._tables:
            if table.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"Table {table.name!r}: pooling {table.pooling} is not supported (SUM or MEAN).")
        self.host_directory = None if str(host_storage) == "memory" else HostDirectory(host_storage)
        sharding = RowSharding()
        if process_group is not None:
            sharding = RowSharding(dist.get_rank(process_group), dist.get_world_size(process_group), process_group)
        self._sharding = sharding
        slot_counts = {
            t.name: DeviceCache.num_slots(t.num_embeddings, plan.table(t.name).static_ids, plan.table(t.name).cache_slots)
            for t in self._tables
        }
        split = {t.name for t in self._tables if not plan.table(t.name).on_device}
        reason = self._why_not_fused(kernel, min(slot_counts.values()))
        self._triton = reason is not None and self._triton_runs(kernel)
        dynamic = {t.name: plan.table(t.name).cache_slots for t in self._tables}
        # The split tables' caches keep their directory in device memory (`DeviceDirectory`,
        # staged by `DirectoryStaging`) where it may serve and nothing in the configuration keeps
        # it on the host; the log line names what does.
        switched_on = self._device_directory_switched_on()
        self._host_directory_reason = self._why_the_directory_stays_on_the_host() if switched_on else None
        directory_on_device = switched_on and self._host_directory_reason is None
        # Under lookahead the device directory's window: the plan's (a plan made without the policy: the default).
        self._window_batches = plan.lookahead_batches or DEFAULT_WINDOW_BATCHES
        parts = 1 if directory_on_device else staging_threads  # a width's host rows: one array for the kernels
        self.layout = build_layout(self._tables, slot_counts, split, reason is None, sharding.world, parts, dynamic)
        if directory_on_device and split and not self.layout.stacks:
            directory_on_device = False  # stacks of 2**31 ids or more: each table keeps a host directory of its own
        self._directories_on_device = directory_on_device
        self._mapping_refusal: str | None = None  # why the host rows could not be mapped for the device directory
        self._fused = None if reason is not None else self._fused_tables(self.layout)
        # Each device table's arrays (weight and optimizer state): the TBE's memory, or, on the
        # PyTorch path, arrays of our own.
        self._device_tables = [
            self._own_device_table(k) if self._fused is None else self._fused.storage(k) for k in range(len(self.layout.device_rows))
        ]
        # Every cache, by key (a stack, or a table of its own); `caches` is by table.
        self._caches: dict[str, DeviceCache] = {}
        self.caches: dict[str, DeviceCache | TableInGroup] = {}
        stores = {
            key: self._host_store(self._stack_store_name(key), self.layout.stack_ids[key] // sharding.world, members[0].embedding_dim)
            for key, members in self.layout.stacks.items()
        }
        if self._directories_on_device and self.device.type == "cuda":
            self._map_host_rows(stores)
        for key, members in self.layout.stacks.items():
            # One host store for the stack (a rank's rows of global id g are at g // world);
            # each table's rows in it are a store of their own, sharing its memory.
            host = stores[key]
            self._caches[key] = self._stack(key, members, host, cache_policy)
            for k, table in enumerate(members):
                start = self.layout.id_starts[table.name]
                rows = HostStore.rows_of(host, table.name, start // sharding.world, sharding.num_local(table.num_embeddings))
                self.caches[table.name] = TableInGroup(self._caches[key], k, start, rows, table.num_embeddings)
        if self.layout.stacks:
            stacked = sum(len(m) for m in self.layout.stacks.values())
            widths = len({m[0].embedding_dim for m in self.layout.stacks.values()})
            where = "one cache" if len(self.layout.stacks) == 1 else f"{len(self.layout.stacks)} caches"
            if len(self.layout.stacks) > widths:
                where += f" staged side by side by {min(staging_threads, len(self.layout.stacks))} threads"
            elif widths > 1:
                where += " (one per width)"
            self.kernel_note += f", {stacked} split table(s) stacked in {where}"
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
                self._host_store(table.name, sharding.num_local(table.num_embeddings), table.embedding_dim) if table.name in split else None,
                self.device,
                sharding,
                self._region(table.name),
            )
            self.caches[table.name] = self._caches[table.name] = cache
        self.caches = {t.name: self.caches[t.name] for t in self._tables}  # in table order
        self._caches = {key: self._caches[key] for key in self.layout.cache_keys}  # in layout order
        if self._mapping_refusal is not None:
            self.kernel_note += f", cache directory on the host ({self._mapping_refusal})"
        elif self._host_directory_reason is not None and split:
            self.kernel_note += f", cache directory on the host ({self._host_directory_reason})"
        if self._directories_on_device:
            if split:
                self.kernel_note += ", cache directory in device memory (host rows read and stepped in place)"
                if cache_policy == "lookahead":
                    self.kernel_note += f", its lookahead window of {self._window_batches} batches there too"
            if staging_threads > 1:
                self.kernel_note += f" (staging_threads={staging_threads} has no effect: the device stages the caches)"
            self._staging: Staging = DirectoryStaging(self.layout, self._caches, self.device)
        else:
            self._staging = Staging(self.layout, self._caches, self.device, staging_threads)
        self._lookup, self._update = self._step_parts()

    def _step_parts(self) -> tuple[Callable[[Any], Tensor], Any]:
        """The lookup and the update of this configuration (kernel x processes)."""
        staging, world = self._staging, self._sharding.world
        if self._fused is not None and world == 1:
            return FusedLookup(self._fused, self._is_weighted, self.device), FusedUpdate(staging)
        update: OwnersUpdate | SummingUpdate
        if world > 1:
            owned = [self._owned_rows(k) for k in range(len(self.layout.device_rows))]
            update = OwnersUpdate(self.layout, owned, staging, self.optimizer, self._sharding, self._is_weighted)
        else:
            update = SummingUpdate(self.layout, self._device_tables, staging, self.optimizer, self._is_weighted)
        if self._fused is not None:
            return LookupForOwners(self._fused, self._is_weighted, self.device, update.on_output_gradient), update
        hosts = self._host_rows_of_device_tables()
        if self._triton and world == 1:
            update = TritonUpdate(self.layout, self._device_tables, staging, self.optimizer, self._is_weighted, hosts)
        weights = [table["weight"] for table in self._device_tables]
        host_weights = [None if host is None else host["weight"] for host in hosts]
        lookup = EmbeddingBagLookup(self.layout, weights, self._is_weighted, self.device, update.on_output_gradient, self._triton, host_weights)
        return lookup, update

    def _device_directory_switched_on(self) -> bool:
        """Whether the device directory may serve: on CUDA unless switched off, elsewhere (a CPU
        under ``TRITON_INTERPRET=1``) only when switched on."""
        wanted = setting(Switch.DEVICE_DIRECTORY)
        return wanted == "1" or (wanted is None and self.device.type == "cuda")

    def _why_the_directory_stays_on_the_host(self) -> str | None:
        """What in this configuration the device directory does not serve (None: nothing)."""
        if not self._triton:
            return "it needs the Triton kernels"
        if self._sharding.world > 1:
            return "several processes exchange rows through it"
        if self.host_directory is not None:
            return "host_storage is a directory of memory-mapped files"
        return None

    def _map_host_rows(self, stores: dict[str, HostStore]) -> None:
        """Map the stacks' host rows into the GPU's address space for the device directory's
        kernels; where the driver refuses to lock them, or the kernels cannot read them there,
        keep the host directory and say why, unless the device directory was asked for by its
        switch."""
        try:
            map_all_for_devices([array for store in stores.values() for array in store.arrays.values()], self.device)
        except HostMappingError as error:
            if setting(Switch.DEVICE_DIRECTORY) == "1":
                raise
            self._directories_on_device = False
            self._mapping_refusal = str(error)

    def _host_rows_of_device_tables(self) -> list[dict[str, Tensor] | None]:
        """Each device table's host arrays where its split tables' cache keeps its directory in
        device memory (one stack a width), else None."""
        hosts: list[dict[str, Tensor] | None] = [None] * len(self._device_tables)
        if self._directories_on_device:
            for key in self.layout.stacks:
                host = self._caches[key].host
                assert host is not None
                hosts[self.layout.regions[key].table] = host.arrays
        return hosts

    def _why_not_fused(self, kernel: KernelChoice, fewest_slots: int) -> str | None:
        """Why the device tier is not FBGEMM's fused kernel here (None: it is); sets `kernel_note`."""
        if kernel in ("pytorch", "triton"):
            reason: str | None = f"kernel={kernel!r} was chosen"
        elif fewest_slots == 0:
            reason = "a table has no device rows"
        else:
            reason = fused_unavailable(self._tables, self.optimizer, self.device)
        if reason is None and kernel == "auto" and self.device.type == "cpu" and self.optimizer.name == "rowwise_adagrad":
            # FBGEMM's CPU row-wise Adagrad backward sorts the batch's ids and steps rows table
            # by table, where the PyTorch path's distinct rows were found in staging, so the
            # PyTorch path trains DLRM faster in one process and no slower across processes
            # (where FBGEMM's kernel only looks rows up; benchmarks/README.md). FBGEMM's CPU
            # SGD is as fast end to end, and faster alone: it stays.
            reason = "on a CPU the PyTorch path trains row-wise Adagrad faster than FBGEMM's CPU kernel (kernel='fbgemm' chooses it)"
        if reason is not None and kernel == "fbgemm":
            raise ValueError(f"kernel='fbgemm' cannot train these tables exactly here: {reason}. Use kernel='auto'.")
        self._fused_refusal = reason
        if reason is not None:
            self.kernel_note = f"pytorch embedding_bag ({reason})"
        elif self._sharding.world == 1:
            self.kernel_note = "fbgemm TBE, optimizer fused"
        else:
            self.kernel_note = "fbgemm TBE lookup, each row's owner applies the ranks' mean gradient"
        return reason

    def _triton_runs(self, kernel: KernelChoice) -> bool:
        """Whether the device tier runs the Triton TBE where FBGEMM's fused kernel does not:
        when asked (or refused with why), and by default on CUDA; sets `kernel_note`."""
        why = triton_tbe.why_unavailable(self.device)
        if kernel == "triton" and why is not None:
            raise ValueError(f"kernel='triton' cannot run here: {why}. Use kernel='auto'.")
        if kernel == "pytorch" or (kernel == "auto" and (self.device.type != "cuda" or why is not None)):
            return False
        if self._sharding.world > 1:
            self.kernel_note = "triton TBE lookup, each row's owner applies the ranks' mean gradient"
        else:
            self.kernel_note = f"triton TBE, {self.optimizer.name} applied in its backward"
        if kernel == "auto":
            self.kernel_note += f" (FBGEMM's fused kernel does not run here: {self._fused_refusal})"
        return True

    def _fused_tables(self, layout: Layout) -> FusedTables:
        """One TBE: a table per device table of the layout (one per width when shared)."""
        index = {t.name: k for k, t in enumerate(self._tables)}
        table_of_feature = [index[layout.table_of[f].name] for f in layout.features]
        return FusedTables(
            layout.device_rows, layout.device_dims, layout.device_table_of_feature(), self._tables[0].pooling,
            self.optimizer, self.device, table_of_feature if layout.shared else None,
        )  # fmt: skip

    def _own_device_table(self, table: int) -> dict[str, Tensor]:
        rows, dim = self.layout.device_rows[table], self.layout.device_dims[table]
        widths = {"weight": dim, **self.optimizer.state_widths(dim)}
        return {key: new_array((rows, width), self.device) for key, width in widths.items()}

    def _region(self, key: str) -> dict[str, Tensor]:
        """Views of one cache's slots in its device table."""
        region = self.layout.regions[key]
        return {name: array[region.start : region.start + region.rows] for name, array in self._device_tables[region.table].items()}

    def _host_store(self, name: str, rows: int, dim: int) -> HostStore:
        """This rank's host rows (and optimizer state) of a split table, or of a stack of them."""
        widths = self.optimizer.state_widths(dim)
        return HostStore(name, rows, dim, widths, self.host_directory)

    def _stack_store_name(self, key: str) -> str:
        """The host store's name of stack ``key``: ``split_tables_dim<width>``, with ``_part<k>`` (from 1) where the width has several."""
        members = self.layout.stacks[key]
        parts = [k for k, m in self.layout.stacks.items() if m[0].embedding_dim == members[0].embedding_dim]
        name = f"split_tables_dim{members[0].embedding_dim}"
        return name if len(parts) == 1 else f"{name}_part{parts.index(key) + 1}"

    def _stack(self, key: str, members: list[EmbeddingBagConfig], host: HostStore, policy: CachePolicy) -> DeviceCache:
        """One cache over the global ids of ``members`` (see `Layout`)."""
        starts = [self.layout.id_starts[t.name] for t in members] + [self.layout.stack_ids[key]]
        table_plans = [self.plan.table(t.name) for t in members]
        return DeviceCache(
            f"stack of {', '.join(t.name for t in members)}",
            starts[-1],
            members[0].embedding_dim,
            self.optimizer,
            torch.cat([torch.as_tensor(p.static_ids, dtype=torch.int64) + start for p, start in zip(table_plans, starts)]),
            sum(p.cache_slots for p in table_plans),
            policy,
            host,
            self.device,
            self._sharding,
            storage=self._region(key),
            segment_starts=starts,
            directory_on_device=self._directories_on_device,
            window_batches=self._window_batches,
        )

    def _owned_rows(self, table: int) -> OwnedRows:
        """Device table ``table``'s rows as its owners step them (across ranks, shared device tables)."""
        keys = [k for k, region in self.layout.regions.items() if region.table == table]
        stacks = [(self._caches[k], self.layout.regions[k].start, self.layout.stack_ids[k]) for k in keys if k in self.layout.stacks]
        wholes = [(self._caches[k], self.layout.regions[k].start) for k in keys if k not in self.layout.stacks]
        return OwnedRows(self._device_tables[table], stacks, wholes, self._sharding)

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
        staging_threads: int = 1,
    ) -> "HotColdEmbeddingBagCollection":
        """Replace ``ebc``: same tables, its current weights, rows placed by ``plan``. When
        ``ebc`` is deferred (declared on the meta device) its rows are initialized where they
        live, from ``seed`` (every rank must pass the same; None draws one), never all in memory."""
        module = cls(
            ebc.embedding_bag_configs(), plan, optimizer, device, cache_policy, host_storage, ebc.is_weighted(),
            process_group, kernel, staging_threads,
        )  # fmt: skip
        if is_deferred(ebc):
            module.initialize(draw_seed() if seed is None else seed)
        else:
            module.load_state_dict(ebc.state_dict())
        return module

    @_whole_tables
    def initialize(self, seed: int) -> None:
        """Every table's initial rows (see `initial_rows`), written chunk by chunk into its tiers."""
        for table, start, rows in initial_rows_of(self._tables, seed, lambda t: self.caches[t.name].initial_rows_at("weight")):
            self.caches[table.name].load_rows("weight", start, rows)  # rows made in the host store stay there

    def reset_parameters(self, seed: int | None = None) -> None:
        """Draw every table's rows anew, as TorchRec's modules initialize them (from ``seed``;
        None draws one). The row-wise optimizer state is left as it is."""
        self.initialize(draw_seed() if seed is None else seed)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # A copy (copy.deepcopy for EMA/SWA, pickle for torch.save(model)) is a TorchRec
        # EmbeddingBagCollection with the current weights: the caches' lock, host files, hooks
        # and the device tier belong to the run that owns them. Across processes every rank
        # must copy (the tables are gathered from the shards).
        return (plain_collection, (self.embedding_bag_configs(), self.is_weighted(), self.state_dict()))

    def __getattr__(self, name: str) -> Any:
        if name == "embedding_bags":
            # TorchRec's modules hold an nn.EmbeddingBag per table; these rows live in caches
            # and host stores, so there is no weight tensor to hand out (nor parameters: the
            # row-wise rule trains them in backward).
            raise AttributeError(
                "HotColdEmbeddingBagCollection has no embedding_bags: its rows live in a device cache and host "
                "stores. Read a table with state_dict()['embedding_bags.<table>.weight'], write one with "
                "load_state_dict, initialize with reset_parameters(seed), or turn the model back into TorchRec "
                "modules with lightning_hotcache.to_torchrec(model) (for weight tying, custom parameters, "
                "torch.export or serving)."
            )
        return super().__getattr__(name)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._tables)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def reads(self, features: KeyedJaggedTensor, batch_index: int | None = None) -> bool:
        """Whether ``features`` is this module's input: it has every feature the module looks up
        (False where it has none: another module's). Raises KeyError, naming what is missing
        (and the batch, with ``batch_index``), where it has some but not all."""
        wanted, given = self.input_features, set(features.keys())
        missing = sorted(wanted - given)
        if missing and len(missing) < len(wanted):
            where = "" if batch_index is None else f"training batch {batch_index} of this epoch "
            raise KeyError(
                f"{where}lacks the feature(s) {missing} that this model's tables look up (it has {sorted(given)}): "
                "give every batch every sparse feature of the model's EmbeddingBagCollection."
            )
        return not missing

    @property
    def input_features(self) -> set[str]:
        """The features this module looks up."""
        return set(self.layout.input_of.values())

    # -------------------------------------------------------------- a step
    def prefetch(self, features: KeyedJaggedTensor, arrives_as: KeyedJaggedTensor | None = None, announced: bool = False) -> None:
        """Make a future batch's rows resident and lock them (call in forward order).
        ``features`` are read on the host: pass the batch before its move to the device, and
        the moved batch, which forward will get, as ``arrives_as``; ``announced``: it is the
        oldest batch `announce`d."""
        self._staging.prefetch(features, arrives_as, announced)

    def step_tensors(self) -> list[Tensor]:
        """Every tensor a training step through this module writes: the device tables, and the
        host rows and directories of caches in device memory (a CPU stand-in for a refused
        CUDA graph capture puts them back)."""
        tensors = [array for table in self._device_tables for array in table.values()]
        for cache in self._caches.values():
            if cache.on_device is not None:
                assert cache.host is not None
                tensors += [*cache.host.arrays.values(), *cache.on_device.tensors(), cache.on_device.tick]
        return tensors

    @property
    def stages_on_the_device(self) -> bool:
        """Whether a batch's rows are found and admitted by its forward on the device (every
        split cache's directory in device memory, `DirectoryStaging`), so that staging ahead
        only checks its ids."""
        return isinstance(self._staging, DirectoryStaging)

    def why_not_graphable(self) -> str | None:
        """Why a step through this module cannot be recorded in a CUDA graph (None where it can:
        its caches' directories are in device memory, `DirectoryStaging`)."""
        if self.stages_on_the_device:
            return None
        return (
            "its caches' directory is on the host, which hands each batch's slots over (the directory is in device "
            f"memory on the Triton path in one process, with host_storage='memory'; here: {self.kernel_note})"
        )

    def check(self, features: KeyedJaggedTensor) -> None:
        """Make sure ``features``' forward needs no host read to check its ids: a batch handed to
        a step graph (`lightning_hotcache._ops.step_graph`) reaches forward as a static copy,
        which cannot be checked there. Prefetched batches are checked already."""
        self._staging.check(features)

    def announce(self, features: KeyedJaggedTensor) -> None:
        """A training batch to be prefetched later (``announced=True``, in this order), its
        ids on the host: with ``cache_policy="lookahead"`` the rows it reads are kept on the
        device until then wherever other rows can go."""
        self._staging.announce(features)

    @_locked
    def clear_prefetched(self) -> None:
        """Drop (and unlock) batches prefetched but never forwarded, and forget the batches
        announced but never prefetched, e.g. when an epoch was cut short."""
        self._staging.clear()
        self._staging.clear_window()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        # A prefetched batch's rows are locked for it: taking it, looking it up and keeping it
        # for backward need not wait for a prefetch thread staging the next ones (each part
        # takes the lock where it changes the caches).
        staged = self._staging.take(features, training=self.training and torch.is_grad_enabled())
        self._update.before_lookup(staged)
        values = self._lookup(staged)
        if torch.is_grad_enabled() and values.requires_grad:
            self._update.attach(staged, values)
        else:
            self._staging.release(staged)
        return KeyedTensor(
            keys=self.layout.features,
            length_per_key=[self.layout.table_of[f].embedding_dim for f in self.layout.features],
            values=values,
        )

    # ---------------------------------------------------------- whole tables
    @_whole_tables
    def flush(self) -> None:
        """Write every changed cached row back to its host store."""
        for cache in self._caches.values():
            cache.flush()

    def device_bytes(self) -> int:
        """Bytes the tables hold on the device now (see `DeviceCache.device_bytes`)."""
        return sum(cache.device_bytes() for cache in self._caches.values())

    def lock_host_storage(self) -> None:
        """Own the host storage directory again (after `release_host_storage`), e.g. for another fit."""
        if self.host_directory is not None:
            self.host_directory.acquire()

    def staging_helper_cpu_seconds(self) -> float:
        """CPU seconds the staging threads have spent on the calling thread's staging, in all
        (beyond its own CPU time: `SideBySide.helper_cpu_seconds`)."""
        return self._staging.side_by_side.helper_cpu_seconds()

    def release_staging_threads(self) -> None:
        """End the threads that stage caches side by side (``staging_threads``; the next batch
        staged starts them again)."""
        self._staging.side_by_side.release()

    def release_host_storage(self) -> None:
        """Let another run use the host storage directory; this module's rows stay readable."""
        if self.host_directory is not None:
            self.host_directory.release()

    @_whole_tables
    def optimizer_state(self) -> dict[str, dict[str, Tensor]]:
        """Current row-wise optimizer state of every table: table -> state name -> (rows, width).
        Tables whose rows are split over host stores are left out while `gather_split_tables`
        is False (their state is in `host_shards`)."""
        return {
            name: {key: cache.full(key) for key in cache.slots if key != "weight"}
            for name, cache in self.caches.items()
            if cache.identity or self.gather_split_tables
        }

    @_whole_tables
    def host_shards(self) -> dict[str, dict[str, Tensor]]:
        """This rank's host rows (round-robin shard) of every split table, current: table ->
        array name -> (local rows, width). No collective."""
        self.flush()  # every cache once (a stack's tables share its flush)
        return {name: dict(cache.host.arrays) for name, cache in self.caches.items() if cache.host is not None}

    @_whole_tables
    def load_optimizer_state(self, state: dict[str, dict[str, Tensor]]) -> None:
        for name, arrays in state.items():  # every table checked before any row is written
            self.optimizer.check_saved_state(name, arrays)
        loads = [(name, key, values) for name, arrays in state.items() for key, values in arrays.items()]
        with self._load_bar("loading row-wise state", [(name, key) for name, key, _ in loads]) as bar:
            for name, key, values in loads:
                self.caches[name].load_full(key, values, bar.update)

    def _load_bar(self, desc: str, arrays: list[tuple[str, str]]) -> tqdm:
        """A bar of the bytes this process writes loading ``arrays`` (table, array name), shown
        on rank 0 where they are large: a checkpoint's restore of many GB otherwise runs for
        minutes in silence."""
        total = sum(self.caches[name].restored_bytes(key) for name, key in arrays)
        return byte_bar(total, desc, show=self._sharding.rank == 0)

    @_whole_tables
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # The keys of the EmbeddingBagCollection this replaces, so checkpoints interchange.
        for name, cache in self.caches.items():
            if cache.identity or self.gather_split_tables:
                destination[f"{prefix}embedding_bags.{name}.weight"] = cache.full("weight")

    @_whole_tables
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
        loads = []
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
            loads.append((table.name, values))
        with self._load_bar("loading tables", [(name, "weight") for name, _ in loads]) as bar:
            for name, values in loads:
                self.caches[name].load_full("weight", values, bar.update)

