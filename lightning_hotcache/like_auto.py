"""DDP-based strategies that, in one process, train exactly what ``strategy="auto"`` trains.

Lightning's DDPStrategy does two things even in a single process that change what a model
learns compared with ``auto``: it re-seeds the global RNGs while setting up the process
group (rewinding whatever the user's code drew since ``seed_everything``), and it replaces
the training loader's sampler with a DistributedSampler that always shuffles. Our
strategies promise "same result as auto", for the user's own DataLoaders too, so in one
process they keep the RNGs running and the user's sampler in place. With N > 1 processes
they behave as DDP does (a sampler per rank is needed then).
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.accelerators import MPSAccelerator
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_hotcache._compat import keep_user_samplers


@contextlib.contextmanager
def global_rngs_restored() -> Iterator[None]:
    """Leave torch's (CPU), numpy's and Python's global RNGs as they were on entry."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)


class LikeAutoInOneProcess(DDPStrategy):
    """A DDPStrategy that, with one process, leaves the RNGs and the user's sampler alone."""

    @override
    def setup_environment(self) -> None:
        # Lightning refuses DDP-family strategies on MPS when it is given an instance or a name
        # with "ddp" in it; a registered name such as "hotcache" passes its check, so here.
        if isinstance(self.accelerator, MPSAccelerator):
            raise ValueError(
                f"strategy={self.strategy_name!r} is from the DDP family, which the MPS accelerator does not support "
                "(as for Lightning's DDPStrategy): set accelerator='cpu', or use strategy='auto'."
            )
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        if self.world_size > 1:
            super().setup_distributed()
            return
        with global_rngs_restored():
            super().setup_distributed()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.world_size == 1:
            keep_user_samplers(trainer)
        super().setup(trainer)
