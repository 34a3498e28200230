"""Precisions that cast the whole model to half ("bf16-true", "16-true") are refused where the
embedding tables stay float32.

hotcache's caches and host stores, TorchRec's fused tables and the zoo's row-wise optimizers keep
the tables and their optimizer state in float32 (TorchRec's default), so under a precision that
casts every parameter to half the pooled embeddings reach the half-precision dense layers as
float32, and the first matmul fails on mismatched dtypes deep inside the model. "bf16-mixed" /
"16-mixed" run the dense layers in half under autocast with the tables in float32: the same
model under every strategy.
"""

from __future__ import annotations

import lightning.pytorch as pl

HALF_TRUE_PRECISIONS = frozenset({"bf16-true", "16-true"})


def refuse_half_true_precision(trainer: pl.Trainer, who: str) -> None:
    """Raise where ``trainer`` casts the whole model to half (see the module docstring)."""
    precision = str(trainer.precision)
    if precision in HALF_TRUE_PRECISIONS:
        mixed = precision.replace("-true", "-mixed")
        raise ValueError(
            f"precision={precision!r} casts every parameter to half, but {who} keeps the embedding tables (and their "
            f"row-wise optimizer state) in float32, so the dense layers would get float32 embeddings. Use "
            f"precision={mixed!r}: the dense layers compute in half under autocast, the tables stay float32."
        )
