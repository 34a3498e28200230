"""MovieLens-100K as click prediction: a rating of 4 or more is a click.

Features: user, item, age bucket, gender, occupation, zip-code prefix (one id each) and the
movie's genres (a multi-hot bag); dense: age / 100 and the timestamp scaled to [0, 1]. The data
is small (100k ratings), so it is read in ``__init__``: table sizes come from the data, and
``tables`` is ready before ``setup``. Reads GroupLens' raw layout (u.data, u.user, u.item) or
RecBole's atomic files (ml-100k.inter/.user/.item); by default the copy inside the ``recbole`` wheel.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np
from torchrec.datasets.utils import Batch

from datamodules.base import CTRDataModule, Split, check_fractions, make_batch, split_ranges

# GroupLens' genre list, in the order of u.item's 19 flags; RecBole's `class` field uses the same names.
GENRES: tuple[str, ...] = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
    "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
# Lower edges of MovieLens-1M's age groups (under 18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+).
AGE_EDGES = np.array([18, 25, 35, 45, 50, 56])
POSITIVE_RATING = 4.0
FEATURES = ("user_id", "item_id", "age", "gender", "occupation", "zip_prefix", "genres")
HOW_TO_GET = (
    "pass data_dir=<directory with u.data/u.user/u.item (GroupLens ml-100k) or ml-100k.inter/.user/.item "
    "(RecBole atomic files)>, or `pip install --no-deps recbole`, whose wheel ships a copy"
)


class _Raw(NamedTuple):
    """Parsed files: ratings (user, item, rating, time), users -> (age, gender, occupation, zip), items -> genres."""

    interactions: list[tuple[str, str, float, float]]
    users: dict[str, tuple[int, str, str, str]]
    items: dict[str, list[str]]


def _rows(path: Path, sep: str, columns: int, encoding: str = "utf-8", skip: int = 0) -> Iterator[list[str]]:
    """Split lines of a file, checking the column count; blank lines are skipped."""
    with open(path, encoding=encoding) as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if lineno <= skip or not line:
                continue
            fields = line.split(sep)
            if len(fields) != columns:
                raise ValueError(
                    f"{path}, line {lineno}: expected {columns} {sep!r}-separated columns, got {len(fields)}"
                )
            yield fields


def _read_grouplens(d: Path) -> _Raw:
    # u.item titles are latin-1; the 19 trailing flags are GENRES.
    items = {
        f[0]: [g for g, flag in zip(GENRES, f[5:]) if flag == "1"]
        for f in _rows(d / "u.item", "|", 5 + len(GENRES), encoding="latin-1")
    }
    users = {f[0]: (int(f[1]), f[2], f[3], f[4]) for f in _rows(d / "u.user", "|", 5, encoding="latin-1")}
    interactions = [(f[0], f[1], float(f[2]), float(f[3])) for f in _rows(d / "u.data", "\t", 4)]
    return _Raw(interactions, users, items)


def _read_atomic(inter: Path) -> _Raw:
    """RecBole atomic files: tab separated, header ``name:type``; columns are found by name."""

    def table(path: Path, names: tuple[str, ...]) -> Iterator[list[str]]:
        with open(path, encoding="utf-8") as f:
            header = [h.split(":")[0] for h in f.readline().rstrip("\r\n").split("\t")]
        missing = [n for n in names if n not in header]
        if missing:
            raise ValueError(f"{path}: header lacks the columns {missing} (has {header})")
        index = [header.index(n) for n in names]
        for fields in _rows(path, "\t", len(header), skip=1):
            yield [fields[i] for i in index]

    stem = inter.with_suffix("")
    items = {i: genres.split() for i, genres in table(stem.with_suffix(".item"), ("item_id", "class"))}
    users = {
        u: (int(age), gender, occupation, zip_code)
        for u, age, gender, occupation, zip_code in table(
            stem.with_suffix(".user"), ("user_id", "age", "gender", "occupation", "zip_code")
        )
    }
    interactions = [
        (u, i, float(r), float(t)) for u, i, r, t in table(inter, ("user_id", "item_id", "rating", "timestamp"))
    ]
    return _Raw(interactions, users, items)


def default_data_dir() -> Path:
    """The MovieLens-100K copy inside the installed ``recbole`` package (found without importing it)."""
    spec = importlib.util.find_spec("recbole")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "dataset_example" / "ml-100k"
        if (candidate / "ml-100k.inter").is_file():
            return candidate
    raise FileNotFoundError(f"MovieLens-100K not found: {HOW_TO_GET}")


def read_movielens(data_dir: Path) -> _Raw:
    if (data_dir / "u.data").is_file():
        return _read_grouplens(data_dir)
    inter = sorted(data_dir.glob("*.inter")) if data_dir.is_dir() else []
    if inter:
        return _read_atomic(inter[0])
    raise FileNotFoundError(f"no MovieLens-100K files in {data_dir}: {HOW_TO_GET}")


class _MovieLensSplit:
    """Interactions ``rows`` (indices into the arrays), turned into batches by gathering user/item attributes."""

    def __init__(self, data: dict[str, np.ndarray], rows: np.ndarray) -> None:
        self.data, self.rows = data, rows

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, start: int, stop: int) -> Batch:
        d, rows = self.data, self.rows[start:stop]
        user, item = d["user"][rows], d["item"][rows]
        genres = d["item_genres"][item]  # (B, len(GENRES)) flags -> bag of genre ids, row by row
        dense = np.stack([d["user_age"][user] / 100.0, d["time"][rows]], axis=1)
        sparse = [user, item, d["user_age_bucket"][user], d["user_gender"][user], d["user_occupation"][user],
                  d["user_zip"][user], (np.nonzero(genres)[1], genres.sum(axis=1))]  # fmt: skip
        return make_batch(FEATURES, dense, d["label"][rows], sparse)


class MovieLensDataModule(CTRDataModule):
    """MovieLens-100K ratings as clicks (label = rating >= 4), split at random with a fixed seed.

    Features (KJT keys): ``user_id``, ``item_id``, ``age`` (7 MovieLens-1M age groups), ``gender``,
    ``occupation``, ``zip_prefix`` (first ``zip_prefix_length`` characters), ``genres`` (multi-hot,
    a movie without genres gets "unknown"). Tables other than ``age`` and ``genres`` are sized
    from the data. Dense features: age / 100 and the timestamp scaled to [0, 1].

    Args:
        data_dir: directory with GroupLens' u.data/u.user/u.item or RecBole's ml-100k.inter/.user/.item;
            None uses the copy in the installed ``recbole`` package (``pip install --no-deps recbole``).
        val_fraction: fraction of ratings for validation.
        test_fraction: fraction of ratings for test (and predict).
        seed: seed of the random train/val/test split.
        zip_prefix_length: characters of the zip code kept as a feature.
        **kwargs: `CTRDataModule` options (batch_size, num_workers, embedding_dim, shuffle).
    """

    def __init__(
        self,
        data_dir: Optional[str] = None,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        seed: int = 0,
        zip_prefix_length: int = 3,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_fractions(val_fraction, test_fraction)
        if zip_prefix_length < 1:
            raise ValueError(f"zip_prefix_length must be >= 1, got {zip_prefix_length}")
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        if self.data_dir.is_file():  # e.g. a Criteo TSV given to the MovieLens module
            raise NotADirectoryError(
                f"MovieLens data_dir {self.data_dir} is a file, not a directory: {HOW_TO_GET}. A Criteo click log "
                "goes to datamodules.CriteoDataModule's path."
            )
        if not self.data_dir.is_dir():
            raise FileNotFoundError(f"MovieLens data directory {self.data_dir} does not exist: {HOW_TO_GET}")
        self.data, self.feature_cardinalities = self._encode(read_movielens(self.data_dir), zip_prefix_length)
        self.num_dense_features = 2
        n = len(self.data["label"])
        order = np.random.default_rng(seed).permutation(n)
        ranges = split_ranges(n, val_fraction, test_fraction, f"MovieLens data in {self.data_dir}")
        self.split_rows = {s: order[a:b] for s, (a, b) in ranges.items()}

    def _encode(self, raw: _Raw, zip_prefix_length: int) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Integer-code users, items and attributes; vocabularies in file order (users, items) or sorted."""
        if not raw.interactions:
            raise ValueError(f"{self.data_dir}: no ratings")
        user_index = {u: k for k, u in enumerate(raw.users)}
        item_index = {i: k for k, i in enumerate(raw.items)}
        attrs = list(raw.users.values())
        genders, occupations = sorted({a[1] for a in attrs}), sorted({a[2] for a in attrs})
        zips = sorted({a[3][:zip_prefix_length] for a in attrs})
        item_genres = np.zeros((len(item_index), len(GENRES)), dtype=bool)
        for k, names in enumerate(raw.items.values()):
            unknown = [g for g in names if g not in GENRES]
            if unknown:
                raise ValueError(f"{self.data_dir}: unknown genres {unknown} (expected names from {GENRES})")
            item_genres[k, [GENRES.index(g) for g in names or ["unknown"]]] = True
        try:
            user = np.array([user_index[x[0]] for x in raw.interactions], dtype=np.int64)
            item = np.array([item_index[x[1]] for x in raw.interactions], dtype=np.int64)
        except KeyError as e:
            raise ValueError(
                f"{self.data_dir}: a rating refers to user or item {e} missing from the user/item file"
            ) from e
        rating, time = np.array([(x[2], x[3]) for x in raw.interactions], dtype=np.float64).reshape(-1, 2).T
        span = time.max() - time.min()
        ages = np.array([a[0] for a in attrs], dtype=np.int64)
        data = {
            "user": user,
            "item": item,
            "label": (rating >= POSITIVE_RATING).astype(np.float32),
            "time": (time - time.min()) / span if span > 0 else np.zeros_like(time),
            "user_age": ages,
            "user_age_bucket": np.searchsorted(AGE_EDGES, ages, side="right"),
            "user_gender": np.array([genders.index(a[1]) for a in attrs], dtype=np.int64),
            "user_occupation": np.array([occupations.index(a[2]) for a in attrs], dtype=np.int64),
            "user_zip": np.array([zips.index(a[3][:zip_prefix_length]) for a in attrs], dtype=np.int64),
            "item_genres": item_genres,
        }
        sizes = [
            len(user_index),
            len(item_index),
            len(AGE_EDGES) + 1,
            len(genders),
            len(occupations),
            len(zips),
            len(GENRES),
        ]
        return data, dict(zip(FEATURES, sizes))

    def source(self, split: Split) -> _MovieLensSplit:
        return _MovieLensSplit(self.data, self.split_rows[split])
