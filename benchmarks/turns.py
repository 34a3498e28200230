"""Strategies timed in turns: every job of a benchmark alive at once, each its own process,
training in blocks of steps one after another, so that each figure is paired with the
baseline's from the same second rather than the same round.

Rounds of separate runs (`report.rounds_of_jobs`) pair figures minutes apart, and this
machine drifts by more than the margins the targets ask about within minutes (TorchRec ran
54.8k to 73.0k samples/s in four runs of one hour; its rounds 79.8k to 52.9k within one
run). Here the jobs pass a token around a ring of pipes (`Baton`): a job runs only while it
holds the token, set-up and warm-up included, so no job's set-up overlaps another's timed
steps; after its warm-up, and after every ``block`` timed steps, it hands the token on and
waits for it (`clock.TurnClock`). Each job's block ``k`` then ran within one turn of everyone
else's, and `report.add_ratios` pairs them as it pairs rounds (a job's blocks are its
``rounds``): the paired ratio is the median over blocks of the ratio within a turn.

What it costs: every job's tables in memory at once (TorchRec's 6.9 GB and hotcache's 4.8 GB
at the Kaggle tables: three jobs fit in 24 GiB, four do not), and each block starts with
caches the previous job filled with its own rows, which blocks of tens of steps amortize.
A job that fails closes its end of the ring: the next one's wait ends with an error, and so
on around, so no job waits for a token that never comes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence


TOKEN = b"t"


class Baton:
    """This job's place in the ring: it takes the token from ``take_fd`` and hands it on
    through ``give_fd`` (the next job's ``take_fd``)."""

    def __init__(self, take_fd: int, give_fd: int) -> None:
        self.take_fd, self.give_fd = take_fd, give_fd

    @classmethod
    def parse(cls, text: str) -> "Baton":
        """The ``--turns`` argument a launched job gets: ``"<take fd>,<give fd>"``."""
        take_fd, give_fd = (int(fd) for fd in text.split(","))
        return cls(take_fd, give_fd)

    def take(self) -> None:
        if os.read(self.take_fd, 1) != TOKEN:
            raise RuntimeError("the job before this one in the turns ended without handing the turn on (it failed: see its error)")

    def hand_over(self) -> None:
        try:
            os.write(self.give_fd, TOKEN)
        except BrokenPipeError:
            pass  # the next job is done and gone: the last turn of the run


def train_in_turns(baton: Baton, train: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``train`` (a fit timed by a `TurnClock` on ``baton``) in its turns: it starts once
    the turn comes, and after the fit waits for the turn once more before handing it on for
    good, so that no job's teardown (gigabytes of tables freed) runs during another's block."""
    baton.take()
    result = train()
    baton.hand_over()
    baton.take()
    baton.hand_over()
    return result


def jobs_in_turns(script: str | Path, settings: Sequence[str], names: Sequence[str], block: int) -> dict[str, dict[str, Any]]:
    """Run ``script settings --job <name> --turns <fds> --block <block>`` for every job of
    ``names`` at once, taking turns in that order, and return each job's JSON (its last
    line), with its blocks' samples/s as its ``rounds`` (`report.add_ratios` pairs them)."""
    # Imported here, not with the module: every job imports this module for its `Baton` before
    # it takes its first turn, and the report's imports (torch) would delay that turn.
    from report import job_env, job_result

    rings = [os.pipe() for _ in names]
    env = job_env()
    jobs: list[tuple[str, subprocess.Popen[str], Any, Any]] = []
    try:
        for k, name in enumerate(names):
            take_fd, give_fd = rings[k][0], rings[(k + 1) % len(names)][1]
            # Files, not pipes, for the output: a job whose pipe filled would stop while holding the turn.
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            command = [sys.executable, str(script), *settings, "--job", name, "--turns", f"{take_fd},{give_fd}", "--block", str(block)]
            jobs.append((name, subprocess.Popen(command, stdout=out, stderr=err, text=True, pass_fds=(take_fd, give_fd), env=env), out, err))
        os.write(rings[0][1], TOKEN)  # the first job's turn
    finally:
        for take_fd, give_fd in rings:  # only the jobs hold the ring now: one that ends closes its ends
            os.close(take_fd)
            os.close(give_fd)
    results, failed = {}, []
    for name, process, out, err in jobs:
        process.wait()
        out.seek(0)
        err.seek(0)
        if process.returncode != 0:
            failed.append(f"{name} (exit {process.returncode}):\n{err.read()[-3000:]}")
            continue
        results[name] = job_result(name, out.read())
        results[name]["rounds"] = results[name].pop("blocks")
    if failed:
        raise RuntimeError("jobs taking turns failed: " + "\n".join(failed))
    return results
