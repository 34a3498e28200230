"""`PredictionWriter`: a predict run's per-sample predictions in one file, in the data's order.

``trainer.predict`` returns each process its own share of the predictions, and LightningCLI's
``predict`` returns them to nobody: without a writer, ``hotcache predict`` computes scores and
drops them. Lightning's `BasePredictionWriter` leaves what to write to a subclass; this one
keeps each batch's predictions on the host, gathers every process's at the epoch's end and
writes them from rank 0 as one file, batch by batch and within a batch rank by rank. That is
the order one process reads the samples in for the zoo's datamodules (each process reads the
``r``-th consecutive slice of every global batch, `lightning_hotcache.distributed.global_batch`), under
every strategy. A loader of another kind gets its own order, batch by batch and rank by rank:
across processes Lightning gives a plain DataLoader a DistributedSampler, which deals samples
to ranks in turn and repeats some to even the ranks out, and the file holds them as they came.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_hotcache.distributed import collectives
from lightning_hotcache.checkpoint.files import check_output_file, write_file_atomically

FORMATS = (".csv", ".npy", ".pt")
DEFAULT_PATH = "predictions.csv"  # also where `hotcache predict` writes, in the trainer's root folder


class PredictionWriter(BasePredictionWriter):
    """Write what ``predict_step`` returns (a tensor of one prediction, or one row of them, per
    sample) to ``path`` once a predict run has gone through its data.

    Args:
        path: the file; its suffix says the format: ``.csv`` (a header, then one line a
            sample), ``.npy`` (numpy) or ``.pt`` (a tensor). Written under a temporary name and
            renamed, so a run killed while writing leaves the previous file or the whole new
            one. With several predict dataloaders, one file each, ``<stem>_<index><suffix>``.
    """

    def __init__(self, path: _PATH = DEFAULT_PATH) -> None:
        super().__init__(write_interval="batch")
        self.path = Path(path)
        if self.path.suffix not in FORMATS:
            raise ValueError(
                f"PredictionWriter writes {', '.join(FORMATS)} files; {str(path)!r} has none of these suffixes."
            )
        self._batches: dict[int, list[Tensor]] = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "predict":
            return
        if trainer.is_global_zero:
            check_output_file(self.path, "predictions")  # before the run, not after it
        writers = [c for c in trainer.callbacks if isinstance(c, BasePredictionWriter)]
        if all(isinstance(w, PredictionWriter) for w in writers):
            # Lightning warns once a run that it cannot tell a writer the samples' indices in
            # the dataset (it can only for loaders that batch samples themselves; the zoo's read
            # whole batches). This writer does not ask for them.
            warnings.filterwarnings("ignore", message="Couldn't infer the batch indices fetched from your dataloader")

    @override
    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batches = {}

    @override
    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if not isinstance(prediction, Tensor) or prediction.dim() not in (1, 2):
            shape = f"a tensor of shape {tuple(prediction.shape)}" if isinstance(prediction, Tensor) else type(prediction).__name__
            raise TypeError(
                f"PredictionWriter writes one prediction (or one row of them) per sample: predict_step should return "
                f"a 1-D or 2-D tensor, but batch {batch_idx} returned {shape}. Return such a tensor, or write your own "
                "lightning.pytorch.callbacks.BasePredictionWriter."
            )
        self._batches.setdefault(dataloader_idx, []).append(prediction.detach().to("cpu", torch.float32))

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_predict_epoch_end(trainer, pl_module)
        gathered = [self._batches] if trainer.world_size == 1 else collectives.all_gather_object(self._batches)
        self._batches = {}
        if not trainer.is_global_zero:
            return
        loaders = sorted({index for ranks in gathered for index in ranks})
        if not loaders:
            rank_zero_warn(f"The predict run read no batch: nothing written to {self.path}.")
        several = len(trainer.num_predict_batches) > 1  # a file each, named by index even where one read nothing
        for index in loaders:
            predictions = torch.cat(_in_data_order([ranks.get(index, []) for ranks in gathered]))
            path = self.path.with_name(f"{self.path.stem}_{index}{self.path.suffix}") if several else self.path
            write_file_atomically(path, lambda f: _write(f, path.suffix, predictions))
            rank_zero_info(f"Predictions of {len(predictions):,} samples written to {path}")


def _in_data_order(per_rank: list[list[Tensor]]) -> list[Tensor]:
    """Batch by batch, rank by rank: the one-process order of the zoo's data (a rank with fewer
    batches than another has nothing more to add)."""
    return [batches[b] for b in range(max(len(batches) for batches in per_rank)) for batches in per_rank if b < len(batches)]


def _write(f: BinaryIO, suffix: str, predictions: Tensor) -> None:
    if suffix == ".pt":
        torch.save(predictions, f)
    elif suffix == ".npy":
        np.save(f, predictions.numpy())
    else:
        columns = 1 if predictions.dim() == 1 else predictions.shape[1]
        header = "prediction" if predictions.dim() == 1 else ",".join(f"prediction_{i}" for i in range(columns))
        np.savetxt(f, predictions.numpy().reshape(len(predictions), columns), fmt="%.9g", delimiter=",", header=header, comments="")
