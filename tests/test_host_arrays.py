"""Long-lived host arrays: on 2 MiB pages (values never change, and the arrays really get them),
and kept out of forked processes, whose copy-on-write sharing made every write-back fault."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import mappings_at

from lightning_hotcache import RowWiseOptimizerConfig
from lightning_hotcache.cache import DeviceCache, HostStore
from lightning_hotcache.cache.fused import FusedTables
from lightning_hotcache.cache.host_arrays import HUGE_PAGE, move_to_huge_pages, new_array, new_host_array
from lightning_hotcache.cache.lookahead import LookaheadWindow
from lightning_hotcache.cache.slot_map import DenseSlotMap
from torchrec.modules.embedding_configs import PoolingType

ROWS = 3 * HUGE_PAGE // (16 * 4)  # 6 MiB of dim-16 float rows: at least two whole 2 MiB pages inside


def huge_kib_at(tensor: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings that overlap ``tensor``'s memory."""
    return mappings_at(tensor)[0].get("AnonHugePages", 0)


def thp_available() -> bool:
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not enabled.exists() or "[never]" in enabled.read_text():
        return False
    return move_to_huge_pages(torch.ones(ROWS, 16))


needs_thp = pytest.mark.skipif(not thp_available(), reason="no transparent huge pages (or no MADV_COLLAPSE) here")


def test_moving_to_huge_pages_keeps_the_values() -> None:
    values = torch.randn(ROWS, 16)
    expected = values.clone()
    move_to_huge_pages(values)  # whether or not the kernel grants them
    assert torch.equal(values, expected)
    assert not move_to_huge_pages(torch.ones(10, 16)), "no whole 2 MiB page inside: nothing to advise"


@needs_thp
def test_filled_arrays_move_and_new_arrays_start_on_huge_pages() -> None:
    filled = torch.randn(ROWS, 16)
    assert move_to_huge_pages(filled) and huge_kib_at(filled) >= 2048
    fresh = new_host_array((ROWS, 16), fill=None)
    assert not fresh.any()  # reading faults in the kernel's zero pages: no memory yet
    fresh += 1
    assert huge_kib_at(fresh) >= 2048 and torch.all(fresh == 1)


@needs_thp
def test_fbgemm_tables_and_host_stores_use_huge_pages() -> None:
    pytest.importorskip("fbgemm_gpu")
    tables = FusedTables([ROWS], [16], [0], PoolingType.SUM, RowWiseOptimizerConfig("rowwise_adagrad"), torch.device("cpu"))
    assert huge_kib_at(tables.tbe.weights_host) >= 2048
    store = HostStore("t", ROWS, 16, {"momentum": 1})
    assert not store.weight.any()
    store.load("weight", torch.ones(ROWS, 16))
    assert huge_kib_at(store.weight) >= 2048 and torch.all(store.weight == 1)


needs_smaps = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps (not Linux)")


@needs_smaps
def test_forked_processes_do_not_share_new_arrays() -> None:
    """A forked DataLoader worker shares the parent's pages copy-on-write: then the parent's
    first write to each page copies it. New host arrays are not in the child at all."""
    kept = new_host_array((ROWS, 16))
    kept.fill_(1)
    plain = torch.ones(ROWS, 16)  # the control: shared, so the measure below sees sharing
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a worker that reads nothing of the parent's arrays, waiting to be told to end
        os.read(read, 1)
        os._exit(0)
    try:
        kept_fields, kept_flags = mappings_at(kept)
        plain_fields, _ = mappings_at(plain)
        assert plain_fields.get("Shared_Dirty", 0) > 0, "the control array should be shared with the child"
        assert "dc" in kept_flags and kept_fields.get("Shared_Dirty", 0) == 0  # dc: "do not copy on fork"
        kept += 1  # private pages: written in place, no copies
        assert torch.all(kept == 2) and mappings_at(kept)[0].get("Shared_Dirty", 0) == 0
    finally:
        os.write(write, b"x")
        os.waitpid(child, 0)
        os.close(read)
        os.close(write)


@needs_smaps
def test_host_stores_maps_and_cpu_slots_stay_out_of_forked_processes() -> None:
    store = HostStore("t", ROWS, 16, {"momentum": 1})
    dense = DenseSlotMap(HUGE_PAGE, torch.tensor([3, 7]), 10, torch.device("cpu"))  # 8 MiB of int32
    slots = new_array((ROWS, 16), "cpu")
    for array in (store.weight, dense.slot_of_id, slots):
        assert "dc" in mappings_at(array)[1]
    assert dense.slot_of_id[3] == 0 and dense.slot_of_id[7] == 1 and int((dense.slot_of_id == -1).sum()) == HUGE_PAGE - 2
    assert not slots.any() and slots.dtype == torch.float32
    assert "dc" not in mappings_at(new_host_array((8, 16)))[1], "arrays under 2 MiB are plain tensors"
    num_rows = 2 * HUGE_PAGE  # HUGE_PAGE slots: even the bool books fill 2 MiB
    optimizer = RowWiseOptimizerConfig("rowwise_adagrad")
    host = HostStore("t", num_rows, 16, optimizer.state_widths(16))
    cache = DeviceCache("t", num_rows, 16, optimizer, torch.tensor([0]), HUGE_PAGE, "lfu", host, torch.device("cpu"))
    for books in (cache.id_of_slot, cache.dirty, cache.last_used, cache.frequency):
        assert "dc" in mappings_at(books)[1]
    assert cache.id_of_slot[0] == 0 and bool((cache.id_of_slot[1:] == -1).all()) and not cache.dirty.any()
    # The lookahead window's arrays: per row, per slot, and its ring once it outgrows 2 MiB.
    window = LookaheadWindow(num_rows, HUGE_PAGE)
    window.announce(torch.arange(HUGE_PAGE // 2), slot_of=lambda distinct: torch.full_like(distinct, -1))
    for books in (window._last_at, window.next_read, window._next_of):
        assert "dc" in mappings_at(books)[1]


def test_new_arrays_hold_their_fill() -> None:
    for shape, dtype, fill in [((ROWS, 16), torch.float32, 0.5), ((HUGE_PAGE,), torch.int32, -1), ((3, 4), torch.int64, 7)]:
        array = new_host_array(shape, dtype, fill=fill)
        assert array.shape == shape and array.dtype == dtype and bool((array == fill).all())


