"""Access profiling: count how often each embedding row is read, to choose the hot rows.

FAE's observation is that CTR lookups are heavily skewed, so a profile of a sample of the
input tells which rows deserve the scarce device memory. `AccessProfiler` observes
torchrec `KeyedJaggedTensor` batches and counts, per embedding table, every id of every
feature that table serves; `AccessStats` answers the planner's questions (the hottest rows,
which fraction of lookups the hottest ``r`` rows cover, how many distinct rows a batch
needs) and saves to a pickle-free ``.npz`` file tied to the tables it was measured on.

A table whose int64 count array fits ``exact_max_bytes`` is counted exactly. A larger table
gets a bounded-memory SpaceSaving heavy-hitter sketch (Metwally et al., 2005) updated one
batch at a time: with ``capacity`` counters and ``N`` lookups of that table, every row read
more than ``N / capacity`` times is kept, each kept count overestimates its row's true count
by at most ``error_bound(table) <= N / capacity``, and a row not kept was read at most
``error_bound(table)`` times. Sketches of the same tables merge (`AccessStats.merge`) with the
same guarantee over the combined lookups, so ranks can profile their shards separately.

Lookups are counted, not weighted: a weighted KJT's per-id weights are ignored, because what
the cache pays for is each read of a row.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
import zipfile
import zlib
from collections.abc import Iterable, Sequence, Sized
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from torchrec import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

FORMAT_VERSION = 1
_FORMAT_NAME = "lightning_hotcache.AccessStats"
_REPROFILE = "profile again with `hotcache profile`"
_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class TableSignature:
    """What access statistics are valid for: a table's name, shape and the features it serves."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]

    @classmethod
    def from_config(cls, config: EmbeddingBagConfig) -> TableSignature:
        return cls(
            name=str(config.name),
            num_embeddings=int(config.num_embeddings),
            embedding_dim=int(config.embedding_dim),
            feature_names=tuple(str(f) for f in config.feature_names),
        )

    def differences(self, model: TableSignature) -> list[str]:
        """How this (profiled) table differs from the model's table of the same name."""
        diffs = []
        if self.num_embeddings != model.num_embeddings:
            diffs.append(
                f"table {self.name} has {self.num_embeddings} rows in the stats but {model.num_embeddings} in the model"
            )
        if self.embedding_dim != model.embedding_dim:
            diffs.append(
                f"table {self.name} has embedding_dim {self.embedding_dim} in the stats "
                f"but {model.embedding_dim} in the model"
            )
        if self.feature_names != model.feature_names:
            diffs.append(
                f"table {self.name} reads features {list(self.feature_names)} in the stats "
                f"but {list(model.feature_names)} in the model"
            )
        return diffs


def _signatures(tables: Sequence[EmbeddingBagConfig | TableSignature]) -> tuple[TableSignature, ...]:
    sigs = tuple(t if isinstance(t, TableSignature) else TableSignature.from_config(t) for t in tables)
    names = [s.name for s in sigs]
    if len(set(names)) != len(names):
        raise ValueError(f"Table names must be unique, got {names}.")
    return sigs


# Written by hand: no installed package (numpy, torch, torchrec, torchmetrics, ...) has a heavy-hitter
# sketch; Apache DataSketches' frequent-items sketch merges, but its Python binding takes one item per
# call and would add a compiled dependency for ~30 lines of numpy.
def _space_saving_merge(
    a_ids: np.ndarray,
    a_counts: np.ndarray,
    a_floor: int,
    b_ids: np.ndarray,
    b_counts: np.ndarray,
    b_floor: int,
    capacity: int | None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Merge two SpaceSaving summaries (ids sorted ascending) into one of at most ``capacity`` ids.

    A summary's ``floor`` bounds both the count of any id it does not hold and the
    overestimate of any count it holds (0 for an exact count). An id missing from one side
    gets that side's floor, the sums are the candidates, and the ``capacity`` largest stay.
    The kept counts sum to at most the lookups of both sides (an id added for lack of a
    counter is paid for by a dropped counter at least as large), so the new floor, the
    smallest kept count, stays <= N / capacity. A batch is an exact summary (floor 0), so one
    batch update is one merge: O(capacity + batch) with no sort of the sketch.
    """
    pos = np.searchsorted(a_ids, b_ids)
    hit = np.zeros(len(b_ids), dtype=bool)
    inside = pos < len(a_ids)
    hit[inside] = a_ids[pos[inside]] == b_ids[inside]
    counts = a_counts + b_floor
    counts[pos[hit]] += b_counts[hit] - b_floor
    new = ~hit
    ids = np.insert(a_ids, pos[new], b_ids[new])
    counts = np.insert(counts, pos[new], b_counts[new] + a_floor)
    excess = len(ids) - capacity if capacity is not None else 0
    if excess <= 0:
        return ids, counts, a_floor + b_floor
    keep = np.ones(len(ids), dtype=bool)
    keep[np.argpartition(counts, excess - 1)[:excess]] = False
    ids, counts = ids[keep], counts[keep]
    return ids, counts, int(counts.min())


@dataclass
class _TableStats:
    """One table's profile: the ids read (hottest first) with their (estimated) counts."""

    signature: TableSignature
    ids: np.ndarray
    counts: np.ndarray
    num_lookups: int
    unique_total: int
    unique_max: int
    error_bound: int = 0
    capacity: int | None = None  # None: exact counts
    cumulative: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        order = np.lexsort((self.ids, -self.counts))  # hottest first, ties by id for determinism
        self.ids = np.ascontiguousarray(self.ids[order], dtype=np.int64)
        self.counts = np.ascontiguousarray(self.counts[order], dtype=np.int64)
        self.cumulative = np.concatenate([[0], np.cumsum(self.counts)])
        for array in (self.ids, self.counts, self.cumulative):
            array.flags.writeable = False  # top_ids hands these out without copying

    @property
    def exact(self) -> bool:
        return self.capacity is None

    def covered(self, num_rows: np.ndarray) -> np.ndarray:
        """Lookups covered by the hottest ``num_rows`` rows (an upper bound for a sketch)."""
        stored = len(self.ids)
        covered = self.cumulative[np.minimum(num_rows, stored)]
        # Rows a sketch does not hold were read at most error_bound times each (0 when exact).
        covered = covered + np.maximum(num_rows - stored, 0) * self.error_bound
        return np.minimum(covered, self.num_lookups)

    def full_coverage_rows(self) -> int:
        """Fewest rows at which covered() reaches every lookup."""
        stored = len(self.ids)
        tail = self.num_lookups - int(self.cumulative[-1])
        if tail > 0 and self.error_bound > 0:
            stored += math.ceil(tail / self.error_bound)
        return min(stored, self.signature.num_embeddings)


class AccessStats:
    """Per-table access counts measured by `AccessProfiler` (or loaded with `AccessStats.load`).

    Attributes:
        tables: the signatures of the profiled tables, in profiling order.
        num_batches: batches observed (counted).
        num_batches_seen: batches offered to the profiler, observed or skipped by sampling.
        batch_size: samples in the largest observed batch (None: no batch observed, or a
            file written before batch sizes were recorded). The unique rows per batch, which
            size the cache, hold for this batch size only.
    """

    def __init__(
        self,
        table_stats: Sequence[_TableStats],
        num_batches: int,
        num_batches_seen: int,
        batch_size: int | None = None,
    ) -> None:
        self.tables: tuple[TableSignature, ...] = _signatures([t.signature for t in table_stats])
        self._by_name = {t.signature.name: t for t in table_stats}
        self.num_batches = int(num_batches)
        self.num_batches_seen = int(num_batches_seen)
        self.batch_size = None if batch_size is None else int(batch_size)

    def _table(self, table: str) -> _TableStats:
        try:
            return self._by_name[table]
        except KeyError:
            raise KeyError(f"No table {table!r} in these stats; tables: {', '.join(self._by_name)}.") from None

    @property
    def num_lookups(self) -> dict[str, int]:
        """Ids read per table (every id of every bag, duplicates included)."""
        return {name: t.num_lookups for name, t in self._by_name.items()}

    def is_exact(self, table: str) -> bool:
        return self._table(table).exact

    def error_bound(self, table: str) -> int:
        """Most any reported count can exceed the true count (0 when exact; <= lookups / capacity)."""
        return self._table(table).error_bound

    def top_ids(self, table: str, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` (default: all) most-read ids of a table and their counts, hottest first.

        Only ids read at least once appear. For a sketched table these are the ids the sketch
        holds, with counts that overestimate by at most ``error_bound(table)``.
        """
        t = self._table(table)
        if k is not None and k < 0:
            raise ValueError(f"k must be >= 0, got {k}.")
        return t.ids[:k], t.counts[:k]

    def coverage(self, table: str, num_rows: int | np.ndarray) -> float | np.ndarray:
        """Fraction of a table's lookups served by its hottest ``num_rows`` rows.

        Monotone in ``num_rows``: 0 at 0 rows, 1 once every row read is included (0
        everywhere if the table was never read). For a sketched table it is an estimate from
        above: the estimated counts of the held ids, then ``error_bound`` per further row,
        capped at 1. It exceeds the coverage that the sketch's own top rows achieve by at
        most ``num_rows * error_bound / lookups``.
        """
        t = self._table(table)
        rows = np.asarray(num_rows, dtype=np.int64)
        if np.any(rows < 0):
            raise ValueError(f"num_rows must be >= 0, got {num_rows}.")
        fraction = t.covered(rows) / t.num_lookups if t.num_lookups else np.zeros(rows.shape)
        return float(fraction) if fraction.ndim == 0 else fraction

    def coverage_curve(self, table: str, num_points: int = 256) -> tuple[np.ndarray, np.ndarray]:
        """Points ``(num_rows, fraction)`` of the coverage curve, spaced geometrically in rows.

        Starts at (0, 0), reaches 1 at the fewest rows that cover every lookup and ends at
        the table's size, so it suits a log-scale plot and interpolation by a planner.
        """
        t = self._table(table)
        full = t.full_coverage_rows()
        rows = np.geomspace(1, max(full, 1), num=max(num_points, 2)).round().astype(np.int64)
        rows = np.unique(np.concatenate([[0], rows, [full, t.signature.num_embeddings]]))
        return rows, np.asarray(self.coverage(table, rows), dtype=np.float64)

    def unique_rows_per_batch(self, table: str) -> tuple[float, int]:
        """Mean and max number of distinct ids of this table per observed batch."""
        t = self._table(table)
        mean = t.unique_total / self.num_batches if self.num_batches else 0.0
        return mean, t.unique_max

    def check_tables(self, tables: Sequence[EmbeddingBagConfig | TableSignature]) -> None:
        """Raise ValueError, saying which table differs and how, unless these stats are for ``tables``."""
        model = {s.name: s for s in _signatures(tables)}
        problems = [f"table {n} is in the stats but not in the model" for n in self._by_name if n not in model]
        problems += [f"table {n} is in the model but not in the stats" for n in model if n not in self._by_name]
        for name, sig in model.items():
            if name in self._by_name:
                problems += self._by_name[name].signature.differences(sig)
        if problems:
            raise ValueError(f"Access stats do not match the model: {'; '.join(problems)}: {_REPROFILE}.")

    def check_run(self, tables: Sequence[EmbeddingBagConfig | TableSignature], batch_size: int | None = None) -> None:
        """Raise ValueError, saying what to do, unless these stats can plan a run of ``tables``
        with batches of ``batch_size`` samples (None: not compared): the same tables, at least
        one batch observed, and the same batch size, since the unique rows per batch that size
        the cache grow with it."""
        self.check_tables(tables)
        if self.num_batches == 0:
            hint = ": raise sample_fraction" if self.num_batches_seen else ""
            raise ValueError(
                f"Access stats hold no batches ({self.num_batches_seen} seen, none observed{hint}), so they "
                f"cannot tell how many rows a batch reads: {_REPROFILE} over some training batches."
            )
        if self.batch_size is None:
            raise ValueError(
                f"Access stats do not record their batch size (written by an older lightning_hotcache): {_REPROFILE}."
            )
        if batch_size is not None and batch_size != self.batch_size:
            raise ValueError(
                f"Access stats were profiled with batches of {self.batch_size} samples but this run's batches have "
                f"{batch_size}; the rows a batch reads, which size the cache, differ: {_REPROFILE} with the run's "
                "batch size."
            )

    def merge(self, other: AccessStats) -> AccessStats:
        """Stats over the batches of both (e.g. ranks that profiled different shards).

        Exact tables add up exactly; if either side sketched a table, the result is a
        sketch with the smaller capacity and the same guarantee over the combined lookups.
        """
        other.check_tables(self.tables)
        merged = []
        for sig in self.tables:
            a, b = self._by_name[sig.name], other._by_name[sig.name]
            capacities = [c for c in (a.capacity, b.capacity) if c is not None]
            capacity = min(capacities) if capacities else None
            a_order, b_order = np.argsort(a.ids), np.argsort(b.ids)
            ids, counts, floor = _space_saving_merge(
                a.ids[a_order], a.counts[a_order], a.error_bound,
                b.ids[b_order], b.counts[b_order], b.error_bound,
                capacity,
            )  # fmt: skip
            merged.append(
                _TableStats(
                    signature=sig,
                    ids=ids,
                    counts=counts,
                    num_lookups=a.num_lookups + b.num_lookups,
                    unique_total=a.unique_total + b.unique_total,
                    unique_max=max(a.unique_max, b.unique_max),
                    error_bound=floor,
                    capacity=capacity,
                )
            )
        sizes = [s for s in (self.batch_size, other.batch_size) if s is not None]
        return AccessStats(
            merged,
            self.num_batches + other.num_batches,
            self.num_batches_seen + other.num_batches_seen,
            max(sizes) if sizes else None,
        )

    def summary(self) -> str:
        """A plain-text table: per table rows, lookups, distinct ids read, top-1%/10% coverage, method."""
        header = ("table", "rows", "lookups", "distinct", "top 1%", "top 10%", "uniq/batch", "counts")
        lines = []
        for sig in self.tables:
            t = self._by_name[sig.name]
            # A full sketch holds only some of the ids read, so their number is a lower bound.
            distinct = f">={len(t.ids):,}" if not t.exact and t.error_bound > 0 else f"{len(t.ids):,}"
            top1, top10 = (self.coverage(sig.name, max(1, round(f * sig.num_embeddings))) for f in (0.01, 0.1))
            mean_unique, _ = self.unique_rows_per_batch(sig.name)
            method = "exact" if t.exact else f"sketch({t.capacity:,}) err<={t.error_bound:,}"
            lines.append(
                (
                    sig.name,
                    f"{sig.num_embeddings:,}",
                    f"{t.num_lookups:,}",
                    distinct,
                    f"{top1:.1%}",
                    f"{top10:.1%}",
                    f"{mean_unique:,.1f}",
                    method,
                )
            )
        widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]

        def fmt(row: tuple[str, ...]) -> str:  # names and methods left-aligned, numbers right-aligned
            last = len(row) - 1
            return "  ".join(c.ljust(w) if i in (0, last) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

        size = "" if self.batch_size is None else f" of {self.batch_size:,}"
        title = f"Access stats: {self.num_batches:,} batches{size} observed of {self.num_batches_seen:,} seen"
        return "\n".join([title, *(fmt(row).rstrip() for row in [header, *lines])])

    def __repr__(self) -> str:
        return (
            f"AccessStats(tables={[t.name for t in self.tables]}, num_batches={self.num_batches}, "
            f"batch_size={self.batch_size})"
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a compressed ``.npz`` (plain arrays and a JSON header, no pickle), atomically."""
        path = Path(path)
        meta = {
            "format": _FORMAT_NAME,
            "num_batches": self.num_batches,
            "num_batches_seen": self.num_batches_seen,
            "batch_size": self.batch_size,
            "tables": [
                {
                    "name": t.signature.name,
                    "num_embeddings": t.signature.num_embeddings,
                    "embedding_dim": t.signature.embedding_dim,
                    "feature_names": list(t.signature.feature_names),
                    "num_lookups": t.num_lookups,
                    "unique_total": t.unique_total,
                    "unique_max": t.unique_max,
                    "error_bound": t.error_bound,
                    "capacity": t.capacity,
                }
                for t in self._by_name.values()
            ],
        }
        arrays: dict[str, np.ndarray] = {"format_version": np.array(FORMAT_VERSION), "meta": np.array(json.dumps(meta))}
        for i, t in enumerate(self._by_name.values()):
            arrays[f"ids_{i}"], arrays[f"counts_{i}"] = t.ids, t.counts
        # A file object keeps numpy from appending ".npz"; the rename keeps a reader from seeing half a file.
        if not path.parent.is_dir():  # else mkstemp's error names the hidden temporary file
            raise FileNotFoundError(f"cannot save {path}: the folder {path.parent} does not exist")
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez_compressed(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], tables: Sequence[EmbeddingBagConfig | TableSignature] | None = None
    ) -> AccessStats:
        """Read stats written by `save`; with ``tables``, also check they were measured on those tables."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No access-stats file at {path}.")
        try:
            stats = cls._read(path)
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile, zlib.error) as err:
            raise ValueError(f"{path} is not a readable access-stats file ({err}): {_REPROFILE}.") from err
        if tables is not None:
            stats.check_tables(tables)
        return stats

    @classmethod
    def _read(cls, path: Path) -> AccessStats:
        with np.load(path, allow_pickle=False) as npz:
            version = int(npz["format_version"])
            if version != FORMAT_VERSION:
                raise ValueError(f"format version {version}, this lightning_hotcache reads version {FORMAT_VERSION}")
            meta = json.loads(str(npz["meta"]))
            if meta.get("format") != _FORMAT_NAME:
                raise ValueError(f"format {meta.get('format')!r} is not {_FORMAT_NAME!r}")
            table_stats = []
            for i, entry in enumerate(meta["tables"]):
                sig = TableSignature(
                    name=str(entry["name"]),
                    num_embeddings=int(entry["num_embeddings"]),
                    embedding_dim=int(entry["embedding_dim"]),
                    feature_names=tuple(str(f) for f in entry["feature_names"]),
                )
                ids, counts = npz[f"ids_{i}"], npz[f"counts_{i}"]
                if ids.ndim != 1 or ids.shape != counts.shape or ids.dtype != np.int64 or counts.dtype != np.int64:
                    raise ValueError(f"table {sig.name}: ids and counts must be 1-d int64 arrays of one length")
                if len(ids) and (ids.min() < 0 or ids.max() >= sig.num_embeddings or counts.min() <= 0):
                    raise ValueError(f"table {sig.name}: ids or counts out of range")
                if len(np.unique(ids)) != len(ids) or counts.sum() > int(entry["num_lookups"]):
                    raise ValueError(f"table {sig.name}: repeated ids or counts above the lookups")
                capacity = entry["capacity"]
                table_stats.append(
                    _TableStats(
                        signature=sig,
                        ids=ids,
                        counts=counts,
                        num_lookups=int(entry["num_lookups"]),
                        unique_total=int(entry["unique_total"]),
                        unique_max=int(entry["unique_max"]),
                        error_bound=int(entry["error_bound"]),
                        capacity=None if capacity is None else int(capacity),
                    )
                )
            # Absent from files written before batch sizes were recorded: they load, but `check_run` refuses them.
            batch_size = meta.get("batch_size")
            if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
                raise ValueError(f"batch_size {batch_size!r} is not a positive integer")
        return cls(table_stats, int(meta["num_batches"]), int(meta["num_batches_seen"]), batch_size)


class _TableCounter:
    """Running counts of one table: a dense int64 array, or a SpaceSaving sketch."""

    def __init__(self, signature: TableSignature, exact: bool, capacity: int) -> None:
        self.signature = signature
        self.capacity: int | None = None if exact else capacity
        self.dense = np.zeros(signature.num_embeddings, dtype=np.int64) if exact else None
        # The sketch: held ids sorted ascending (so a batch merges in by searchsorted) and their counts.
        self.ids = np.zeros(0, dtype=np.int64)
        self.counts = np.zeros(0, dtype=np.int64)
        self.floor = 0
        self.num_lookups = 0
        self.unique_total = 0
        self.unique_max = 0

    def add(self, ids: np.ndarray) -> None:
        n = self.signature.num_embeddings
        if self.dense is not None and n <= 8 * len(ids):
            # Small table, big batch: one O(rows) bincount beats sorting the batch.
            batch_counts = np.bincount(ids, minlength=n)
            self.dense += batch_counts
            unique = int(np.count_nonzero(batch_counts))
        else:
            batch_ids, batch_counts = np.unique(ids, return_counts=True)
            unique = len(batch_ids)
            if self.dense is not None:
                self.dense[batch_ids] += batch_counts  # ids are unique, so plain fancy-index add is exact
            else:
                self.ids, self.counts, self.floor = _space_saving_merge(
                    self.ids, self.counts, self.floor, batch_ids.astype(np.int64), batch_counts, 0, self.capacity
                )
        self.num_lookups += len(ids)
        self.unique_total += unique
        self.unique_max = max(self.unique_max, unique)

    def snapshot(self) -> _TableStats:
        if self.dense is not None:
            ids = np.flatnonzero(self.dense)
            counts = self.dense[ids]
        else:
            ids, counts = self.ids, self.counts
        return _TableStats(
            signature=self.signature,
            ids=ids,
            counts=counts,
            num_lookups=self.num_lookups,
            unique_total=self.unique_total,
            unique_max=self.unique_max,
            error_bound=self.floor,
            capacity=self.capacity,
        )


class AccessProfiler:
    """Counts row reads per embedding table over `KeyedJaggedTensor` batches.

    Args:
        tables: the model's table configs (torchrec ``EmbeddingBagConfig``); every feature a
            table lists counts into that table (into each of them, for a feature several
            tables read), features no table lists are ignored.
        exact_max_bytes: a table whose int64 count array (8 bytes a row) fits this is
            counted exactly; a larger one gets a SpaceSaving sketch.
        sketch_capacity: counters per sketched table. Guarantee, with N lookups of the
            table: every row read more than N / capacity times is held, and every held
            count overestimates by at most ``error_bound <= N / capacity``.
        sample_fraction: observe only this fraction of batches, FAE-style: batch ``i``
            (0-based, counting every call to `observe`) is observed iff the ``i``-th draw of
            ``np.random.default_rng(seed).random()`` is below it. Skipped batches are not
            validated.
        seed: seeds the batch sampling.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig | TableSignature],
        exact_max_bytes: int = 64 * 2**20,
        sketch_capacity: int = 65_536,
        sample_fraction: float = 1.0,
        seed: int = 0,
    ) -> None:
        if sketch_capacity < 1:
            raise ValueError(f"sketch_capacity must be >= 1, got {sketch_capacity}.")
        if not 0.0 < sample_fraction <= 1.0:
            raise ValueError(f"sample_fraction must be in (0, 1], got {sample_fraction}.")
        self.tables = _signatures(tables)
        self.sample_fraction = sample_fraction
        self._rng = np.random.default_rng(seed)
        self._counters = [
            _TableCounter(sig, exact=sig.num_embeddings * 8 <= exact_max_bytes, capacity=sketch_capacity)
            for sig in self.tables
        ]
        # A feature may feed several tables, as TorchRec allows (e.g. a model's first-order tables).
        self._feature_tables: dict[str, list[int]] = {}
        for index, sig in enumerate(self.tables):
            for feature in sig.feature_names:
                self._feature_tables.setdefault(feature, []).append(index)
        self.num_batches = 0
        self.num_batches_seen = 0
        self.batch_size: int | None = None

    def observe(self, features: KeyedJaggedTensor) -> None:
        """Count every id of every table feature in ``features`` (weights, if any, are ignored).

        Raises:
            TypeError: ``features`` is not a KeyedJaggedTensor or its ids are not integers.
            ValueError: an id is outside its table; nothing of this batch is counted then.
        """
        if not all(hasattr(features, a) for a in ("keys", "values", "length_per_key")):
            raise TypeError(f"AccessProfiler.observe expects a KeyedJaggedTensor, got {type(features).__name__}.")
        self.num_batches_seen += 1
        if self.sample_fraction < 1.0 and self._rng.random() >= self.sample_fraction:
            return
        values = features.values()
        if values.dtype not in _INTEGER_DTYPES:
            raise TypeError(f"Embedding ids must be integers, got a KeyedJaggedTensor with {values.dtype} values.")
        ids = values.detach().cpu().numpy()
        per_table: list[list[np.ndarray]] = [[] for _ in self.tables]
        start = 0
        # Validate the whole batch before counting any of it, so an error leaves the counts untouched.
        for feature, length in zip(features.keys(), features.length_per_key()):
            chunk, start = ids[start : start + length], start + length
            if not len(chunk):
                continue
            for index in self._feature_tables.get(feature, []):
                rows = self.tables[index].num_embeddings
                if chunk.min() < 0 or chunk.max() >= rows:
                    bad = chunk[np.flatnonzero((chunk < 0) | (chunk >= rows))[0]]
                    raise ValueError(
                        f"Feature {feature!r} of table {self.tables[index].name} has id {bad}, "
                        f"outside the table's rows [0, {rows})."
                    )
                per_table[index].append(chunk)
        for counter, chunks in zip(self._counters, per_table):
            counter.add(np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64))
        self.num_batches += 1
        self.batch_size = max(self.batch_size or 0, _samples_in(features))

    def stats(self) -> AccessStats:
        """A snapshot of the counts so far (the profiler can keep observing)."""
        return AccessStats(
            [c.snapshot() for c in self._counters], self.num_batches, self.num_batches_seen, self.batch_size
        )


def _samples_in(features: KeyedJaggedTensor) -> int:
    """Samples in a batch: the bags per feature of its sparse features."""
    return int(features.stride())


def run_batch_size(batches: Iterable[Any]) -> int | None:
    """The full batch size of a run whose batches (torchrec ``Batch`` objects or KJTs) these
    are: the larger of the first two (an epoch has at most one short batch, its last, which a
    shuffled order may put first); None when there is none. What a run's stats or plan (whose
    profile recorded its largest batch) are checked against."""
    sizes = [_samples_in(getattr(batch, "sparse_features", batch)) for batch in itertools.islice(batches, 2)]
    return max(sizes, default=None)


def profile_batches(
    batches: Iterable[Any],
    tables: Sequence[EmbeddingBagConfig | TableSignature],
    max_batches: int | None = None,
    progress: bool = True,
    **profiler_kwargs: Any,
) -> AccessStats:
    """Profile an iterable of torchrec ``Batch`` objects (their ``sparse_features``) or KJTs.

    ``max_batches`` bounds the batches taken from ``batches`` (sampled or not); ``progress``
    shows a tqdm bar with batches/s on stderr. ``profiler_kwargs`` go to `AccessProfiler`.
    """
    from tqdm.auto import tqdm

    if max_batches is not None and max_batches < 0:
        raise ValueError(f"max_batches must be >= 0, got {max_batches}.")
    profiler = AccessProfiler(tables, **profiler_kwargs)
    total = len(batches) if isinstance(batches, Sized) else None
    if max_batches is not None:
        total = max_batches if total is None else min(total, max_batches)
    # islice, not a break: a data loader must not load a batch beyond max_batches.
    for batch in tqdm(islice(batches, max_batches), total=total, desc="profiling", unit="batch", disable=not progress):
        profiler.observe(getattr(batch, "sparse_features", batch))
    return profiler.stats()


def plot_coverage(stats: AccessStats, path: str | os.PathLike[str]) -> None:
    """Save the coverage curves of all tables: x = fraction of table rows (log), y = fraction of lookups."""
    # The object API with an Agg canvas leaves pyplot's global backend and figure list alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    many = len(stats.tables) > 8  # then the legend goes beside the axes, not over the curves
    fig = Figure(figsize=(9.5 if many else 7.0, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for sig in stats.tables:
        rows, fraction = stats.coverage_curve(sig.name)
        exact = stats.is_exact(sig.name)
        ax.plot(
            rows[1:] / sig.num_embeddings,  # drop (0, 0): no place on a log axis
            fraction[1:],
            linestyle="-" if exact else "--",
            label=sig.name if exact else f"{sig.name} (sketch)",
        )
    ax.set_xscale("log")
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("fraction of table rows (hottest first)")
    ax.set_ylabel("fraction of lookups covered")
    ax.set_title(f"Access coverage ({stats.num_batches:,} batches)")
    ax.grid(True, which="both", alpha=0.3)
    if many:
        ax.legend(fontsize="small", ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    elif stats.tables:
        ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)


__all__ = ["AccessProfiler", "AccessStats", "TableSignature", "run_batch_size", "plot_coverage", "profile_batches"]
