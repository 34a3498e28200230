"""The `hotcache` CLI: every shipped config runs, W&B writes offline files, user subclasses plug in."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_hotcache.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))

# Keep every run tiny, whatever the config asks for.
SMALL_SYNTHETIC = ["--data.init_args.num_embeddings_cap=200", "--data.init_args.num_train_samples=2048",
                   "--data.init_args.num_val_samples=1024", "--data.init_args.batch_size=256"]  # fmt: skip


def _data_overrides(config: Path, tmp_path: Path) -> list[str]:
    text = config.read_text()
    if "datamodules.SyntheticCTRDataModule" in text:
        # A config that splits tables by a budget fraction needs tables bigger than its batches.
        uncapped = ["--data.init_args.num_embeddings_cap=null"] if "HotCacheStrategy" in text else []
        return SMALL_SYNTHETIC + uncapped
    if "datamodules.CriteoDataModule" in text:
        tsv = tmp_path / "criteo.tsv"
        rows = []
        for i in range(64):
            dense = "\t".join(str((i * 7 + j) % 50) for j in range(13))
            cats = "\t".join(format((i * 31 + j * 17) % 4096, "x") for j in range(26))
            rows.append(f"{i % 2}\t{dense}\t{cats}")
        tsv.write_text("\n".join(rows) + "\n")
        return [f"--data.init_args.path={tsv}", "--data.init_args.num_embeddings_per_feature=100",
                "--data.init_args.batch_size=16", "--data.init_args.num_workers=0"]  # fmt: skip
    return []


def test_configs_are_found() -> None:
    names = {c.stem for c in CONFIGS}
    assert {"dlrm_synthetic", "deepfm_synthetic", "dcn_synthetic", "dlrm_dcn_synthetic", "dlrm_criteo",
            "deepfm_movielens"} <= names  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_config_runs_with_fast_dev_run(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cli = main(["fit", "-c", str(config), "--trainer.fast_dev_run=true", *_data_overrides(config, tmp_path)])
    assert cli.trainer.state.finished
    assert cli.trainer.global_step == 1


SYNTHETIC_CONFIGS = [c for c in CONFIGS if "datamodules.SyntheticCTRDataModule" in c.read_text()]


@pytest.mark.parametrize("config", SYNTHETIC_CONFIGS, ids=[c.stem for c in SYNTHETIC_CONFIGS])
def test_synthetic_configs_run_with_hotcache(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_hotcache import HotCacheStrategy
    from lightning_hotcache.embedding import hot_cold_modules

    monkeypatch.chdir(tmp_path)
    cli = main(["fit", "-c", str(config), "--trainer.fast_dev_run=true", "--trainer.strategy=hotcache", *SMALL_SYNTHETIC])
    assert isinstance(cli.trainer.strategy, HotCacheStrategy)
    assert hot_cold_modules(cli.model) and cli.trainer.global_step == 1


def test_strategy_by_class_path_with_init_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs" / "dlrm_synthetic.yaml")
    cli = main(["fit", "-c", config, "--trainer.fast_dev_run=true", "--trainer.strategy=lightning_hotcache.HotCacheStrategy",
                "--trainer.strategy.cache_policy=lru", "--trainer.strategy.prefetch_depth=2", *SMALL_SYNTHETIC])  # fmt: skip
    assert cli.trainer.strategy.cache_policy == "lru" and cli.trainer.strategy.prefetch_depth == 2


def test_wandb_offline_run_checkpoint_and_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    config = REPO / "configs" / "dlrm_synthetic.yaml"
    main(["fit", "-c", str(config), "--trainer.max_epochs=1", "--trainer.limit_train_batches=3",
          "--trainer.limit_val_batches=2", *_data_overrides(config, tmp_path)])  # fmt: skip
    assert list((tmp_path / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))
    # The demo config trains with hotcache: its plan goes to W&B as a table.
    (table,) = (tmp_path / "logs" / "wandb").glob("offline-run-*/files/media/table/hotcache/plan_*.table.json")
    assert "expected_hit_rate" in table.read_text()
    assert (tmp_path / "checkpoints" / "dlrm_synthetic" / "last.ckpt").is_file()
    summary = capsys.readouterr().out
    assert "val/bayes_auc" in summary and "AUC gap to Bayes-optimal" in summary


USER_MODEL = '''
import torch
from torch import nn
from models import DLRM


class SumInteraction(nn.Module):
    """Adds the dense vector to every pooled embedding, then flattens."""

    def forward(self, dense, sparse):
        return (sparse + dense.unsqueeze(1)).flatten(1)


class MyDLRM(DLRM):
    def build_interaction(self):
        return SumInteraction()

    def build_over_arch(self, in_features):
        return nn.Sequential(nn.Linear(in_features, 8), nn.ReLU(), nn.Linear(8, 1))
'''


def test_user_subclass_trains_by_class_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_models.py").write_text(textwrap.dedent(USER_MODEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    cli = main(["fit", "--model=my_models.MyDLRM", "--data=datamodules.SyntheticCTRDataModule",
                "--trainer.fast_dev_run=true", "--trainer.accelerator=cpu", *SMALL_SYNTHETIC])  # fmt: skip
    assert type(cli.model.inter_arch).__name__ == "SumInteraction"
    assert cli.trainer.global_step == 1


def test_profile_then_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from lightning_hotcache.planner import HotColdPlan
    from lightning_hotcache.profiling import AccessStats

    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs" / "dlrm_synthetic.yaml")
    data = [*SMALL_SYNTHETIC, "--data.init_args.num_embeddings_cap=null", "--data.init_args.batch_size=64"]
    main(["profile", "-c", config, "--out", "stats.npz", "--plot", "coverage.png", "--batches", "4", *data])
    stats = AccessStats.load(tmp_path / "stats.npz")
    assert stats.num_batches == 4
    assert (tmp_path / "coverage.png").read_bytes().startswith(b"\x89PNG")
    plan = main(["plan", "-c", config, "--budget", "0.5", "--stats", "stats.npz", "--out", "plan.json", *data])
    assert "hit rate" in capsys.readouterr().out
    assert HotColdPlan.load(tmp_path / "plan.json").to_dict() == plan.to_dict()
    assert plan.device_bytes <= plan.budget_bytes
    assert any(not t.on_device for t in plan.tables)
    with pytest.raises(SystemExit, match="the minimum is"):
        main(["plan", "-c", config, "--budget", "10KB", "--stats", "stats.npz", *data])


def test_module_entry_point_prints_help() -> None:
    result = subprocess.run([sys.executable, "-m", "lightning_hotcache", "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "fit" in result.stdout and "validate" in result.stdout
