"""benchmarks/resume_memory.py: a sharded checkpoint of memory-mapped tables resumed piece by
piece and whole, each in a process of its own, restoring the same rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # appended: shadows nothing
import pytest  # noqa: E402
import resume_memory  # noqa: E402


@pytest.mark.full  # the benchmark's own run; test_resharding resumes sharded checkpoints by default
def test_both_loads_restore_the_same_rows_and_report_their_memory(tmp_path) -> None:
    out = tmp_path / "resume_memory.json"
    resume_memory.main(["--scale", "0.01", "--dim", "16", "--batch-size", "256", "--dir", str(tmp_path / "scratch"), "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["pieces", "whole"]
    assert all(r["global_step"] == 2 and r["peak_anon_gib"] > 0 and r["load_s"] > 0 for r in results.values())
    assert results["pieces"]["tables_crc32"] == results["whole"]["tables_crc32"]
    assert not (tmp_path / "scratch").exists()  # tables and checkpoint deleted after the run
