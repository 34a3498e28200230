"""Id -> slot maps of a device cache: a dense array, or sorted ids searched in O(log n).

The dense map costs 4 bytes per row of the *whole* table, which at small budgets can cost
more than the cached rows themselves (1.6% of a 64-wide float table); the sorted map costs
8 bytes per *resident* row (12 for tables of 2**31 rows or more) but a binary search per
lookup. `slot_map_kind` picks the cheaper one in bytes, and the planner counts the same
bytes, so the budget is always honest.

The sorted map keeps the static ids (fixed for the whole run, int64, the slot being the
position) apart from the dynamic ones (int32 id and int32 slot where ids fit), so a fetch
merges only the dynamic part, which is small.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

SlotMapKind = Literal["dense", "sorted"]
DENSE_BYTES_PER_ROW = 4  # int32 slot per table row
SORTED_BYTES_PER_RESIDENT = 8  # a static int64 id (its slot is its position), or a dynamic int32 id + int32 slot
INT32_IDS_BELOW = 2**31


def sorted_bytes_per_resident(num_embeddings: int) -> int:
    # Tables too large for int32 ids keep dynamic ids in int64 (with an int32 slot).
    return SORTED_BYTES_PER_RESIDENT if num_embeddings < INT32_IDS_BELOW else SORTED_BYTES_PER_RESIDENT + 4


def slot_map_kind(num_embeddings: int, num_resident: int) -> SlotMapKind:
    dense = num_embeddings * DENSE_BYTES_PER_ROW
    return "dense" if dense <= num_resident * sorted_bytes_per_resident(num_embeddings) else "sorted"


def slot_map_bytes(num_embeddings: int, num_resident: int) -> int:
    return min(num_embeddings * DENSE_BYTES_PER_ROW, num_resident * sorted_bytes_per_resident(num_embeddings))


class DenseSlotMap:
    """``slot_of_id[id]``: one gather per lookup."""

    def __init__(self, num_embeddings: int, static_ids: Tensor, device: torch.device) -> None:
        self.slot_of_id = torch.full((num_embeddings,), -1, dtype=torch.int32, device=device)
        self.slot_of_id[static_ids] = torch.arange(len(static_ids), dtype=torch.int32, device=device)

    def tensors(self) -> list[Tensor]:
        return [self.slot_of_id]

    def lookup(self, ids: Tensor) -> Tensor:
        return self.slot_of_id[ids].long()

    def assign(self, ids: Tensor, slots: Tensor) -> None:
        self.slot_of_id[ids] = slots.int()

    def remove(self, ids: Tensor) -> None:
        self.slot_of_id[ids] = -1


class SortedSlotMap:
    """Static ids sorted (slot = position) plus dynamic ids sorted with their slots."""

    def __init__(self, num_embeddings: int, static_ids: Tensor, device: torch.device) -> None:
        self.static_ids = static_ids.to(device)  # sorted by the cache
        self.id_dtype = torch.int32 if num_embeddings < INT32_IDS_BELOW else torch.int64
        self.dynamic_ids = torch.empty(0, dtype=self.id_dtype, device=device)
        self.dynamic_slots = torch.empty(0, dtype=torch.int32, device=device)

    def tensors(self) -> list[Tensor]:
        return [self.static_ids, self.dynamic_ids, self.dynamic_slots]

    @staticmethod
    def _find(sorted_ids: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        pos = torch.searchsorted(sorted_ids, ids).clamp_(max=len(sorted_ids) - 1)
        return pos, sorted_ids[pos] == ids

    def lookup(self, ids: Tensor) -> Tensor:
        slots = torch.full_like(ids, -1)
        if len(self.static_ids):
            pos, found = self._find(self.static_ids, ids)
            slots = torch.where(found, pos, slots)
        if len(self.dynamic_ids):
            pos, found = self._find(self.dynamic_ids, ids.to(self.id_dtype))
            slots = torch.where(found, self.dynamic_slots[pos].long(), slots)
        return slots

    def assign(self, ids: Tensor, slots: Tensor) -> None:
        """Add ``ids`` (none present) at ``slots``. Removed ids are dropped here, and only
        the new ids are sorted: they merge into the sorted dynamic ids by their ranks in each
        other, cheaper than re-sorting the union every fetch."""
        live = self.dynamic_slots >= 0
        old, old_slots = self.dynamic_ids[live], self.dynamic_slots[live]
        ids, order = ids.to(self.id_dtype).sort()
        slots = slots[order].int()
        new_at = torch.searchsorted(old, ids) + torch.arange(len(ids), device=ids.device)
        old_at = torch.searchsorted(ids, old) + torch.arange(len(old), device=old.device)
        merged_ids = torch.empty(len(old) + len(ids), dtype=self.id_dtype, device=old.device)
        merged_slots = torch.empty(len(old) + len(ids), dtype=torch.int32, device=old.device)
        merged_ids[old_at], merged_ids[new_at] = old, ids
        merged_slots[old_at], merged_slots[new_at] = old_slots, slots
        self.dynamic_ids, self.dynamic_slots = merged_ids, merged_slots

    def remove(self, ids: Tensor) -> None:
        """Drop ``ids`` (all present as dynamic ids, any order). They stay in the sorted
        array with slot -1, which `lookup` reports as absent, until the next `assign`
        compacts them away: an eviction is followed by a fill, so one compaction serves both."""
        self.dynamic_slots[torch.searchsorted(self.dynamic_ids, ids.to(self.id_dtype))] = -1


def make_slot_map(num_embeddings: int, static_ids: Tensor, num_slots: int, device: torch.device) -> DenseSlotMap | SortedSlotMap:
    cls = DenseSlotMap if slot_map_kind(num_embeddings, num_slots) == "dense" else SortedSlotMap
    return cls(num_embeddings, static_ids, device)
