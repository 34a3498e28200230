"""The compiled row copy gives what torch's index_copy_ gives, and refuses what it refuses."""

from __future__ import annotations

import pytest
import torch

from lightning_hotcache import host_rows
from lightning_hotcache.host_rows import put_rows


@pytest.mark.parametrize("width", [1, 3, 128])
def test_put_rows_is_index_copy(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    target = torch.randn(1000, width, generator=gen)
    at = torch.randperm(1000, generator=gen)[:300]
    rows = torch.randn(300, width, generator=gen)
    expected = target.clone().index_copy_(0, at, rows)
    version = target._version
    put_rows(target, at, rows)
    assert torch.equal(target, expected)
    assert target._version > version  # autograd sees the change, as after index_copy_


def test_put_rows_into_a_strided_view_leaves_the_rest_alone() -> None:
    base = torch.zeros(50, 8)
    view = base[:, 2:6]  # rows of 4 values, 8 apart
    at = torch.tensor([3, 40, 7])
    put_rows(view, at, torch.ones(3, 4))
    assert base.sum() == 12 and torch.equal(base[[3, 40, 7], 2:6], torch.ones(3, 4))


def test_an_index_out_of_range_writes_nothing() -> None:
    target = torch.zeros(10, 4)
    with pytest.raises(IndexError, match="Row index 10 is out of range for a tensor of 10 rows"):
        put_rows(target, torch.tensor([2, 10]), torch.ones(2, 4))
    with pytest.raises(IndexError, match="Row index -1"):
        put_rows(target, torch.tensor([-1]), torch.ones(1, 4))
    assert target.sum() == 0


def test_what_it_does_not_compile_goes_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def compiled(*args: object) -> int:
        raise AssertionError("went to the compiled loop")

    monkeypatch.setattr(host_rows, "_put_rows", compiled)
    target = torch.zeros(10)  # 1-D
    put_rows(target, torch.tensor([1]), torch.ones(1))
    assert target[1] == 1
    column = torch.zeros(10, 1)  # rows of one value: torch's column scatter is the faster
    put_rows(column, torch.tensor([4, 2]), torch.ones(2, 1))
    assert column.sum() == 2 and column[4, 0] == column[2, 0] == 1
    with pytest.raises(AssertionError, match="compiled loop"):  # and rows of two are compiled
        put_rows(torch.zeros(10, 2), torch.tensor([4]), torch.ones(1, 2))
    with pytest.raises(RuntimeError):  # torch's own error for mismatched dtypes
        put_rows(torch.zeros(10, 4, dtype=torch.float64), torch.tensor([2]), torch.ones(1, 4))
