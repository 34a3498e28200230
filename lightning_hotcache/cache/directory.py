"""The cache directory's per-batch steps, each one compiled call that holds no GIL.

The directory's steps are many small ones over a batch's distinct ids (hits and misses,
installs, evictions and the order of their write-backs, tallies, the reserve, the id -> slot
maps, the lookahead window's books). As torch ops they would be over a hundred calls a batch,
and on a GPU host each call hands the GIL over to a training loop running Python and waits to
take it back (see `lightning_hotcache._ops.compiled`), so their hand-overs, not their work,
would set staging's time. Here each step is a loop compiled with ``without_gil``: called
once, and one pass over the ids where torch's ops would make one each, which is faster even
on a thread of its own (benchmarks/README.md).
They read and write numpy views of the directory's host tensors, so the directory stays torch
tensors everywhere else; the rows themselves (device slots, host store, pinned buffers) still
move with torch, a few large calls a batch. Written by hand: TorchRec and FBGEMM keep their
cache directories in CUDA kernels of their own (FBGEMM's UVM cache), with no host-side
equivalent.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lightning_hotcache._ops.compiled import without_gil

_EMPTY = np.empty(0, dtype=np.int64)  # an argument left out (no counts: once each; no window)
# No dense id -> slot map to keep in the same call (a cache with another kind keeps its own).
_NO_MAP = np.empty(0, dtype=np.int32)
_LOCKED = np.iinfo(np.int64).max  # the score of a slot no scan may choose


def _view(tensor: Tensor) -> np.ndarray:
    return tensor.numpy()  # host tensors only: the directory lives on the host


# A tally of ids per segment, where the caller keeps one (see `tally`): (counts, segment ends).
Tally = tuple[Tensor, Tensor]


def _tally_views(tally: Tally | None) -> tuple[np.ndarray, np.ndarray]:
    return (_EMPTY, _EMPTY) if tally is None else (_view(tally[0]), _view(tally[1]))


def _hit_tally_views(lookups: Tally | None, misses: Tally | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The views `split_hits` tallies into: both tallies or neither (one without the other
    would leave the hit counters silently off)."""
    if (lookups is None) != (misses is None):
        raise ValueError("split_hits tallies both lookups and misses, or neither")
    (lookups_at, ends), (missed_at, _) = _tally_views(lookups), _tally_views(misses)
    return lookups_at, missed_at, ends


def _map_view(slot_of_id: Tensor | None) -> np.ndarray:
    return _NO_MAP if slot_of_id is None else _view(slot_of_id)


def _optional_view(tensor: Tensor | None) -> np.ndarray:
    return _EMPTY if tensor is None else _view(tensor)


@without_gil
def _split_hits(distinct, slots, counts, last_used, holders, issued, lookups, misses, ends):  # type: ignore[no-untyped-def]
    missing = np.empty(len(slots), np.int64)
    needed = np.empty(len(slots), np.int64)
    missed_reads = np.empty(len(slots), np.int64)
    n = total = 0
    for i in range(len(slots)):
        slot = slots[i]
        if slot < 0:
            missing[n], needed[n], missed_reads[n] = i, distinct[i], counts[i]
            total += counts[i]
            n += 1
        else:
            last_used[slot] = issued
            holders[slot] += 1
    if len(ends):
        _tally_ascending(lookups, ends, distinct, counts)
        _tally_ascending(misses, ends, needed[:n], missed_reads[:n])
    return missing[:n], needed[:n], missed_reads[:n], total


def split_hits(
    distinct: Tensor, slots: Tensor, counts: Tensor, last_used: Tensor, holders: Tensor, issued: int,
    lookups: Tally | None = None, misses: Tally | None = None,
) -> tuple[Tensor, Tensor, Tensor, int]:  # fmt: skip
    """Lock the hits among ``distinct`` ids (ascending; ``slots``: each one's slot, -1 for a
    miss; ``counts``: its reads): one more holder each, last used by ticket ``issued``; the
    misses' positions, ids and reads, and their reads in all. ``lookups`` / ``misses``, where
    given, tally the reads and the missed reads in the same call (one GIL hand-over, not three)."""
    lookups_at, missed_at, ends = _hit_tally_views(lookups, misses)
    missing, needed, missed_reads, total = _split_hits(
        _view(distinct), _view(slots), _view(counts), _view(last_used), _view(holders), issued, lookups_at, missed_at, ends
    )
    return torch.from_numpy(missing), torch.from_numpy(needed), torch.from_numpy(missed_reads), int(total)


@without_gil
def _look_up_and_split_hits(slot_of_id, distinct, counts, last_used, holders, issued, lookups, misses, ends):  # type: ignore[no-untyped-def]
    slots = _slots_of(slot_of_id, distinct)
    return (slots, *_split_hits(distinct, slots, counts, last_used, holders, issued, lookups, misses, ends))


def look_up_and_split_hits(
    slot_of_id: Tensor, distinct: Tensor, counts: Tensor, last_used: Tensor, holders: Tensor, issued: int,
    lookups: Tally | None = None, misses: Tally | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:  # fmt: skip
    """`slots_of` in a dense id -> slot map, then `split_hits`, in one call: the ``distinct``
    ids' slots (-1 for a miss), then what `split_hits` returns."""
    lookups_at, missed_at, ends = _hit_tally_views(lookups, misses)
    slots, missing, needed, missed_reads, total = _look_up_and_split_hits(
        _view(slot_of_id), _view(distinct), _view(counts), _view(last_used), _view(holders), issued, lookups_at, missed_at, ends
    )
    return torch.from_numpy(slots), torch.from_numpy(missing), torch.from_numpy(needed), torch.from_numpy(missed_reads), int(total)


@without_gil
def _install(slots, missing, victims, needed, id_of_slot, frequency, last_used, holders, ticket, reads, fetched, ends, slot_of_id, next_read, next_reads):  # type: ignore[no-untyped-def]
    for k in range(len(victims)):
        victim = victims[k]
        id_of_slot[victim] = needed[k]
        frequency[victim] = 0
        last_used[victim] = ticket
        holders[victim] += 1
        slots[missing[k]] = victim
        if len(slot_of_id):
            slot_of_id[needed[k]] = victim
    if len(reads) or len(next_reads):
        _count_reads(frequency, slots, reads, next_read, next_reads)
    if len(ends):
        _tally_ascending(fetched, ends, needed, _EMPTY)


def install(
    slots: Tensor,
    missing: Tensor,
    victims: Tensor,
    needed: Tensor,
    id_of_slot: Tensor,
    frequency: Tensor,
    last_used: Tensor,
    holders: Tensor,
    ticket: int,
    reads: Tensor | None = None,
    fetched: Tally | None = None,
    slot_of_id: Tensor | None = None,
    next_read: Tensor | None = None,
    next_reads: Tensor | None = None,
) -> None:
    """The ``needed`` ids (ascending) fetched into ``victims``: named there, uses reset, locked
    (one holder each, last used by ``ticket``), and each one's slot written at its position (``missing``) in ``slots``.
    In the same call, where given: every slot's ``reads`` and ``next_reads`` noted
    (`count_reads`, after the reset), the fetched ids tallied, and their slots put in the
    dense id -> slot map."""
    fetched_at, ends = _tally_views(fetched)
    _install(
        _view(slots), _view(missing), _view(victims), _view(needed), _view(id_of_slot), _view(frequency), _view(last_used), _view(holders), ticket,
        _optional_view(reads), fetched_at, ends, _map_view(slot_of_id), _optional_view(next_read), _optional_view(next_reads),
    )  # fmt: skip


@without_gil
def _count_reads(frequency, slots, counts, next_read, next_reads):  # type: ignore[no-untyped-def]
    for i in range(len(slots)):
        if len(counts):
            frequency[slots[i]] += counts[i]
        if len(next_reads):
            next_read[slots[i]] = next_reads[i]


def count_reads(frequency: Tensor, slots: Tensor, counts: Tensor | None, next_read: Tensor | None = None, next_reads: Tensor | None = None) -> None:
    """Add each slot's reads (``counts``, where given) to its use count (``slots`` distinct),
    and, under the lookahead policy, set each one's ``next_read`` to ``next_reads``: the two
    per-slot notes of a batch in one pass."""
    _count_reads(_view(frequency), _view(slots), _optional_view(counts), _optional_view(next_read), _optional_view(next_reads))


@without_gil
def _slots_at_least(slots, values, least):  # type: ignore[no-untyped-def]
    out = np.empty(len(slots), np.int64)
    n = 0
    for slot in slots:
        if values[slot] >= least:
            out[n] = slot
            n += 1
    return out[:n]


def occupied(slots: Tensor, id_of_slot: Tensor) -> Tensor:
    """The ``slots`` that hold a row (an id, not -1)."""
    return torch.from_numpy(_slots_at_least(_view(slots), _view(id_of_slot), 0))


# Digits of `_sort_by_key`'s radix sort: 2,048 buckets, three passes for ids below 2**33.
_RADIX_BITS = 11


@without_gil
def _sort_by_key(keys, values):  # type: ignore[no-untyped-def]
    # An LSD radix sort of the keys' span, stable: inside a compiled loop np.argsort is
    # numba's own quicksort, several times slower than this (numpy's C sort cannot be called
    # from here).
    n = len(keys)
    if n == 0:
        return keys.copy(), values.copy()
    lo = keys.min()
    span = keys.max() - lo
    keys, values = keys - lo, values.copy()
    keys_out, values_out = np.empty_like(keys), np.empty_like(values)
    mask = (1 << _RADIX_BITS) - 1
    shift = 0
    while (span >> shift) > 0:
        starts = np.zeros(mask + 2, np.int64)
        for i in range(n):
            starts[((keys[i] >> shift) & mask) + 1] += 1
        for digit in range(1, mask + 2):
            starts[digit] += starts[digit - 1]
        for i in range(n):
            digit = (keys[i] >> shift) & mask
            at = starts[digit]
            keys_out[at], values_out[at] = keys[i], values[i]
            starts[digit] = at + 1
        keys, keys_out, values, values_out = keys_out, keys, values_out, values
        shift += _RADIX_BITS
    return keys + lo, values


def sort_by_key(keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """``keys`` ascending and ``values`` in the same order, equal keys in their order (int64)."""
    keys, values = _sort_by_key(_view(keys), _view(values))
    return torch.from_numpy(keys), torch.from_numpy(values)


@without_gil
def _dirty_by_id(slots, dirty, id_of_slot, written_back, ends):  # type: ignore[no-untyped-def]
    changed = _slots_at_least(slots, dirty, True)
    ids = np.empty(len(changed), np.int64)
    for k in range(len(changed)):
        ids[k] = id_of_slot[changed[k]]
    ids, changed = _sort_by_key(ids, changed)
    if len(ends):
        _tally_ascending(written_back, ends, ids, _EMPTY)
    return ids, changed


def dirty_by_id(slots: Tensor, dirty: Tensor, id_of_slot: Tensor, written_back: Tally | None = None) -> tuple[Tensor, Tensor]:
    """The ``slots`` whose rows changed since they came in, as the ids they hold (ascending)
    and those ids' slots: a write-back's rows, in the host store's order (tallied in
    ``written_back``, where given). The marks stay until the write-back clears them, so a
    write that fails loses no update."""
    ids, changed = _dirty_by_id(_view(slots), _view(dirty), _view(id_of_slot), *_tally_views(written_back))
    return torch.from_numpy(ids), torch.from_numpy(changed)


@without_gil
def _vacate(slots, id_of_slot, evicted, ends, slot_of_id):  # type: ignore[no-untyped-def]
    ids = np.empty(len(slots), np.int64)
    for k in range(len(slots)):
        ids[k] = id_of_slot[slots[k]]
        id_of_slot[slots[k]] = -1
        if len(slot_of_id):
            slot_of_id[ids[k]] = -1
    if len(ends):
        _tally_any(evicted, ends, ids, _EMPTY)
    return ids


def vacate(slots: Tensor, id_of_slot: Tensor, evicted: Tally | None = None, slot_of_id: Tensor | None = None) -> Tensor:
    """Empty ``slots``; the ids they held (tallied in ``evicted``, and dropped from the dense id
    -> slot map, where given)."""
    return torch.from_numpy(_vacate(_view(slots), _view(id_of_slot), *_tally_views(evicted), _map_view(slot_of_id)))


@without_gil
def _let_go(holders, slots):  # type: ignore[no-untyped-def]
    for slot in slots:
        if slot >= 0:
            holders[slot] -= 1


def let_go(holders: Tensor, slots: Tensor) -> None:
    """A batch in flight is done with ``slots`` (distinct; -1, a miss never installed, is
    skipped): one holder fewer each."""
    _let_go(_view(holders), _view(slots))


@without_gil
def _unread(reserve, last_used, ticket, next_read, never):  # type: ignore[no-untyped-def]
    out = np.empty(len(reserve), np.int64)
    n = 0
    for slot in reserve:
        if last_used[slot] < ticket and (len(next_read) == 0 or next_read[slot] == never):
            out[n] = slot
            n += 1
    return out[:n]


def unread(reserve: Tensor, last_used: Tensor, ticket: int, next_read: Tensor | None, never: int) -> Tensor:
    """The ``reserve``'s slots not read since ticket ``ticket`` was issued and (``next_read``
    given: the lookahead window's next read of each slot) read by no announced batch, in order."""
    return torch.from_numpy(_unread(_view(reserve), _view(last_used), ticket, _optional_view(next_read), never))


@without_gil
def _score(slot, last_used, frequency, id_of_slot, issued, lfu):  # type: ignore[no-untyped-def]
    if id_of_slot[slot] < 0:
        return -1  # empty: first
    # LFU ranks by reads, then by last use (tickets are at most `issued`): one exact integer key.
    return frequency[slot] * (issued + 1) + last_used[slot] if lfu else last_used[slot]


@without_gil
def _eviction_scores(last_used, holders, frequency, id_of_slot, start, issued, lfu):  # type: ignore[no-untyped-def]
    scores = np.empty(len(last_used) - start, np.int64)
    free = 0
    for slot in range(start, len(last_used)):
        if holders[slot] > 0:
            scores[slot - start] = _LOCKED  # a batch in flight reads it
        else:
            scores[slot - start] = _score(slot, last_used, frequency, id_of_slot, issued, lfu)
            free += 1
    return scores, free


def eviction_scores(
    last_used: Tensor, holders: Tensor, frequency: Tensor, id_of_slot: Tensor, start: int, issued: int, lfu: bool
) -> tuple[Tensor, int]:
    """The eviction score of every slot from ``start`` on (lowest goes first; see `scores_of`),
    int64's largest for a slot locked by a batch in flight (``holders`` above 0), and how many
    are not locked. One pass, where torch's ops took nine over the dynamic slots (a scan every
    few batches)."""
    scores, free = _eviction_scores(_view(last_used), _view(holders), _view(frequency), _view(id_of_slot), start, issued, lfu)
    return torch.from_numpy(scores), int(free)


@without_gil
def _scores_of(slots, last_used, frequency, id_of_slot, issued, lfu):  # type: ignore[no-untyped-def]
    scores = np.empty(len(slots), np.int64)
    for i in range(len(slots)):
        scores[i] = _score(slots[i], last_used, frequency, id_of_slot, issued, lfu)
    return scores


def scores_of(slots: Tensor, last_used: Tensor, frequency: Tensor, id_of_slot: Tensor, issued: int, lfu: bool) -> Tensor:
    """The eviction score of each of ``slots`` (lowest goes first): empty slots -1, then, with
    ``lfu``, the reads with ties by last use (tickets are at most ``issued``), else the last use."""
    return torch.from_numpy(_scores_of(_view(slots), _view(last_used), _view(frequency), _view(id_of_slot), issued, lfu))


@without_gil
def _window_victims(holders, next_read, frequency, start, count, uses_cap, never):  # type: ignore[no-untyped-def]
    spare = np.empty(len(next_read) - start, np.int64)
    awaited = np.empty(len(next_read) - start, np.int64)
    n_spare = n_awaited = 0
    for slot in range(start, len(next_read)):
        if holders[slot] > 0:
            continue  # locked: a batch in flight reads it
        if next_read[slot] == never:
            spare[n_spare] = slot
            n_spare += 1
        else:
            awaited[n_awaited] = slot
            n_awaited += 1
    free = n_spare + n_awaited
    if n_spare >= count:
        return spare[:n_spare], awaited[:0], free
    need = min(count - n_spare, n_awaited)
    if need == 0:
        return spare[:n_spare], spare[:n_spare].copy(), free
    awaited = awaited[:n_awaited]
    # The farthest next reads first. They are announcement numbers of the batches in the
    # window, a range as long as the window: counted by value rather than sorted.
    lo = hi = next_read[awaited[0]]
    for slot in awaited:
        lo, hi = min(lo, next_read[slot]), max(hi, next_read[slot])
    per_read = np.zeros(hi - lo + 1, np.int64)
    for slot in awaited:
        per_read[next_read[slot] - lo] += 1
    taken = 0
    cut = hi - lo  # the nearest next read taken: all of the farther ones, some of this one
    while taken + per_read[cut] < need:
        taken += per_read[cut]
        cut -= 1
    place = np.empty(hi - lo + 1, np.int64)  # where each farther next read's slots go in the answer
    at = 0
    for read in range(hi - lo, cut, -1):
        place[read] = at
        at += per_read[read]
    chosen = np.empty(need, np.int64)
    ties = np.empty(per_read[cut], np.int64)
    n_ties = 0
    for slot in awaited:
        read = next_read[slot] - lo
        if read > cut:
            chosen[place[read]] = slot
            place[read] += 1
        elif read == cut:
            ties[n_ties] = slot
            n_ties += 1
    # Among the nearest next read taken, the fewest reads since the row came in first.
    uses = np.empty(n_ties, np.int64)
    for i in range(n_ties):
        uses[i] = min(frequency[ties[i]], uses_cap)
    ties = _sort_by_key(uses, ties)[1]
    for i in range(need - taken):
        chosen[taken + i] = ties[i]
    victims = np.empty(n_spare + need, np.int64)  # the spare ones, then these: one array, no concatenation call
    victims[:n_spare] = spare[:n_spare]
    victims[n_spare:] = chosen
    return spare[:n_spare], victims, free


def window_victims(
    holders: Tensor, next_read: Tensor, frequency: Tensor, start: int, count: int, uses_cap: int, never: int
) -> tuple[Tensor, Tensor, int]:
    """Lookahead's candidates among slots ``start`` on that no batch in flight holds
    (``holders`` 0): those that no announced batch reads
    (``next_read`` is ``never``), in slot order; where they are fewer than ``count``, the
    victims: those, then the rest from the slots read farthest ahead, of those read next by
    one batch the fewest reads (``frequency``, capped at ``uses_cap``) first (else empty); and
    how many slots are unlocked in all."""
    spare, victims, free = _window_victims(_view(holders), _view(next_read), _view(frequency), start, count, uses_cap, never)
    return torch.from_numpy(spare), torch.from_numpy(victims), int(free)


@without_gil
def _tally_ascending(tally, ends, ids, counts):  # type: ignore[no-untyped-def]
    segment = 0
    for i in range(len(ids)):
        while ids[i] >= ends[segment]:  # the last end is past every id
            segment += 1
        tally[segment] += counts[i] if len(counts) else 1


@without_gil
def _tally_any(tally, ends, ids, counts):  # type: ignore[no-untyped-def]
    for i in range(len(ids)):
        tally[np.searchsorted(ends, ids[i], side="right")] += counts[i] if len(counts) else 1


def tally(into: Tensor, ends: Tensor, ids: Tensor, counts: Tensor | None, ascending: bool) -> None:
    """Add ``ids`` (each ``counts`` times, default once) to ``into``, a count per segment of
    ids, the segments ending (exclusive) at ``ends``; ``ascending`` ids are walked, not searched."""
    add = _tally_ascending if ascending else _tally_any
    add(_view(into), _view(ends), _view(ids), _optional_view(counts))


@without_gil
def _match_sorted(held, ids):  # type: ignore[no-untyped-def]
    at = np.empty(min(len(held), len(ids)), np.int64)
    source = np.empty(min(len(held), len(ids)), np.int64)
    n, j = 0, 0
    for i in range(len(ids)):
        while j < len(held) and held[j] < ids[i]:
            j += 1
        if j == len(held):
            break
        if held[j] == ids[i]:
            at[n], source[n] = i, j
            n += 1
    return at[:n], source[:n]


def match_sorted(held: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Where the distinct ascending ``ids`` are among the distinct ascending ``held``: the
    positions in ``ids`` and in ``held`` of each id in both (one merge walk)."""
    at, source = _match_sorted(_view(held), _view(ids))
    return torch.from_numpy(at), torch.from_numpy(source)


@without_gil
def _ring_entries(ring, first, count):  # type: ignore[no-untyped-def]
    mask = len(ring) - 1
    out = np.empty(count, np.int64)
    for i in range(count):
        out[i] = ring[(first + i) & mask]
    return out


def ring_entries(ring: Tensor, first: int, count: int) -> Tensor:
    """A copy of the lookahead window's ring (its length a power of two) at positions ``[first,
    first + count)``, wrapping around its end: one call, not a slice or two and a concatenation."""
    return torch.from_numpy(_ring_entries(_view(ring), first, count))


@without_gil
def _link_announced(last_at, ring, distinct, start, first, number, never, slot_of_id, next_read):  # type: ignore[no-untyped-def]
    mask = len(ring) - 1
    unlinked = np.empty(len(distinct), np.int64)
    n = 0
    for i in range(len(distinct)):
        row = distinct[i]
        latest = last_at[row]
        if latest >= start:  # read by a batch in the window: this batch is that read's next
            ring[latest & mask] = number
        else:
            slot = slot_of_id[row] if len(slot_of_id) else -1
            if slot >= 0:  # resident, and no batch in the window reads it: this one is its next read
                next_read[slot] = number
            else:
                unlinked[n] = row
                n += 1
        ring[(first + i) & mask] = never  # the ring never wraps onto the live entries linked above
        last_at[row] = first + i
    return unlinked[:n]


def link_announced(
    last_at: Tensor, ring: Tensor, distinct: Tensor, start: int, first: int, number: int, never: int,
    slot_of_id: Tensor | None = None, next_read: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Announcement ``number``'s ``distinct`` ids into the lookahead window's books (see
    `LookaheadWindow`): each id's latest read in the window (``last_at`` its ring position,
    live from ``start``) linked to it, its own entries at ring positions ``first`` on, read
    by nothing yet; the ids no batch in the window read. Given the cache's dense id -> slot
    map (``slot_of_id``), those of them that are resident are looked up in the same pass and
    their slots' ``next_read`` set to ``number`` (what `fill_where_resident` does after a
    look-up elsewhere), and only the others are returned: the batch's coming misses."""
    if (slot_of_id is None) != (next_read is None):
        raise ValueError("link_announced looks resident rows up in slot_of_id to set their next_read: give both or neither")
    return torch.from_numpy(
        _link_announced(_view(last_at), _view(ring), _view(distinct), start, first, number, never, _map_view(slot_of_id), _optional_view(next_read))
    )


@without_gil
def _fill_where_resident(target, slots, value, ids):  # type: ignore[no-untyped-def]
    absent = np.empty(len(slots), np.int64)
    n = 0
    for i in range(len(slots)):
        if slots[i] >= 0:
            target[slots[i]] = value
        else:
            absent[n] = ids[i]
            n += 1
    return absent[:n]


def fill_where_resident(target: Tensor, slots: Tensor, value: int, ids: Tensor) -> Tensor:
    """``target[slots[slots >= 0]] = value``; the ``ids`` (whose slots ``slots`` are) not resident."""
    return torch.from_numpy(_fill_where_resident(_view(target), _view(slots), value, _view(ids)))


@without_gil
def _slots_of(slot_of_id, ids):  # type: ignore[no-untyped-def]
    out = np.empty(len(ids), np.int64)
    for i in range(len(ids)):
        out[i] = slot_of_id[ids[i]]
    return out


def slots_of(slot_of_id: Tensor, ids: Tensor) -> Tensor:
    """``slot_of_id[ids]`` as int64."""
    return torch.from_numpy(_slots_of(_view(slot_of_id), _view(ids)))


@without_gil
def _scatter(target, at, values):  # type: ignore[no-untyped-def]
    for i in range(len(at)):
        target[at[i]] = values[i]


@without_gil
def _fill_at(target, at, value):  # type: ignore[no-untyped-def]
    for i in range(len(at)):
        target[at[i]] = value


def scatter(target: Tensor, at: Tensor, values: Tensor | int) -> None:
    """``target[at] = values``: a tensor as long as ``at`` (cast to ``target``'s type), or one
    value for all."""
    if isinstance(values, int):
        _fill_at(_view(target), _view(at), values)
    else:
        _scatter(_view(target), _view(at), _view(values))
