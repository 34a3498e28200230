"""On a CUDA device: hotcache learns what auto learns there for every zoo model, and its
checkpoints load on a machine without a GPU.

On CUDA the strategy stages batches on its prefetch thread by default, so every hotcache
case here runs with it. Marked ``cuda`` and skipped without a CUDA device: `make gpu-check`
runs them on the lent GPU machine (``pytest -m cuda``). The cases and the check are test_strategy's, on CUDA.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer
from test_strategy import OPTIMIZER, assert_hotcache_matches_auto, data, fit, stats_paths  # noqa: F401 (stats_paths: a fixture)

from lightning_hotcache import HotCacheStrategy
from models import MODEL_REGISTRY

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = {"accelerator": "cuda", "devices": 1}
CASES = list(itertools.product(sorted(MODEL_REGISTRY), [1.0, 0.1, "minimum"], ["lfu", "lru", "static"]))
TESTS = Path(__file__).parent

# Runs in a process that sees no GPU, as on a CPU-only machine: the plain model validates
# from the checkpoint under `auto` and prints its metrics.
VALIDATE_ON_CPU = """
import json, sys
import torch
from conftest import cpu_trainer
from test_strategy import data
from models import create_model

assert not torch.cuda.is_available()
dm = data()
model = create_model("dlrm", dm.tables, dm.num_dense_features)
print(json.dumps(cpu_trainer().validate(model, dm, ckpt_path=sys.argv[1], verbose=False)[0]))
"""


@pytest.fixture(scope="module")
def cuda_baselines() -> dict[str, tuple[dict, dict]]:
    out = {}
    for name in MODEL_REGISTRY:
        model, _, metrics = fit(name, "auto", **CUDA)
        out[name] = (model.state_dict(), metrics)
    return out


@pytest.mark.parametrize(("name", "budget", "policy"), CASES)
def test_hotcache_matches_auto_on_cuda(name, budget, policy, stats_paths, cuda_baselines) -> None:
    assert_hotcache_matches_auto(name, budget, policy, stats_paths[name], cuda_baselines[name], **CUDA)


def test_checkpoint_written_on_cuda_loads_without_a_gpu(tmp_path, stats_paths) -> None:
    strategy = HotCacheStrategy(device_budget=0.1, stats_path=str(stats_paths["dlrm"]))
    _, trainer, metrics = fit("dlrm", strategy, **CUDA)
    assert any(not t.on_device for t in trainer.strategy.plan.tables), "split tables are gathered from both tiers"
    # On CUDA staging runs on the prefetch thread by default: every hotcache case here ran with it.
    assert trainer.strategy.uses_prefetch_thread
    trainer.save_checkpoint(tmp_path / "cuda.ckpt")
    path = os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", VALIDATE_ON_CPU, str(tmp_path / "cuda.ckpt")],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path},
        cwd=TESTS, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    on_cpu = json.loads(done.stdout.strip().splitlines()[-1])
    # The same weights, evaluated by CPU kernels instead of CUDA ones.
    assert on_cpu["val/auc"] == pytest.approx(metrics["val/auc"], abs=1e-4)


def test_cpu_lookup_baseline_keeps_the_tables_on_the_host_and_learns_what_auto_learns(cuda_baselines) -> None:
    # benchmarks/gpu.py's FAE baseline: its figures mean something only if the CPU really
    # looks the rows up, and it trains the same model.
    sys.path.append(str(TESTS.parent / "benchmarks"))
    from gpu import HostLookupDLRM

    pl.seed_everything(0)
    dm = data()
    model = HostLookupDLRM(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    cpu_trainer(strategy="auto", max_epochs=1, **CUDA).fit(model, dm)
    assert {p.device.type for p in model.sparse_arch.parameters()} == {"cpu"}
    assert {p.device.type for p in model.over_arch.parameters()} == {"cuda"}
    expected = {key: value.cpu() for key, value in cuda_baselines["dlrm"][0].items()}
    torch.testing.assert_close({key: value.cpu() for key, value in model.state_dict().items()}, expected, rtol=1e-4, atol=1e-5)
