"""benchmarks/beyond_ram.py: a job under the lookahead policy trains from memory-mapped host
files and reports the rows it read ahead of their batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # appended: shadows nothing
import beyond_ram  # noqa: E402


def test_a_lookahead_job_reads_its_misses_ahead(tmp_path, capsys) -> None:
    # A cache of 0.02% of RAM (~5 MB) holds a fraction of the scale-0.01 tables, so batches miss.
    beyond_ram.main(["--job", "hotcache_lookahead", "--scale", "0.01", "--dim", "16", "--batch-size", "256", "--steps", "8",
                     "--warmup", "2", "--profile-batches", "4", "--cache-fraction", "0.0002", "--dir", str(tmp_path)])  # fmt: skip
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["fetched_rows_per_step"] > 0 and result["read_ahead_rows_per_step"] > 0 and result["samples_per_s"] > 0
    assert not (tmp_path / "hotcache_lookahead").exists()  # its files deleted after the run
