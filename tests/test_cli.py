"""The `hotcache` CLI: every shipped config runs, W&B writes offline files, user subclasses plug in."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from lightning_hotcache.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))

# Keep every run tiny, whatever the config asks for.
SMALL_SYNTHETIC = ["--data.init_args.num_embeddings_cap=200", "--data.init_args.num_train_samples=2048",
                   "--data.init_args.num_val_samples=1024", "--data.init_args.batch_size=256"]  # fmt: skip


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # main() puts the current directory (a test's tmp_path) on sys.path.
    monkeypatch.setattr(sys, "path", list(sys.path))


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


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("device_budget=-1", "device_budget must be positive"),
        ("device_budget=1.5", r"A float device_budget is a fraction of the embedding bytes and must lie in \(0, 1\]"),
        ("device_budget=abc", "Cannot read device_budget 'abc'"),
        ("device_budget=0GB", "device_budget '0GB' is less than one byte"),
        ("cache_policy=lfuu", "Unknown cache policy 'lfuu'"),
        ("prefetch_depth=-1", "prefetch_depth must be >= 0"),
        ("profile_batches=0", "profile_batches must be >= 1"),
        ("stats_path=missing.npz", "stats_path missing.npz does not exist"),
        ("plan_path=missing.json", "plan_path missing.json does not exist"),
        # Issue 69 item 8: these two ended in jsonargparse's union error after a usage dump.
        ("kernel=fbgem", r"kernel must be one of \('auto', 'fbgemm', 'triton', 'pytorch'\), got 'fbgem'"),
        ("prefetch_thread=maybe", r"prefetch_thread must be true, false or null .*got 'maybe'"),
    ],
)
def test_bad_strategy_settings_on_the_command_line_name_what_is_wrong(
    setting: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 29 item 12: each ended in jsonargparse's "Expected a <class 'str'>. Got value: Namespace(...)".
    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs" / "dlrm_synthetic.yaml")
    with pytest.raises(ValueError, match=rf"--trainer.strategy \(lightning_hotcache.HotCacheStrategy\): {message}"):
        main(["fit", "-c", config, "--trainer.fast_dev_run=true", "--trainer.strategy=lightning_hotcache.HotCacheStrategy",
              f"--trainer.strategy.{setting}", *SMALL_SYNTHETIC])  # fmt: skip


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
    from lightning_hotcache.planner.plan import HotColdPlan
    from lightning_hotcache.planner.profiling import AccessStats

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


# Tables bigger than the batches, so that a budget fraction splits them.
PLAN_DATA = [*SMALL_SYNTHETIC, "--data.init_args.num_embeddings_cap=null", "--data.init_args.batch_size=64"]
DEMO_CONFIG = str(REPO / "configs" / "dlrm_synthetic.yaml")


def test_plan_for_several_ranks_prints_what_each_rank_holds_and_sends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from lightning_hotcache.planner.plan import format_bytes

    monkeypatch.chdir(tmp_path)
    main(["profile", "-c", DEMO_CONFIG, "--out", "stats.npz", "--batches", "4", *PLAN_DATA])
    capsys.readouterr()
    plan = main(["plan", "-c", DEMO_CONFIG, "--budget", "0.5", "--stats", "stats.npz", *PLAN_DATA])
    assert "per rank" not in capsys.readouterr().out  # one process: nothing to exchange
    plan = main(["plan", "-c", DEMO_CONFIG, "--budget", "0.5", "--stats", "stats.npz", "--world-size", "4", *PLAN_DATA])
    out = capsys.readouterr().out
    assert plan.world_size == 4
    # each rank's round-robin shard of every split table, rows with row-wise Adagrad's one state float (the demo's)
    host = sum(-(-t.num_embeddings // 4) * 4 * (t.embedding_dim + 1) for t in plan.tables if not t.on_device)
    assert f"per rank of 4: device {format_bytes(plan.device_bytes)}, host {format_bytes(host)}" in out
    sent = {line.split()[0]: line for line in out.splitlines() if "collectives" in line}
    assert set(sent) == {"hotcache", "all_gather", "torchrec_table_wise", "torchrec_row_wise"}


def test_plan_file_trains_with_exactly_that_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    main(["profile", "-c", DEMO_CONFIG, "--out", "stats.npz", "--batches", "8", *PLAN_DATA])
    # Budget, policy and prefetch depth default to the config's strategy (0.25, lfu, 1).
    plan = main(["plan", "-c", DEMO_CONFIG, "--stats", "stats.npz", "--out", "plan.json", *PLAN_DATA])
    assert "prefetch depth 1 (4 batches in flight), policy lfu" in capsys.readouterr().out
    assert any(not t.on_device for t in plan.tables)
    fit = ["fit", "-c", DEMO_CONFIG, "--trainer.fast_dev_run=true", *PLAN_DATA]
    cli = main([*fit, "--trainer.strategy.init_args.plan_path=plan.json"])
    assert cli.trainer.strategy.plan.to_dict() == plan.to_dict()
    assert cli.trainer.global_step == 1
    main(["plan", "-c", DEMO_CONFIG, "--stats", "stats.npz", "--out", "lru.json", "--policy", "lru", *PLAN_DATA])
    with pytest.raises(ValueError, match="cache_policy 'lru' but this run uses 'lfu'.*hotcache plan"):
        main([*fit, "--trainer.strategy.init_args.plan_path=lru.json"])
    with pytest.raises(ValueError, match="Table 't_cat_2' is 200x16 in the model but .* in the plan"):
        main([*fit, "--trainer.strategy.init_args.plan_path=plan.json", "--data.init_args.num_embeddings_cap=200"])


def test_minimum_that_plan_reports_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `hotcache plan` and the strategy count the same batches in flight.
    monkeypatch.chdir(tmp_path)
    main(["profile", "-c", DEMO_CONFIG, "--out", "stats.npz", "--batches", "8", *PLAN_DATA])
    with pytest.raises(SystemExit, match=r"the minimum is .* \((\d+) bytes\) for 4 batches in flight") as exit_:
        main(["plan", "-c", DEMO_CONFIG, "--budget", "10KB", "--stats", "stats.npz", *PLAN_DATA])
    minimum = re.search(r"\((\d+) bytes\)", str(exit_.value)).group(1)  # type: ignore[union-attr]
    cli = main(["fit", "-c", DEMO_CONFIG, "--trainer.fast_dev_run=true", f"--trainer.strategy.init_args.device_budget={minimum}",
                "--trainer.strategy.init_args.stats_path=stats.npz", *PLAN_DATA])  # fmt: skip
    assert cli.trainer.strategy.plan.budget_bytes == int(minimum)
    assert cli.trainer.global_step == 1


def test_stats_that_cannot_serve_the_run_are_refused_when_planning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not at the first training step, with advice to raise the budget.
    monkeypatch.chdir(tmp_path)
    main(["profile", "-c", DEMO_CONFIG, "--out", "stats.npz", "--batches", "4", *PLAN_DATA])
    bigger = [*PLAN_DATA, "--data.init_args.batch_size=128"]
    message = "batches of 64 samples but this run's batches have 128.*hotcache profile"
    with pytest.raises(SystemExit, match=message):
        main(["plan", "-c", DEMO_CONFIG, "--budget", "0.25", "--stats", "stats.npz", *bigger])
    with pytest.raises(ValueError, match=message):
        main(["fit", "-c", DEMO_CONFIG, "--trainer.fast_dev_run=true", "--trainer.strategy.init_args.stats_path=stats.npz",
              *bigger])  # fmt: skip
    with pytest.raises(SystemExit):
        main(["profile", "-c", DEMO_CONFIG, "--out", "none.npz", "--batches", "0", *PLAN_DATA])


def test_strategy_plan_path_is_checked_up_front(tmp_path: Path) -> None:
    from lightning_hotcache import HotCacheStrategy

    with pytest.raises(FileNotFoundError, match="plan_path .*missing.json does not exist; make it with `hotcache plan"):
        HotCacheStrategy(plan_path=str(tmp_path / "missing.json"))
    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "stats.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="plan_path or stats_path, not both"):
        HotCacheStrategy(plan_path=str(tmp_path / "plan.json"), stats_path=str(tmp_path / "stats.npz"))


def test_the_module_entry_point_prints_help_importing_neither_torchrec_nor_numba() -> None:
    # `python -m lightning_hotcache --help` loads Lightning alone: the strategies and the cache
    # (TorchRec, FBGEMM, numba) load when a command needs them.
    script = (
        "import sys, runpy\n"
        "sys.argv = ['hotcache', '--help']\n"
        "try:\n    runpy.run_module('lightning_hotcache', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torchrec', 'fbgemm_gpu', 'numba', 'wandb') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert all(command in result.stdout for command in ("fit", "validate", "plan")), result.stdout
    assert result.stdout.strip().endswith("[]"), result.stdout


@pytest.mark.parametrize("class_path", ["lightning_hotcache.HotCacheStrategy", "lightning_hotcache.strategies.hotcache.HotCacheStrategy"])
def test_strategy_by_class_path_alone(class_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_hotcache import HotCacheStrategy

    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs" / "deepfm_synthetic.yaml")
    cli = main(["fit", "-c", config, "--trainer.fast_dev_run=true", f"--trainer.strategy={class_path}", *SMALL_SYNTHETIC])
    assert type(cli.trainer.strategy) is HotCacheStrategy and cli.trainer.strategy.cache_policy == "lfu"
    assert cli.trainer.global_step == 1


def test_unknown_strategy_name_lists_the_hotcache_presets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 29 item 15: Lightning's message lists a few of its own names ("auto, ddp, ddp_spawn, deepspeed, ...").
    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs" / "deepfm_synthetic.yaml")
    with pytest.raises(ValueError, match=r"strategy=hotcach is not a registered strategy name; .*hotcache, hotcache_10pct"):
        main(["fit", "-c", config, "--trainer.fast_dev_run=true", "--trainer.strategy=hotcach", *SMALL_SYNTHETIC])


@pytest.mark.parametrize("value", ["lightning_hotcache.NoSuch", "no_such_package.Strategy", "collections.OrderedDict"])
def test_strategy_class_path_that_is_no_strategy(value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs" / "deepfm_synthetic.yaml")
    with pytest.raises(ValueError, match=rf"strategy={value} is neither a registered strategy name \(.*hotcache"):
        main(["fit", "-c", config, "--trainer.fast_dev_run=true", f"--trainer.strategy={value}", *SMALL_SYNTHETIC])


def test_user_module_in_current_directory_by_class_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As `hotcache` is run from a shell: the script's folder on sys.path, not the current one.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    (tmp_path / "cwd_models.py").write_text(textwrap.dedent(USER_MODEL))
    monkeypatch.chdir(tmp_path)
    cli = main(["fit", "--model=cwd_models.MyDLRM", "--data=datamodules.SyntheticCTRDataModule",
                "--trainer.fast_dev_run=true", "--trainer.accelerator=cpu", *SMALL_SYNTHETIC])  # fmt: skip
    assert type(cli.model).__module__ == "cwd_models"


def test_constructor_errors_are_shown_as_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not inside jsonargparse's errors, which repeat every argument (the linked tables: ~20 KB).
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        main(["fit", "--model=models.DLRM", "--model.init_args.dense_lr=-1", "--data=datamodules.SyntheticCTRDataModule",
              "--trainer.fast_dev_run=true", *SMALL_SYNTHETIC])  # fmt: skip
    assert str(error.value) == "dense_lr must be > 0, got -1.0."
    missing = tmp_path / "nowhere" / "train.txt"
    with pytest.raises(FileNotFoundError, match=f"Criteo data not found at {missing}: expected"):
        main(["fit", "-c", str(REPO / "configs" / "dlrm_criteo.yaml"), f"--data.init_args.path={missing}",
              "--data.init_args.num_embeddings_per_feature=10"])  # fmt: skip


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (["--out", "missing/stats.npz"], "the output folder missing does not exist"),
        (["--out", "stats.npz", "--plot", "missing/c.png"], "the output folder missing does not exist"),
        (["--out", "."], "--out: cannot save the stats as .: it is a folder"),  # issue 29 item 15
        (["--out", ""], "--out: the output path for the stats is empty"),
    ],
)
def test_profile_output_is_checked_before_profiling(
    outputs: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import lightning_hotcache.cli as cli_module

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_module, "_lightning_cli", lambda *args, **kwargs: pytest.fail("profiled first"))
    with pytest.raises(SystemExit):
        main(["profile", "-c", str(REPO / "configs" / "dlrm_synthetic.yaml"), *outputs])
    assert message in capsys.readouterr().err


def _documented(config: Path, step: str) -> list[str]:
    """The command a config's header comment gives for `step` (Run, Evaluate), as main's args."""
    (command,) = re.findall(rf"^# {step}:\s+hotcache (.+)$", config.read_text(), flags=re.MULTILINE)
    return shlex.split(command, comments=True)


# Three configs (a synthetic, a MovieLens, a Criteo one) by default; every config trains in
# test_config_runs_with_fast_dev_run.
EVALUATED = {"dlrm_synthetic", "deepfm_movielens", "dlrm_criteo"}


@pytest.mark.parametrize(
    "config", [c if c.stem in EVALUATED else pytest.param(c, marks=pytest.mark.full) for c in CONFIGS], ids=[c.stem for c in CONFIGS]
)
def test_documented_evaluate_tests_the_newest_run(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    small = [*_data_overrides(config, tmp_path), "--trainer.max_epochs=1"]
    short = ["--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1"]
    # Each config's commands, and, for the demo's, that of two runs the newest is evaluated (the
    # second saves beside the first; which one is newest does not depend on the config).
    for _ in range(2 if config.stem == "dlrm_synthetic" else 1):
        newest = main([*_documented(config, "Run"), *small, *short]).trainer.checkpoint_callback.last_model_path
    evaluated = main([*_documented(config, "Evaluate"), *small, *short]).trainer.ckpt_path
    assert Path(evaluated).resolve() == Path(newest).resolve()


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_ckpt_path_last_without_a_run_is_an_error(subcommand: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning would only warn and evaluate the untrained model.
    monkeypatch.chdir(tmp_path)
    config = REPO / "configs" / "deepfm_synthetic.yaml"
    folder = tmp_path / "checkpoints" / "deepfm_synthetic"
    with pytest.raises(FileNotFoundError, match=re.escape(f"--ckpt_path last: no last checkpoint in {folder}. Train")):
        main([subcommand, "-c", str(config), "--ckpt_path", "last", *SMALL_SYNTHETIC])


def test_predict_writes_its_scores_to_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI returns the predictions to nobody: without a writer they were lost.
    monkeypatch.chdir(tmp_path)
    config = REPO / "configs" / "dlrm_synthetic.yaml"
    batches = [*_data_overrides(config, tmp_path), "--trainer.limit_predict_batches=2", "--trainer.logger=false"]
    main(["predict", "-c", str(config), *batches])
    header, *lines = (tmp_path / "predictions.csv").read_text().splitlines()
    assert header == "prediction" and len(lines) == 2 * 256
    assert all(0 < float(line) < 1 for line in lines)
    # A writer the user configures takes the place of the default one.
    (tmp_path / "predictions.csv").unlink()
    own = ["--trainer.callbacks+=lightning_hotcache.PredictionWriter", "--trainer.callbacks.path=scores.npy"]
    main(["predict", "-c", str(config), *batches, *own])
    assert np.load(tmp_path / "scores.npy").shape == (2 * 256,)
    assert not (tmp_path / "predictions.csv").exists()


def test_predict_scores_criteo_data_without_labels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Scoring new logs (Criteo Kaggle's test.txt has no label column) with a trained model.
    monkeypatch.chdir(tmp_path)
    config = REPO / "configs" / "dlrm_criteo.yaml"
    small = _data_overrides(config, tmp_path)
    main(["fit", "-c", str(config), *small, "--trainer.max_steps=2", "--trainer.logger=false"])
    lines = (tmp_path / "criteo.tsv").read_text().splitlines()[:10]
    (tmp_path / "test.txt").write_text("".join(line.split("\t", 1)[1] + "\n" for line in lines))
    main(["predict", "-c", str(config), *small, "--data.init_args.predict_path=test.txt", "--ckpt_path=last",
          "--trainer.logger=false"])  # fmt: skip
    header, *scores = (tmp_path / "predictions.csv").read_text().splitlines()
    assert header == "prediction" and len(scores) == 10


@pytest.mark.parametrize("argv", [["--help"], ["-h"], []], ids=["--help", "-h", "no-args"])
def test_help_lists_every_command(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr()
    shown = out.out if argv else out.err  # no command is a usage error: help on stderr, status 2
    for command in ("fit", "validate", "test", "predict", "profile", "plan", "consolidate"):
        assert re.search(rf"^ +{command} +\w", shown, flags=re.MULTILINE), f"{command} missing from\n{shown}"
    assert exit_.value.code == (0 if argv else 2)


def _readme_commands() -> list[list[str]]:
    """Every `hotcache ...` line of README.md's code blocks, as argv (comments dropped)."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", (REPO / "README.md").read_text(), flags=re.MULTILINE | re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines() if line.startswith("hotcache ")]
    return [shlex.split(line, comments=True)[1:] for line in lines]


def test_readme_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")  # the README's paths are relative to the repository
    commands = _readme_commands()
    assert {argv[0] for argv in commands} >= {"fit", "test", "profile", "plan"}
    for argv in commands:  # in README order: `plan --stats` reads what `profile` wrote
        if argv[0] == "fit":
            cli = main([*argv, "--trainer.fast_dev_run=true"])
            # Unset, Lightning trains for 1000 epochs.
            assert cli.config.fit.trainer.max_epochs is not None, f"`hotcache {shlex.join(argv)}` sets no max_epochs"
        elif argv[0] == "profile":
            main([*argv, "--batches=2"])
        elif argv[0] in ("plan", "consolidate"):
            main(argv)
        else:  # validate/test/predict need a trained checkpoint: check that they parse
            with pytest.raises(SystemExit) as exit_:
                main([*argv, "--print_config"])
            assert exit_.value.code == 0


def test_console_script_destroys_the_process_group_it_leaves(monkeypatch) -> None:
    # Lightning keeps the process group after fit; exiting with it alive can abort a finished
    # run at interpreter exit (gloo's threads outlive finalization, pytorch/pytorch#179291).
    # The group is faked: this test process may hold a real one of other tests.
    import torch.distributed as dist

    from lightning_hotcache import cli

    group = {"alive": False}
    monkeypatch.setattr(cli, "main", lambda: group.update(alive=True))
    monkeypatch.setattr(dist, "is_initialized", lambda: group["alive"])
    monkeypatch.setattr(dist, "destroy_process_group", lambda: group.update(alive=False))
    cli.entry_point()
    assert not group["alive"]
