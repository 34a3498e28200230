"""Several tables cached as one: split tables stacked end to end behind a single `DeviceCache`.

The bookkeeping of a cache step (slot-map lookup, locking, victim choice, eviction,
install) is a few dozen small tensor ops; done per table, 26 tables cost ~1,300 op calls a
step, more than FBGEMM's fused kernel spends on the whole lookup and update. Stacked, a
collection's split tables are one "table" of global ids (a table's id plus the rows of the
tables before it), so a step is one lookup, one victim choice and one install whatever the
number of tables, and the dynamic slots are one pool shared by all of them (the victim is
the least-used row of any table). On the device the stack is one table of FBGEMM's
table-batched embedding, which every split feature reads (see `HotColdEmbeddingBagCollection`).

Each table keeps its own host store (its own files with ``host_storage=<dir>``);
`StackedHostStores` routes the stack's reads and writes to them. `TableInGroup` is a
table's view of the stack, with the part of `DeviceCache`'s interface that whole-table
work uses (state_dict, checkpoints, initialization, metrics).
"""

from __future__ import annotations

import bisect
from typing import Iterator, Sequence

import torch
from torch import Tensor

from lightning_hotcache.cache.device import CacheCounters, DeviceCache
from lightning_hotcache.cache.host import HostStore


class StackedHostStores:
    """Host stores of several tables read and written as one: rows of table ``k`` are
    ``[starts[k], starts[k + 1])``."""

    def __init__(self, stores: Sequence[HostStore], starts: Sequence[int]) -> None:
        if len(starts) != len(stores) + 1:
            raise ValueError(f"{len(stores)} stores need {len(stores) + 1} starts, got {len(starts)}.")
        self.stores = list(stores)
        self.starts = list(starts)
        self._starts = torch.tensor(self.starts)
        self.num_embeddings = self.starts[-1]

    def _segments(self, sorted_ids: Tensor) -> Iterator[tuple[HostStore, int, slice]]:
        """(store, its first row, positions of its ids) for each store some ``sorted_ids`` fall in."""
        cuts = torch.searchsorted(sorted_ids, self._starts).tolist()
        for store, start, a, b in zip(self.stores, self.starts, cuts[:-1], cuts[1:]):
            if a < b:
                yield store, start, slice(a, b)

    def read(self, ids: Tensor) -> dict[str, Tensor]:
        """Copies of rows ``ids`` (ascending, as the cache fetches them) of every array."""
        ids = ids.cpu()
        widths = {key: array.shape[1] for key, array in self.stores[0].arrays.items()}
        rows = {key: torch.empty(len(ids), width, dtype=torch.float32) for key, width in widths.items()}
        for store, start, where in self._segments(ids):
            local = ids[where] - start
            for key, array in store.arrays.items():  # straight into place: no concatenation
                torch.index_select(array, 0, local, out=rows[key][where])
        return rows

    def write(self, ids: Tensor, rows: dict[str, Tensor]) -> None:
        """Overwrite rows ``ids`` of every array with ``rows`` (ascending ids, as the cache
        writes them back, take one slice per table; other orders are sorted first)."""
        ids = ids.cpu()
        if len(ids) > 1 and bool((ids[1:] < ids[:-1]).any()):
            ids, order = ids.sort()
            rows = {key: values.index_select(0, order.to(values.device)) for key, values in rows.items()}
        for store, start, where in self._segments(ids):
            store.write(ids[where] - start, {key: values[where] for key, values in rows.items()})

    def load(self, key: str, values: Tensor, start: int = 0) -> None:
        """Replace rows ``[start, start + len(values))`` of one table's array."""
        k = bisect.bisect_right(self.starts, start) - 1
        if not 0 <= k < len(self.stores) or start + len(values) > self.starts[k + 1]:
            raise ValueError(f"Rows [{start}, {start + len(values)}) do not lie within one table of the stack.")
        self.stores[k].load(key, values, start - self.starts[k])

    def flush_to_disk(self) -> None:
        for store in self.stores:
            store.flush_to_disk()


class TableInGroup:
    """One table's view of a stacked `DeviceCache`: whole-table reads and writes, counters,
    and the stack's slots (whose rows may belong to any of its tables)."""

    identity = False

    def __init__(self, group: DeviceCache, index: int, start: int, host: HostStore) -> None:
        self.group = group
        self.index = index
        self.start = start
        self.host = host
        self.name = host.name
        self.num_embeddings = host.num_embeddings

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
        No disk sync: a checkpoint reads every table's arrays in turn, and syncing every
        stacked table's files for each of them would repeat it tables x arrays times."""
        self.group.write_back()
        return self.host.arrays[key]

    def load_full(self, key: str, values: Tensor) -> None:
        expected = (self.num_embeddings, self.group.slots[key].shape[1])
        if tuple(values.shape) != expected:
            raise ValueError(f"Table {self.name!r}: {key} has shape {expected}, got {tuple(values.shape)}.")
        self.load_rows(key, 0, values)

    def load_rows(self, key: str, start: int, values: Tensor) -> None:
        self.group.load_rows(key, self.start + start, values)
