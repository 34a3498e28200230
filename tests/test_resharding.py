"""A hotcache checkpoint written by N processes resumes on M processes (M != N too), exactly.

Split tables live in round-robin host shards, one per rank; a checkpoint holds them either
gathered into whole tables or as one shard file per rank (``checkpoint_shards``). Loading
hands the N saved shards on as round-robin pieces, from which every one of the M new ranks
copies its own round-robin share and its cached rows, so the resumed run learns what one
process with the same global batch learns (TorchRec's sharded checkpoints cannot change the
world size: torchrec #2534).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import flip_largest_tensor
from launch import Run, planned, train, train_together

from lightning_hotcache.checkpoint.files import consolidated

SPLIT = ["--big-tables", "--device-budget=0.05"]
GLOBAL_BATCH = 256
# One process, the global batch, 6 steps (ddp_train's default), no interruption.
STRAIGHT = planned("test_sharded_checkpoint_resumes_on_another_number_of_processes", 1, GLOBAL_BATCH, "rowwise_adagrad", "auto", "--big-tables")
STRAIGHT_DEFERRED = planned(
    "test_sharded_checkpoint_of_deferred_tables_resumes_on_one_process", 1, GLOBAL_BATCH, "rowwise_adagrad", "auto", "--big-tables", "--defer-tables"
)
# The first 3 steps, saved as shards (launched with the other planned runs; the resumed runs
# are launched by the tests, from these checkpoints).
SAVED_AT_STEP_3 = {
    procs: planned("test_sharded_checkpoint_resumes_on_another_number_of_processes", procs, GLOBAL_BATCH // procs,
                   "rowwise_adagrad", "hotcache", *SPLIT, "--steps=3", "--sharded-checkpoint=step3.ckpt")
    for procs in (1, 2)
}  # fmt: skip
DEFERRED_SAVED_AT_STEP_3 = planned(
    "test_sharded_checkpoint_of_deferred_tables_resumes_on_one_process", 2, GLOBAL_BATCH // 2, "rowwise_adagrad", "hotcache",
    *SPLIT, "--defer-tables", "--steps=3", "--sharded-checkpoint=step3.ckpt",
)  # fmt: skip


@pytest.mark.parametrize(
    ("before", "after"),
    [(2, 1), pytest.param(1, 2, marks=pytest.mark.full), pytest.param(2, 4, marks=pytest.mark.full), pytest.param(2, 2, marks=pytest.mark.full)],
    ids=["2to1", "1to2", "2to4", "2to2"],
)
def test_sharded_checkpoint_resumes_on_another_number_of_processes(tmp_path: Path, trained, before: int, after: int) -> None:
    first = trained(SAVED_AT_STEP_3[before])
    checkpoint = first["dir"] / "step3.ckpt"
    assert len(list(first["dir"].glob(f"step3.ckpt.*.rank*-of-{before}"))) == before  # really saved as shards
    resumed = train(tmp_path, after, GLOBAL_BATCH // after, "rowwise_adagrad", "hotcache", *SPLIT, "--steps=6",
                    f"--resume-ckpt={checkpoint}")  # fmt: skip
    assert first["world_size"] == before and resumed["world_size"] == after
    assert resumed["batches_trained"] == 3  # it went on from step 3
    torch.testing.assert_close(resumed["state_dict"], trained(STRAIGHT)["state_dict"], rtol=1e-5, atol=1e-5)


def test_sharded_checkpoint_of_deferred_tables_resumes_on_one_process(tmp_path: Path, trained) -> None:
    # Tables declared on the meta device (the README's path for tables larger than RAM): the
    # checkpoint is restored into the tiers setup builds, not into meta tables (which dropped it).
    deferred = [*SPLIT, "--defer-tables"]
    straight = trained(STRAIGHT_DEFERRED)
    checkpoint = trained(DEFERRED_SAVED_AT_STEP_3)["dir"] / "step3.ckpt"
    resumed = train(tmp_path, 1, GLOBAL_BATCH, "rowwise_adagrad", "hotcache", *deferred, "--steps=6",
                    f"--resume-ckpt={checkpoint}")  # fmt: skip
    assert resumed["batches_trained"] == 3
    torch.testing.assert_close(resumed["state_dict"], straight["state_dict"], rtol=1e-5, atol=1e-5)


def test_a_damaged_shard_stops_every_resuming_rank_each_naming_it(tmp_path: Path, trained) -> None:
    # Resuming on two ranks, each verifies the checksums of half the shards: rank 0 never
    # checks rank 1's, and the ranks agree before any row is copied, so both stop.
    saved = trained(SAVED_AT_STEP_3[2])["dir"]
    folder = tmp_path / "saved"
    folder.mkdir()
    for file in saved.glob("step3.ckpt*"):
        shutil.copy(file, folder / file.name)
    (damaged,) = folder.glob("step3.ckpt.*.rank1-of-2")
    flip_largest_tensor(damaged)
    main_file = folder / "step3.ckpt"
    consolidated(torch.load(main_file, weights_only=True), main_file, in_pieces=True, checks=lambda shard: shard == 0)  # unchecked
    with pytest.raises(ValueError, match=f"{damaged.name} is corrupt"):
        consolidated(torch.load(main_file, weights_only=True), main_file, in_pieces=True)
    resume = Run(2, (f"--batch-size={GLOBAL_BATCH // 2}", "--optimizer=rowwise_adagrad", "--strategy=hotcache", *SPLIT, "--steps=6",
                     f"--resume-ckpt={main_file}"), "this test", ends_in_an_error=True)  # fmt: skip
    (launch := tmp_path / "launch").mkdir()
    raised = train_together(launch, [resume])[resume]["raised"]
    assert len(raised) == 2, raised
    assert "Rank 1 could not load" in raised[0] and f"{damaged.name} is corrupt" in raised[0], raised[0]
    assert f"{damaged.name} is corrupt" in raised[1], raised[1]
