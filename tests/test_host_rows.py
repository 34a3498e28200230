"""The compiled row copy gives what torch's index_copy_ gives, and refuses what it refuses,
on one thread or split between several."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import pytest
import torch
from forked import from_a_fresh_process, in_forked_child

from lightning_hotcache._ops import host_rows
from lightning_hotcache._ops.host_rows import SPLIT_VALUES, put_rows, release_helpers


@pytest.fixture(autouse=True)
def _no_helpers_left() -> Iterator[None]:
    yield
    release_helpers()  # as a fit's end does: later tests count the threads left


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


def _large_copy(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target, distinct row indices and rows: 3 x `SPLIT_VALUES` values, enough for 3 threads."""
    gen = torch.Generator().manual_seed(seed)
    width = 128
    target = torch.randn(20_000, width, generator=gen)
    at = torch.randperm(20_000, generator=gen)[: 3 * SPLIT_VALUES // width]
    return target, at, torch.randn(len(at), width, generator=gen)


def test_a_large_copy_is_split_between_threads_and_is_index_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_HOTCACHE_COPY_THREADS", "3")
    copied_on: list[tuple[str, int]] = []
    copy_rows = host_rows._copy_rows

    def recorded(target, at, rows):  # type: ignore[no-untyped-def]
        copied_on.append((threading.current_thread().name, len(at)))
        copy_rows(target, at, rows)

    monkeypatch.setattr(host_rows, "_copy_rows", recorded)
    target, at, rows = _large_copy(0)
    expected = target.clone().index_copy_(0, at, rows)
    put_rows(target, at, rows)
    assert torch.equal(target, expected)
    names = [name for name, _ in copied_on]
    helpers = [name for name in names if name.startswith("hotcache-row-copy")]
    assert len(names) == 3 and len(helpers) == 2 and threading.current_thread().name in names, names  # the caller takes a share
    assert sum(n for _, n in copied_on) == len(at)


def test_a_small_copy_stays_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_HOTCACHE_COPY_THREADS", "3")
    monkeypatch.setattr(host_rows, "_copy_split", lambda *args: pytest.fail("split a small copy"))
    target = torch.zeros(100, 8)
    put_rows(target, torch.tensor([5, 9]), torch.ones(2, 8))
    assert target.sum() == 16


def test_a_split_copy_with_an_index_out_of_range_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_HOTCACHE_COPY_THREADS", "3")
    target, at, rows = _large_copy(1)
    at[-1] = 20_000
    before = target.clone()
    with pytest.raises(IndexError, match="Row index 20000 is out of range for a tensor of 20000 rows"):
        put_rows(target, at, rows)
    assert torch.equal(target, before)


def test_threads_by_default_are_the_cores_beyond_two_at_most_eight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTNING_HOTCACHE_COPY_THREADS", raising=False)
    for cores, threads in ((1, 1), (2, 1), (3, 1), (4, 2), (16, 8), (64, 8)):
        monkeypatch.setattr(host_rows, "host_cores", lambda cores=cores: cores)
        assert host_rows.copy_threads() == threads


@pytest.mark.parametrize("setting", ["0", "two", "-3", ""])
def test_a_bad_thread_setting_is_named(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    monkeypatch.setenv("LIGHTNING_HOTCACHE_COPY_THREADS", setting)
    with pytest.raises(ValueError, match=f"LIGHTNING_HOTCACHE_COPY_THREADS={setting!r}: give the number of threads"):
        put_rows(torch.zeros(10, 4), torch.tensor([2]), torch.ones(1, 4))


def _splits_in_child() -> bool:
    # As a DataLoader worker does: torch's own parallel ops hang in a child forked after the
    # parent ran them (GNU OpenMP is not fork-safe); the helpers here are Python threads.
    torch.set_num_threads(1)
    target, at, rows = _large_copy(2)
    expected = target.clone().index_copy_(0, at, rows)
    put_rows(target, at, rows)
    return torch.equal(target, expected)


def fork_with_the_helpers_started(tmp_path: Path) -> str:
    """In a fresh process (`from_a_fresh_process`): the row-copy helpers started, then a fork."""
    target, at, rows = _large_copy(3)
    put_rows(target, at, rows)
    assert _helper_threads()
    return in_forked_child(_splits_in_child, tmp_path)


def test_a_forked_process_copies_on_helper_threads_of_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # Threads do not survive a fork: a child that kept the parent's pool would wait for ever.
    monkeypatch.setenv("LIGHTNING_HOTCACHE_COPY_THREADS", "3")
    answer = from_a_fresh_process("test_host_rows:fork_with_the_helpers_started", tmp_path)
    assert answer == "True", answer


def _helper_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hotcache-row-copy")]


def test_released_helpers_end_and_the_next_split_copy_starts_them_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_HOTCACHE_COPY_THREADS", "3")
    target, at, rows = _large_copy(4)
    put_rows(target, at, rows)
    assert _helper_threads()  # one or two: the pool starts a thread for a chunk only if none is idle
    release_helpers()
    assert not _helper_threads()
    expected = target.clone().index_copy_(0, at, rows + 1)
    put_rows(target, at, rows + 1)
    assert torch.equal(target, expected) and _helper_threads()


def test_helpers_released_from_another_thread_mid_copy_finish_its_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    # A teardown on one thread while another still copies: the copies finish, none is refused.
    monkeypatch.setenv("LIGHTNING_HOTCACHE_COPY_THREADS", "3")
    target, at, rows = _large_copy(5)
    expected = target.clone().index_copy_(0, at, rows)
    done = threading.Event()
    errors: list[BaseException] = []

    def copy_repeatedly() -> None:
        try:
            for _ in range(30):
                put_rows(target, at, rows)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            errors.append(error)
        finally:
            done.set()

    copier = threading.Thread(target=copy_repeatedly)
    copier.start()
    while not done.is_set():
        release_helpers()
    copier.join()
    assert not errors and torch.equal(target, expected)
