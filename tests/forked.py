"""Work run in a forked child, as a DataLoader worker forked from a training process runs:
for the modules that keep threads of their own and must start new ones in a child.

The fork is made by a fresh interpreter, not by pytest's process: after a thousand tests that
process holds threads and library state of its own (OpenMP's pools, W&B's and tqdm's threads),
and a child forked from it once hung a CI run for its whole 90 minutes and once died of a
segmentation fault before its first line of work (the full suite only: never in hundreds of
runs of the test alone). A fresh parent holds only the threads under test.
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

TESTS = Path(__file__).resolve().parent


def from_a_fresh_process(setup: str, tmp_path: Path, seconds: float = 60) -> str:
    """Call ``setup(tmp_path)`` (``"module:function"``, a module of the tests folder) in a fresh
    interpreter, where it makes the parent's state and forks (`in_forked_child`); its answer."""
    module, function = setup.split(":")
    code = (
        f"import json, sys; sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]; from pathlib import Path; "
        f"from {module} import {function}; print(json.dumps({function}(Path({str(tmp_path)!r}))))"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=seconds + 60)
    except subprocess.TimeoutExpired as timed_out:
        return f"the fresh process did not finish in {seconds + 60:.0f} s; its output: {timed_out.stdout} {timed_out.stderr}"
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return f"the fresh process failed (exit {done.returncode}): {done.stdout} {done.stderr}"
    return json.loads(lines[-1])  # one line whatever the answer holds (a child's stacks)


def in_forked_child(work: Callable[[], object], tmp_path: Path, seconds: float = 60) -> str:
    """Run ``work()`` in a forked child; whether it returned something true ("True"/"False"),
    or why there is no answer. A bare fork, a pipe and a deadline rather than a
    `multiprocessing.Pool`: a child that dies or hangs fails the test with its stacks
    (faulthandler) instead of leaving the pool's ``apply`` waiting for ever."""
    stacks = tmp_path / "child_stacks.txt"
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child, which leaves through os._exit
        status = 1
        try:
            os.close(read)
            with open(stacks, "w") as dump:
                faulthandler.enable(dump, all_threads=True)
                faulthandler.dump_traceback_later(seconds - 5, file=dump)
                os.write(write, str(bool(work())).encode())
                status = 0
        finally:
            os._exit(status)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], seconds)
        answer = os.read(read, 16).decode() if ready else ""
    finally:
        os.close(read)
    if not answer:
        os.kill(child, signal.SIGKILL)
    _, status = os.waitpid(child, 0)
    if answer:
        return answer
    dumped = stacks.read_text() if stacks.exists() else ""
    return f"no answer from the child ({'killed' if os.WIFSIGNALED(status) else 'exit'} status {status}); its stacks:\n{dumped}"
