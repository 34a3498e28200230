"""Several tables cached as one: split tables stacked end to end behind a single `DeviceCache`.

The bookkeeping of a cache step (slot-map lookup, locking, victim choice, eviction,
install) is a few dozen small tensor ops; done per table, 26 tables cost ~1,300 op calls a
step, more than FBGEMM's fused kernel spends on the whole lookup and update. Stacked, a
collection's split tables are one "table" of global ids (a table's id plus the rows of the
tables before it), so a step is one lookup, one victim choice and one install whatever the
number of tables, and the dynamic slots are one pool shared by all of them (the victim is
the least-used row of any table). On the device the stack is one table of FBGEMM's
table-batched embedding, which every split feature reads (see `HotColdEmbeddingBagCollection`).

The stack has one host store too (one array, or one file with ``host_storage=<dir>``, per
array), so that a fetch or a write-back is one index op whatever the number of tables (a
store per table took ~8 op calls per table a step); each table's rows in it are a store of
their own that shares its memory (`HostStore.rows_of`). `TableInGroup` is a
table's view of the stack, with the part of `DeviceCache`'s interface that whole-table
work uses (state_dict, checkpoints, initialization, metrics).
"""

from __future__ import annotations

from torch import Tensor

from lightning_hotcache.cache.device import CacheCounters, DeviceCache
from lightning_hotcache.cache.exchange import RoundRobinRows, gather_table
from lightning_hotcache.cache.host import HostStore, RowsAt
from lightning_hotcache._ops.progress import Progress


class TableInGroup:
    """One table's view of a stacked `DeviceCache`, for whole-table work only: reads and
    writes of the whole table (`full`, `load_full`, `load_rows`, `flush`), its own counters,
    and, read-only, the stack's slot arrays and slot map (whose rows may belong to any of its
    tables). A step's work (acquire, release, updates) goes to the stack itself, never
    through a table's view: these are all it offers."""

    identity = False

    def __init__(self, group: DeviceCache, index: int, start: int, host: HostStore, num_embeddings: int) -> None:
        self.group = group
        self.index = index
        self.start = start  # its first global id in the stack
        self.host = host  # this rank's rows of the table (all of them in one process)
        self.name = host.name
        self.num_embeddings = num_embeddings

    @property
    def counters(self) -> CacheCounters:
        return self.group.segment_counters(self.index)

    @property
    def slots(self) -> dict[str, Tensor]:
        return self.group.slots

    @property
    def slot_map(self) -> object:
        return self.group.slot_map

    def num_locked(self) -> int:
        return self.group.num_locked()

    def flush(self) -> None:
        self.group.flush()

    def full(self, key: str = "weight") -> Tensor:
        """The current whole table or optimizer state array (cached rows written back first).
        Across ranks a collective (the shards gathered). No disk sync: a checkpoint reads every table's arrays in turn, and syncing every
        stacked table's files for each of them would repeat it tables x arrays times."""
        self.group.write_back()
        if self.group.sharding.world == 1:
            return self.host.arrays[key]
        return gather_table(self.host.arrays[key], self.num_embeddings, self.group.sharding)

    def load_full(self, key: str, values: Tensor | RoundRobinRows, progress: Progress | None = None) -> None:
        """`DeviceCache.load_full` for this table's rows of the stack."""
        expected = (self.num_embeddings, self.group.slots[key].shape[1])
        if tuple(values.shape) != expected:
            raise ValueError(f"Table {self.name!r}: {key} has shape {expected}, got {tuple(values.shape)}.")
        if isinstance(values, RoundRobinRows):
            self.group.load_pieces(key, values.pieces, self.host, self.start, progress)
        else:
            self.load_rows(key, 0, values, progress)

    def restored_bytes(self, key: str) -> int:
        """`DeviceCache.restored_bytes` of this table's rows of the stack."""
        array = self.host.arrays[key]
        return array.numel() * array.element_size()

    def load_rows(self, key: str, start: int, values: Tensor, progress: Progress | None = None) -> None:
        self.group.load_rows(key, self.start + start, values, progress)

    def initial_rows_at(self, key: str) -> RowsAt | None:
        """`DeviceCache.initial_rows_at` for this table's rows of the stack (where the stack
        takes rows in place, after landing its write-backs, so does this table's view of it)."""
        if self.group.initial_rows_at(key) is None:
            return None
        return self.host.rows_at(key)
