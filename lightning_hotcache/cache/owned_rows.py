"""One device table's rows across ranks, addressed by keys whose owner is ``key % world``.

A device table of the stacked layout (see `lightning_hotcache.embedding.layout`) holds a
stack's slots first, then whole tables' rows. Across ranks every row has one owner, and the
owners' update and the forward's fetch of other ranks' rows work on all of a device table's
rows at once: a row read is named by its key (a stack slot by the global id it holds, a whole
table's row by where its table starts in the key space, a multiple of the world size, plus
its id), and an owner finds a key's row (or, for a stacked row not on its device, its host
row) with a few tensor ops whatever the number of tables. The whole step for a width is then
one gather-step-scatter on the device table and one on the host, not one per table.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from lightning_hotcache.cache.device import DeviceCache
from lightning_hotcache.cache.exchange import RowSharding
from lightning_hotcache.rowwise import RowWiseOptimizerConfig, step_rows


class OwnedRows:
    """Rows of one device table: ``stack`` (a stacked `DeviceCache` over keys ``[0,
    stack_keys)``, its slots at rows ``[0, len(stack slots))``) and ``wholes`` (tables wholly on
    the device: each its cache and first row), in row order.

    Args:
        storage: the device table's arrays (``weight`` and the optimizer state), all rows.
        stack: the stack, or None.
        stack_keys: keys the stack spans (a multiple of the world size).
        wholes: (cache, first row) of each whole table, in row order.
        sharding: this rank among the ranks sharing the rows.
    """

    def __init__(
        self,
        storage: dict[str, Tensor],
        stack: DeviceCache | None,
        stack_keys: int,
        wholes: Sequence[tuple[DeviceCache, int]],
        sharding: RowSharding,
    ) -> None:
        self.storage = storage
        self.stack = stack
        self.stack_keys = stack_keys
        self.wholes = [cache for cache, _ in wholes]
        self.sharding = sharding
        self.width = storage["weight"].shape[1]
        device = storage["weight"].device
        stack_rows = 0 if stack is None else len(stack.weight)
        # Region k: rows from row_starts[k], keys from key_starts[k] (the stack's entry is a
        # placeholder: its keys come from its slots).
        row_starts, key_starts = [0], [0]
        next_key = stack_keys
        for cache, first_row in wholes:
            row_starts.append(first_row)
            key_starts.append(next_key)
            next_key += -(-cache.num_embeddings // sharding.world) * sharding.world
        self.num_keys = next_key
        self._stack_rows = stack_rows
        self._row_starts = torch.tensor(row_starts, device=device)
        self._key_starts = torch.tensor(key_starts, device=device)
        self._key_minus_row = self._key_starts - self._row_starts

    @property
    def _state(self) -> dict[str, Tensor]:
        return {key: array for key, array in self.storage.items() if key != "weight"}

    def regions_of_rows(self, rows: Tensor) -> Tensor:
        """Region of each row (0: the stack, or the first whole table when there is no stack)."""
        return torch.searchsorted(self._row_starts, rows, right=True) - 1

    def keys_of_rows(self, rows: Tensor, regions: Tensor) -> Tensor:
        """The key of each of ``rows`` (ascending resident rows, with their `regions_of_rows`)."""
        keys = rows + self._key_minus_row[regions]
        if self.stack is not None:  # the stack's rows come first
            cut = int(torch.searchsorted(rows, self._stack_rows))
            keys[:cut] = self.stack.ids_of_slots(rows[:cut])
        return keys

    def rows_of_keys(self, keys: Tensor) -> Tensor:
        """The row of each of ``keys`` on this device, -1 for a stacked row that is not."""
        region = torch.searchsorted(self._key_starts, keys, right=True) - 1
        rows = keys - self._key_minus_row[region]
        if self.stack is not None:
            in_stack = keys < self.stack_keys
            rows[in_stack] = self.stack.cached_slots(keys[in_stack])
        return rows

    def serve(self, keys: Tensor) -> Tensor:
        """Current weights of ``keys`` (all owned here): the device's copy, else the host's."""
        rows = self.rows_of_keys(keys)
        weights = self.storage["weight"].index_select(0, rows.clamp(min=0))
        missing = (rows < 0).nonzero().squeeze(1)
        if len(missing):
            assert self.stack is not None
            weights[missing] = self.stack.host_weights(keys[missing]).to(weights.device)
        return weights

    @torch.no_grad()
    def apply(self, keys: Tensor, grads: Tensor, optimizer: RowWiseOptimizerConfig) -> None:
        """One row-wise step for distinct ``keys`` (ascending, owned here) with summed ``grads``:
        one gather-step-scatter on the device table, one on the host for the rest."""
        rows = self.rows_of_keys(keys)
        resident = rows >= 0
        on_device = rows[resident]
        step_rows(optimizer, self.storage["weight"], self._state, on_device, grads[resident])
        if self.stack is None:
            return
        self.stack.mark_updated(on_device[on_device < self._stack_rows])
        elsewhere = ~resident
        self.stack.update_host_rows(keys[elsewhere], grads[elsewhere], optimizer)
