"""Host arrays on 2 MiB pages: values never change, and the long-lived arrays really get them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_hotcache import RowWiseOptimizerConfig
from lightning_hotcache.cache import HostStore
from lightning_hotcache.cache import huge_pages
from lightning_hotcache.cache.fused import FusedTables
from lightning_hotcache.cache.huge_pages import HUGE_PAGE, move_to_huge_pages, zeros_on_huge_pages
from torchrec.modules.embedding_configs import PoolingType

ROWS = 3 * HUGE_PAGE // (16 * 4)  # 6 MiB of dim-16 float rows: at least two whole 2 MiB pages inside


def huge_kib_at(tensor: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings that overlap ``tensor``'s memory (advising a range
    splits a mapping at its 2 MiB boundaries, so the array spans several)."""
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    huge, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < last and first < end
        elif inside and head == "AnonHugePages:":
            huge += int(line.split()[1])
    return huge


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
    fresh = zeros_on_huge_pages(ROWS, 16)
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


def test_switched_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("LIGHTNING_HOTCACHE_HUGE_PAGES", "0")
    huge_pages._madvise.cache_clear()
    try:
        assert not move_to_huge_pages(torch.randn(ROWS, 16))
    finally:
        monkeypatch.undo()
        huge_pages._madvise.cache_clear()
