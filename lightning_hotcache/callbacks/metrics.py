"""Callbacks that put training figures on the progress bar and in the loggers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_hotcache._compat import writes_step_logs

if TYPE_CHECKING:
    from lightning_hotcache.cache.device import DeviceCache


def on_host(value: float) -> Tensor:
    """A figure to log, as a tensor on the CPU. Lightning makes a logged number a tensor on the
    model's device (on CUDA a copy that waits for the step's queued work) and reads a
    progress-bar metric back with ``item()`` every step after (another wait); a tensor is
    logged where it is, so a figure counted on the host never touches the device."""
    return torch.tensor(value, dtype=torch.get_default_dtype())


def _num_samples(batch: Any) -> int:
    labels = getattr(batch, "labels", None)
    if labels is None:
        raise TypeError(
            f"SamplesPerSecond expects batches with a `labels` tensor (torchrec's Batch); got {type(batch).__name__}."
        )
    return int(labels.shape[0])


class SamplesPerSecond(Callback):
    """Training throughput (samples/s on this rank) on the progress bar and in the loggers.

    Lightning's ThroughputMonitor logs only to loggers, not the progress bar, and needs a
    batch-size function per model; CTR batches always carry labels, so we count those. The
    figure is an exponential moving average over batches, so one slow step does not hide
    the trend; the first batch of each epoch (data loader start-up) is not counted. It is
    logged once an epoch has a rate (its second batch, for the progress bar) and then on the
    steps whose logs Lightning writes to the loggers (every ``trainer.log_every_n_steps``):
    a ``self.log`` call runs a good deal of Python, and at every step it would take what a
    step of a GPU bound by its host can least spare.
    """

    def __init__(self, smoothing: float = 0.9) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}.")
        self.smoothing = smoothing
        self._last: float | None = None
        self._rate: float | None = None
        self._shown_this_epoch = False

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None
        self._shown_this_epoch = False

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last is not None and now > self._last:
            rate = _num_samples(batch) / (now - self._last)
            self._rate = rate if self._rate is None else self.smoothing * self._rate + (1 - self.smoothing) * rate
            if not self._shown_this_epoch or writes_step_logs(trainer):
                pl_module.log("train/samples_per_s", on_host(self._rate), prog_bar=True, on_step=True, on_epoch=False)
                self._shown_this_epoch = True
        self._last = now


class CacheMetrics(Callback):
    """Hot/cold cache figures for the loggers and the progress bar.

    ``cache/hit_rate`` (all tables, on the progress bar), ``cache/<table>/hit_rate`` of each
    table split between the device and the host (a table wholly on the device hits every
    time: its 1.0 would be one more ``self.log``, host time a step, for nothing), rows fetched into and
    evicted from the device per step, and host->device / device->host bytes
    per sample; with a prefetch thread, the share of steps whose batch was not staged in time
    (``cache/staging_waits``) and the milliseconds a step waited for it on average
    (``cache/staging_wait_ms``): staging, not the device, bounds such steps; and what staging a
    batch took the thread (``cache/staging_ms``, and ``cache/staging_cpu_ms`` of its own CPU
    time: far less means it waited, for the GIL or a copy), and announcing it, on the reader
    thread where there is one (``cache/announcing_ms``). Across ranks a
    hit is a row already in a slot, and the rows fetched include
    the other ranks' rows a step reads, which come from their owners whether cached or not.
    Each figure covers the steps since it was last logged: it is logged on the
    first batch of an epoch (for the progress bar) and on each step whose logs Lightning
    writes to the loggers (every ``trainer.log_every_n_steps``), so a written figure ends at
    the step it is written with (logging 30 figures every step cost 8% of a CPU training
    step). The strategy's plan is logged once: as a W&B table under ``hotcache/plan`` when a
    WandbLogger is attached, and as text in every logger's hyperparameters.
    """

    def __init__(self, per_table: bool = True) -> None:
        self.per_table = per_table
        self._last: dict[str, tuple[int, int, int, int, int]] = {}
        self._split: set[str] = set()  # the caches with a host tier
        self._steps = self._samples = 0
        self._staging: dict[str, float] = {}  # the strategy's staging waits and work when last logged (`staging_totals`)

    @staticmethod
    def _caches(pl_module: pl.LightningModule) -> Iterator[tuple[str, DeviceCache]]:
        from lightning_hotcache.embedding import hot_cold_modules

        for module in hot_cold_modules(pl_module).values():
            yield from module.caches.items()

    def _snapshot(self, pl_module: pl.LightningModule) -> dict[str, tuple[int, int, int, int, int, int]]:
        out = {}
        for name, cache in self._caches(pl_module):
            c = cache.counters
            row_bytes = 4 * sum(t.shape[1] for t in cache.slots.values())
            out[name] = (c.lookups, c.hits, c.fetched_rows, c.evicted_rows, c.written_back_rows, row_bytes)
        return out

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = {k: v[:5] for k, v in self._snapshot(pl_module).items()}
        self._split = {name for name, cache in self._caches(pl_module) if not cache.identity}
        self._steps = self._samples = 0
        self._staging = staging_totals(trainer)
        plan = getattr(trainer.strategy, "plan", None)
        if plan is None:
            return
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                rows = [[t.name, t.num_embeddings, t.embedding_dim, len(t.static_ids), t.cache_slots, t.device_bytes,
                         t.expected_hit_rate] for t in plan.tables]  # fmt: skip
                columns = ["table", "rows", "dim", "static_rows", "cache_slots", "device_bytes", "expected_hit_rate"]
                logger.log_table(key="hotcache/plan", columns=columns, data=rows)
            logger.log_hyperparams({"hotcache_plan": str(plan)})

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._steps += 1
        self._samples += _num_samples(batch)
        if batch_idx and not writes_step_logs(trainer):
            return
        now = self._snapshot(pl_module)
        lookups = hits = h2d = d2h = fetched = evicted = 0
        for name, (n, h, f, e, w, row_bytes) in now.items():
            dn, dh, df, de, dw = (a - b for a, b in zip((n, h, f, e, w), self._last.get(name, (0,) * 5)))
            lookups, hits, fetched, evicted = lookups + dn, hits + dh, fetched + df, evicted + de
            h2d, d2h = h2d + df * row_bytes, d2h + dw * row_bytes
            if self.per_table and dn and name in self._split:
                pl_module.log(f"cache/{name}/hit_rate", on_host(dh / dn), on_step=True, on_epoch=False)
        steps, samples = self._steps, self._samples
        self._last = {k: v[:5] for k, v in now.items()}
        self._steps = self._samples = 0
        before, self._staging = self._staging, staging_totals(trainer)
        if getattr(trainer.strategy, "uses_prefetch_thread", False):  # inline, staging keeps no step waiting
            moved = {key: value - before.get(key, 0) for key, value in self._staging.items()}
            figures = {"cache/staging_waits": moved["staging_waits"] / steps, "cache/staging_wait_ms": 1e3 * moved["staging_wait_s"] / steps}
            if moved["staged_batches"]:
                staged = moved["staged_batches"]
                figures |= {"cache/staging_ms": 1e3 * moved["staging_s"] / staged, "cache/staging_cpu_ms": 1e3 * moved["staging_cpu_s"] / staged,
                            "cache/announcing_ms": 1e3 * moved["announcing_s"] / staged}  # fmt: skip
            pl_module.log_dict({key: on_host(value) for key, value in figures.items()}, on_step=True, on_epoch=False)
        if not lookups:
            return
        pl_module.log("cache/hit_rate", on_host(hits / lookups), prog_bar=True, on_step=True, on_epoch=False)
        pl_module.log_dict(
            {
                "cache/rows_fetched": on_host(fetched / steps),
                "cache/rows_evicted": on_host(evicted / steps),
                "cache/h2d_bytes_per_sample": on_host(h2d / samples),
                "cache/d2h_bytes_per_sample": on_host(d2h / samples),
            },
            on_step=True,
            on_epoch=False,
        )


def staging_totals(trainer: pl.Trainer) -> dict[str, float]:
    """Running totals of the hotcache strategy's waits for its prefetch thread: batches the
    loop waited for, and seconds; and the thread's own time (`StagingWork`): batches staged,
    seconds waiting for the reader thread to read them, seconds staging them, the thread's CPU
    seconds in staging, and seconds announcing them. Zeros under other strategies; under
    inline staging all but the announcing. `CacheMetrics` logs them; the benchmarks read them
    too."""
    waits = getattr(trainer.strategy, "staging_waits", None)
    work = getattr(trainer.strategy, "staging_work", None)
    return {
        "staging_waits": 0 if waits is None else waits.batches, "staging_wait_s": 0.0 if waits is None else waits.seconds,
        "staged_batches": 0 if work is None else work.batches, "reading_s": 0.0 if work is None else work.reading_seconds,
        "staging_s": 0.0 if work is None else work.staging_seconds, "staging_cpu_s": 0.0 if work is None else work.staging_cpu_seconds,
        "announcing_s": 0.0 if work is None else work.announcing_seconds,
    }  # fmt: skip
