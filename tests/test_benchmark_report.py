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

    def job(script, settings, name):
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
