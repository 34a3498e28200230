"""StepClock: training throughput between a warm-up batch and the last batch of a fit (and
TurnClock, its variant for jobs that take turns: `turns`); the cache counters and the bare
Trainer the throughput benchmarks share."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import lightning.pytorch as pl
import torch
from torch import nn

if TYPE_CHECKING:
    from turns import Baton


class StepClock(pl.Callback):
    """Wall time and samples from the end of batch ``warmup - 1`` to the end of the last batch
    (of the epoch, or of ``max_steps``; set-up, table initialization and profiling fall before
    it; teardown after it).

    Args:
        warmup: batches before the timed window.
        probe: read at the start of the window (``at_start``) and after its last batch
            (``at_end``), e.g. counters to take differences of.
    """

    def __init__(self, warmup: int, probe: Callable[[], Any] | None = None) -> None:
        self.warmup = warmup
        self.probe = probe
        self.start = self.end = 0.0
        self.first_batch_at = 0.0  # when the first batch began: what came before it is set-up
        self.samples = 0
        self.at_start: Any = None
        self.at_end: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.first_batch_at = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup:
            self.samples += batch.labels.shape[0]
        last = is_last_batch(trainer)
        if batch_idx != self.warmup - 1 and not (last and batch_idx >= self.warmup):
            return
        # Only the window's two ends wait for the device (the step's kernels are queued, not
        # done, when the hook runs): a wait after every step would stop the host running ahead.
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        if batch_idx == self.warmup - 1:
            self.at_start = self.probe() if self.probe else None
            self.start = time.perf_counter()
        else:
            self.end = time.perf_counter()
            self.at_end = self.probe() if self.probe else None

    @property
    def samples_per_s(self) -> float:
        return self.samples / (self.end - self.start)


def is_last_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch that just ended is the fit's last: of the epoch, or of ``max_steps``."""
    return trainer.is_last_batch or 0 < trainer.max_steps <= trainer.global_step


class TurnClock(StepClock):
    """`StepClock` for a job that takes turns: its samples/s over the time it held the turn
    in its timed steps, and each block's (``blocks``). The warm-up's last batch hands the turn
    on before the timed steps start, so every job's set-up and warm-up precede every timed
    block; the last block keeps the turn (the job hands it on once its fit is over: `train_in_turns`).
    For CPU runs: unlike `StepClock` it never waits for a device's queued work."""

    def __init__(self, warmup: int, block: int, baton: Baton, probe: Callable[[], Any] | None = None) -> None:
        super().__init__(warmup, probe)
        if block < 1 or warmup < 1:
            raise ValueError(f"a turn is at least one step, after at least one warm-up step (block={block}, warmup={warmup})")
        self.block, self.baton = block, baton
        self.blocks: list[float] = []
        self.held = 0.0
        self._block_start = 0.0
        self._block_samples = 0

    def _next_turn(self) -> None:
        self.baton.hand_over()
        self.baton.take()
        self._block_start, self._block_samples = time.perf_counter(), 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx < self.warmup - 1:
            return
        if batch_idx == self.warmup - 1:
            self.at_start = self.probe() if self.probe else None
            self._next_turn()
            return
        samples = batch.labels.shape[0]
        self.samples += samples
        self._block_samples += samples
        last = is_last_batch(trainer)
        if not last and (batch_idx - self.warmup + 1) % self.block:
            return
        held = time.perf_counter() - self._block_start
        self.blocks.append(self._block_samples / held)
        self.held += held
        if last:
            self.at_end = self.probe() if self.probe else None
            return
        self._next_turn()

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.held


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096
    except OSError:
        return 0


def timed_trainer(strategy: Any, max_steps: int, clock: StepClock, accelerator: str = "cpu", precision: str = "32-true") -> pl.Trainer:
    """A Trainer that only trains on one device: no validation, logger, checkpoints, progress bar or summary."""
    return pl.Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, max_steps=max_steps, limit_val_batches=0, precision=precision,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[clock],
    )  # fmt: skip


def cache_counters(model: nn.Module) -> dict[str, int]:
    """Running totals summed over every hotcache table of ``model`` (zeros without one): lookups,
    hits, rows fetched, evicted, written back, read ahead and read and stepped in place in host
    memory, and the bytes those rows (with their optimizer state) moved host -> device and device
    -> host (a row stepped in place: once each way, at least)."""
    from lightning_hotcache.embedding import hot_cold_modules

    counted = ("lookups", "hits", "fetched_rows", "evicted_rows", "written_back_rows", "read_ahead_rows", "from_host_rows", "h2d_bytes", "d2h_bytes")
    out = dict.fromkeys(counted, 0)
    for module in hot_cold_modules(model).values():
        for cache in module.caches.values():
            c = cache.counters
            row_bytes = sum(t.shape[1] * t.element_size() for t in cache.slots.values())
            out["lookups"] += c.lookups
            out["hits"] += c.hits
            out["fetched_rows"] += c.fetched_rows
            out["evicted_rows"] += c.evicted_rows
            out["written_back_rows"] += c.written_back_rows
            out["read_ahead_rows"] += c.read_ahead_rows
            out["from_host_rows"] += c.from_host_rows
            out["h2d_bytes"] += (c.fetched_rows + c.from_host_rows) * row_bytes
            out["d2h_bytes"] += (c.written_back_rows + c.from_host_rows) * row_bytes
    return out


# What a results table says under a run whose caches were still filling (`still_filling`).
FILLING_NOTE = (
    "* the caches were still filling: fewer rows were evicted than fetched in the timed steps (a full cache evicts one "
    "for each), so they measured fewer victims and write-backs than a long run's steps pay; time more steps "
    "(--steps, --warmup) for the steady state."
)


def still_filling(moved: dict[str, float]) -> bool:
    """Whether the caches were (partly) filling over a window (differences of
    `cache_counters`): a full cache evicts a row for every row it fetches, so where fewer than
    9 in 10 fetched rows evicted one, the dynamic slots were still taking rows in and the window
    measured fewer victims and write-backs than a steady state pays every step (every 10% GPU
    figure before 2026-11-29: its timed steps evicted nothing)."""
    return moved["fetched_rows"] > 0 and moved["evicted_rows"] < 0.9 * moved["fetched_rows"]


def hit_rate_text(result: dict[str, Any]) -> str:
    """A result's hit rate as a results table shows it: ``-`` without a cache, marked ``*``
    where its caches were still filling (`FILLING_NOTE`)."""
    if result.get("hit_rate") is None:
        return "-"
    return f"{result['hit_rate']:.3f}{'*' if result.get('caches_filling') else ''}"


def print_filling_note(results: dict[str, dict[str, Any]]) -> None:
    """`FILLING_NOTE`, under a results table where a result's caches were still filling."""
    if any(r.get("caches_filling") for r in results.values()):
        print(FILLING_NOTE)
