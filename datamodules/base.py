"""Shared base of every CTR datamodule: tables, batches of ``torchrec`` type and data loaders.

A concrete datamodule only says which categorical features it has (name -> rows), how many
dense features, and how to read samples ``[start, stop)`` of a split (a :class:`BatchSource`).
Everything else lives here: ``EmbeddingBagConfig`` tables, the numpy -> ``Batch`` conversion and
map-style datasets over *global batch* indices (global batch ``k`` of N processes x ``B`` is
samples ``[k*N*B, (k+1)*N*B)``, each process reading its share), so a batch never depends on
the number of workers reading it, and N processes read what one process of batch N*B reads.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol, Union

import lightning.pytorch as pl
from lightning.pytorch.strategies import ParallelStrategy
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from typing_extensions import override

from lightning_hotcache._compat import fit_resume_point
from lightning_hotcache.distributed.global_batch import BatchShare, share_bounds


Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = ("train", "val", "test")

# One categorical feature of a batch: one id per sample, or a bag as (values grouped by sample, lengths).
SparseColumn = Union[np.ndarray, tuple[np.ndarray, np.ndarray]]


def make_batch(keys: Sequence[str], dense: np.ndarray, labels: np.ndarray, sparse: Sequence[SparseColumn]) -> Batch:
    """Build a ``Batch`` from numpy arrays: ``dense`` (B, D), ``labels`` (B,), one ``SparseColumn`` per key.

    KJT values are laid out key by key, then sample by sample, as torchrec's own Criteo loader does.
    The KJT's offsets are computed here, on the host, and travel with it: from lengths on a CUDA
    device torchrec computes them with an FBGEMM op that FBGEMM's CPU build cannot run there.
    """
    batch_size = len(labels)
    values, lengths = [], []
    for column in sparse:
        if isinstance(column, tuple):
            values.append(column[0])
            lengths.append(column[1])
        else:
            values.append(column)
            lengths.append(np.ones(batch_size, dtype=np.int32))
    all_lengths = np.concatenate(lengths).astype(np.int32, copy=False)
    offsets = np.zeros(len(all_lengths) + 1, dtype=np.int32)
    np.cumsum(all_lengths, out=offsets[1:])
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        sparse_features=KeyedJaggedTensor(
            keys=list(keys),
            values=torch.from_numpy(np.concatenate(values).astype(np.int64, copy=False)),
            lengths=torch.from_numpy(all_lengths),
            offsets=torch.from_numpy(offsets),
        ).sync(),
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32)),
    )


def check_fractions(val_fraction: float, test_fraction: float) -> None:
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(
            f"val_fraction and test_fraction must be in [0, 1) with a sum below 1, got {val_fraction}, {test_fraction}"
        )


def split_ranges(n: int, val_fraction: float, test_fraction: float, data: str) -> dict[Split, tuple[int, int]]:
    """Consecutive [start, stop) ranges of n items: train first, then val, then test (the tail).

    A split asked for (fraction > 0) that rounds down to no rows is an error naming the sizes
    (``data`` says whose): an empty validation split would quietly skip validation, and a
    checkpoint monitoring a val metric would fail only at the first epoch's end.
    """
    num_val, num_test = math.floor(n * val_fraction), math.floor(n * test_fraction)
    for split, fraction, rows in (("validation", val_fraction, num_val), ("test", test_fraction, num_test)):
        if fraction > 0 and rows == 0:
            raise ValueError(
                f"{data} has {n} rows: {split} fraction {fraction} of them is {n * fraction:g}, so {split} would get "
                f"no rows. Use more data (at least {math.ceil(1 / fraction)} rows), a larger fraction, or 0 for no "
                f"{split} split."
            )
    bounds = (0, n - num_val - num_test, n - num_test, n)
    return {split: (bounds[i], bounds[i + 1]) for i, split in enumerate(SPLITS)}


class BatchSource(Protocol):
    """One split of a dataset: ``len()`` samples, readable by contiguous range."""

    def __len__(self) -> int: ...

    def batch(self, start: int, stop: int) -> Batch: ...


class BatchDataset(Dataset[BatchShare]):
    """Map-style dataset whose item ``k`` is this process's share of global batch ``k``.

    Global batch ``k`` is samples ``[k*G, min((k+1)*G, n))`` with ``G = batch_size * num_shares``;
    share ``share`` of it is its ``share``-th consecutive slice (`share_bounds`), so the
    shares of all processes together are the batch one process of batch size G reads.
    Used with ``DataLoader(batch_size=None)`` and a sampler that gives every process the
    same order of global batches: shuffling permutes global batches, never the samples
    inside one, and no process ever reads a sample twice in an epoch.
    """

    def __init__(self, source: BatchSource, batch_size: int, num_shares: int = 1, share: int = 0) -> None:
        if not 0 <= share < num_shares:
            raise ValueError(f"share {share} out of range [0, {num_shares})")
        self.source = source
        self.batch_size = batch_size
        self.num_shares = num_shares
        self.share = share

    def __len__(self) -> int:
        return -(-len(self.source) // (self.batch_size * self.num_shares))

    def __getitem__(self, index: int) -> BatchShare:
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range [0, {len(self)})")
        first = index * self.batch_size * self.num_shares
        samples = min(self.batch_size * self.num_shares, len(self.source) - first)
        start, stop = share_bounds(samples, self.num_shares, self.share)
        padding = int(start == stop)  # an empty share reads the global batch's last sample, as padding
        batch = self.source.batch(first + start - padding, first + stop)
        return BatchShare(
            batch.dense_features, batch.sparse_features, batch.labels,
            global_samples=samples, num_shares=self.num_shares, padding=padding,
        )  # fmt: skip


class ResumableSampler(DistributedSampler):
    """A sampler of batch indices whose next pass can start an epoch a number of batches in.

    Every process uses it with one replica (the same order everywhere: each reads its share
    of the global batch, see `BatchDataset`). It is a DistributedSampler so that Lightning
    keeps it instead of injecting its own.

    Lightning restores a run killed mid-epoch at the right batch index but iterates a plain
    sampler from the start again, so a resumed run would see the epoch's first batches twice
    and never its last. It also creates the resumed epoch's iterator before it sets the
    sampler's epoch, so a shuffled run would draw another epoch's order. The datamodule
    tells the sampler which epoch the restored run continues and how many of its batches
    were already trained (see `lightning_hotcache._compat.fit_resume_point`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0

    def resume_at(self, epoch: int, batches_done: int) -> None:
        """Make the next pass epoch ``epoch``'s order, less its first ``batches_done`` batches."""
        self.set_epoch(epoch)
        self._skip = batches_done

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self._skip = self._skip, 0
        return iter(indices[skip:])


class CTRDataModule(pl.LightningDataModule):
    """Base of the CTR datamodules: yields each process its share of every global batch, a
    ``torchrec.datasets.utils.Batch`` (`BatchShare`).

    Subclasses fill ``feature_cardinalities`` (feature name -> table rows, in KJT key order) and
    ``num_dense_features`` in ``__init__`` (LightningCLI links ``tables`` and
    ``num_dense_features`` into the model before ``setup``) and implement ``source(split)``.

    Args:
        batch_size: samples per batch of each process (a step reads batch_size x processes samples;
            the last batch of a split may be smaller).
        num_workers: DataLoader worker processes; 0 reads batches in the main process.
        embedding_dim: embedding width of every table.
        shuffle: shuffle the order of training batches every epoch (the samples inside a batch stay fixed).
    """

    def __init__(
        self, batch_size: int = 512, num_workers: int = 0, embedding_dim: int = 16, shuffle: bool = True
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {embedding_dim}")
        # Collects the subclass' constructor arguments too (Lightning walks the __init__ frames);
        # they go into checkpoints as the datamodule's hyperparameters.
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.embedding_dim = embedding_dim
        self.shuffle = shuffle
        self.feature_cardinalities: dict[str, int] = {}
        self.num_dense_features: int = 0
        self._saved_global_batch: int | None = None  # of the checkpoint a fit resumes, if any

    @property
    def feature_names(self) -> list[str]:
        return list(self.feature_cardinalities)

    @property
    def tables(self) -> list[EmbeddingBagConfig]:
        """One SUM-pooled table ``t_<feature>`` per categorical feature, in KJT key order."""
        return [
            EmbeddingBagConfig(
                num_embeddings=rows,
                embedding_dim=self.embedding_dim,
                name=f"t_{name}",
                feature_names=[name],
                pooling=PoolingType.SUM,
            )
            for name, rows in self.feature_cardinalities.items()
        ]

    def source(self, split: Split) -> BatchSource:
        """Samples of one split; loads the data first if ``setup`` has not done it."""
        raise NotImplementedError

    def reference_metrics(self, stage: str) -> dict[str, float]:
        """Metrics of a known reference predictor on a stage's split ("val"/"test"); none by default."""
        return {}

    def dataloader(self, split: Split, shuffle: bool = False) -> DataLoader[BatchShare]:
        return self.loader_of(self.source(split), shuffle)

    def loader_of(self, source: BatchSource, shuffle: bool = False) -> DataLoader[BatchShare]:
        """The loader of ``source``'s samples (a split's, or other data's) for this process."""
        # Each process reads its share of every global batch (see `BatchDataset`), in an order
        # that is the same in every process and every run: our own sampler follows `shuffle`
        # with a fixed seed per epoch (Lightning's injected sampler always shuffles training
        # data, and a plain RandomSampler draws from the global RNG, so either would make the
        # order depend on the strategy). N processes x batch B thus see the batches of
        # 1 process x N*B, shuffled or not, with no sample repeated at an uneven epoch end.
        num_shares, share = self._shares()
        dataset = BatchDataset(source, self.batch_size, num_shares, share)
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        return DataLoader(
            dataset,
            batch_size=None,
            sampler=ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed),
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def _shares(self) -> tuple[int, int]:
        """Processes a global batch is split across, and this process' share."""
        trainer = self.trainer
        if trainer is not None and isinstance(trainer.strategy, ParallelStrategy):
            replicas = trainer.distributed_sampler_kwargs
            return replicas["num_replicas"], replicas["rank"]
        return 1, 0

    def train_dataloader(self) -> DataLoader[BatchShare]:
        loader = self.dataloader("train", shuffle=self.shuffle)
        if self.trainer is not None:
            epoch, batches_done = fit_resume_point(self.trainer)
            self._check_resumable(epoch, batches_done)
            loader.sampler.resume_at(epoch, batches_done)
        return loader

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"global_batch_samples": self.batch_size * self._shares()[0]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_global_batch = state_dict.get("global_batch_samples")

    def _check_resumable(self, epoch: int, batches_done: int) -> None:
        # The resume point is counted in global batches: with another global batch size (another
        # number of processes, or batch size) the same count is other samples, and the epoch's
        # order of global batches another one.
        saved = self._saved_global_batch
        num_shares = self._shares()[0]
        now = self.batch_size * num_shares
        if batches_done == 0 or saved is None or saved == now:
            return
        raise ValueError(
            f"This checkpoint was saved {batches_done} global batches of {saved} samples ({batches_done * saved} "
            f"samples) into epoch {epoch}; this run's global batches have {now} samples (batch_size {self.batch_size} "
            f"x {num_shares} process(es)), so it would go on from sample {batches_done * now} of another order. Resume "
            f"with batch_size x processes = {saved} (the saved run's global batch), or from a checkpoint taken at an "
            "epoch's end."
        )

    def val_dataloader(self) -> DataLoader[BatchShare]:
        return self.dataloader("val")

    def test_dataloader(self) -> DataLoader[BatchShare]:
        return self.dataloader("test")

    def predict_dataloader(self) -> DataLoader[BatchShare]:
        return self.dataloader("test")
