"""A hotcache checkpoint written by N processes resumes on M != N processes, exactly.

Split tables live in round-robin host shards, one per rank; a checkpoint holds them either
gathered into whole tables or as one shard file per rank (``checkpoint_shards``). Loading
interleaves the N saved shards back into whole tables and every one of the M new ranks keeps
its own round-robin share, so the resumed run learns what one process with the same global
batch learns (TorchRec's sharded checkpoints cannot change the world size: torchrec #2534).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import train

SPLIT = ["--big-tables", "--device-budget=0.05"]
GLOBAL_BATCH = 256


@pytest.fixture
def straight(trained_alone) -> dict:
    """One process, the global batch, 6 steps (ddp_train's default), no interruption."""
    return trained_alone(GLOBAL_BATCH, "rowwise_adagrad", "--big-tables")


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 4)], ids=["2to1", "1to2", "2to4"])
def test_sharded_checkpoint_resumes_on_another_number_of_processes(tmp_path: Path, straight: dict, before: int, after: int) -> None:
    checkpoint = tmp_path / "step3.ckpt"
    first = train(tmp_path, before, GLOBAL_BATCH // before, "rowwise_adagrad", "hotcache", *SPLIT, "--steps=3",
                  f"--sharded-checkpoint={checkpoint}")  # fmt: skip
    assert len(list(tmp_path.glob(f"step3.ckpt.*.rank*-of-{before}"))) == before  # really saved as shards
    resumed = train(tmp_path, after, GLOBAL_BATCH // after, "rowwise_adagrad", "hotcache", *SPLIT, "--steps=6",
                    f"--resume-ckpt={checkpoint}")  # fmt: skip
    assert first["world_size"] == before and resumed["world_size"] == after
    assert resumed["batches_trained"] == 3  # it went on from step 3
    torch.testing.assert_close(resumed["state_dict"], straight["state_dict"], rtol=1e-5, atol=1e-5)


def test_sharded_checkpoint_of_deferred_tables_resumes_on_one_process(tmp_path: Path, trained_alone) -> None:
    # Tables declared on the meta device (the README's path for tables larger than RAM): the
    # checkpoint is restored into the tiers setup builds, not into meta tables (which dropped it).
    deferred = [*SPLIT, "--defer-tables"]
    straight = trained_alone(GLOBAL_BATCH, "rowwise_adagrad", "--big-tables", "--defer-tables")
    checkpoint = tmp_path / "step3.ckpt"
    train(tmp_path, 2, GLOBAL_BATCH // 2, "rowwise_adagrad", "hotcache", *deferred, "--steps=3",
          f"--sharded-checkpoint={checkpoint}")  # fmt: skip
    resumed = train(tmp_path, 1, GLOBAL_BATCH, "rowwise_adagrad", "hotcache", *deferred, "--steps=6",
                    f"--resume-ckpt={checkpoint}")  # fmt: skip
    assert resumed["batches_trained"] == 3
    torch.testing.assert_close(resumed["state_dict"], straight["state_dict"], rtol=1e-5, atol=1e-5)
