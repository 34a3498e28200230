"""benchmarks/quality.py on a tiny setting: shipped configs in, a sane report out."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # appended: shadows nothing
import quality  # noqa: E402

TINY = ["data.init_args.num_embeddings_cap=200", "data.init_args.num_train_samples=2048",
        "data.init_args.num_val_samples=2048", "data.init_args.num_test_samples=2048"]  # fmt: skip


def test_quality_report_from_shipped_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    # Only dlrm's synthetic config here: deepfm (no config) is skipped with a note, not an error.
    configs = tmp_path / "configs"
    configs.mkdir()
    shutil.copy(quality.config_path("dlrm", "synthetic"), configs)
    monkeypatch.setattr(quality, "CONFIGS", configs)
    writes = []  # (partial?, models with results): a stopped run must keep what it measured

    def spy(name, args, results, echo=True, **settings):
        writes.append((settings.get("partial", False), sorted(results)))
        return write_report(name, args, results, echo, **settings)

    write_report = quality.write_report
    monkeypatch.setattr(quality, "write_report", spy)
    out = tmp_path / "quality.json"
    quality.main(["--models", "dlrm", "deepfm", "--seeds", "0", "--datasets", "synthetic", "--max-epochs", "1",
                  "--set", *TINY, "--out", str(out)])  # fmt: skip

    assert writes == [(True, ["dlrm"]), (False, ["deepfm", "dlrm"])]  # after dlrm, then the final report
    report = json.loads(out.read_text())
    assert report["benchmark"] == "quality" and {"commit", "torch"} <= set(report["machine"])
    assert report["settings"]["seeds"] == [0] and report["settings"]["set"] == TINY
    assert report["results"]["deepfm"] == {"synthetic": {"skipped": "no configs/deepfm_synthetic.yaml"}}
    summary = report["results"]["dlrm"]["synthetic"]
    assert summary["config"] == "configs/dlrm_synthetic.yaml"
    (run,) = summary["runs"]
    assert run["seed"] == 0 and run["epochs"] == 1
    assert 0.5 < run["test_auc"] <= run["bayes_auc"] <= 1.0 and 0.5 < run["best_val_auc"] <= 1.0
    assert 0 < run["test_logloss"] < 0.693  # better than a coin
    assert run["bayes_auc_gap"] == pytest.approx(run["bayes_auc"] - run["test_auc"])
    for figure in quality.FIGURES:
        assert summary[figure] == {"mean": pytest.approx(run[figure]), "std": None}  # one seed: no spread
    table = capsys.readouterr().out
    assert "deepfm      synthetic    skipped" in table and "gap to Bayes AUC" in table


def test_bad_options_are_clear_errors(capsys) -> None:
    with pytest.raises(SystemExit):
        quality.main(["--models", "nosuchmodel"])
    assert "unknown models ['nosuchmodel']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quality.main(["--max-epochs", "0"])
    assert "--max-epochs must be >= 1" in capsys.readouterr().err
