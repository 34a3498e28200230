"""Launch tests/ddp_train.py as a fresh process (which starts its other ranks itself) and load what it saved."""

from __future__ import annotations

import os
import subprocess
import sys
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
