"""Criteo-shaped synthetic click data with a planted teacher whose click probability is known.

Every value is a counter-based hash (splitmix64) of ``(seed, stream, split, feature, sample index)``,
so a sample is a pure function of its coordinates: batch size, batch boundaries, workers and
processes never change the data, and nothing is stored (tables of 10M rows cost O(1) memory).
Ids are Zipf-skewed (bounded power law, inverse CDF) and scattered over the id space by a
per-table affine bijection, so hot rows are spread out like hashed ids of real logs. Labels are
Bernoulli draws from a teacher: per-id weights, a few low-rank feature crosses and dense terms.
The teacher's own AUC / log loss (``reference_metrics``) is the Bayes-optimal yardstick for models.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Optional

import numpy as np
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.utils import Batch

from datamodules.base import SPLITS, CTRDataModule, Split, make_batch

# Rows per categorical feature of Criteo Kaggle (Display Advertising Challenge), as in
# facebookresearch/dlrm (`ln_emb` of the Kaggle profile) and torchrec's DLRM example.
KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

# Feature pairs (indices into the 26 categorical features) with a planted low-rank interaction:
# small and large tables alike (shrinking the effects of rare ids keeps the large ones learnable).
CROSS_PAIRS: tuple[tuple[int, int], ...] = ((0, 1), (4, 6), (9, 12), (2, 14), (3, 17), (23, 25))
CROSS_RANK = 4

# Largest table: keeps the affine map (a * rank + b) below 2**63 in int64.
MAX_ROWS = 2**31

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
# E[softplus(Z)], Z ~ N(0, 1): centers the dense features inside the teacher.
_SOFTPLUS_NORMAL_MEAN = 0.80606
# Hash streams: independent pseudo-random quantities never share a key.
_RANK, _LENGTH, _WEIGHT, _CROSS, _DENSE, _DENSE_WEIGHT, _LABEL, _BIJECTION = range(1, 9)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic is intended)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _key(*parts: int) -> np.uint64:
    """Fold integer coordinates into one well-mixed 64-bit key."""
    k = np.zeros(1, dtype=np.uint64)  # arrays wrap silently where numpy scalars would warn
    for part in parts:
        k = _mix(k ^ (np.array([part % 2**64], dtype=np.uint64) + _GAMMA))
    return k[0]


def _hash(key: np.ndarray | np.uint64, counter: np.ndarray) -> np.ndarray:
    return _mix(np.asarray(key, dtype=np.uint64) + np.asarray(counter, dtype=np.uint64) * _GAMMA)


def _uniform(h: np.ndarray) -> np.ndarray:
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _normal(h: np.ndarray) -> np.ndarray:
    """Box-Muller on the two 32-bit halves of one hash."""
    u1 = ((h >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0**-32
    u2 = (h & np.uint64(0xFFFFFFFF)).astype(np.float64) * 2.0**-32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def zipf_ranks(u: np.ndarray, rows: np.ndarray, exponent: float) -> np.ndarray:
    """Ranks in [0, rows) of a bounded power law p(r) ~ (r + 1) ** -exponent, by inverse CDF of ``u``.

    Continuous approximation on [1, rows + 1), computed in log space so it stays exact enough for
    tables of billions of rows; ``rows`` broadcasts against ``u``.
    """
    log_n = np.log(rows.astype(np.float64) + 1.0)
    if abs(exponent - 1.0) < 1e-9:
        x = np.exp(u * log_n)
    else:
        s = 1.0 - exponent
        x = np.exp(np.log1p(u * np.expm1(s * log_n)) / s)
    return np.minimum(x.astype(np.int64) - 1, rows - 1)


class SyntheticSamples(NamedTuple):
    """Samples ``[start, stop)`` of a split; ``ids[f]``/``lengths[f]``: bag values (grouped by sample) and sizes."""

    dense: np.ndarray
    ids: list[np.ndarray]
    lengths: list[np.ndarray]
    labels: np.ndarray
    probability: np.ndarray


class SyntheticGenerator:
    """Picklable, stateless sampler behind :class:`SyntheticCTRDataModule` (see its docstring)."""

    def __init__(
        self,
        seed: int,
        cardinalities: Sequence[int],
        bag_sizes: Sequence[int],
        num_dense: int,
        zipf_exponent: float,
        signal_rows: float,
        click_rate: float,
        id_weight_scale: float,
        cross_scale: float,
        dense_scale: float,
    ) -> None:
        self.seed = seed
        self.rows = np.asarray(cardinalities, dtype=np.int64)
        self.bag_sizes = np.asarray(bag_sizes, dtype=np.int64)
        self.num_dense = num_dense
        self.zipf_exponent = zipf_exponent
        self.signal_rows = signal_rows
        self.id_weight_scale = id_weight_scale
        self.cross_scale = cross_scale
        self.dense_scale = dense_scale
        num_features, max_bag = len(self.rows), int(self.bag_sizes.max())
        self.mult, self.offset = self._bijections()
        self.weight_keys = np.array([_key(seed, _WEIGHT, f) for f in range(num_features)])
        # cross_keys[p, side, d]: hashed vector u (side 0) or v (side 1) of pair p, coordinate d.
        self.cross_keys = np.array(
            [
                [[_key(seed, _CROSS, p, s, d) for d in range(CROSS_RANK)] for s in (0, 1)]
                for p in range(len(CROSS_PAIRS))
            ]
        )
        self.dense_weights = _normal(_hash(_key(seed, _DENSE_WEIGHT), np.arange(num_dense)))
        # Per split: keys of (feature, bag slot) ranks, bag lengths, dense features and labels.
        self.rank_keys = [
            np.array([[_key(seed, _RANK, s, f, j) for j in range(max_bag)] for f in range(num_features)])
            for s in range(len(SPLITS))
        ]
        self.length_keys = [
            np.array([_key(seed, _LENGTH, s, f) for f in range(num_features)]) for s in range(len(SPLITS))
        ]
        self.dense_keys = [np.array([_key(seed, _DENSE, s, d) for d in range(num_dense)]) for s in range(len(SPLITS))]
        self.label_keys = [_key(seed, _LABEL, s) for s in range(len(SPLITS))]
        self.bias = self._solve_bias(click_rate)

    def _solve_bias(self, click_rate: float, num_samples: int = 8192) -> float:
        """Logit offset giving the wanted mean click probability, by bisection on the first train samples.

        Calibrated rather than fixed because 1-row tables (small ``scale``) add constant weights to the logit.
        """
        self.bias = 0.0
        logit = _logit(self.sample("train", 0, num_samples).probability)  # the teacher's logit without offset
        low, high = -30.0, 30.0
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if np.mean(_sigmoid(logit + mid)) < click_rate else (low, mid)
        return (low + high) / 2

    def _bijections(self) -> tuple[np.ndarray, np.ndarray]:
        """Per table (a, b) with gcd(a, n) == 1: rank r -> id (a * r + b) mod n is a bijection."""
        mult, offset = [], []
        for f, n in enumerate(self.rows.tolist()):
            h = int(_hash(_key(self.seed, _BIJECTION, f), np.zeros(1))[0])
            a = 1 + (h >> 32) % max(n - 1, 1)
            while math.gcd(a, n) != 1:
                a += 1
            mult.append(a)
            offset.append(h % n)
        return np.array(mult, dtype=np.int64), np.array(offset, dtype=np.int64)

    def sample(self, split: Split, start: int, stop: int) -> SyntheticSamples:
        s = SPLITS.index(split)
        index = np.arange(start, stop, dtype=np.uint64)
        num_features, max_bag = self.rank_keys[s].shape
        with np.errstate(over="ignore"):
            # ids[b, f, j]: bag slot j of feature f; slots >= the bag length are masked out.
            u = _uniform(_hash(self.rank_keys[s][None], index[:, None, None]))
            ranks = zipf_ranks(u, self.rows[None, :, None], self.zipf_exponent)
            ids = (self.mult[None, :, None] * ranks + self.offset[None, :, None]) % self.rows[None, :, None]
            lengths = 1 + (_uniform(_hash(self.length_keys[s][None], index[:, None])) * self.bag_sizes).astype(np.int64)
            mask = np.arange(max_bag)[None, None, :] < lengths[:, :, None]
            dense = np.logaddexp(0.0, _normal(_hash(self.dense_keys[s][None], index[:, None])))
            probability = self._probability(ranks, mask, lengths, dense)
            labels = _uniform(_hash(self.label_keys[s], index)) < probability
        by_feature = ids.transpose(1, 0, 2)
        mask_by_feature = mask.transpose(1, 0, 2)
        return SyntheticSamples(
            dense=dense.astype(np.float32),
            ids=[by_feature[f][mask_by_feature[f]] for f in range(num_features)],
            lengths=[lengths[:, f].astype(np.int32) for f in range(num_features)],
            labels=labels.astype(np.float32),
            probability=probability,
        )

    def _probability(self, ranks: np.ndarray, mask: np.ndarray, lengths: np.ndarray, dense: np.ndarray) -> np.ndarray:
        """Teacher click probability; bags contribute the mean over their ids.

        Effects are hashed from (feature, rank), a fixed function of the id since ids are a bijection
        of ranks. They shrink like (1 + rank / signal_rows) ** -0.5: rare ids carry little signal,
        so the teacher is learnable from a sample of realistic size (as with real logs, where a rare
        id's click rate is mostly noise).
        """
        r = ranks.astype(np.uint64)
        shrink = mask / np.sqrt(1.0 + ranks / self.signal_rows)
        weights = _normal(_hash(self.weight_keys[None, :, None], r)) * shrink
        logit = self.id_weight_scale * (weights.sum(axis=2) / lengths).sum(axis=1)
        for p, (i, j) in enumerate(CROSS_PAIRS):
            # (B, bag, CROSS_RANK) hashed vectors, averaged over each bag, then dotted.
            u = _normal(_hash(self.cross_keys[p, 0][None, None], r[:, i, :, None]))
            v = _normal(_hash(self.cross_keys[p, 1][None, None], r[:, j, :, None]))
            u = (u * shrink[:, i, :, None]).sum(axis=1) / lengths[:, i, None]
            v = (v * shrink[:, j, :, None]).sum(axis=1) / lengths[:, j, None]
            logit += self.cross_scale / math.sqrt(CROSS_RANK) * (u * v).sum(axis=1)
        centered = dense - _SOFTPLUS_NORMAL_MEAN
        dense_term = centered @ self.dense_weights / math.sqrt(self.num_dense) + centered[:, 0] * centered[:, 1]
        logit += self.bias + self.dense_scale * dense_term
        return _sigmoid(logit)


class _SyntheticSplit:
    def __init__(self, generator: SyntheticGenerator, split: Split, num_samples: int, keys: list[str]) -> None:
        self.generator, self.split, self.num_samples, self.keys = generator, split, num_samples, keys

    def __len__(self) -> int:
        return self.num_samples

    def batch(self, start: int, stop: int) -> Batch:
        s = self.generator.sample(self.split, start, stop)
        return make_batch(self.keys, s.dense, s.labels, list(zip(s.ids, s.lengths)))


class SyntheticCTRDataModule(CTRDataModule):
    """Criteo-shaped synthetic clicks (26 categorical, 13 dense features) with a known teacher.

    Tables have the Criteo Kaggle cardinalities times ``scale``; ids follow a per-feature Zipf law
    scattered by a bijection (hot ids are not the small ids). Labels are Bernoulli(p) with
    ``logit p = bias + id_weight_scale * sum_f w_f[id] + cross_scale * sum_pairs u[id_i].v[id_j] / 2
    + dense_scale * (linear + one product of dense features)``, where ``w``, ``u``, ``v`` are hashed
    normals shrunk by ``(1 + rank / signal_rows) ** -0.5`` (the hot ids carry the signal). With the
    defaults the Bayes-optimal val AUC is about 0.82, and a dim-16 DLRM gets within about 0.02 in
    one epoch. ``reference_metrics`` gives the AUC and log loss of the true ``p`` on val/test labels.

    Args:
        seed: determines tables, teacher and every sample.
        scale: multiplies the Criteo Kaggle cardinalities (each table keeps at least one row).
        num_embeddings_cap: optional upper bound on the rows of every table.
        zipf_exponent: power-law exponent of id popularity (> 0; about 1 for real CTR logs).
        multi_hot_sizes: optional max bag size per feature (26 values, 1 = one-hot); bag lengths are
            uniform in 1..size and a bag's teacher contribution is the mean over its ids.
        num_train_samples: samples in the train split.
        num_val_samples: samples in the val split.
        num_test_samples: samples in the test split (also used by predict).
        signal_rows: popularity rank scale below which ids carry full teacher signal (> 0).
        click_rate: mean click probability in (0, 1); the teacher's logit offset ``bias`` is solved for it.
        id_weight_scale: std of the teacher weight of the hottest ids.
        cross_scale: strength of the planted low-rank feature crosses.
        dense_scale: strength of the dense-feature terms.
        **kwargs: `CTRDataModule` options (batch_size, num_workers, embedding_dim, shuffle).
    """

    def __init__(
        self,
        seed: int = 0,
        scale: float = 0.01,
        num_embeddings_cap: Optional[int] = None,
        zipf_exponent: float = 1.05,
        multi_hot_sizes: Optional[list[int]] = None,
        num_train_samples: int = 200_000,
        num_val_samples: int = 20_000,
        num_test_samples: int = 20_000,
        signal_rows: float = 5.0,
        click_rate: float = 0.27,
        id_weight_scale: float = 0.5,
        cross_scale: float = 0.3,
        dense_scale: float = 1.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        if num_embeddings_cap is not None and num_embeddings_cap < 1:
            raise ValueError(f"num_embeddings_cap must be >= 1 or None, got {num_embeddings_cap}")
        if not zipf_exponent > 0:
            raise ValueError(f"zipf_exponent must be > 0, got {zipf_exponent}")
        bag_sizes = [1] * len(DEFAULT_CAT_NAMES) if multi_hot_sizes is None else list(multi_hot_sizes)
        if len(bag_sizes) != len(DEFAULT_CAT_NAMES) or min(bag_sizes) < 1:
            raise ValueError(
                f"multi_hot_sizes must list {len(DEFAULT_CAT_NAMES)} bag sizes >= 1 (1 = one-hot), "
                f"got {multi_hot_sizes}"
            )
        non_negative = {
            "num_train_samples": num_train_samples,
            "num_val_samples": num_val_samples,
            "num_test_samples": num_test_samples,
            "id_weight_scale": id_weight_scale,
            "cross_scale": cross_scale,
            "dense_scale": dense_scale,
        }
        for name, value in non_negative.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not 0 < click_rate < 1:
            raise ValueError(f"click_rate must be in (0, 1), got {click_rate}")
        if not signal_rows > 0:
            raise ValueError(f"signal_rows must be > 0, got {signal_rows}")
        rows = [max(1, round(n * scale)) for n in KAGGLE_CARDINALITIES]
        if num_embeddings_cap is not None:
            rows = [min(n, num_embeddings_cap) for n in rows]
        if max(rows) > MAX_ROWS:
            raise ValueError(f"scale={scale} gives a table of {max(rows)} rows; at most {MAX_ROWS} are supported")
        self.feature_cardinalities = dict(zip(DEFAULT_CAT_NAMES, rows))
        self.num_dense_features = len(DEFAULT_INT_NAMES)
        self.num_samples: dict[Split, int] = {
            "train": num_train_samples,
            "val": num_val_samples,
            "test": num_test_samples,
        }
        self.generator = SyntheticGenerator(
            seed,
            rows,
            bag_sizes,
            self.num_dense_features,
            zipf_exponent,
            signal_rows,
            click_rate,
            id_weight_scale,
            cross_scale,
            dense_scale,
        )
        self._reference: dict[Split, dict[str, float]] = {}

    def source(self, split: Split) -> _SyntheticSplit:
        return _SyntheticSplit(self.generator, split, self.num_samples[split], self.feature_names)

    def sample(self, split: Split, start: int, stop: int) -> SyntheticSamples:
        """Raw samples ``[start, stop)`` of a split, with the teacher's click probability."""
        return self.generator.sample(split, start, stop)

    def true_probability(self, split: Split, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """Teacher click probability of samples ``[start, stop)`` (default: the whole split)."""
        return np.concatenate([np.empty(0), *(c.probability for c in self._chunks(split, start, stop))])

    def reference_metrics(self, stage: str) -> dict[str, float]:
        """Bayes-optimal ``bayes_auc`` / ``bayes_logloss``: the true probability scored on the split's labels."""
        if stage not in ("val", "test") or self.num_samples[stage] == 0:
            return {}
        if stage not in self._reference:
            chunks = list(self._chunks(stage, 0, None))
            p = np.concatenate([c.probability for c in chunks])
            y = np.concatenate([c.labels for c in chunks])
            logloss = -np.mean(np.where(y > 0, np.log(p), np.log1p(-p)))
            auc = binary_auroc(torch.from_numpy(p), torch.from_numpy(y).long()).item()
            self._reference[stage] = {"bayes_auc": float(auc), "bayes_logloss": float(logloss)}
        return dict(self._reference[stage])

    def _chunks(self, split: Split, start: int, stop: Optional[int]) -> Iterator[SyntheticSamples]:
        stop = self.num_samples[split] if stop is None else stop
        chunk = 65_536  # bounds the memory of the (B, 26, bag) intermediates
        for a in range(start, stop, chunk):
            yield self.generator.sample(split, a, min(a + chunk, stop))
