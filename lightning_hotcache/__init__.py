"""lightning-hotcache: train CTR models whose embedding tables outgrow the accelerator.

Importing this package is cheap; heavy modules (torchrec, the CLI) load on first use.
"""

from lightning_hotcache.callbacks import SamplesPerSecond
from lightning_hotcache.rowwise import (
    ROWWISE_OPTIMIZERS,
    RowWiseOptimizer,
    RowWiseOptimizerConfig,
    use_sparse_gradients,
)

__all__ = [
    "ROWWISE_OPTIMIZERS",
    "RowWiseOptimizer",
    "RowWiseOptimizerConfig",
    "SamplesPerSecond",
    "use_sparse_gradients",
]
__version__ = "0.1.0"
