"""Registered strategy presets: each trains every shipped synthetic config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import exactness_matrix
from lightning.pytorch.strategies import StrategyRegistry

from lightning_hotcache import STRATEGY_PRESETS
from lightning_hotcache.cli import main

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC_CONFIGS = sorted((REPO / "configs").rglob("*synthetic*.yaml"))
# The configs' tables as shipped (a fractional budget is a share of them); fewer samples keep
# profiling and validation short.
FEWER_SAMPLES = ["--data.init_args.num_train_samples=4096", "--data.init_args.num_val_samples=512"]


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # main() puts the current directory (a test's tmp_path) on sys.path.
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_presets_are_registered() -> None:
    assert set(STRATEGY_PRESETS) <= set(StrategyRegistry.available_strategies())
    assert len(SYNTHETIC_CONFIGS) >= 4


@pytest.mark.parametrize("name", [*sorted(STRATEGY_PRESETS), "torchrec"])
def test_registered_names_make_their_strategies_and_refuse_mps_as_instances_do(name: str) -> None:
    # Issue 29 item 20: on MPS a name passed the "no DDP family on MPS" check that an instance
    # fails. The registry holds factories that import the strategy when asked for one (so that
    # `hotcache --help` imports no TorchRec), and what they make is the strategy itself.
    from lightning.pytorch.accelerators import MPSAccelerator

    from lightning_hotcache import HotCacheStrategy, TorchRecStrategy

    strategy = StrategyRegistry.get(name)
    assert type(strategy) is (TorchRecStrategy if name == "torchrec" else HotCacheStrategy)
    assert StrategyRegistry[name]["description"]
    strategy.accelerator = MPSAccelerator()
    with pytest.raises(ValueError, match=r"DDP family, which the MPS accelerator does not support.*accelerator='cpu'"):
        strategy.setup_environment()


@pytest.mark.parametrize(
    ("preset", "config"),
    exactness_matrix(["preset", "config"], together={"preset": sorted(STRATEGY_PRESETS)}, apart={"config": SYNTHETIC_CONFIGS}),
)
def test_preset_trains_synthetic_config(preset: str, config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_hotcache import HotCacheStrategy

    monkeypatch.chdir(tmp_path)
    cli = main(["fit", "-c", str(config), f"--trainer.strategy={preset}", "--trainer.fast_dev_run=true", *FEWER_SAMPLES])
    assert isinstance(cli.trainer.strategy, HotCacheStrategy)
    assert cli.trainer.global_step == 1


def test_budget_below_the_minimum_grows_to_it_only_when_asked() -> None:
    import torch
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from lightning_hotcache.planner.plan import HotColdPlanner
    from lightning_hotcache.planner.profiling import AccessProfiler

    table = EmbeddingBagConfig(name="t", num_embeddings=10_000, embedding_dim=8, feature_names=["f"])
    profiler = AccessProfiler([table])
    profiler.observe(KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(256), torch.ones(256, dtype=torch.int32)))
    stats = profiler.stats()
    with pytest.raises(ValueError, match=r"the minimum is .* or pass grow_budget_to_minimum=True"):
        HotColdPlanner(0.01).plan([table], stats)
    planner = HotColdPlanner(0.01, grow_budget_to_minimum=True)
    minimum = planner.minimum_bytes([table], stats)
    with pytest.warns(UserWarning, match=r"device budget of .* is below the minimum .* planning with the minimum"):
        plan = planner.plan([table], stats)
    assert plan.budget_bytes == minimum and plan.device_bytes <= minimum
