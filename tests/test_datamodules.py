"""Datamodules: the Batch contract, determinism of the synthetic data, and parsing of Criteo / MovieLens."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, BinaryCriteoUtils
from torchrec.datasets.utils import Batch

from datamodules import CriteoDataModule, CTRDataModule, MovieLensDataModule, SyntheticCTRDataModule
from datamodules.movielens import GENRES, default_data_dir
from datamodules.synthetic import KAGGLE_CARDINALITIES

SMALL = dict(num_train_samples=3000, num_val_samples=4000, num_test_samples=500, batch_size=256)


def arrays(batch: Batch) -> dict[str, np.ndarray]:
    """Flatten a Batch into comparable numpy arrays, checking the contract's dtypes on the way."""
    kjt = batch.sparse_features
    assert batch.dense_features.dtype == torch.float32 and batch.labels.dtype == torch.float32
    assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype in (torch.int32, torch.int64)
    assert batch.dense_features.shape[0] == batch.labels.shape[0] == kjt.stride()
    # Offsets made on the host travel with the batch: on a CUDA device torchrec would compute
    # them with an FBGEMM op that FBGEMM's CPU build (all the lent GPU machine has) cannot run there.
    offsets = kjt.offsets_or_none()
    assert offsets is not None and offsets.tolist() == [0, *kjt.lengths().cumsum(0).tolist()]
    out = {"dense": batch.dense_features.numpy(), "labels": batch.labels.numpy()}
    for key, jt in kjt.to_dict().items():
        out[f"{key}.values"], out[f"{key}.lengths"] = jt.values().numpy(), jt.lengths().numpy()
    return out


def concat(*batches: Batch) -> dict[str, np.ndarray]:
    parts = [arrays(b) for b in batches]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def check_contract(dm: CTRDataModule, batch: Batch) -> None:
    """Keys follow .tables, ids lie in their table, dense width matches."""
    assert batch.sparse_features.keys() == [t.feature_names[0] for t in dm.tables]
    assert batch.dense_features.shape[1] == dm.num_dense_features >= 1
    for table, (key, jt) in zip(dm.tables, batch.sparse_features.to_dict().items()):
        assert table.name == f"t_{key}" and table.embedding_dim == dm.embedding_dim
        values = jt.values()
        assert values.numel() == 0 or (values.min() >= 0 and values.max() < table.num_embeddings), key


# ---------------------------------------------------------------- synthetic


def test_synthetic_tables_and_contract() -> None:
    dm = SyntheticCTRDataModule(scale=0.001, num_embeddings_cap=5000, embedding_dim=8, **SMALL)
    assert [t.name for t in dm.tables] == [f"t_{n}" for n in DEFAULT_CAT_NAMES]
    assert [t.num_embeddings for t in dm.tables] == [min(5000, max(1, round(n * 0.001))) for n in KAGGLE_CARDINALITIES]
    assert {t.embedding_dim for t in dm.tables} == {8} and dm.num_dense_features == 13
    batches = list(dm.val_dataloader())
    assert [b.labels.shape[0] for b in batches] == [256] * 15 + [4000 - 15 * 256]
    for b in batches:
        check_contract(dm, b)
    assert dm.reference_metrics("train") == {} and CTRDataModule().reference_metrics("val") == {}
    assert_same(concat(*dm.predict_dataloader()), concat(*dm.test_dataloader()))
    loader = SyntheticCTRDataModule(num_workers=2, **SMALL).train_dataloader()
    assert loader.pin_memory == torch.cuda.is_available() and loader.persistent_workers


def test_synthetic_is_a_pure_function_of_seed_split_and_index() -> None:
    def first_batches(seed: int, batch_size: int, n: int) -> list[Batch]:
        loader = SyntheticCTRDataModule(seed=seed, **{**SMALL, "batch_size": batch_size}).dataloader("train")
        return list(itertools.islice(loader, n))

    a, b = first_batches(0, 64, 2), first_batches(0, 64, 2)
    assert_same(concat(*a), concat(*b))
    assert_same(concat(*first_batches(0, 128, 1)), concat(*a))
    other = concat(*first_batches(1, 64, 2))
    assert not np.array_equal(other["cat_2.values"], concat(*a)["cat_2.values"])
    # Splits are different samples, not copies.
    dm = SyntheticCTRDataModule(**SMALL)
    assert not np.array_equal(arrays(dm.source("val").batch(0, 64))["dense"], arrays(a[0])["dense"])


def test_synthetic_workers_do_not_change_batches() -> None:
    kwargs = dict(SMALL, num_val_samples=1500)
    serial = concat(*SyntheticCTRDataModule(num_workers=0, **kwargs).val_dataloader())
    parallel = concat(*SyntheticCTRDataModule(num_workers=2, **kwargs).val_dataloader())
    assert_same(serial, parallel)


def test_synthetic_train_shuffles_batch_order_only() -> None:
    dm = SyntheticCTRDataModule(**{**SMALL, "num_train_samples": 1024})
    torch.manual_seed(0)
    shuffled = [arrays(b)["dense"] for b in dm.train_dataloader()]
    in_order = [arrays(dm.source("train").batch(k * 256, (k + 1) * 256))["dense"] for k in range(4)]
    assert sorted(x.sum() for x in shuffled) == sorted(x.sum() for x in in_order)


def test_synthetic_ids_are_zipf_skewed_and_scattered() -> None:
    dm = SyntheticCTRDataModule(**SMALL)
    rows = dm.feature_cardinalities["cat_2"]  # ~100k rows at the default scale
    ids = dm.sample("val", 0, 4000).ids[2]
    counts = np.sort(np.bincount(ids, minlength=rows))[::-1]
    assert counts[: rows // 100].sum() > 0.5 * len(ids)  # top 1% of rows take most lookups
    hottest = np.argsort(np.bincount(ids, minlength=rows))[::-1][:50]
    assert np.median(hottest) > rows / 10  # hot rows are spread over the table, not the small ids
    for ids, n in zip(dm.sample("val", 0, 500).ids, dm.feature_cardinalities.values()):
        assert ids.min() >= 0 and ids.max() < n


def test_synthetic_multi_hot_bags() -> None:
    sizes = [3, 1, 5] + [1] * 23
    dm = SyntheticCTRDataModule(multi_hot_sizes=sizes, **SMALL)
    batch = dm.source("train").batch(0, 1000)
    check_contract(dm, batch)
    a = arrays(batch)
    for key, size in zip(DEFAULT_CAT_NAMES, sizes):
        lengths = a[f"{key}.lengths"]
        assert set(lengths.tolist()) == set(range(1, size + 1)), key
        assert len(a[f"{key}.values"]) == lengths.sum()


def test_synthetic_reference_metrics_and_label_rate() -> None:
    dm = SyntheticCTRDataModule(**SMALL)
    ref = dm.reference_metrics("val")
    assert 0.7 < ref["bayes_auc"] < 0.95
    assert dm.reference_metrics("val") == ref and dm.reference_metrics("test") != ref
    p = dm.true_probability("val")
    labels = concat(*dm.val_dataloader())["labels"]
    assert len(p) == len(labels) == 4000 and np.all((p > 0) & (p < 1))
    rate = labels.mean()
    assert 0.2 < rate < 0.35 and abs(rate - p.mean()) < 0.03
    # The click rate is calibrated, also where tiny tables (scale) add constant teacher terms.
    assert abs(SyntheticCTRDataModule(scale=1e-4, click_rate=0.1).true_probability("val", 0, 4000).mean() - 0.1) < 0.02
    # Bayes log loss beats the constant predictor; a noisy score has a lower AUC than the truth.
    constant = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert ref["bayes_logloss"] < constant - 0.05
    noisy = p + np.random.default_rng(0).normal(0, 0.3, len(p))
    y = torch.from_numpy(labels).long()
    assert binary_auroc(torch.from_numpy(noisy), y).item() < ref["bayes_auc"] - 0.02
    np.testing.assert_allclose(dm.true_probability("val", 100, 200), p[100:200])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(scale=0.0), "scale"),
        (dict(zipf_exponent=-1.0), "zipf_exponent"),
        (dict(batch_size=0), "batch_size"),
        (dict(num_workers=-1), "num_workers"),
        (dict(embedding_dim=0), "embedding_dim"),
        (dict(num_embeddings_cap=0), "num_embeddings_cap"),
        (dict(multi_hot_sizes=[2, 2]), "multi_hot_sizes"),
        (dict(multi_hot_sizes=[0] * 26), "multi_hot_sizes"),
        (dict(num_val_samples=-5), "num_val_samples"),
        (dict(cross_scale=-1.0), "cross_scale"),
        (dict(signal_rows=0.0), "signal_rows"),
        (dict(click_rate=1.0), "click_rate"),
        (dict(scale=1e4), "rows"),
    ],
)
def test_synthetic_bad_args(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyntheticCTRDataModule(**kwargs)


# ---------------------------------------------------------------- criteo

# label, 13 integer columns (empty = missing, may be negative), 26 hex columns (empty = missing)
CRITEO_ROWS = [
    ["1", "5", "", "-3", *["0"] * 10, "ff", "", "1A2b", *["0a"] * 23],
    ["0", *[str(i) for i in range(13)], *[f"{i:x}" for i in range(26)]],
    ["0", *[""] * 13, *[""] * 26],
    ["1", *["100"] * 13, *["deadbeef"] * 26],
    ["0", *["7"] * 13, *["12345678"] * 26],
]


def write_tsv(path: Path, rows: list[list[str]]) -> Path:
    path.write_text("".join("\t".join(r) + "\n" for r in rows))
    return path


def test_criteo_tsv_parsing_and_hashing(tmp_path: Path) -> None:
    path = write_tsv(tmp_path / "train.txt", CRITEO_ROWS)
    table_rows = list(range(5, 31))
    dm = CriteoDataModule(str(path), num_embeddings_per_feature=table_rows, val_fraction=0, test_fraction=0)
    assert [t.num_embeddings for t in dm.tables] == table_rows and dm.num_dense_features == 13
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    check_contract(dm, batch)
    a = arrays(batch)
    dense = np.array([[max(int(x or 0), 0) for x in r[1:14]] for r in CRITEO_ROWS], dtype=np.float64)
    np.testing.assert_allclose(a["dense"], np.log1p(dense), rtol=1e-6)
    np.testing.assert_array_equal(a["labels"], [1, 0, 0, 1, 0])
    for c, (key, n) in enumerate(zip(DEFAULT_CAT_NAMES, table_rows)):
        expected = [int(r[14 + c] or "0", 16) % n for r in CRITEO_ROWS]
        np.testing.assert_array_equal(a[f"{key}.values"], expected, err_msg=key)
        np.testing.assert_array_equal(a[f"{key}.lengths"], [1] * 5)


def test_criteo_contiguous_tail_splits_and_directories(tmp_path: Path) -> None:
    rows = [["1" if i % 3 == 0 else "0", str(i), *[""] * 12, *["a"] * 26] for i in range(20)]
    write_tsv(tmp_path / "day_10", rows[10:])
    write_tsv(tmp_path / "day_2", rows[:10])
    (tmp_path / "notes.md").write_text("not data")
    dm = CriteoDataModule(str(tmp_path), val_fraction=0.2, test_fraction=0.1, batch_size=3)
    first = {s: np.expm1(concat(*dm.dataloader(s))["dense"][:, 0]).round() for s in ("train", "val", "test")}
    assert first["train"].tolist() == list(range(14)) and first["val"].tolist() == [14, 15, 16, 17]
    assert first["test"].tolist() == [18, 19]
    listed = CriteoDataModule([str(tmp_path / "day_2"), str(tmp_path / "day_10")], val_fraction=0.2, test_fraction=0.1)
    assert_same(concat(*listed.dataloader("test")), concat(*dm.dataloader("test")))


@pytest.mark.parametrize(
    "bad_row, match",
    [
        (CRITEO_ROWS[1][:-1], "expected 40 tab-separated columns.*got 39"),
        (["2", *CRITEO_ROWS[1][1:]], "label must be 0 or 1"),
        (["", *CRITEO_ROWS[1][1:]], "label must be 0 or 1"),
        (["0", "1.5", *CRITEO_ROWS[1][2:]], "column 2 must be an integer"),
        (["0", *CRITEO_ROWS[1][1:13], "-", *CRITEO_ROWS[1][14:]], "column 14 must be an integer"),
        ([*CRITEO_ROWS[1][:20], "xyz", *CRITEO_ROWS[1][21:]], "column 21 must be hexadecimal.*'xyz'"),
    ],
)
def test_criteo_malformed_line_names_file_and_line(tmp_path: Path, bad_row: list[str], match: str) -> None:
    path = write_tsv(tmp_path / "bad.tsv", [CRITEO_ROWS[0], CRITEO_ROWS[1], bad_row])
    dm = CriteoDataModule(str(path))
    with pytest.raises(ValueError, match=rf"bad\.tsv, line 3\): {match}"):
        dm.setup("fit")


@pytest.mark.filterwarnings("ignore:Local function is not supported by pickle")  # inside tsv_to_npys
def test_criteo_npy_triples_from_torchrec(tmp_path: Path) -> None:
    rows = CRITEO_ROWS * 2
    (tmp_path / "npy").mkdir()
    for day, part in enumerate((rows[:7], rows[7:])):
        tsv = write_tsv(tmp_path / f"day_{day}.tsv", part)
        BinaryCriteoUtils.tsv_to_npys(
            str(tsv), *(str(tmp_path / f"npy/day_{day}{s}") for s in ("_dense.npy", "_sparse.npy", "_labels.npy"))
        )
    dm = CriteoDataModule(
        str(tmp_path / "npy"), num_embeddings_per_feature=1000, val_fraction=0.0, test_fraction=0.2, batch_size=4
    )
    train = concat(*dm.dataloader("train"))  # batch 1 spans both files
    dense = np.concatenate([np.load(tmp_path / f"npy/day_{d}_dense.npy") for d in (0, 1)])
    sparse = np.concatenate([np.load(tmp_path / f"npy/day_{d}_sparse.npy") for d in (0, 1)])
    np.testing.assert_array_equal(train["dense"], dense[:8])
    np.testing.assert_array_equal(train["cat_2.values"], sparse[:8, 2] % 1000)
    np.testing.assert_array_equal(train["labels"], [int(r[0]) for r in rows[:8]])
    check_contract(dm, next(iter(dm.test_dataloader())))


def test_criteo_missing_path_and_bad_args(tmp_path: Path) -> None:
    # At construction: LightningCLI builds the model (GBs of tables) between __init__ and setup.
    with pytest.raises(FileNotFoundError, match="nowhere.tsv.*expected a Criteo TSV file"):
        CriteoDataModule(str(tmp_path / "nowhere.tsv"))
    (tmp_path / "readme.md").write_text("x")
    with pytest.raises(FileNotFoundError, match="no Criteo TSV files"):
        CriteoDataModule(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="_labels.npy"):
        np.save(tmp_path / "day_0_dense.npy", np.zeros((2, 13), dtype=np.float32))
        CriteoDataModule(str(tmp_path), format="npy")
    with pytest.raises(ValueError, match="num_embeddings_per_feature"):
        CriteoDataModule("x", num_embeddings_per_feature=[10, 10])
    with pytest.raises(ValueError, match="fraction"):
        CriteoDataModule("x", val_fraction=0.6, test_fraction=0.5)


@pytest.mark.parametrize(("val_fraction", "test_fraction", "split"), [(0.05, 0.0, "validation"), (0.0, 0.1, "test")])
def test_criteo_file_too_small_for_a_split_says_so(tmp_path: Path, val_fraction: float, test_fraction: float, split: str) -> None:
    # Issue 23 item 10: before, 5 rows at val_fraction 0.05 gave an empty validation split without a word.
    path = write_tsv(tmp_path / "tiny.tsv", CRITEO_ROWS)
    dm = CriteoDataModule(str(path), val_fraction=val_fraction, test_fraction=test_fraction)
    with pytest.raises(ValueError, match=rf"Criteo data at {path} has 5 rows: {split} fraction .* so {split} would get "
                                         r"no rows\. Use more data \(at least \d+ rows\)"):  # fmt: skip
        dm.dataloader("train")


def test_criteo_predicts_on_data_of_its_own_with_or_without_labels(tmp_path: Path) -> None:
    train = write_tsv(tmp_path / "train.tsv", CRITEO_ROWS * 4)
    labeled = write_tsv(tmp_path / "new.tsv", CRITEO_ROWS[::-1])
    unlabeled = write_tsv(tmp_path / "test.txt", [row[1:] for row in CRITEO_ROWS[::-1]])  # Kaggle's test.txt: no label
    kwargs = dict(num_embeddings_per_feature=list(range(5, 31)), val_fraction=0, test_fraction=0.25, batch_size=2)
    read_whole = concat(*CriteoDataModule(str(labeled), **kwargs | dict(test_fraction=0)).dataloader("train"))
    with_labels = CriteoDataModule(str(train), predict_path=str(labeled), **kwargs)
    assert_same(concat(*with_labels.predict_dataloader()), read_whole)
    without = concat(*CriteoDataModule(str(train), predict_path=[str(unlabeled)], **kwargs).predict_dataloader())
    assert_same({**without, "labels": read_whole["labels"]}, read_whole)
    np.testing.assert_array_equal(without["labels"], np.zeros(len(CRITEO_ROWS)))
    assert with_labels._parts is None  # predicting reads no training data
    # Without predict_path, predict reads the test split, as before.
    plain = CriteoDataModule(str(train), **kwargs)
    assert_same(concat(*plain.predict_dataloader()), concat(*plain.dataloader("test")))


def test_criteo_data_to_predict_on_is_checked_like_training_data(tmp_path: Path) -> None:
    train = write_tsv(tmp_path / "train.tsv", CRITEO_ROWS * 4)
    with pytest.raises(FileNotFoundError, match="nowhere.tsv.*expected a Criteo TSV file"):  # at construction
        CriteoDataModule(str(train), predict_path=str(tmp_path / "nowhere.tsv"))
    bad = write_tsv(tmp_path / "test.txt", [CRITEO_ROWS[1][1:], CRITEO_ROWS[1][2:]])
    dm = CriteoDataModule(str(train), predict_path=str(bad), val_fraction=0, test_fraction=0)
    with pytest.raises(ValueError, match=r"test\.txt, line 2\): expected 39 tab-separated columns \(13 integer, 26 hex "
                                         r"categorical: no label, as the file's first line\), got 38"):  # fmt: skip
        dm.predict_dataloader()
    # Training data must have its labels.
    with pytest.raises(ValueError, match=r"test\.txt, line 1\): expected 40 tab-separated columns.*got 39"):
        CriteoDataModule(str(bad)).setup("fit")


# ---------------------------------------------------------------- movielens

ML_USERS = [("7", 24, "M", "technician", "85711"), ("3", 53, "F", "other", "94043"), ("9", 17, "M", "writer", "T8H1N")]
ML_ITEMS = [("10", "Café Society (1995)", ["Comedy", "Drama"]), ("20", "Heat (1995)", ["Action", "Crime", "Thriller"]),
            ("30", "Nothing (1996)", [])]  # fmt: skip
ML_RATINGS = [
    ("7", "10", 5, 881250949), ("7", "20", 3, 881250950), ("3", "10", 4, 881250951), ("3", "30", 1, 881250952),
    ("9", "20", 2, 881250953), ("9", "30", 4, 881250954), ("7", "30", 1, 881250955), ("3", "20", 5, 881250956),
]  # fmt: skip


def write_grouplens(d: Path) -> Path:
    d.mkdir()
    (d / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ML_RATINGS))
    (d / "u.user").write_text("".join("|".join(map(str, u)) + "\n" for u in ML_USERS))
    lines = [
        f"{i}|{title}|01-Jan-1995||http://x|" + "|".join("1" if g in gs else "0" for g in GENRES)
        for i, title, gs in ML_ITEMS
    ]
    (d / "u.item").write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    return d


def write_atomic(d: Path) -> Path:
    d.mkdir()
    (d / "ml.inter").write_text(
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
        + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ML_RATINGS)
    )
    (d / "ml.user").write_text(
        "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
        + "".join("\t".join(map(str, u)) + "\n" for u in ML_USERS)
    )
    (d / "ml.item").write_text(
        "item_id:token\tmovie_title:token_seq\tclass:token_seq\n"
        + "".join(f"{i}\t{t}\t{' '.join(g)}\n" for i, t, g in ML_ITEMS)
    )
    return d


@pytest.mark.parametrize("layout", [write_grouplens, write_atomic])
def test_movielens_layouts(tmp_path: Path, layout) -> None:
    dm = MovieLensDataModule(str(layout(tmp_path / "ml")), val_fraction=0.25, test_fraction=0.25, batch_size=3)
    assert dm.feature_cardinalities == {
        "user_id": 3,
        "item_id": 3,
        "age": 7,
        "gender": 2,
        "occupation": 3,
        "zip_prefix": 3,
        "genres": 19,
    }
    rows = np.concatenate([dm.split_rows[s] for s in ("train", "val", "test")])
    assert sorted(rows.tolist()) == list(range(8)) and [len(dm.split_rows[s]) for s in ("train", "val", "test")] == [
        4,
        2,
        2,
    ]
    batches = [b for s in ("train", "val", "test") for b in dm.dataloader(s)]
    for b in batches:
        check_contract(dm, b)
    a = concat(*batches)
    ratings = [ML_RATINGS[r] for r in rows]
    np.testing.assert_array_equal(a["labels"], [float(r[2] >= 4) for r in ratings])
    item_ids = [[i for i, _, _ in ML_ITEMS].index(r[1]) for r in ratings]
    np.testing.assert_array_equal(a["item_id.values"], item_ids)
    genres = [ML_ITEMS[i][2] or ["unknown"] for i in item_ids]
    np.testing.assert_array_equal(a["genres.lengths"], [len(g) for g in genres])
    np.testing.assert_array_equal(
        a["genres.values"], [GENRES.index(g) for gs in genres for g in sorted(gs, key=GENRES.index)]
    )
    np.testing.assert_array_equal(a["age.values"], [{"7": 1, "3": 5, "9": 0}[r[0]] for r in ratings])
    ages = {u[0]: u[1] for u in ML_USERS}
    np.testing.assert_allclose(a["dense"][:, 0], [ages[r[0]] / 100 for r in ratings], rtol=1e-6)
    assert a["dense"][:, 1].min() >= 0 and a["dense"][:, 1].max() <= 1


def test_movielens_layouts_agree_and_split_is_seeded(tmp_path: Path) -> None:
    splits = {"val_fraction": 0.25, "test_fraction": 0.25}  # 8 ratings: the defaults leave val and test empty
    raw = MovieLensDataModule(str(write_grouplens(tmp_path / "raw")), seed=3, **splits)
    atomic = MovieLensDataModule(str(write_atomic(tmp_path / "atomic")), seed=3, **splits)
    assert_same(concat(*raw.dataloader("train")), concat(*atomic.dataloader("train")))
    other = MovieLensDataModule(str(tmp_path / "raw"), seed=4, **splits)
    again = MovieLensDataModule(str(tmp_path / "raw"), seed=4, **splits)
    np.testing.assert_array_equal(other.split_rows["val"], again.split_rows["val"])
    assert not np.array_equal(
        other.split_rows["train"], MovieLensDataModule(str(tmp_path / "raw"), seed=5, **splits).split_rows["train"]
    )


def test_movielens_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="pip install --no-deps recbole"):
        MovieLensDataModule(str(tmp_path))
    # Issue 23 item 10: a file (here a Criteo log) was reported as a directory that "does not exist".
    criteo = write_tsv(tmp_path / "train.txt", CRITEO_ROWS)
    with pytest.raises(NotADirectoryError, match=rf"MovieLens data_dir {criteo} is a file, not a directory.*CriteoDataModule"):
        MovieLensDataModule(str(criteo))
    with pytest.raises(ValueError, match=r"MovieLens data in .* has 8 rows: validation fraction 0\.1 .* no rows"):
        MovieLensDataModule(str(write_grouplens(tmp_path / "tiny")))
    d = write_grouplens(tmp_path / "ml")
    (d / "u.data").write_text("7\t99\t5\t1\n")
    with pytest.raises(ValueError, match="'99'"):
        MovieLensDataModule(str(d))
    (d / "u.user").write_text("7|24|M\n")
    with pytest.raises(ValueError, match=r"u.user, line 1: expected 5"):
        MovieLensDataModule(str(d))


def test_movielens_recbole_copy() -> None:
    try:
        data_dir = default_data_dir()
    except FileNotFoundError:
        pytest.skip("recbole's MovieLens-100K copy is not installed")
    dm = MovieLensDataModule(str(data_dir))
    assert len(dm.data["label"]) == 100_000 and sum(len(r) for r in dm.split_rows.values()) == 100_000
    assert dm.feature_cardinalities["user_id"] == 943 and dm.feature_cardinalities["item_id"] == 1682
    assert 0.5 < dm.data["label"].mean() < 0.6  # 55% of MovieLens-100K ratings are 4 or 5
    check_contract(dm, next(iter(dm.val_dataloader())))
