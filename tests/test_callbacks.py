"""The callbacks' figures and the zoo's loss: what they measure, and on which steps they are logged."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from conftest import cpu_trainer, tiny_synthetic
from lightning.pytorch.loggers import CSVLogger

from lightning_hotcache import CacheMetrics, HotCacheStrategy, SamplesPerSecond
from lightning_hotcache.embedding import hot_cold_modules
from models import create_model

EVERY = 5  # log_every_n_steps: Lightning writes the logs of steps 4, 9, 14 (the 5th, 10th, 15th)


class Record(pl.Callback):
    """After each batch, every cache's lookups and hits so far; and each figure the callbacks
    logged, with the batch that logged it."""

    def __init__(self) -> None:
        self.lookups_and_hits: list[tuple[int, int]] = []
        self.logged: dict[str, list[int]] = {}
        self.split: set[str] = set()  # caches with a host tier
        self.whole: set[str] = set()  # tables wholly on the device

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for module in hot_cold_modules(pl_module).values():
            for name, cache in module.caches.items():
                (self.split if cache.host is not None else self.whole).add(name)
        log = pl_module.log

        def recording_log(name: str, *args: Any, **kwargs: Any) -> None:
            self.logged.setdefault(name, []).append(trainer.fit_loop.epoch_loop.batch_idx)
            log(name, *args, **kwargs)

        pl_module.log = recording_log  # type: ignore[method-assign]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        counters = [c.counters for m in hot_cold_modules(pl_module).values() for c in m.caches.values()]
        self.lookups_and_hits.append((sum(c.lookups for c in counters), sum(c.hits for c in counters)))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Record, dict[int, dict[str, str]]]:
    pl.seed_everything(0)
    # Tables up to ~100k rows against batches of 64, so a 10% budget really splits them.
    dm = tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=1024, num_val_samples=512, batch_size=64)
    model = create_model("dlrm", dm.tables, dm.num_dense_features)
    record = Record()
    logger = CSVLogger(tmp_path_factory.mktemp("logs"))
    trainer = cpu_trainer(strategy=HotCacheStrategy(device_budget=0.1, profile_batches=4), max_steps=3 * EVERY, log_every_n_steps=EVERY,
                          logger=logger, callbacks=[CacheMetrics(), SamplesPerSecond(), record])  # fmt: skip
    trainer.fit(model, dm)
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        written = {int(row["step"]): {k: v for k, v in row.items() if v} for row in csv.DictReader(f)}
    return record, written


def test_cache_metrics_written_cover_the_steps_up_to_the_written_one(fitted) -> None:
    """The hit rate written with a step is that of the batches since the last written one, not
    of a window that ended steps before (at batch 0, 5, ..., as it once did)."""
    record, written = fitted
    hit_rates = {step: float(row["cache/hit_rate"]) for step, row in written.items() if "cache/hit_rate" in row}

    def hit_rate(first: int, last: int) -> float:  # of batches first..last
        (lookups_before, hits_before), (lookups, hits) = record.lookups_and_hits[first - 1], record.lookups_and_hits[last]
        return (hits - hits_before) / (lookups - lookups_before)

    expected = {4: hit_rate(1, 4), 9: hit_rate(5, 9), 14: hit_rate(10, 14)}  # batch 0 is logged alone, for the bar
    assert len(set(expected.values())) == 3  # windows that tell each other apart
    assert hit_rates == pytest.approx(expected, rel=1e-6)
    assert record.logged["cache/hit_rate"] == [0, 4, 9, 14]


def test_cache_metrics_log_per_table_hit_rates_of_split_tables_only(fitted) -> None:
    """A table wholly on the device hits every time: no figure of its own."""
    record, written = fitted
    per_table = {name for name in record.logged if name.startswith("cache/") and name.count("/") == 2}
    assert per_table == {f"cache/{name}/hit_rate" for name in record.split}
    assert record.split and record.whole  # the fit has both kinds


def test_samples_per_second_is_logged_once_for_the_bar_then_where_lightning_writes(fitted) -> None:
    """The first batch of an epoch is not timed, so the second shows the first figure; then only
    the steps whose logs Lightning writes log it (a ``self.log`` is ~1 ms of Python)."""
    record, written = fitted
    assert record.logged["train/samples_per_s"] == [1, 4, 9, 14]
    assert sorted(step for step, row in written.items() if float(row.get("train/samples_per_s", 0)) > 0) == [4, 9, 14]


def test_the_zoo_logs_its_loss_on_the_first_step_and_where_lightning_writes(fitted) -> None:
    record, written = fitted
    assert record.logged["train/loss"] == [0, 4, 9, 14]
    assert sorted(step for step, row in written.items() if "train/loss" in row) == [4, 9, 14]
