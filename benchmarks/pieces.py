"""Where staging's time goes, piece by piece: wall time summed per piece of the reader's and
the prefetch thread's work, for the benchmarks' reports (`PieceClock` times any methods named
to it: `resume_memory.py` times a checkpoint's load with it).

On a GPU host a 1% cache's step waits for the prefetch thread, whose work is mostly compiled
loops and row copies that torch.profiler does not see (they are not torch ops) and that no
sampling profiler on the GPU machine's image reaches (py-spy is not on it). So the benchmarks
time the pieces themselves: `PieceClock` wraps each method of `STAGING_PIECES` with a clock
while it is entered, and restores them on exit. The pieces nest (``stage`` holds the acquire's pieces,
``begin acquire`` the victims and the eviction), so they do not add up to a total; each is
inclusive. A clock costs ~0.2 us a call, a few calls a batch per cache: nothing next to a
batch's milliseconds.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable

from lightning_hotcache.cache.device import DeviceCache
from lightning_hotcache.embedding.device_staging import DirectoryStaging
from lightning_hotcache.embedding.staging import Staging

# (name, class, method): in the order a batch meets them.
STAGING_PIECES: tuple[tuple[str, type, str], ...] = (
    ("announce", Staging, "announce"),  # the reader thread: ids checked, ordered, deduplicated; the window's books
    ("stage", Staging, "stage"),  # the prefetch thread: all below, and the batch's ids and slots
    ("begin acquire", DeviceCache, "_begin_acquire"),  # hits looked up and locked, victims, eviction
    ("victims", DeviceCache, "_choose_victims"),
    ("evict", DeviceCache, "_evict"),  # evicted rows copied off the device to land later, slots vacated
    ("read rows", DeviceCache, "_read_own"),  # missed rows gathered from the host store and sent up
    ("install", DeviceCache, "_finish_acquire"),  # fetched rows into their slots, the directory's books
    ("land write-backs", DeviceCache, "_land_write_backs"),  # evicted rows written into the host store
    # A cache whose directory is in device memory: the host only checks each batch's ids (on the
    # training loop); the rest is forward's device ops, which torch.profiler sees.
    ("check ids", DirectoryStaging, "_check"),
    # Under lookahead it announces instead: the ids checked, and handed to each window.
    ("announce", DirectoryStaging, "announce"),
)


class PieceClock:
    """While entered, the seconds spent in each of ``pieces`` ((name, class, method); methods of
    one name add up), on any thread, summed since entering: `seconds()`."""

    def __init__(self, pieces: tuple[tuple[str, type, str], ...] = STAGING_PIECES) -> None:
        self.pieces = pieces
        self._seconds = dict.fromkeys((name for name, _, _ in pieces), 0.0)
        self._lock = threading.Lock()  # the reader and the prefetch thread both add
        self._originals: list[tuple[type, str, Callable[..., Any]]] = []

    def seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                with self._lock:
                    self._seconds[name] += elapsed

        return timed

    def __enter__(self) -> "PieceClock":
        for name, owner, attribute in self.pieces:
            method = owner.__dict__[attribute]  # KeyError: the piece was renamed; update its list
            self._originals.append((owner, attribute, method))
            setattr(owner, attribute, self._timed(name, method))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attribute, method in reversed(self._originals):
            setattr(owner, attribute, method)
        self._originals.clear()

    def probe(self) -> dict[str, dict[str, float]]:
        """`seconds` under one key, for a `StepClock` probe (`window_ms_per_batch` takes it out)."""
        return {"pieces": self.seconds()}


def per_batch_ms(before: dict[str, float], after: dict[str, float], batches: int) -> dict[str, float]:
    """Milliseconds a batch in each piece between two `PieceClock.seconds`."""
    return {name: 1e3 * (after[name] - before[name]) / batches for name in after} if batches else {}


def window_ms_per_batch(clock: Any, batches: int) -> dict[str, float] | None:
    """Milliseconds a batch in each piece over a `StepClock`'s window, the probe's `probe`
    entries taken out of its readings (None where it had none)."""
    if "pieces" not in clock.at_end:
        return None
    return per_batch_ms(clock.at_start.pop("pieces"), clock.at_end.pop("pieces"), batches)


def print_pieces(results: dict[str, dict[str, Any]], key: str) -> None:
    """A table of ``results[name][key]`` (`per_batch_ms`), a row per run that staged batches."""
    timed = {name: r[key] for name, r in results.items() if any(r.get(key, {}).values())}
    if not timed:
        return
    names = list(dict.fromkeys(name for name, _, _ in STAGING_PIECES))  # methods of one name are one piece
    print(f"{'ms a batch':<24}" + "".join(f"{name:>18}" for name in names) + "   (inclusive: pieces nest)")
    for run, pieces in timed.items():
        print(f"{run:<24}" + "".join(f"{pieces.get(name, 0.0):>18.2f}" for name in names))
