"""Launch tests/ddp_train.py as a fresh process (which starts its other ranks itself) and load what it saved.

The runs the multi-process tests compare are planned when their modules load (`planned`) and
launched together, all runs of one number of processes in one launch, by the first test that
asks for one of them (conftest's ``trained``): each launch spends ~10 s importing before rank 0
starts the other ranks, which import again, where a run of these tiny models trains in ~2 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

SCRIPT = Path(__file__).with_name("ddp_train.py")
REPO = SCRIPT.parents[1]


def launch_env() -> dict[str, str]:
    """This process's environment for a fresh launch of ``SCRIPT``."""
    # In-process tests of DDP-based strategies leave their rendezvous variables (and a live
    # store on MASTER_PORT) behind; a fresh launch must pick its own.
    stale = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "PL_GLOBAL_SEED"}
    env = {k: v for k, v in os.environ.items() if k not in stale}
    # A rank that dies in native code says where (its Python stack) before the others time out.
    # The repository first, and whatever the caller had after it (the GPU check's wheel folder).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.update(PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    return env


def assert_exited_cleanly(result: subprocess.CompletedProcess) -> None:
    """Exit code 0, or the first error lines of any rank (the tail is usually another rank's
    'connection reset' once one has died) and the tail."""
    errors = [line for line in result.stderr.splitlines() if "Fatal Python error" in line or "Error:" in line]
    assert result.returncode == 0, f"exit code {result.returncode}; first errors: {errors[:5]}\n{result.stderr[-4000:]}"


def train(tmp_path: Path, devices: int, batch_size: int, optimizer: str, strategy: str = "ddp", *extra: str) -> dict:
    """Train with ``devices`` processes under ``strategy`` (one process runs ``auto``, unless
    ``strategy`` is ``hotcache``: see ddp_train.py); what rank 0 saved."""
    out = tmp_path / f"{strategy}{devices}_{optimizer}.pt"
    cmd = [sys.executable, str(SCRIPT), f"--devices={devices}", f"--batch-size={batch_size}",
           f"--optimizer={optimizer}", f"--strategy={strategy}", f"--out={out}", *extra]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert_exited_cleanly(result)
    return torch.load(out)


@dataclass(frozen=True)
class Run:
    """A training run of ``SCRIPT`` with ``devices`` processes and ``options`` (paths in them
    relative: each run has a directory of its own), planned for the test ``used_by``."""

    devices: int
    options: tuple[str, ...]
    used_by: str = field(compare=False)
    # The run's every rank stops with an error, which its test checks: one it writes to
    # ``<OUT>.rank<r>`` (a check that the ranks agree to stop) or one it raises; it saves
    # nothing else, and runs after its launch's other runs.
    ends_in_an_error: bool = field(default=False, compare=False)


PLANNED: list[Run] = []
OUT = "out.pt"  # what rank 0 of a run saves (`ddp_train.py --out`); ``OUT.rank<r>``: the error rank r wrote


def planned(
    used_by: str, devices: int, batch_size: int, optimizer: str, strategy: str = "ddp", *extra: str, ends_in_an_error: bool = False
) -> Run:
    """A run the test function ``used_by`` compares (see `train`'s arguments), launched with
    the other planned runs of ``devices`` processes when a test first asks for one of them."""
    options = (f"--batch-size={batch_size}", f"--optimizer={optimizer}", f"--strategy={strategy}", *extra)
    run = Run(devices, options, used_by, ends_in_an_error)
    PLANNED.append(run)
    return run


def train_together(directory: Path, runs: list[Run]) -> dict[Run, dict | str]:
    """Launch ``SCRIPT`` once for ``runs`` (of one number of processes): for each, what rank 0
    saved (and ``"dir"``, the run's directory), or the traceback of the error it raised; for a
    run that ends in an error, its directory, ``"raised"`` (each rank's traceback, if any) and
    ``"wrote"`` (the error each rank wrote, if any)."""
    (devices,) = {run.devices for run in runs}
    # Runs that end in an error last: should a regression leave one rank waiting in a collective
    # the others left, it would hang the launch, but only after the other runs have saved.
    runs = sorted(runs, key=lambda run: run.ends_in_an_error)
    plan = {}
    for k, run in enumerate(runs):
        (directory / f"run{k}").mkdir()
        plan[f"run{k}"] = {"dir": str(directory / f"run{k}"), "argv": [f"--devices={devices}", *run.options, f"--out={OUT}"]}
    (directory / "plan.json").write_text(json.dumps(plan, indent=1))
    cmd = [sys.executable, str(SCRIPT), "--runs", str(directory / "plan.json")]
    result = subprocess.run(cmd, cwd=directory, env=launch_env(), capture_output=True, text=True, timeout=300 + 30 * len(runs))
    assert_exited_cleanly(result)
    out: dict[Run, dict | str] = {}
    for k, run in enumerate(runs):
        run_dir = directory / f"run{k}"
        errors = sorted(run_dir.glob("error.rank*"))
        if run.ends_in_an_error:
            wrote = sorted(run_dir.glob(f"{OUT}.rank*"))
            out[run] = {"dir": run_dir, "raised": [error.read_text() for error in errors], "wrote": [w.read_text() for w in wrote]}
        else:
            out[run] = errors[0].read_text() if errors else torch.load(run_dir / OUT) | {"dir": run_dir}
    return out
