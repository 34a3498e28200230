"""benchmarks/turns.py: jobs alive at once run one at a time, in order, and a failing job ends the run."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.append(str(BENCHMARKS))  # appended: shadows nothing
import cpu_throughput  # noqa: E402
from turns import jobs_in_turns  # noqa: E402

# A job of the ring's protocol without a fit: three turns of 30 ms, each recorded as
# (start, end) on the machine's monotonic clock; "fails" raises in its first turn.
JOB = textwrap.dedent(
    """
    import argparse, json, sys, time
    sys.path.insert(0, {benchmarks!r})
    from turns import Baton, train_in_turns

    parser = argparse.ArgumentParser()
    parser.add_argument("--job"); parser.add_argument("--turns", type=Baton.parse); parser.add_argument("--block", type=int)
    args = parser.parse_args()

    def turns():
        spans = []
        for turn in range(3):
            if turn:
                args.turns.hand_over(); args.turns.take()
            start = time.monotonic()
            if args.job == "fails":
                raise SystemExit("this job fails")
            time.sleep(0.03)
            spans.append((start, time.monotonic()))
        return {{"blocks": [1.0, 2.0, 3.0], "spans": spans}}

    print(json.dumps(train_in_turns(args.turns, turns)))
    """
)


@pytest.fixture
def job(tmp_path: Path) -> Path:
    script = tmp_path / "job.py"
    script.write_text(JOB.format(benchmarks=str(BENCHMARKS)))
    return script


@pytest.mark.timeout(60)
def test_jobs_take_turns_in_order_and_never_at_once(job: Path) -> None:
    results = jobs_in_turns(job, [], ["a", "b", "c"], block=1)
    assert all(r["rounds"] == [1.0, 2.0, 3.0] for r in results.values())  # a job's blocks are its rounds
    turns = sorted((start, end, name) for name, r in results.items() for start, end in r["spans"])
    assert [name for _, _, name in turns] == ["a", "b", "c"] * 3
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(turns, turns[1:]))


@pytest.mark.timeout(60)
def test_a_failing_job_ends_the_run_with_its_error(job: Path) -> None:
    with pytest.raises(RuntimeError, match="this job fails") as failure:
        jobs_in_turns(job, [], ["a", "fails", "c"], block=1)
    # The jobs after it ended too, each told why, rather than waiting for a turn that never came.
    assert "c (exit 1)" in str(failure.value) and "ended without handing the turn on" in str(failure.value)


@pytest.mark.full  # the benchmark end to end; the ring's order and failures are tested above
@pytest.mark.timeout(300)
def test_cpu_throughput_in_turns_pairs_blocks(tmp_path: Path, capsys) -> None:
    out = tmp_path / "turns.json"
    cpu_throughput.main(["--scale", "0.01", "--batch-size", "256", "--steps", "14", "--warmup", "4", "--interleave", "4",
                         "--strategies", "torchrec", "hotcache@0.1", "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["settings"]["interleave"] == 4 and report["settings"]["rounds"] is None
    # 10 timed steps in turns of 4: blocks of 4, 4 and 2 steps, each job's paired with the other's.
    assert [len(r["rounds"]) for r in results.values()] == [3, 3]
    assert results["torchrec"]["x_torchrec_paired"] == 1.0 and results["hotcache@0.1"]["x_torchrec_paired"] > 0
    assert "blocks" in capsys.readouterr().out


def test_interleave_takes_no_rounds() -> None:
    with pytest.raises(SystemExit):
        cpu_throughput.main(["--interleave", "20", "--rounds", "5"])
