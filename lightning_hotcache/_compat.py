"""The one place where lightning-hotcache reaches into Lightning's (and torch's) private state.

Each shim says which public API is missing. Keep them few and small: a Lightning upgrade
breaks here first, and only here.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import _TransferableDataType
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from torch.nn.parallel import DistributedDataParallel


# What Lightning's ``move_data_to_device`` moves: anything with a ``.to`` (the staging thread
# moves the same things, some without blocking: `batch_to_device`). Lightning has the test
# only as this private ABC.
TransferableData = _TransferableDataType


def fit_train_dataloader(trainer: pl.Trainer) -> Any:
    """The training dataloader(s) of the running fit as the user gave them: a datamodule's,
    the LightningModule's, or ``trainer.fit(train_dataloaders=...)``; None when there are none.

    The hotcache strategy profiles them in ``setup``, before the fit loop loads them into
    ``trainer.train_dataloader`` (still None then); no public API returns the fit's source.
    """
    source = trainer.fit_loop._data_source
    return source.dataloader() if source.is_defined() and source.instance is not None else None


def keep_user_samplers(trainer: pl.Trainer) -> None:
    """Stop Lightning from swapping the training loader's sampler for a shuffling
    DistributedSampler, as it does for every DDPStrategy subclass even in one process.

    `auto` keeps a user's ``DataLoader(shuffle=False)`` in order; the hotcache strategy must
    learn what `auto` learns, so in one process it keeps the user's sampler too. The
    Trainer's ``use_distributed_sampler`` flag is the switch, read only when loaders are
    set up; there is no public setter after construction.
    """
    trainer._accelerator_connector.use_distributed_sampler = False


def fit_resume_point(trainer: pl.Trainer) -> tuple[int, int]:
    """The epoch a fit's next training iterator serves, and how many of its batches were trained.

    Lightning asks for the training loader (and iterates it) after a checkpoint's loop state
    is restored but before its loops' ``reset`` settles where the run goes on; with
    ``reload_dataloaders_every_n_epochs`` it asks again between ``FitLoop.reset`` and
    ``_TrainingEpochLoop.reset``. This follows their rules from the restored counters (which
    neither call has changed in a way that matters here), so the iterator serves exactly the
    batches the epoch loop will draw:

    - not restarting (a fresh fit, or a checkpoint of a finished epoch under ``max_epochs``):
      the epoch after the last processed one, from its first batch;
    - saved by ``on_train_batch_end`` of an epoch's last batch (e.g. ``ModelCheckpoint(
      every_n_train_steps=...)`` landing on it): that epoch is over, so the next one from its
      first batch (Lightning closes the epoch, then starts the next one's batch count at 0);
    - otherwise the restored epoch less the batches it completed, counting the one whose
      ``on_train_batch_end`` saved the checkpoint (Lightning completes it on restart). An
      epoch whose batches are all done (saved at its end under ``max_steps``) serves none.
    """
    fit_loop = trainer.fit_loop
    epochs = fit_loop.epoch_progress.current
    if not fit_loop.restarting:
        return epochs.processed, 0
    batches = fit_loop.epoch_loop.batch_progress
    total = batches.total
    saved_on_batch_end = total.started == total.ready == total.processed == total.completed + 1
    if saved_on_batch_end and batches.is_last_batch:
        # `started` counts the saving epoch in, so it indexes the next one; FitLoop.reset, which
        # closes the saving epoch, leaves it as it is.
        return epochs.started, 0
    return epochs.processed, batches.current.completed + int(saved_on_batch_end)


def has_last_checkpoint(callback: ModelCheckpoint, trainer: pl.Trainer) -> bool:
    """Whether ``ckpt_path="last"`` finds a checkpoint of ``callback`` (its ``last*.ckpt``):
    Lightning's own search, which it keeps private, so that the answer is the one it acts on."""
    return bool(callback._find_last_checkpoints(trainer))


def writes_step_logs(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes the current training step's logged metrics to its loggers,
    asked in ``on_train_batch_end``: every ``log_every_n_steps`` batches that stepped,
    counted over the whole fit, and on a stop; every step under ``fast_dev_run``. Lightning's
    own rule (what it acts on after the hook), which it keeps on a private connector."""
    return trainer._logger_connector.should_update_logs or bool(trainer.fast_dev_run)


def is_wrapping_checkpoint_io(io: object) -> bool:
    """Whether ``io`` wraps another checkpoint IO (AsyncCheckpointIO does): Lightning's base
    class for those is private, and the strategy must put its own IO inside such a wrapper."""
    return isinstance(io, _WrappingCheckpointIO)


def set_ddp_ignored_parameters(module: torch.nn.Module, names: list[str]) -> None:
    """Make a later ``DistributedDataParallel(module)`` skip these parameters (by name).

    DDP reads the list from an attribute of the module it wraps; its setter is a private
    static method (TorchRec's DistributedModelParallel uses it the same way), and there is
    no public argument that Lightning's DDPStrategy passes through.
    """
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def add_to_each(tensors: list[torch.Tensor], scalars: list[int | float]) -> list[torch.Tensor]:
    """``[t + s for t, s in zip(tensors, scalars)]`` as one op, one kernel launch on CUDA where the
    list comprehension launches one per tensor: torch's multi-tensor ``_foreach_add``, what
    torch.optim's ``foreach`` implementations run on; it has no public name."""
    return list(torch._foreach_add(tensors, scalars))


# Modules that moved into the package's folders, by their old flat path. Importing an old
# path still works for one release: it warns and gives the module at its new path (the same
# module object, so monkeypatching and pickles saved under the old path keep working).
MOVED_MODULES = {
    f"lightning_hotcache.{old}": f"lightning_hotcache.{new}"
    for old, new in {
        "accumulation": "strategies.accumulation",
        "background": "_ops.background",
        "callbacks": "callbacks",
        "checkpoint": "checkpoint",
        "collectives": "distributed.collectives",
        "compiled": "_ops.compiled",
        "even_batches": "distributed.even_batches",
        "global_batch": "distributed.global_batch",
        "guards": "_ops.guards",
        "host_rows": "_ops.host_rows",
        "like_auto": "strategies.like_auto",
        "precision": "strategies.precision",
        "predictions": "callbacks.predictions",
        "profiling": "planner.profiling",
        "progress": "_ops.progress",
        "rowwise": "optim.rowwise",
        "sorting": "_ops.sorting",
        "sparse_ddp": "distributed.sparse_ddp",
        "stacked_tables": "optim.stacked_tables",
        "strategy": "strategies.hotcache",
        "table_init": "embedding.table_init",
        "torchrec_strategy": "strategies.torchrec",
        "traffic": "planner.traffic",
    }.items()
    if old != new
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module path of `MOVED_MODULES` to the module at its new path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (the old path goes in the next release).",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: Any) -> None:
        """The module at the new path is already executed."""


def alias_moved_modules() -> None:
    """Let the old module paths of `MOVED_MODULES` import (once per process)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())  # before the path finders, which would find nothing there
