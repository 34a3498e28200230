"""Two CPU processes (gloo DDP) learn what one process learns with twice the batch.

DDP averages gradients over ranks, so with a mean loss 2 ranks x batch B == 1 rank x batch
2B, for the dense layers and (sparse gradients, averaged the same way) the embedding rows.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import SCRIPT, launch_env, planned

from lightning_hotcache.checkpoint.files import SHARDS_KEY, consolidate_checkpoint, shard_path

# The runs these tests compare, launched together (tests/launch.py): `two`/`alone`/`many` of a test.
OPTIMIZERS = ["rowwise_adagrad", "adam"]
DOUBLE_BATCH = {
    optimizer: (planned("test_two_processes_match_one_with_double_batch", 2, 128, optimizer),
                planned("test_two_processes_match_one_with_double_batch", 1, 256, optimizer, "auto"))
    for optimizer in OPTIMIZERS
}  # fmt: skip


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_processes_match_one_with_double_batch(trained, optimizer: str) -> None:
    two, one = (trained(run) for run in DOUBLE_BATCH[optimizer])
    assert two["world_size"] == 2
    # Float tolerance only: the all-reduce averages two half-batch means, the single process
    # takes one mean over the whole batch; Adam's normalization magnifies that rounding for
    # near-zero gradients, hence atol 1e-5 on weights of order 0.1.
    torch.testing.assert_close(two["state_dict"], one["state_dict"], rtol=1e-5, atol=1e-5)


TORCHREC_DOUBLE_BATCH = (
    planned("test_torchrec_two_processes_match_one_with_double_batch", 2, 128, "rowwise_adagrad", "torchrec"),
    planned("test_torchrec_two_processes_match_one_with_double_batch", 1, 256, "rowwise_adagrad", "auto"),
)


def test_torchrec_two_processes_match_one_with_double_batch(trained) -> None:
    """TorchRec shards tables across the 2 ranks (table-wise) and averages like DDP."""
    two, one = (trained(run) for run in TORCHREC_DOUBLE_BATCH)
    assert two["world_size"] == 2
    torch.testing.assert_close(two["state_dict"], one["state_dict"], rtol=1e-5, atol=1e-5)


MANUAL = tuple(
    planned("test_manual_optimization_on_two_processes_matches_one_with_double_batch", procs, 256 // procs, "rowwise_adagrad",
            "ddp" if procs > 1 else "auto", "--manual-optimization")
    for procs in (2, 1)
)  # fmt: skip


def test_manual_optimization_on_two_processes_matches_one_with_double_batch(trained) -> None:
    two, one = (trained(run) for run in MANUAL)
    torch.testing.assert_close(two["state_dict"], one["state_dict"], rtol=1e-5, atol=1e-5)


TORCHREC_MANUAL = planned("test_torchrec_refuses_manual_optimization_on_two_processes", 2, 128, "rowwise_adagrad", "torchrec",
                          "--manual-optimization", ends_in_an_error=True)  # fmt: skip


def test_torchrec_refuses_manual_optimization_on_two_processes(trained) -> None:
    # Issue 29 item 17: the ranks' dense gradients were not averaged (the DDP inside TorchRec's
    # DistributedModelParallel is out of Lightning's manual-optimization hooks).
    raised = trained(TORCHREC_MANUAL)["raised"]
    assert len(raised) == 2, raised  # every rank refuses
    for traceback in raised:
        assert "torchrec strategy does not run manual optimization with several processes" in traceback


SEEDED_APART = {
    strategy: (planned("test_ranks_seeded_apart_start_from_rank_zeros_weights", 2, 128, "rowwise_adagrad", strategy, "--seed-per-rank"),
               planned("test_ranks_seeded_apart_start_from_rank_zeros_weights", 1, 256, "rowwise_adagrad", "auto"))
    for strategy in ["torchrec", "hotcache", "ddp"]
}  # fmt: skip


@pytest.mark.parametrize("strategy", list(SEEDED_APART))
def test_ranks_seeded_apart_start_from_rank_zeros_weights(trained, strategy: str) -> None:
    # Lightning's DDP contract: every rank trains rank 0's model, however each rank was seeded.
    # TorchRec's DMP copied each rank's own pre-wrap state back in, dense layers included.
    two, one = (trained(run) for run in SEEDED_APART[strategy])
    torch.testing.assert_close(two["state_dict"], one["state_dict"], rtol=1e-5, atol=1e-5)


HOTCACHE_CASES = {  # id: (processes, optimizer, staging thread / lookahead, kernel[, staging threads])
    "2-sgd": (2, "sgd", False, "fbgemm"),
    # Each width's split tables in two caches, staged side by side, on their owners' keys.
    "2-rowwise_adagrad-lookahead-2threads": (2, "rowwise_adagrad", "lookahead", "pytorch", 2),
    "2-rowwise_adagrad-prefetch_thread": (2, "rowwise_adagrad", True, "fbgemm"),
    "2-rowwise_adagrad-lookahead": (2, "rowwise_adagrad", "lookahead", "fbgemm"),
    "2-rowwise_adagrad-pytorch": (2, "rowwise_adagrad", False, "pytorch"),
    "2-adam": (2, "adam", False, "pytorch"),  # no fused Adam (see fused_unavailable)
    "4-sgd": (4, "sgd", False, "fbgemm"),
    "4-adam": (4, "adam", False, "pytorch"),
}  # 4 x row-wise Adagrad: the torchrun test


def _hotcache_runs(procs: int, optimizer: str, thread: bool | str, kernel: str, staging_threads: int = 1) -> tuple:
    split = ["--big-tables", "--device-budget=0.05", *(["--prefetch-thread"] if thread else []), f"--staging-threads={staging_threads}"]
    if thread == "lookahead":
        split.append("--cache-policy=lookahead")
    test = "test_hotcache_processes_match_one_with_their_batches_together"
    many = planned(test, procs, 256 // procs, optimizer, "hotcache", *split, f"--kernel={kernel}", "--sharded-checkpoint=sharded.ckpt")
    return many, planned(test, 1, 256, optimizer, "auto", "--big-tables")  # the cache's options mean nothing to auto


HOTCACHE_RUNS = {case: _hotcache_runs(*settings) for case, settings in HOTCACHE_CASES.items()}


# Four processes only under `make test-all`: two cover every path the exchange takes.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.full) if c.startswith("4-") else c for c in HOTCACHE_CASES])
def test_hotcache_processes_match_one_with_their_batches_together(trained, case: str) -> None:
    """Host stores sharded across the ranks, each row updated by its owner from every rank's
    gradient, other ranks' rows fetched in the forward that reads them (with staging on a
    background thread, too, and on it under the lookahead policy), on FBGEMM's kernel and on
    PyTorch's: the same tables as 1 process with all the ranks' batches."""
    procs, optimizer, _, kernel, *staging_threads = HOTCACHE_CASES[case]
    many, one = (trained(run) for run in HOTCACHE_RUNS[case])
    sharded = many["dir"] / "sharded.ckpt"
    assert many["world_size"] == procs
    assert [note.split()[0] for note in many["kernels"]] == [kernel], many["kernels"]
    if staging_threads:
        assert all("staged side by side by 2 threads" in note for note in many["kernels"]), many["kernels"]
    assert many["fetched_rows"] > 0  # the caches really fetched rows from the ranks' stores
    # rank 0 holds every procs-th row of each of the 26 split tables, rounded up
    assert many["host_rows"] * procs - many["table_rows"] in range(0, 26 * (procs - 1) + 1)
    # Each rank wrote its shard; consolidating them gives the gathered tables.
    consolidated = consolidate_checkpoint(sharded)
    save_id = torch.load(sharded, weights_only=True)[SHARDS_KEY]["id"]  # drawn by rank 0, used by every rank
    assert set(many["dir"].glob("sharded.ckpt.*")) == {shard_path(sharded, save_id, rank, procs) for rank in range(procs)}
    torch.testing.assert_close(consolidated["state_dict"], many["state_dict"])
    # Float tolerance only (see above): with 4 ranks Adam's normalization of near-zero
    # gradients moves single weights by up to ~1e-5 (one of 437k weights in this test).
    atol = 3e-5 if optimizer == "adam" and procs > 2 else 1e-5
    torch.testing.assert_close(many["state_dict"], one["state_dict"], rtol=1e-5, atol=atol)


NAN_AT_STEP_2 = {
    strategy: planned("test_nan_loss_on_one_rank_stops_every_rank", 2, 128, "rowwise_adagrad", strategy, "--big-tables",
                      "--device-budget=0.05", "--nan-at-step=2", ends_in_an_error=True)
    for strategy in ["hotcache", "ddp"]
}  # fmt: skip


@pytest.mark.parametrize("strategy", list(NAN_AT_STEP_2))
def test_nan_loss_on_one_rank_stops_every_rank(trained, strategy: str) -> None:
    # Without agreeing across ranks, the rank with the NaN would stop and the others would
    # wait forever for it in backward's collectives.
    run = trained(NAN_AT_STEP_2[strategy])
    assert not run["raised"], run["raised"][0]  # the error is the check's, which it writes
    assert len(run["wrote"]) == 2
    for wrote in run["wrote"]:  # both ranks name the rank whose loss went NaN (the last), not their own loss
        assert "not finite on rank 1 (nan) at global step 2 " in wrote


ONE_RANK_REFUSES = planned(
    "test_a_refusal_on_one_rank_stops_every_rank_with_its_message", 2, 128, "rowwise_adagrad", "hotcache", "--big-tables",
    "--device-budget=0.05", "--link-last-ranks-storage", ends_in_an_error=True,
)  # fmt: skip


def test_a_refusal_on_one_rank_stops_every_rank_with_its_message(trained) -> None:
    # Issue 69 item 7: rank 1 refused its host_storage folder (a symlink) and rank 0 ended in
    # gloo's "Connection closed by peer".
    run = trained(ONE_RANK_REFUSES)
    assert not run["raised"], run["raised"][0]  # each rank's error is what it writes
    assert len(run["wrote"]) == 2
    for wrote in run["wrote"]:
        assert "rank1 is a symlink" in wrote, wrote
    assert "Rank 1 could not plan its tables, so no rank goes on" in run["wrote"][0], run["wrote"][0]


UNEVEN_PREDICT = {
    # No stats needed for hotcache: nothing to profile in predict.
    strategy: planned("test_predict_with_uneven_user_batches_fails_on_every_rank_at_once", 2, 64, "rowwise_adagrad", strategy,
                      *(["--device-budget=1.0"] if strategy == "hotcache" else []), "--predict-batches=5", ends_in_an_error=True)
    for strategy in ["hotcache", "torchrec"]
}  # fmt: skip


@pytest.mark.parametrize("strategy", list(UNEVEN_PREDICT))
def test_predict_with_uneven_user_batches_fails_on_every_rank_at_once(trained, strategy: str) -> None:
    # Issue 29 item 6: Lightning gives rank 0 three batches and rank 1 two; the forward's
    # collectives then waited forever on rank 0's third batch.
    run = trained(UNEVEN_PREDICT[strategy])
    assert not run["raised"], run["raised"][0]
    assert len(run["wrote"]) == 2
    for wrote in run["wrote"]:
        assert "different numbers of batches (rank 0: 3, rank 1: 2)" in wrote


TORCHRUN_ALONE = planned("test_hotcache_on_two_nodes_of_two_processes_under_torchrun", 1, 256, "rowwise_adagrad", "auto", "--big-tables")


@pytest.mark.full  # torchrun's launch; Lightning's own launcher runs the two-process cases by default
def test_hotcache_on_two_nodes_of_two_processes_under_torchrun(tmp_path: Path, trained) -> None:
    """Multi-node as a cluster runs it: one torchrun per "node" (here both on this machine),
    Lightning's num_nodes; 2 nodes x 2 processes x batch 64 learn what 1 process x 256 learns."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "nodes.pt"
    env = launch_env()
    split = ["--big-tables", "--device-budget=0.05"]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
             "--master-addr=127.0.0.1", f"--master-port={port}", str(SCRIPT), "--devices=2", "--num-nodes=2",
             "--batch-size=64", "--optimizer=rowwise_adagrad", "--strategy=hotcache", *split, f"--out={out}"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), logs[0][-3000:] + logs[1][-3000:]
    four = torch.load(out)
    one = trained(TORCHRUN_ALONE)
    assert four["world_size"] == 4
    assert four["fetched_rows"] > 0
    torch.testing.assert_close(four["state_dict"], one["state_dict"], rtol=1e-5, atol=1e-5)


UNEVEN_CASES = {  # id: (strategy, training samples, shuffled)
    "ddp-last-batch-64": ("ddp", 2624, False),
    "hotcache-last-batch-64-shuffled": ("hotcache", 2624, True),
    "torchrec-last-batch-64": ("torchrec", 2624, False),
    "hotcache-last-batch-1": ("hotcache", 2561, False),
    "ddp-last-batch-1-shuffled": ("ddp", 2561, True),
}


def _one_epoch(train_samples: int) -> int:
    """Steps of one epoch of global batches of 256, ending in the uneven one."""
    return -(-train_samples // 256)


def _uneven_runs(strategy: str, train_samples: int, shuffle: bool) -> tuple:
    data = [f"--train-samples={train_samples}", f"--steps={_one_epoch(train_samples)}", "--val-samples=1100",
            *(["--shuffle"] if shuffle else []), "--big-tables"]  # fmt: skip
    test = "test_uneven_epoch_end_and_validation_match_one_process"
    return planned(test, 2, 128, "rowwise_adagrad", strategy, *data, "--device-budget=0.05"), planned(test, 1, 256, "rowwise_adagrad", "auto", *data)


UNEVEN_RUNS = {case: _uneven_runs(*settings) for case, settings in UNEVEN_CASES.items()}


@pytest.mark.parametrize("case", list(UNEVEN_CASES))
def test_uneven_epoch_end_and_validation_match_one_process(trained, case: str) -> None:
    """An epoch that does not divide into global batches of 2 x 128: its last, smaller global
    batch is split across the ranks with no sample repeated, each rank's loss weighted so
    the average is the global batch's mean; a last batch of 1 sample leaves rank 1 only
    padding, which it still runs (DDP's and hotcache's collectives) with weight 0. The
    validation split (1,100 samples: 4 global batches and one of 76) gives the metrics of
    one process: before global batches, rank 1 was given a repeated batch of 128 there."""
    steps = _one_epoch(UNEVEN_CASES[case][1])
    two, one = (trained(run) for run in UNEVEN_RUNS[case])
    assert two["world_size"] == 2 and two["batches_trained"] == one["batches_trained"] == steps
    torch.testing.assert_close(two["state_dict"], one["state_dict"], rtol=1e-5, atol=1e-5)
    assert set(two["val"]) >= {"val/auc", "val/logloss"}
    # AUC: a rank statistic, within a few of the ~3e5 positive-negative pairs.
    assert two["val"]["val/auc"] == pytest.approx(one["val"]["val/auc"], abs=2e-5)
    assert two["val"]["val/logloss"] == pytest.approx(one["val"]["val/logloss"], rel=1e-5)
    # The Bayes-optimal figures, scored by every rank on the whole split, come through the sync as they are.
    assert two["val"]["val/bayes_auc"] == one["val"]["val/bayes_auc"]
    # Issue 29 item 9: the last (uneven) step's logged loss was rank 0's N/n-weighted share.
    assert two["last_train_loss"] == pytest.approx(one["last_train_loss"], rel=1e-5)
