"""The one place where lightning-hotcache reaches into Lightning's private state.

Each shim says which public API is missing. Keep them few and small: a Lightning upgrade
breaks here first, and only here.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


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
