"""CTR datamodules yielding ``torchrec.datasets.utils.Batch``: synthetic (planted truth), Criteo, MovieLens.

All share :class:`CTRDataModule` (tables, batch construction, data loaders); see ``base.py``.
"""

from datamodules.base import CTRDataModule
from datamodules.criteo import CriteoDataModule
from datamodules.movielens import MovieLensDataModule
from datamodules.synthetic import SyntheticCTRDataModule

__all__ = ["CTRDataModule", "CriteoDataModule", "MovieLensDataModule", "SyntheticCTRDataModule"]
