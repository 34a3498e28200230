"""One device table's rows across ranks, addressed by keys whose owner is ``key % world``.

A device table of the stacked layout (see `lightning_hotcache.embedding.layout`) holds its
stacks' slots first (a width's split tables, one stack or several parts), then whole tables'
rows. Across ranks every row has one owner, and the owners' update and the forward's fetch of
other ranks' rows work on all of a device table's rows at once: a row read is named by its key
(a stack slot by the global id it holds plus where its stack's keys start, a whole table's row
by where its table starts in the key space, plus its id; every start a multiple of the world
size), and an owner finds a key's row (or, for a stacked row not on its device, its host row)
with a few tensor ops whatever the number of tables. The whole step for a width is then one
gather-step-scatter on the device table and one on the host per stack, not one per table.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from lightning_hotcache.cache.device import DeviceCache
from lightning_hotcache.cache.exchange import RowSharding
from lightning_hotcache.optim.rowwise import RowWiseOptimizerConfig, step_rows


class OwnedRows:
    """Rows of one device table: ``stacks`` (stacked `DeviceCache`s, the parts of a width's
    split tables, each over keys of its own: the first over ``[0, keys)``, the next from
    there, and so on) and ``wholes`` (tables wholly on the device), each with its first row, in
    row order.

    Args:
        storage: the device table's arrays (``weight`` and the optimizer state), all rows.
        stacks: (stack, first row, keys it spans: a multiple of the world size) of each stack.
        wholes: (cache, first row) of each whole table, in row order.
        sharding: this rank among the ranks sharing the rows.
    """

    def __init__(
        self,
        storage: dict[str, Tensor],
        stacks: Sequence[tuple[DeviceCache, int, int]],
        wholes: Sequence[tuple[DeviceCache, int]],
        sharding: RowSharding,
    ) -> None:
        self.storage = storage
        self.stacks = [stack for stack, _, _ in stacks]
        self.wholes = [cache for cache, _ in wholes]
        self.sharding = sharding
        self.width = storage["weight"].shape[1]
        device = storage["weight"].device
        # Region k (the stacks', then the whole tables'): rows from row_starts[k], keys from
        # key_starts[k]. A stack's row holds the key of the global id its slot holds.
        row_starts, key_starts = [], []
        next_key = 0
        for stack, first_row, keys in stacks:
            row_starts.append(first_row)
            key_starts.append(next_key)
            next_key += keys
        self._stack_spans = [(first_row, first_row + len(stack.weight)) for stack, first_row, _ in stacks]
        self._stack_keys = [(first_key, first_key + keys) for first_key, (_, _, keys) in zip(key_starts, stacks)]
        for cache, first_row in wholes:
            row_starts.append(first_row)
            key_starts.append(next_key)
            next_key += -(-cache.num_embeddings // sharding.world) * sharding.world
        self.num_keys = next_key
        self._row_starts = torch.tensor(row_starts, device=device)
        self._key_starts = torch.tensor(key_starts, device=device)
        self._key_minus_row = self._key_starts - self._row_starts

    @property
    def _state(self) -> dict[str, Tensor]:
        return {key: array for key, array in self.storage.items() if key != "weight"}

    def regions_of_rows(self, rows: Tensor) -> Tensor:
        """Region of each row: its stack's index, or the number of stacks plus its whole table's."""
        return torch.searchsorted(self._row_starts, rows, right=True) - 1

    def keys_of_rows(self, rows: Tensor, regions: Tensor) -> Tensor:
        """The key of each of ``rows`` (ascending resident rows, with their `regions_of_rows`)."""
        keys = rows + self._key_minus_row[regions]
        for k, stack in enumerate(self.stacks):
            at = regions == k
            keys[at] = stack.ids_of_slots(rows[at] - self._stack_spans[k][0]) + self._stack_keys[k][0]
        return keys

    def ids_in_stack(self, keys: Tensor, k: int) -> Tensor:
        """The global ids in stack ``k`` of its ``keys``."""
        return keys - self._stack_keys[k][0]

    def _in_stacks(self, keys: Tensor) -> list[tuple[DeviceCache, Tensor, int, int]]:
        """Each stack with where ``keys`` are its keys, its first row and its first key."""
        out = []
        for stack, (first_row, _), (first_key, end_key) in zip(self.stacks, self._stack_spans, self._stack_keys):
            out.append((stack, (keys >= first_key) & (keys < end_key), first_row, first_key))
        return out

    def rows_of_keys(self, keys: Tensor) -> Tensor:
        """The row of each of ``keys`` on this device, -1 for a stacked row that is not."""
        region = torch.searchsorted(self._key_starts, keys, right=True) - 1
        rows = keys - self._key_minus_row[region]
        for stack, at, first_row, first_key in self._in_stacks(keys):
            slots = stack.cached_slots(keys[at] - first_key)
            rows[at] = torch.where(slots >= 0, slots + first_row, slots)
        return rows

    def serve(self, keys: Tensor) -> Tensor:
        """Current weights of ``keys`` (all owned here): the device's copy, else the host's."""
        rows = self.rows_of_keys(keys)
        weights = self.storage["weight"].index_select(0, rows.clamp(min=0))
        missing = (rows < 0).nonzero().squeeze(1)  # stacked rows only: whole tables are all here
        if len(missing):
            for stack, at, _, first_key in self._in_stacks(keys[missing]):
                there = missing[at]
                if len(there):
                    weights[there] = stack.host_weights(keys[there] - first_key).to(weights.device)
        return weights

    @torch.no_grad()
    def apply(self, keys: Tensor, grads: Tensor, optimizer: RowWiseOptimizerConfig) -> None:
        """One row-wise step for distinct ``keys`` (ascending, owned here) with summed ``grads``:
        one gather-step-scatter on the device table, one on the host per stack for the rest."""
        rows = self.rows_of_keys(keys)
        resident = rows >= 0
        on_device = rows[resident]
        step_rows(optimizer, self.storage["weight"], self._state, on_device, grads[resident])
        for stack, (first_row, end_row) in zip(self.stacks, self._stack_spans):
            stack.mark_updated(on_device[(on_device >= first_row) & (on_device < end_row)] - first_row)
        elsewhere = (~resident).nonzero().squeeze(1)
        for stack, at, _, first_key in self._in_stacks(keys[elsewhere]):
            there = elsewhere[at]
            stack.update_host_rows(keys[there] - first_key, grads[there], optimizer)
