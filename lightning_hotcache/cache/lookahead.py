"""The lookahead window of a cache: the batches announced ahead of their acquire, and for
every resident row the next of them that reads it.

Under ``cache_policy="lookahead"`` the loader reads batches ahead of staging and announces
each (`DeviceCache.announce`). Eviction then follows Belady within the window: a row that
no announced batch reads goes first (by LFU), then the row whose next read is farthest.

What it keeps, all on the host:

* each announced batch deduplicated (distinct ids, each id's place among them, counts),
  which its acquire reuses instead of deduplicating the batch again;
* the window's ids end to end in a ring, each entry with the announcement number of the
  next batch that reads the same row (``never`` if none yet): a link a later announcement
  fills in. Entries have global positions; the live ones are ``[start, end)``;
* per row of the table, the position of its latest announced read (4 bytes a row), which is
  how an announcement finds the entry to link from;
* per slot, the announcement number of its row's next read.

So an announcement is one compiled pass over the batch's distinct ids
(`directory.link_announced`) and a retirement a slice of the ring, whatever the window's
length: no search through the window. Written by hand because no
cache in TorchRec or FBGEMM takes future accesses (theirs evict by LRU or LFU).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from lightning_hotcache.cache import directory
from lightning_hotcache.cache.host_arrays import new_host_array
from lightning_hotcache._ops.sorting import Distinct, unique

NEVER = torch.iinfo(torch.int64).max  # no announced batch reads the row
# The default window, measured (benchmarks/README.md, "hit_rate"): on Criteo-shaped Zipf
# traces at 1% of the rows, 80% of the hit-rate gap between LFU and Belady's optimum closed
# with 256 batches of 256 or 512 samples (128 closed 63-80% and 77%), and with 64 batches of
# 2,048 (32 closed 54-71%): 131,072 samples, but at least 64 batches and at most 256 (the
# loader reads the whole window before the first step).
DEFAULT_WINDOW_SAMPLES = 131_072
DEFAULT_WINDOW_BATCHES = 64
MAX_DEFAULT_WINDOW_BATCHES = 256
# Positions are kept per row in an int32; past this the live ones are moved down (`_make_room`).
MAX_POSITION = 2**31 - 1


def default_lookahead_batches(batch_size: int | None) -> int:
    """Batches the window holds by default for batches of ``batch_size`` samples (unknown:
    `DEFAULT_WINDOW_BATCHES`)."""
    if not batch_size:
        return DEFAULT_WINDOW_BATCHES
    return min(MAX_DEFAULT_WINDOW_BATCHES, max(DEFAULT_WINDOW_BATCHES, -(-DEFAULT_WINDOW_SAMPLES // batch_size)))


@dataclass
class Announced:
    """An announced batch as `unique` found it, and where its distinct ids start in the ring."""

    distinct: Tensor
    inverse: Tensor
    counts: Tensor
    first: int


class LookaheadWindow:
    """The announced batches of a table of ``num_embeddings`` rows cached in ``num_slots`` slots.

    Args:
        num_embeddings: rows of the table.
        num_slots: slots of its cache.
        max_position: positions kept below this (a test makes it small to move them often).
    """

    def __init__(self, num_embeddings: int, num_slots: int, max_position: int = MAX_POSITION) -> None:
        self.max_position = max_position
        self._batches: deque[Announced] = deque()
        self._announced = 0  # announcement number of the next batch announced
        self._start = self._end = 0  # live ring positions
        # Written at random every announcement, as the ring is: kept from forked workers (`host_arrays`).
        self._next_of = new_host_array((1024,), torch.int64, fill=NEVER)  # the ring; its length a power of two
        self._last_at = new_host_array((num_embeddings,), torch.int32, fill=-1)
        self.next_read = new_host_array((num_slots,), torch.int64, fill=NEVER)

    def __len__(self) -> int:
        return len(self._batches)

    def announce(
        self, ids: Tensor, slot_of: Callable[[Tensor], Tensor], found: Distinct | None = None, slot_of_id: Tensor | None = None
    ) -> Tensor:
        """A future batch reads ``ids`` (on the host; ``found``: their `unique`, where the caller
        has it); ``slot_of`` gives the slot of resident ids (-1 elsewhere), or ``slot_of_id``,
        the cache's dense id -> slot map where it has one, read inside the link pass (one
        compiled call where there are three otherwise). Returns the batch's coming misses,
        ascending: its distinct ids that are not resident and that no batch announced before
        it reads (those are coming already)."""
        distinct, inverse, counts = found if found is not None else unique(ids, return_counts=True)
        self._make_room(len(distinct))
        number, first = self._announced, self._end
        # A resident row no batch in the window read: this batch is its next read.
        if slot_of_id is not None:
            coming = directory.link_announced(self._last_at, self._next_of, distinct, self._start, first, number, NEVER, slot_of_id, self.next_read)
        else:
            unlinked = directory.link_announced(self._last_at, self._next_of, distinct, self._start, first, number, NEVER)
            coming = directory.fill_where_resident(self.next_read, slot_of(unlinked), number, unlinked)
        self._batches.append(Announced(distinct, inverse, counts, first))
        self._announced += 1
        self._end += len(distinct)
        return coming

    def retire(self, num_ids: int, table: str) -> tuple[Announced, Tensor]:
        """The oldest announced batch, being acquired with ``num_ids`` ids, out of the window;
        and the next read of each of its distinct ids, which its acquire writes to
        ``next_read`` at their slots (`directory.count_reads`)."""
        oldest = self._batches.popleft()
        if len(oldest.inverse) != num_ids:
            raise RuntimeError(
                f"Table {table!r}: acquire(announced=True) got {num_ids} ids, but the oldest announced batch has "
                f"{len(oldest.inverse)}; acquire announced batches in the order they were announced."
            )
        self._start = oldest.first + len(oldest.distinct)
        return oldest, directory.ring_entries(self._next_of, oldest.first, len(oldest.distinct))

    def emptied(self, slots: Tensor) -> None:
        directory.scatter(self.next_read, slots, NEVER)

    def clear(self) -> None:
        """Forget every announced batch."""
        self._batches.clear()
        self._start = self._end
        self.next_read.fill_(NEVER)

    def _make_room(self, count: int) -> None:
        """Room for ``count`` more entries: a longer ring, and positions moved down to start at
        0 when they would pass ``max_position`` (rare: once in ~2 billion ids announced)."""
        shift = self._start if self._end + count > self.max_position else 0
        needed = self._end - self._start + count
        if needed > self.max_position:
            raise RuntimeError(f"The lookahead window would hold {needed} ids, more than {self.max_position}; shorten it.")
        if shift:
            stale = self._last_at < self._start
            self._last_at.sub_(shift).masked_fill_(stale, -1)
            for batch in self._batches:
                batch.first -= shift
        if shift or needed > len(self._next_of):
            ring = new_host_array((max(len(self._next_of), 1 << (needed - 1).bit_length()),), torch.int64, fill=NEVER)
            live = torch.arange(self._start, self._end)
            ring[(live - shift) & (len(ring) - 1)] = self._next_of[live & (len(self._next_of) - 1)]
            self._next_of = ring
            self._start, self._end = self._start - shift, self._end - shift
