"""benchmarks/cpu_throughput.py: one job of it trains the tables of the ``--scale`` it is given."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from datamodules import SyntheticCTRDataModule

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # appended: shadows nothing
import cpu_throughput  # noqa: E402


def test_a_job_trains_the_tables_of_its_scale(capsys) -> None:
    cpu_throughput.main(["--job", "hotcache@0.1", "--scale", "0.01", "--steps", "8", "--warmup", "2", "--batch-size", "256"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = sum(t.num_embeddings for t in SyntheticCTRDataModule(scale=0.01).tables)
    # A tenth of those tables' bytes: each row's 16 floats and its row-wise Adagrad state (one float).
    assert result["budget_mib"] * 2**20 == pytest.approx(0.1 * rows * (16 + 1) * 4, abs=1)
    assert 0 < result["hit_rate"] < 1 and result["fetched_rows_per_step"] > 0 and result["samples_per_s"] > 0
    # Eight steps cannot fill a tenth of the tables' cache: said, not passed off as a steady state.
    assert result["caches_filling"] and result["written_back_rows_per_step"] == 0


def test_pieces_are_timed_when_asked(capsys) -> None:
    cpu_throughput.main(["--job", "hotcache@0.1", "--scale", "0.01", "--steps", "8", "--warmup", "2", "--batch-size", "256", "--pieces"])
    pieces = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["pieces_ms_per_batch"]
    assert 0 < pieces["begin acquire"] <= pieces["stage"] and pieces["announce"] > 0
    cpu_throughput.main(["--job", "hotcache@0.1", "--scale", "0.01", "--steps", "4", "--warmup", "2", "--batch-size", "256"])
    assert "pieces_ms_per_batch" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("name", "thread", "depth"),
    [("hotcache@0.1", None, None), ("hotcache@0.1+inline", False, None), ("hotcache@0.1+thread", True, 1),
     ("hotcache@0.01+lookahead+thread+depth3", True, 3), ("hotcache@1+thread", True, 1)],
)  # fmt: skip
def test_a_name_makes_the_strategy_it_says(name, thread, depth) -> None:
    # None: the strategy's own choice (`staging_choice`), made at setup from the tables' size
    strategy = cpu_throughput.strategy_makers()[name]()
    assert (strategy.prefetch_thread, strategy.prefetch_depth_setting) == (thread, depth)
    assert strategy.cache_policy == ("lookahead" if "+lookahead" in name else "lfu")
