"""Work run in a forked child, as a DataLoader worker forked from a training process runs:
for the modules that keep threads of their own and must start new ones in a child."""

from __future__ import annotations

import faulthandler
import os
import select
import signal
from pathlib import Path
from typing import Callable


def in_forked_child(work: Callable[[], object], tmp_path: Path, seconds: float = 60) -> str:
    """Run ``work()`` in a forked child; whether it returned something true ("True"/"False"),
    or why there is no answer. A bare fork, a pipe and a deadline rather than a
    `multiprocessing.Pool`: a child that dies or hangs fails the test with its stacks
    (faulthandler) instead of leaving the pool's ``apply`` waiting for ever (a CI run once hung
    in such a test for its whole 90 minutes)."""
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
