"""Staging threads at background priority (`lightning_hotcache._ops.background`): the thread that
asks is lowered, the training thread is not, and threads it starts inherit the priority."""

from __future__ import annotations

import os
import threading

import pytest

from lightning_hotcache._ops.background import BACKGROUND_NICE, background_priority_supported, run_at_background_priority

pytestmark = pytest.mark.skipif(not background_priority_supported(), reason="per-thread priority is Linux's")


def priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_only_the_calling_thread_and_those_it_starts_are_lowered() -> None:
    before = priority()
    seen: dict[str, int] = {}

    def child() -> None:
        seen["child"] = priority()

    def staging() -> None:
        run_at_background_priority()
        seen["staging"] = priority()
        started = threading.Thread(target=child)
        started.start()
        started.join()

    thread = threading.Thread(target=staging)
    thread.start()
    thread.join()
    assert seen == {"staging": BACKGROUND_NICE, "child": BACKGROUND_NICE}
    assert priority() == before


def test_a_refused_priority_change_warns_and_staging_goes_on(monkeypatch) -> None:
    def refused(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refused)
    before = priority()
    with pytest.warns(UserWarning, match=r"Could not lower the staging thread's priority .*Operation not permitted.*; it runs at the training step's"):
        run_at_background_priority()
    assert priority() == before


def test_processes_forked_from_a_lowered_thread_inherit_it() -> None:
    # What a DataLoader's workers get when the loader's iterator is made on the staging thread.
    import multiprocessing

    seen: dict[str, int] = {}

    def staging() -> None:
        run_at_background_priority()
        with multiprocessing.get_context("fork").Pool(1) as pool:
            seen["worker"] = pool.apply(os.getpriority, (os.PRIO_PROCESS, 0))

    thread = threading.Thread(target=staging)
    thread.start()
    thread.join()
    assert seen == {"worker": BACKGROUND_NICE}
