"""Golden values: every zoo model's val AUC after a short, fully seeded CPU run, pinned.

A change that moves what a model learns (initialization, forward, loss, either optimizer, the
data or the training loop) moves these numbers: the quality benchmark (benchmarks/quality.py)
takes hours on a CPU, this catches the same drift in seconds. When a change moves them on purpose,
re-pin them from the failure message and say why in the commit.
"""

from __future__ import annotations

from typing import Iterator

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer, tiny_synthetic

from models import MODEL_REGISTRY, create_model

# val/auc after 2 epochs of `_short_run` on tiny_synthetic(); torch 2.13 CPU, 1 thread.
GOLDEN_VAL_AUC: dict[str, float] = {
    "dcn": 0.72291,
    "deepfm": 0.72370,
    "dlrm": 0.71116,
    "dlrm_dcn": 0.70719,
    "finalmlp": 0.71421,
    "fm": 0.66046,
    "lr": 0.67574,
    "wide_deep": 0.72635,
    "xdeepfm": 0.70842,
}
# Run to run on one machine the numbers are identical; float noise across builds (summation
# order in BLAS) should stay well below this. What it catches: a 20% change of the embedding
# optimizer's lr moves lr/deepfm/dlrm by 0.0054/0.0028/0.0025.
TOLERANCE = 0.002


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: the summation order, so the numbers, do not depend on the core count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _short_run(name: str) -> float:
    pl.seed_everything(0)
    dm = tiny_synthetic(seed=0)
    model = create_model(name, dm.tables, dm.num_dense_features, dense_lr=3e-3)
    trainer = cpu_trainer(max_epochs=2)
    trainer.fit(model, dm)
    return trainer.callback_metrics["val/auc"].item()


def test_every_model_has_a_golden_value() -> None:
    assert sorted(GOLDEN_VAL_AUC) == sorted(MODEL_REGISTRY), (
        "pin a golden val AUC for every registered model (run this file and copy the value from the failure)"
    )


@pytest.mark.parametrize("name", sorted(MODEL_REGISTRY))
def test_val_auc_matches_golden(name: str, one_thread: None) -> None:
    auc = _short_run(name)
    assert name in GOLDEN_VAL_AUC, f"no golden value for {name!r}: add GOLDEN_VAL_AUC[{name!r}] = {auc:.5f}"
    assert auc == pytest.approx(GOLDEN_VAL_AUC[name], abs=TOLERANCE), (
        f"{name}: val AUC {auc:.5f} != golden {GOLDEN_VAL_AUC[name]:.5f}; if the change is meant to move it, "
        f"re-pin GOLDEN_VAL_AUC[{name!r}] = {auc:.5f}"
    )
