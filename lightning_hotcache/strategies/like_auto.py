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
from typing import Any, Iterator

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


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The torch Generators a training loader draws from besides the global RNGs: its own
    (``DataLoader(generator=...)``: its workers' base seed and its RandomSampler's shuffle),
    its sampler's and its batch sampler's, in a loader or a collection of loaders."""
    if isinstance(loader, (list, tuple)):
        return [g for item in loader for g in loader_generators(item)]
    if isinstance(loader, dict):
        return [g for item in loader.values() for g in loader_generators(item)]
    parts = [loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)]
    parts.append(getattr(parts[-1], "sampler", None))
    found: dict[int, torch.Generator] = {}
    for part in parts:
        for value in vars(part).values() if hasattr(part, "__dict__") else ():
            if isinstance(value, torch.Generator):
                found[id(value)] = value
    return list(found.values())


@contextlib.contextmanager
def loader_rngs_restored(loader: Any) -> Iterator[None]:
    """Leave the global RNGs and every generator of ``loader`` (`loader_generators`) as they
    were on entry: reading a loader before training (profiling, the batch size check) must not
    move the order or the seeds that training then gets."""
    generators = loader_generators(loader)
    states = [g.get_state() for g in generators]
    with global_rngs_restored():
        try:
            yield
        finally:
            for generator, state in zip(generators, states):
                generator.set_state(state)


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
