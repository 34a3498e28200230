"""benchmarks/report.py: rounds of jobs run in a rotating order, and ratios read within a round."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # appended: shadows nothing
import report  # noqa: E402


def test_rounds_rotate_the_order_and_ratios_pair_within_rounds(monkeypatch) -> None:
    order: list[str] = []
    # A machine that runs 10% slower in odd rounds, and "fast" 1.25x "base" in every round.
    speed = {"base": 100.0, "fast": 125.0, "other": 90.0}

    def job(script, settings, name, wrapper=()):
        order.append(name)
        round_index = (len(order) - 1) // len(speed)
        return {"samples_per_s": speed[name] * (0.9 if round_index % 2 else 1.0)}

    monkeypatch.setattr(report, "job_in_process", job)
    results = report.rounds_of_jobs("script.py", [], ["base", "fast", "other"], rounds=4)
    assert order == ["base", "fast", "other", "fast", "other", "base", "other", "base", "fast", "base", "fast", "other"]
    assert results["fast"]["rounds"] == pytest.approx([125.0, 112.5, 125.0, 112.5])
    report.add_ratios(results, ["base"])
    assert results["fast"]["x_base_paired"] == pytest.approx(1.25)
    assert results["other"]["x_base_paired"] == pytest.approx(0.9)
    assert results["base"]["x_base_paired"] == pytest.approx(1.0)


def test_partial_reports_come_after_each_first_round_job_then_each_round_and_pair(monkeypatch) -> None:
    # gpu.py writes a partial report from each: its ratios pair rounds, so every job it gets must
    # have as many rounds as the others.
    monkeypatch.setattr(report, "job_in_process", lambda script, settings, name, wrapper=(): {"samples_per_s": 100.0})
    seen: list[dict[str, int]] = []

    def partial(done):
        report.add_ratios(done, ["base"])
        seen.append({name: len(r["rounds"]) for name, r in done.items()})

    report.rounds_of_jobs("script.py", [], ["base", "fast"], rounds=3, after_each=partial)
    assert seen == [{"base": 1}, {"base": 1, "fast": 1}, {"base": 2, "fast": 2}, {"base": 3, "fast": 3}]


def test_scaling_jobs_run_behind_a_shaped_loopback_of_their_own() -> None:
    """scaling.py --link-gbit X: a job of N processes shares one tbf qdisc of N x X Gbit/s on
    the loopback of a network namespace of its own."""
    import shutil
    import subprocess

    import scaling

    wrapper = scaling.namespace_wrapper(2, 1.0)
    if not wrapper:
        pytest.skip("no unshare/ip here")
    if shutil.which("tc") is None:
        pytest.skip("no tc here")
    shown = subprocess.run([*wrapper, "tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    if shown.returncode != 0 and "unshare" in shown.stderr:
        pytest.skip(f"no user namespaces here: {shown.stderr.strip()}")
    assert shown.returncode == 0, shown.stderr
    assert "tbf" in shown.stdout and "rate 2Gbit" in shown.stdout, shown.stdout
    unshaped = subprocess.run([*scaling.namespace_wrapper(2, None), "tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    assert "tbf" not in unshaped.stdout


def test_reports_record_output_paths_relative_to_the_repository(tmp_path, capsys) -> None:
    # Issue 29: committed results named the machine's folders (settings.out was absolute).
    import argparse

    inside = report.REPO / "benchmarks" / "results" / "x.json"
    args = argparse.Namespace(out=tmp_path / "r.json", baseline=inside)
    written = report.write_report("t", args, {}, echo=False)
    assert written["settings"]["baseline"] == "benchmarks/results/x.json"
    assert written["settings"]["out"] == str(tmp_path / "r.json")  # outside the repository: as given


def test_slot_map_benchmark_turns_every_map_over_alike() -> None:
    # The benchmark checks as it goes that each map finds the drawn hits and, after the
    # turnover, every resident id at its slot; a small run goes through those checks.
    import slot_map

    results = slot_map.measure(rows=50_000, slots=600, ids=300, hit=0.5, fetched=40, repeats=3)
    assert {"dense", "hashed"} <= set(results)
    assert all(figures["lookup_ms"] > 0 and figures["turnover_ms"] > 0 for figures in results.values())
