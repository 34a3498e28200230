"""Read-ahead of memory-mapped host rows (`lightning_hotcache.cache.read_ahead`): the pages of
the rows asked for reach the page cache, runs of pages are advised once, and under the
lookahead policy an announced batch's coming misses, and only those, are read ahead."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from forked import from_a_fresh_process, in_forked_child

from lightning_hotcache import RowWiseOptimizerConfig
from lightning_hotcache.cache import DeviceCache, HostStore
from lightning_hotcache.cache import read_ahead as read_ahead_module
from lightning_hotcache.cache.host import HostDirectory, map_rows
from lightning_hotcache.cache.read_ahead import read_ahead, read_ahead_later

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and mincore are Linux's")

PAGE = mmap.PAGESIZE
DIM = 16  # 64-byte rows: 64 to a 4 KiB page


def _resident_pages(array: np.ndarray) -> np.ndarray:
    """Whether each page of ``array``'s mapping is in the page cache (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p)
    start = array.ctypes.data
    assert start % PAGE == 0
    flags = np.zeros(-(-array.nbytes // PAGE), dtype=np.uint8)
    assert libc.mincore(start, array.nbytes, flags.ctypes.data) == 0, os.strerror(ctypes.get_errno())
    return flags & 1 == 1


def _cold_rows(path, num_rows: int) -> np.ndarray:
    """A mapped file of ``num_rows`` rows, written, made durable and dropped from the page cache."""
    written = map_rows(path, num_rows, DIM)
    written[:] = 1.0
    written.base.flush()
    del written  # pages mapped into a process stay in the page cache
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    array = map_rows(path, num_rows, DIM)
    if _resident_pages(array).any():
        pytest.skip("this filesystem keeps file pages in memory (tmpfs?): nothing to read ahead")
    return array


def test_the_rows_asked_for_reach_the_page_cache(tmp_path) -> None:
    array = _cold_rows(tmp_path / "t.f32", 64 * 256)  # 256 pages
    rows_per_page = PAGE // (DIM * 4)
    pages = [3, 4, 100, 200]
    ids = torch.tensor(sorted([p * rows_per_page + 5 for p in pages] + [4 * rows_per_page + 6]))
    assert read_ahead_later([torch.from_numpy(array)], ids)  # on the read-ahead thread
    assert _became_resident(array, pages), "the advised pages were not read"
    assert _resident_pages(array).sum() < 64, "a row's advice reads its page (and at most the kernel's read-around), not the file"


def test_rows_on_one_page_are_advised_once(tmp_path) -> None:
    array = map_rows(tmp_path / "t.f32", 64 * 256, DIM)
    rows_per_page = PAGE // (DIM * 4)
    ids = torch.tensor([3 * rows_per_page + 5, 4 * rows_per_page + 5, 4 * rows_per_page + 6, 100 * rows_per_page])
    assert read_ahead(torch.from_numpy(array), ids) == 3  # the two rows on page 4: one run


def test_a_row_across_a_page_boundary_advises_both_pages(tmp_path) -> None:
    array = map_rows(tmp_path / "t.f32", 100, 1000)  # 4,000-byte rows: row 1 spans pages 0 and 1
    assert read_ahead(torch.from_numpy(array), torch.tensor([1, 2])) == 1  # rows 1 and 2 share page 1: one run
    assert read_ahead(torch.from_numpy(array), torch.tensor([1, 5, 9])) == 3
    assert read_ahead(torch.from_numpy(array), torch.tensor([], dtype=torch.int64)) == 0


def test_read_ahead_turned_off_advises_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LIGHTNING_HOTCACHE_READ_AHEAD", "0")
    read_ahead_module._compiled_advise.cache_clear()
    try:
        array = map_rows(tmp_path / "t.f32", 100, DIM)
        assert read_ahead(torch.from_numpy(array), torch.tensor([1, 50])) == 0
        assert not read_ahead_later([torch.from_numpy(array)], torch.tensor([1, 50]))
        host = HostStore("t", 100, DIM, {}, HostDirectory(tmp_path / "rows"))
        cache = DeviceCache("t", 100, DIM, RowWiseOptimizerConfig(name="sgd"), torch.empty(0, dtype=torch.int64), 10, "lookahead", host, torch.device("cpu"))
        cache.read_ahead(cache.announce(torch.tensor([4, 7])))
        assert cache.counters.read_ahead_rows == 0  # counts only rows asked for
    finally:
        read_ahead_module._compiled_advise.cache_clear()


@pytest.mark.parametrize("storage", ["mmap", "memory"])
def test_an_announced_batch_reads_ahead_its_coming_misses(storage: str, tmp_path) -> None:
    # Rows 0-9 static; 20 dynamic slots. Each announcement reads ahead the ids it reads that
    # are neither resident nor read by a batch announced before it (those were read ahead then).
    sgd = RowWiseOptimizerConfig(name="rowwise_adagrad")
    directory = HostDirectory(tmp_path) if storage == "mmap" else None
    host = HostStore("t", 1000, DIM, sgd.state_widths(DIM), directory)
    cache = DeviceCache("t", 1000, DIM, sgd, torch.arange(10), 20, "lookahead", host, torch.device("cpu"), segment_starts=[0, 500, 1000])
    advised: list[list[int]] = []
    host.read_ahead = lambda ids: advised.append(ids.tolist()) or True  # type: ignore[method-assign]

    def announce(ids: list[int]) -> None:
        cache.read_ahead(cache.announce(torch.tensor(ids)))

    announce([3, 700, 40, 40, 41])  # 3 is static
    announce([41, 42, 3, 600])  # 41 is coming already
    cache.release(DeviceCache.acquire_all([cache], [torch.tensor([3, 700, 40, 40, 41])], announced=True)[0].ticket)
    announce([40, 43])  # 40 is resident now
    if storage == "memory":
        assert advised == [] and cache.counters.read_ahead_rows == 0  # rows in RAM are there already
        return
    assert advised == [[40, 41, 700], [42, 600], [43]]
    assert cache.counters.read_ahead_rows == 6
    assert [cache.segment_counters(k).read_ahead_rows for k in (0, 1)] == [4, 2]


def test_across_ranks_a_rank_reads_ahead_only_the_rows_it_owns(tmp_path) -> None:
    # Rank 1 of 2 owns the odd ids, at local rows id // 2; the others' owners read their own.
    from lightning_hotcache.cache.exchange import RowSharding

    sgd = RowWiseOptimizerConfig(name="sgd")
    sharding = RowSharding(rank=1, world=2)
    host = HostStore("t", sharding.num_local(100), DIM, {}, HostDirectory(tmp_path))
    cache = DeviceCache("t", 100, DIM, sgd, torch.empty(0, dtype=torch.int64), 10, "lookahead", host, torch.device("cpu"), sharding)
    advised: list[list[int]] = []
    host.read_ahead = lambda ids: advised.append(ids.tolist()) or True  # type: ignore[method-assign]
    cache.read_ahead(cache.announce(torch.tensor([4, 7, 9, 10])))
    assert advised == [[3, 4]] and cache.counters.read_ahead_rows == 2


class _Blocking:
    """An "array" whose read-ahead waits for ``event``: it keeps the read-ahead thread busy."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def numel(self) -> int:
        self.event.wait()
        return 0


def _reads_ahead_in_child(path: Path) -> bool:
    array = map_rows(path, 64 * 256, DIM)
    assert read_ahead_later([torch.from_numpy(array)], torch.tensor([64 * 10]))
    return _became_resident(array, [10])


def _became_resident(array: np.ndarray, pages: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while not _resident_pages(array)[pages].all() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(_resident_pages(array)[pages].all())


def fork_while_the_thread_is_busy(tmp_path: Path) -> str:
    """In a fresh process (`from_a_fresh_process`): the read-ahead thread kept busy, then a fork."""
    _cold_rows(tmp_path / "t.f32", 64 * 256)
    busy = threading.Event()
    assert read_ahead_later([_Blocking(busy)], torch.tensor([0]))  # type: ignore[list-item]
    try:
        return in_forked_child(lambda: _reads_ahead_in_child(tmp_path / "t.f32"), tmp_path)
    finally:
        busy.set()
        read_ahead_module.settle()


def test_a_forked_process_reads_ahead_on_a_thread_of_its_own(tmp_path) -> None:
    # Threads do not survive a fork: a child that took the parent's busy thread for its own
    # would queue requests that nothing makes.
    answer = from_a_fresh_process("test_read_ahead:fork_while_the_thread_is_busy", tmp_path)
    assert answer == "True", answer


def test_the_thread_ends_when_the_window_is_forgotten(tmp_path) -> None:
    # At the end of a fit (`DeviceCache.clear_window`) no read-ahead thread is left behind.
    busy = threading.Event()
    assert read_ahead_later([_Blocking(busy)], torch.tensor([0]))  # type: ignore[list-item]
    assert read_ahead_later([_Blocking(busy)], torch.tensor([0]))  # type: ignore[list-item]
    assert [t.name for t in threading.enumerate()].count("hotcache-read-ahead") == 1
    threading.Timer(0.2, busy.set).start()
    host = HostStore("t", 100, DIM, {}, HostDirectory(tmp_path))
    DeviceCache("t", 100, DIM, RowWiseOptimizerConfig(name="sgd"), torch.empty(0, dtype=torch.int64), 10, "lookahead", host,
                torch.device("cpu")).clear_window()  # fmt: skip
    assert "hotcache-read-ahead" not in [t.name for t in threading.enumerate()]
