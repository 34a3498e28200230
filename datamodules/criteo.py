"""Criteo click logs (Kaggle Display Advertising Challenge, Terabyte) as a CTR datamodule.

Two inputs: raw TSV (label, 13 integer, 26 hex categorical columns, empty = missing), parsed once
into numpy arrays in ``setup``, or the ``*_dense.npy`` / ``*_sparse.npy`` / ``*_labels.npy`` triples
written by ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys``, memory-mapped and read
per batch (the fast path for the full datasets). Categorical values are hashed to table rows by
``value mod rows``; the data is time-ordered, so val and test are contiguous tail slices.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, NamedTuple, Optional, Union

import numpy as np
from torch.utils.data import DataLoader
from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    INT_FEATURE_COUNT,
    BinaryCriteoUtils,
)
from torchrec.datasets.utils import Batch
from typing_extensions import override

from datamodules.base import CTRDataModule, Split, check_fractions, make_batch, split_ranges
from lightning_hotcache.distributed.global_batch import BatchShare

NUM_COLUMNS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
NPY_SUFFIXES = ("_dense.npy", "_sparse.npy", "_labels.npy")
# Fast path: a well-formed line; only lines that fail it are diagnosed field by field.
_LINE = re.compile(r"[01]" + r"\t(?:-?\d+)?" * INT_FEATURE_COUNT + r"\t[0-9a-fA-F]*" * CAT_FEATURE_COUNT)
_INT = re.compile(r"(?:-?\d+)?")
_HEX = re.compile(r"[0-9a-fA-F]*")
# Criteo Terabyte files are named day_0 .. day_23, without extension.
_TSV_NAME = re.compile(r".*\.(tsv|txt)|day_\d+")


def _natural_key(path: Path) -> list[Union[int, str]]:
    """day_2 before day_10: keeps time order of numbered files."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def _line_error(path: Path, lineno: int, fields: list[str], labeled: bool = True) -> ValueError:
    where = f"{path}, line {lineno}"
    if not labeled and len(fields) != NUM_COLUMNS:  # "0" put before the line's fields
        problem = (
            f"expected {NUM_COLUMNS - 1} tab-separated columns ({INT_FEATURE_COUNT} integer, {CAT_FEATURE_COUNT} hex "
            f"categorical: no label, as the file's first line), got {len(fields) - 1}"
        )
    elif len(fields) != NUM_COLUMNS:
        problem = (
            f"expected {NUM_COLUMNS} tab-separated columns (label, {INT_FEATURE_COUNT} integer, "
            f"{CAT_FEATURE_COUNT} hex categorical), got {len(fields)}"
        )
    elif fields[0] not in ("0", "1"):
        problem = f"label must be 0 or 1, got {fields[0]!r}"
    else:
        col = next(
            c for c in range(1, NUM_COLUMNS) if not (_INT if c <= INT_FEATURE_COUNT else _HEX).fullmatch(fields[c])
        )
        kind = "an integer" if col <= INT_FEATURE_COUNT else "hexadecimal"
        problem = f"column {col + 1} must be {kind} or empty, got {fields[col]!r}"
    return ValueError(f"malformed Criteo line ({where}): {problem}")


def parse_tsv(path: Path, rows: np.ndarray, unlabeled: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse one Criteo TSV file into (dense log(1 + max(x, 0)) float32 (N, 13), ids (N, 26), labels (N,)).

    Missing fields are 0 before the transforms (as torchrec does); ids are already ``value mod rows``.
    Blank lines are skipped; any other malformed line raises ValueError with file and line number.
    ``unlabeled``: a file whose first line has no label column (39 columns, as Criteo Kaggle's
    ``test.txt``) is read with labels 0, every line the same way (data to predict on).
    """
    dense: list[list[int]] = []
    sparse: list[list[int]] = []
    labels: list[int] = []
    table_rows = rows.tolist()
    labeled: bool | None = None  # decided by the first line
    with open(path, encoding="ascii", errors="replace", newline="") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if not line:
                continue
            if labeled is None:
                labeled = not unlabeled or line.count("\t") != NUM_COLUMNS - 2
            if not labeled:
                line = "0\t" + line
            fields = line.split("\t")
            if not _LINE.fullmatch(line):
                raise _line_error(path, lineno, fields, labeled)
            labels.append(int(fields[0]))
            dense.append([int(x or 0) for x in fields[1 : 1 + INT_FEATURE_COUNT]])
            sparse.append([int(x or "0", 16) % r for x, r in zip(fields[1 + INT_FEATURE_COUNT :], table_rows)])
    dense_np = np.log1p(np.maximum(np.array(dense, dtype=np.float64).reshape(-1, INT_FEATURE_COUNT), 0.0))
    return (
        dense_np.astype(np.float32),
        np.array(sparse, dtype=np.int64).reshape(-1, CAT_FEATURE_COUNT),
        np.array(labels, dtype=np.float32),
    )


class _ArrayPart(NamedTuple):
    """Rows held in memory (parsed TSV)."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.labels)

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.dense[start:stop], self.sparse[start:stop], self.labels[start:stop]


class _NpyPart(NamedTuple):
    """Rows of one ``<prefix>_{dense,sparse,labels}.npy`` triple, memory-mapped per read (no handles to pickle)."""

    prefix: str
    num_rows: int

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dense, sparse, labels = (
            BinaryCriteoUtils.load_npy_range(self.prefix + s, start, stop - start, mmap_mode=True) for s in NPY_SUFFIXES
        )
        return dense, sparse, labels.reshape(-1)


_Part = Union[_ArrayPart, _NpyPart]


class _CriteoSplit:
    """Rows ``[first, last)`` of the files laid end to end."""

    def __init__(self, parts: list[_Part], first: int, last: int, rows: np.ndarray) -> None:
        self.parts, self.first, self.last, self.rows = parts, first, last, rows

    def __len__(self) -> int:
        return self.last - self.first

    def batch(self, start: int, stop: int) -> Batch:
        pieces, begin = [], 0
        lo, hi = self.first + start, self.first + stop
        for part in self.parts:
            end = begin + part.num_rows
            if lo < end and hi > begin:
                pieces.append(part.read(max(lo, begin) - begin, min(hi, end) - begin))
            begin = end
        dense, sparse, labels = (np.concatenate(arrays) for arrays in zip(*pieces))
        ids = sparse % self.rows  # npy triples hold raw values; for parsed TSV this is a no-op
        return make_batch(DEFAULT_CAT_NAMES, dense, labels, list(ids.T))


class CriteoDataModule(CTRDataModule):
    """Criteo Kaggle / Terabyte click logs: 13 dense and 26 categorical features (``cat_0`` .. ``cat_25``).

    Categorical value ``v`` (hex in the TSV) goes to row ``v mod num_embeddings_per_feature[f]`` of its
    table (collisions are the price of a bounded table). TSV dense values become
    ``log(1 + max(x, 0))``; npy triples from ``BinaryCriteoUtils.tsv_to_npys`` are used as stored
    (already log-transformed there). TSV is parsed in Python into memory in ``setup``: fine for
    samples and tests; for the full datasets convert once with ``tsv_to_npys`` and use the npy path.

    Args:
        path: a TSV file (``.tsv``, ``.txt``, or Terabyte's ``day_N``), a list of them (read in order),
            a directory of them, or a directory of ``<prefix>_{dense,sparse,labels}.npy`` triples.
        format: "tsv", "npy", or "auto" (npy if the directory holds ``*_dense.npy`` files).
        num_embeddings_per_feature: table rows, one int for all 26 features or a list of 26.
        val_fraction: fraction of rows, just before the test rows, used for validation.
        test_fraction: fraction of rows at the end used for test (and predict, unless
            ``predict_path`` is given).
        predict_path: data to predict on instead of the test split (as ``path``, read whole;
            TSV files may lack the label column, as Criteo Kaggle's ``test.txt`` does), hashed
            into the same tables.
        **kwargs: `CTRDataModule` options (batch_size, num_workers, embedding_dim, shuffle).
    """

    def __init__(
        self,
        path: Union[str, list[str]],
        format: Literal["auto", "tsv", "npy"] = "auto",
        num_embeddings_per_feature: Union[int, list[int]] = 100_000,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        predict_path: Union[str, list[str], None] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if format not in ("auto", "tsv", "npy"):
            raise ValueError(f"format must be 'auto', 'tsv' or 'npy', got {format!r}")
        rows = (
            [num_embeddings_per_feature] * CAT_FEATURE_COUNT
            if isinstance(num_embeddings_per_feature, int)
            else list(num_embeddings_per_feature)
        )
        if len(rows) != CAT_FEATURE_COUNT or min(rows) < 1:
            raise ValueError(
                f"num_embeddings_per_feature must be an int >= 1 or a list of {CAT_FEATURE_COUNT} of them, "
                f"got {num_embeddings_per_feature}"
            )
        check_fractions(val_fraction, test_fraction)
        self.paths = _paths(path)
        self.format = format
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.rows = np.array(rows, dtype=np.int64)
        self.feature_cardinalities = dict(zip(DEFAULT_CAT_NAMES, rows))
        self.num_dense_features = INT_FEATURE_COUNT
        # Found now, not in setup: LightningCLI builds the model (GBs of tables) in between.
        self._format, self._files = self._resolve(self.paths)
        self._parts: Optional[list[_Part]] = None
        self._predict_files = None if predict_path is None else self._resolve(_paths(predict_path))
        self._predict_parts: Optional[list[_Part]] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if stage == "predict" and self._predict_files is not None:
            if self._predict_parts is None:  # the training files are not read: only their tables' sizes count
                self._predict_parts = self._read(*self._predict_files, unlabeled=True)
        elif self._parts is None:
            self._parts = self._read(self._format, self._files)

    def _read(self, fmt: str, files: list[str], unlabeled: bool = False) -> list[_Part]:
        if fmt == "npy":
            parts: list[_Part] = [_NpyPart(p, BinaryCriteoUtils.get_shape_from_npy(p + NPY_SUFFIXES[0])[0]) for p in files]
        else:
            parts = [_ArrayPart(*parse_tsv(Path(p), self.rows, unlabeled)) for p in files]
        if sum(p.num_rows for p in parts) == 0:
            raise ValueError(f"Criteo data at {', '.join(files)} has no rows")
        return parts

    def _resolve(self, paths: list[Path]) -> tuple[str, list[str]]:
        """(format, TSV files or npy prefixes) of ``paths``, in time order."""
        expected = (
            "a Criteo TSV file (.tsv/.txt/day_N), a directory of them, "
            "or a directory of *_dense.npy/*_sparse.npy/*_labels.npy triples"
        )
        files: list[Path] = []
        for p in paths:
            if p.is_dir():
                files += sorted((c for c in p.iterdir() if c.is_file()), key=_natural_key)
            elif p.is_file():
                files.append(p)
            else:
                raise FileNotFoundError(f"Criteo data not found at {p}: expected {expected}")
        dense_files = [f for f in files if f.name.endswith(NPY_SUFFIXES[0])]
        fmt = self.format if self.format != "auto" else ("npy" if dense_files else "tsv")
        if fmt == "npy":
            prefixes = [str(f)[: -len(NPY_SUFFIXES[0])] for f in dense_files]
            missing = [p + s for p in prefixes for s in NPY_SUFFIXES if not os.path.isfile(p + s)]
            if not prefixes or missing:
                raise FileNotFoundError(
                    f"Criteo npy data incomplete in {', '.join(map(str, paths))}: "
                    f"missing {missing or '*_dense.npy'}; expected {expected}"
                )
            return fmt, prefixes
        # Files named explicitly are taken whatever their name; directory listings are filtered.
        tsv = [f for f in files if f in paths or _TSV_NAME.fullmatch(f.name)]
        if not tsv:
            raise FileNotFoundError(f"no Criteo TSV files in {', '.join(map(str, paths))}: expected {expected}")
        return fmt, [str(f) for f in tsv]

    def source(self, split: Split) -> _CriteoSplit:
        self.setup()
        assert self._parts is not None
        total = sum(p.num_rows for p in self._parts)
        data = f"Criteo data at {', '.join(map(str, self.paths))}"
        start, stop = split_ranges(total, self.val_fraction, self.test_fraction, data)[split]
        return _CriteoSplit(self._parts, start, stop, self.rows)

    @override
    def predict_dataloader(self) -> DataLoader[BatchShare]:
        if self._predict_files is None:
            return super().predict_dataloader()
        self.setup("predict")
        assert self._predict_parts is not None
        total = sum(p.num_rows for p in self._predict_parts)
        return self.loader_of(_CriteoSplit(self._predict_parts, 0, total, self.rows))


def _paths(path: Union[str, list[str]]) -> list[Path]:
    return [Path(p) for p in ([path] if isinstance(path, str) else path)]
