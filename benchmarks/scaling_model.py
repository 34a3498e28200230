"""Communication model: the bytes each rank sends and receives per training step, against the
number of ranks N, for four ways to train embedding tables data-parallel.

Designs (every one also all-reduces the dense layers' gradients, as DDP does):

- ``today``: lightning_hotcache as built. Staging fetches each rank's cache misses (rows and
  optimizer state) from their round-robin owners (`exchange_table_rows`: three all-to-alls);
  backward all-gathers every rank's (id, gradient row) pairs of every table
  (`all_gather_table_rows`: three all-gathers), so every copy of a row gets every update.
  What a rank receives grows as (N - 1) x its own rows.
- ``torchrec_table_wise``: TorchRec's DistributedModelParallel with whole tables on ranks
  (torchrec/distributed/sharding/tw_sharding.py). Forward: `KJTAllToAll` (an all-to-all of
  splits, then one each of lengths and values) sends each sample's ids to the table's rank,
  and `PooledEmbeddingsAllToAll` brings the pooled rows back (B x features x dim per rank);
  backward sends their gradients the same way. Flat in N on average, but a rank holding a
  table serves all N ranks, so once N exceeds the tables the busiest rank grows with N
  (``max_send_bytes_per_rank``).
- ``torchrec_row_wise``: rows of every table split over all ranks
  (torchrec/distributed/sharding/rw_sharding.py). Ids go to their row's rank; lengths go to
  every rank (the bucketized KJT carries a length per sample per feature per bucket); each
  rank pools partial sums for all N x B samples and `PooledEmbeddingsReduceScatter` sums them
  (dist_data.py); its backward is an all-gather (comm_ops.py, ReduceScatterBase_Wait). A
  ring reduce-scatter or all-gather moves (N - 1)/N of an N x B x features x dim tensor per
  rank: (N - 1) x B x features x dim, linear in N.
- ``hotcache``: the next design. The plan's static rows are replicated on every rank and
  their gradients reduced among ranks, per table whichever is cheaper: a dense ring
  all-reduce of the static block, 2 (N - 1)/N x its bytes, or a sparse one over the rows
  read (each rank's rows to a reducing rank by all-to-all, the reduced union back by
  all-gather: (N - 1)/N x (rows one rank read + rows any rank read)). Every other row has
  one owner: a rank fetches the current row (not its optimizer state) of each non-owned
  row it reads and sends the gradient back to the owner, which applies the update. The
  gradient all-to-all reuses the fetch's id order, so it carries no ids. A copy of a cold
  row cached on a non-owner is always stale at its next read (its reader sent a gradient,
  so the owner changed it), so keeping copies exact costs one refresh per read: that is
  the fetch, counted once per row read per step; no separate invalidation is sent because
  copies are dropped after the step that read them.

Workload: for every table, groups of rows sharing a lookup probability ``p`` (iid lookups),
flagged static or not. With ``m`` lookups a row is read at least once with probability
``1 - (1 - p)^m``; the expected distinct rows of N ranks' batches (iid, B samples each) is
the sum of that over rows with ``m = N x B x lookups per sample``. `workload_from_stats`
takes ``p`` from profiled counts (`AccessStats`) by Good-Turing (`seen_probabilities`), with
the unseen mass (rows seen once / lookups, as the planner) spread evenly over the rows never
seen: for a skewed table that overestimates the distinct rows of unions much larger than the
profile (an even spread maximizes distinct rows for a given mass). The benchmark below uses
the synthetic data's exact Zipf law and reports how far the profile-based estimate is off. Cache misses of ``today`` follow Che's approximation of an LRU cache of the
plan's dynamic slots (the cache is LFU/LRU; an approximation). Counts are expectations:
the padding of all-gathers to the largest rank and TCP/gloo headers are not modelled.

Mean per-rank sent and received bytes are equal (every byte sent is received once); both
are reported, with the busiest rank's where it differs. Collectives count the calls per
step on each rank. The module's functions are pure, so `hotcache plan --world-size N` can
print them; run as a script it writes the table, JSON and plot for DLRM at the Criteo
Kaggle cardinalities, and ``--validate`` compares the model with loopback bytes measured
for 2 and 4 gloo processes (benchmarks/scaling.py's jobs, each in its own network
namespace so that no other process's loopback traffic is counted; needs ``unshare``).

    python benchmarks/scaling_model.py [--scale 1.0] [--dim 128] [--batch-size 8192] [--budget 0.1] [--validate]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    from datamodules import SyntheticCTRDataModule
    from lightning_hotcache import AccessStats, HotColdPlan

FLOAT_BYTES = 4  # float32 rows, gradients and optimizer state
ID_BYTES = 8  # int64 ids and counts
LENGTH_BYTES = 4  # int32 bag lengths of a KeyedJaggedTensor
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb: one all-reduce per bucket
RESULTS = Path(__file__).parent / "results"
WORLD_SIZES = tuple(2**k for k in range(11))  # 1, 2, 4, ..., 1024


# ------------------------------------------------------------------------------ workload
@dataclass(frozen=True)
class TableLoad:
    """One table's access law: groups of rows, each row of a group read by one lookup with
    probability ``probability[g]``; ``static[g]``: the group is in the plan's static region.

    Attributes:
        name, dim: the table.
        num_features: pooled outputs per sample (features the table serves).
        lookups_per_sample: ids per sample over those features.
        probability, rows, static: per group, as above (``rows`` may be fractional).
        cache_slots: the plan's dynamic cache slots (for ``today``'s misses).
    """

    name: str
    dim: int
    num_features: int
    lookups_per_sample: float
    probability: np.ndarray
    rows: np.ndarray
    static: np.ndarray
    cache_slots: int = 0

    def __post_init__(self) -> None:
        shapes = {a.shape for a in (self.probability, self.rows, self.static)}
        if len(shapes) != 1 or self.probability.ndim != 1:
            raise ValueError(f"Table {self.name!r}: probability, rows and static must be 1-d arrays of one length.")
        if np.any(self.probability < 0) or np.any(self.probability > 1) or np.any(self.rows < 0):
            raise ValueError(f"Table {self.name!r}: probabilities must lie in [0, 1] and rows be >= 0.")
        mass = float(np.sum(self.probability * self.rows))
        if not math.isclose(mass, 1.0, rel_tol=1e-6):
            raise ValueError(
                f"Table {self.name!r}: probability x rows must sum to 1 over the groups (one lookup reads one row); "
                f"got {mass}."
            )
        if self.dim < 1 or self.num_features < 1 or self.lookups_per_sample <= 0:
            raise ValueError(f"Table {self.name!r}: dim and num_features must be >= 1, lookups_per_sample > 0.")

    @property
    def num_embeddings(self) -> int:
        return round(float(self.rows.sum()))

    @property
    def static_rows(self) -> float:
        return float(self.rows[self.static].sum())

    @property
    def on_device(self) -> bool:
        """Every row is static (``today`` keeps the table out of the miss exchange)."""
        return bool(self.static[self.rows > 0].all())

    def read_probability(self, lookups: float) -> np.ndarray:
        """Per group: probability that a row is read at least once in ``lookups`` lookups."""
        with np.errstate(divide="ignore"):  # a row read by every lookup (p = 1): log(0)
            return -np.expm1(lookups * np.log1p(-self.probability))

    def expected_unique(self, lookups: float, static: bool | None = None) -> float:
        """Expected distinct rows read by ``lookups`` lookups (only static or non-static rows if given)."""
        read = self.rows * self.read_probability(lookups)
        if static is not None:
            read = read[self.static == static]
        return float(read.sum())


@dataclass(frozen=True)
class Workload:
    """What one training step reads: the tables, samples per rank, optimizer state floats per
    row (row-wise Adagrad: 1) and the dense parameters DDP all-reduces."""

    tables: tuple[TableLoad, ...]
    batch_size: int
    state_width: int = 0
    dense_params: int = 0

    def lookups(self, table: TableLoad, ranks: int = 1) -> float:
        """Lookups of ``table`` by ``ranks`` ranks' batches in one step."""
        return ranks * self.batch_size * table.lookups_per_sample


@dataclass(frozen=True)
class Traffic:
    """One step on one rank: mean bytes sent per collective part, collective calls, and the
    busiest rank's bytes (None: same as the mean)."""

    parts: dict[str, float]
    collectives: int
    max_send: float | None = None
    max_recv: float | None = None

    @property
    def send_bytes_per_rank(self) -> float:
        return float(sum(self.parts.values()))

    @property
    def recv_bytes_per_rank(self) -> float:
        return self.send_bytes_per_rank  # every byte one rank sends, one other rank receives

    @property
    def max_send_bytes_per_rank(self) -> float:
        return self.send_bytes_per_rank if self.max_send is None else self.max_send

    @property
    def max_recv_bytes_per_rank(self) -> float:
        return self.recv_bytes_per_rank if self.max_recv is None else self.max_recv

    def to_json(self) -> dict[str, Any]:
        return {
            "send_bytes_per_rank": self.send_bytes_per_rank,
            "recv_bytes_per_rank": self.recv_bytes_per_rank,
            "max_send_bytes_per_rank": self.max_send_bytes_per_rank,
            "max_recv_bytes_per_rank": self.max_recv_bytes_per_rank,
            "collectives": self.collectives,
            "parts": self.parts,
        }


def _check_ranks(ranks: int) -> None:
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"The number of ranks must be an integer >= 1, got {ranks!r}.")


def _remote(ranks: int) -> float:
    """Share of uniformly spread items that live on another rank."""
    return (ranks - 1) / ranks


def _dense_allreduce(w: Workload, ranks: int) -> tuple[float, int]:
    """DDP's ring all-reduce of the dense gradients: bytes a rank sends, and collectives."""
    size = w.dense_params * FLOAT_BYTES
    if ranks == 1 or size == 0:
        return 0.0, 0
    return 2 * _remote(ranks) * size, math.ceil(size / DDP_BUCKET_BYTES)


def _with_dense(w: Workload, ranks: int, parts: dict[str, float], collectives: int, **busiest: float) -> Traffic:
    dense, dense_calls = _dense_allreduce(w, ranks)
    return Traffic({**parts, "dense_allreduce": dense}, collectives + dense_calls, **busiest)


# ------------------------------------------------------------------------------- designs
def lru_misses(table: TableLoad, lookups: float) -> float:
    """Expected distinct non-static rows of one batch (``lookups`` lookups) not in an LRU cache
    of ``table.cache_slots`` rows, by Che's approximation: a row is cached iff it was read in
    the last ``T`` lookups, where ``T`` fills the slots in expectation."""
    cold = ~table.static & (table.probability > 0)
    p, rows = table.probability[cold], table.rows[cold]
    if table.cache_slots >= rows.sum():
        return 0.0

    def filled(window: float) -> float:  # expected distinct rows read in `window` lookups
        return float(np.sum(rows * -np.expm1(-p * window)))

    low, high = 0.0, 1.0
    while filled(high) < table.cache_slots:
        low, high = high, 2 * high
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if filled(middle) < table.cache_slots else (low, middle)
    read = -np.expm1(lookups * np.log1p(-p))
    return float(np.sum(rows * read * np.exp(-p * high)))


def today(w: Workload, ranks: int) -> Traffic:
    """lightning_hotcache as built: miss exchange in staging, gradient all-gather in backward."""
    _check_ranks(ranks)
    if ranks == 1:
        return Traffic({}, 0)
    split = [t for t in w.tables if not t.on_device]
    misses = [lru_misses(t, w.lookups(t)) for t in split]
    unique = [t.expected_unique(w.lookups(t)) for t in w.tables]
    parts = {
        # all_to_all_single of (rank, table) miss counts, ids and rows with their state.
        "miss_counts": (ranks - 1) * len(split) * ID_BYTES,
        "miss_ids": _remote(ranks) * sum(misses) * ID_BYTES,
        "miss_rows": _remote(ranks) * sum(m * (t.dim + w.state_width) * FLOAT_BYTES for m, t in zip(misses, split)),
        # A ring all-gather forwards the other N - 1 ranks' parts.
        "gradient_counts": (ranks - 1) * len(w.tables) * ID_BYTES,
        "gradient_ids": (ranks - 1) * sum(unique) * ID_BYTES,
        "gradient_rows": (ranks - 1) * sum(u * t.dim * FLOAT_BYTES for u, t in zip(unique, w.tables)),
    }
    return _with_dense(w, ranks, parts, (3 if split else 0) + 3)


def _kjt_all_to_all(w: Workload, ranks: int, lengths_to_every_rank: bool) -> dict[str, float]:
    """TorchRec's KJTAllToAll: splits, then lengths and values (ids)."""
    features = sum(t.num_features for t in w.tables)
    lengths = w.batch_size * features * LENGTH_BYTES
    return {
        "kjt_splits": (ranks - 1) * 2 * ID_BYTES,
        "kjt_lengths": (ranks - 1) * lengths if lengths_to_every_rank else _remote(ranks) * lengths,
        "kjt_ids": _remote(ranks) * sum(w.lookups(t) for t in w.tables) * ID_BYTES,
    }


def torchrec_table_wise(w: Workload, ranks: int) -> Traffic:
    """TorchRec table-wise: ids to each table's rank, pooled rows back, their gradients back again.

    Tables go to ranks round-robin for the busiest rank (TorchRec's planner balances by cost;
    with one-hot tables of one width that is the same count per rank)."""
    _check_ranks(ranks)
    if ranks == 1:
        return Traffic({}, 0)
    pooled = w.batch_size * sum(t.num_features * t.dim for t in w.tables) * FLOAT_BYTES
    parts = {
        **_kjt_all_to_all(w, ranks, lengths_to_every_rank=False),
        "pooled_forward": _remote(ranks) * pooled,
        "pooled_backward": _remote(ranks) * pooled,
    }
    # Per rank k: what its hosted tables serve to N - 1 ranks, and what its batch needs from the others.
    host = np.arange(len(w.tables)) % ranks
    ids = np.array([w.batch_size * (t.num_features * LENGTH_BYTES + t.lookups_per_sample * ID_BYTES) for t in w.tables])
    rows = np.array([w.batch_size * t.num_features * t.dim * FLOAT_BYTES for t in w.tables])
    hosted_ids, hosted_rows = (np.bincount(host, weights=x, minlength=ranks) for x in (ids, rows))
    send = (ids.sum() - hosted_ids) + (ranks - 1) * hosted_rows + (rows.sum() - hosted_rows)
    recv = (ranks - 1) * hosted_ids + (rows.sum() - hosted_rows) + (ranks - 1) * hosted_rows
    fixed = parts["kjt_splits"] + _dense_allreduce(w, ranks)[0]
    return _with_dense(w, ranks, parts, 3 + 2, max_send=float(send.max()) + fixed, max_recv=float(recv.max()) + fixed)


def torchrec_row_wise(w: Workload, ranks: int) -> Traffic:
    """TorchRec row-wise: ids to their row's rank, partial sums of all N x B samples reduce-scattered
    forward and all-gathered backward."""
    _check_ranks(ranks)
    if ranks == 1:
        return Traffic({}, 0)
    pooled = w.batch_size * sum(t.num_features * t.dim for t in w.tables) * FLOAT_BYTES
    parts = {
        **_kjt_all_to_all(w, ranks, lengths_to_every_rank=True),
        "pooled_reduce_scatter": (ranks - 1) * pooled,
        "pooled_all_gather": (ranks - 1) * pooled,
    }
    return _with_dense(w, ranks, parts, 3 + 2)


def hot_reduction(table: TableLoad, batch_size: int, ranks: int) -> tuple[str, float]:
    """How ``hotcache`` reduces a table's static rows across ``ranks`` ranks, and the bytes a
    rank sends for it: ``"dense"`` (ring all-reduce of the static block), ``"sparse"`` (the
    rows read, with ids) or ``"none"`` (no static rows, or one rank)."""
    if ranks == 1 or table.static_rows == 0:
        return "none", 0.0
    lookups = batch_size * table.lookups_per_sample
    dense = 2 * _remote(ranks) * table.static_rows * table.dim * FLOAT_BYTES
    read = table.expected_unique(lookups, static=True) + table.expected_unique(ranks * lookups, static=True)
    sparse = _remote(ranks) * read * (ID_BYTES + table.dim * FLOAT_BYTES)
    return ("dense", dense) if dense <= sparse else ("sparse", sparse)


def hotcache(w: Workload, ranks: int) -> Traffic:
    """The next design: static rows replicated (gradients reduced), every other row owned by one rank."""
    _check_ranks(ranks)
    if ranks == 1:
        return Traffic({}, 0)
    reductions = [hot_reduction(t, w.batch_size, ranks) for t in w.tables]
    modes = {mode for mode, _ in reductions}
    owned = [t.expected_unique(w.lookups(t), static=False) for t in w.tables]
    parts = {
        "hot_dense_allreduce": sum(b for mode, b in reductions if mode == "dense"),
        # counts by all-to-all and all-gather, then the rows (ids and gradients)
        "hot_sparse_counts": 2 * (ranks - 1) * len(w.tables) * ID_BYTES if "sparse" in modes else 0.0,
        "hot_sparse_rows": sum(b for mode, b in reductions if mode == "sparse"),
        "cold_fetch_counts": (ranks - 1) * len(w.tables) * ID_BYTES if any(owned) else 0.0,
        "cold_fetch_ids": _remote(ranks) * sum(owned) * ID_BYTES,
        "cold_fetch_rows": _remote(ranks) * sum(u * t.dim * FLOAT_BYTES for u, t in zip(owned, w.tables)),
        "cold_gradient_rows": _remote(ranks) * sum(u * t.dim * FLOAT_BYTES for u, t in zip(owned, w.tables)),
    }
    collectives = int("dense" in modes) + 6 * int("sparse" in modes) + 4 * int(any(owned))
    return _with_dense(w, ranks, parts, collectives)


DESIGNS: dict[str, Callable[[Workload, int], Traffic]] = {
    "today": today,
    "torchrec_table_wise": torchrec_table_wise,
    "torchrec_row_wise": torchrec_row_wise,
    "hotcache": hotcache,
}


def replicate_frequent(w: Workload) -> Workload:
    """``w`` with the static region every table's rows that ``hotcache`` should replicate.

    Per row and rank, replicating costs a dense all-reduce share of ``2 (N-1)/N x 4 dim``
    bytes (sparse costs more: ids, and the rows other ranks read), owning costs
    ``(N-1)/N x q x (8 + 2 x 4 dim)`` (fetch id and row, gradient row), with ``q`` the
    probability that a rank's batch reads the row. Replicate iff ``q > dim / (dim + 1)``:
    only rows that nearly every batch reads. The threshold does not depend on N."""
    tables = []
    for t in w.tables:
        read = t.read_probability(w.lookups(t))
        tables.append(replace(t, static=read > t.dim / (t.dim + 1)))
    return replace(w, tables=tuple(tables))


def model_table(w: Workload, world_sizes: Sequence[int], designs: dict[str, Callable[[Workload, int], Traffic]] = DESIGNS) -> dict[str, dict[str, dict[str, Any]]]:
    """design -> str(N) -> `Traffic.to_json` (what the JSON report holds)."""
    return {name: {str(n): design(w, n).to_json() for n in world_sizes} for name, design in designs.items()}


def seen_probabilities(counts: np.ndarray, lookups: int, exact: bool, has_unseen: bool) -> tuple[np.ndarray, float]:
    """Lookup probability of each profiled row from its count, and the mass of rows never seen.

    Exact counts: Good-Turing with Katz's cut-off. The unseen mass is ``f1 / lookups`` (``f_r``:
    rows seen ``r`` times), a row seen ``r <= 5`` times gets Turing's ``(r + 1) f_{r+1} / f_r``
    lookups instead of ``r`` (rows seen once in a sample are rarer than that sample says), and
    the seen rows are scaled to ``1 - unseen``. A sketch holds only heavy hitters: its counts
    are taken as they are and the lookups they miss are the unseen mass."""
    counts = counts.astype(float)
    if not exact:
        held = counts.sum()
        unseen = max(0.0, 1.0 - held / lookups) if has_unseen else 0.0
        return counts / held * (1.0 - unseen), unseen
    values, rows_with = np.unique(counts, return_counts=True)
    frequency = dict(zip(values.tolist(), rows_with.tolist()))
    adjusted = counts.copy()
    for r in range(1, 6):
        if frequency.get(r + 1, 0) == 0 or r not in frequency:
            break
        adjusted[counts == r] = (r + 1) * frequency[r + 1] / frequency[r]
    unseen = frequency.get(1, 0) / lookups if has_unseen else 0.0
    return adjusted / adjusted.sum() * (1.0 - unseen), unseen


def workload_from_stats(
    stats: AccessStats,
    plan: HotColdPlan,
    batch_size: int,
    state_width: int,
    dense_params: int,
    samples_per_profiled_batch: int | None = None,
) -> Workload:
    """A workload from profiled counts and a plan (static ids, cache slots).

    Seen rows get Good-Turing probabilities (`seen_probabilities`); the unseen mass is spread
    evenly over the rows never seen. ``samples_per_profiled_batch`` (default ``batch_size``)
    turns lookups per profiled batch into lookups per sample."""
    per_batch = samples_per_profiled_batch or batch_size
    if stats.num_batches == 0:
        raise ValueError("The access stats observed no batch: profile some batches first.")
    tables = []
    for sig in stats.tables:
        lookups = stats.num_lookups[sig.name]
        if lookups == 0:
            raise ValueError(f"Table {sig.name} was never read in the profile: the model needs its lookups.")
        table_plan = plan.table(sig.name)
        ids, counts = stats.top_ids(sig.name)
        unseen_rows = sig.num_embeddings - len(ids)
        seen, unseen = seen_probabilities(counts, lookups, stats.is_exact(sig.name), unseen_rows > 0)
        static = np.isin(ids, table_plan.static_ids)
        # Rows sharing a count (so a probability) and a static flag form one group.
        keys, first, group_rows = np.unique(np.stack([counts, static]), axis=1, return_index=True, return_counts=True)
        probability, rows, flags = seen[first], group_rows.astype(float), keys[1].astype(bool)
        if unseen_rows:
            static_unseen = len(table_plan.static_ids) - int(static.sum())
            probability = np.append(probability, [unseen / unseen_rows] * 2)
            rows = np.append(rows, [static_unseen, unseen_rows - static_unseen])
            flags = np.append(flags, [True, False])
        tables.append(
            TableLoad(
                sig.name, sig.embedding_dim, len(sig.feature_names), lookups / (stats.num_batches * per_batch),
                probability, rows, flags, table_plan.cache_slots,
            )  # fmt: skip
        )
    return Workload(tuple(tables), batch_size, state_width, dense_params)


# ----------------------------------------------------------------------------- benchmark
def zipf_rank_probabilities(rows: int, exponent: float) -> np.ndarray:
    """P(rank = r), r < rows, of `datamodules.synthetic.zipf_ranks`: rank ``floor(x) - 1`` for
    ``x`` on ``[1, rows + 1)`` with CDF ``F(x) = expm1(s ln x) / expm1(s ln(rows + 1))``, s = 1 - exponent."""
    edges = np.arange(1, rows + 2, dtype=np.float64)  # rank r is x in [r + 1, r + 2)
    log_n = math.log(rows + 1.0)
    if abs(exponent - 1.0) < 1e-9:
        cdf = np.log(edges) / log_n
    else:
        s = 1.0 - exponent
        cdf = np.expm1(s * np.log(edges)) / math.expm1(s * log_n)
    return np.diff(cdf)


def synthetic_workload(
    dm: SyntheticCTRDataModule, plan: HotColdPlan, state_width: int, dense_params: int, bins: int = 4096
) -> Workload:
    """The exact access law of `SyntheticCTRDataModule` (Zipf ranks scattered over ids by a
    bijection), rows grouped by ``bins`` geometric rank ranges (probabilities within a group
    differ by under 1% at 10M rows) and by the plan's static flag."""
    g = dm.generator
    tables = []
    for f, config in enumerate(dm.tables):
        n = int(g.rows[f])
        probability = zipf_rank_probabilities(n, g.zipf_exponent)
        static = np.zeros(n, dtype=bool)
        static_ids = plan.table(config.name).static_ids.astype(np.int64)
        # id = (mult * rank + offset) mod n, so rank = (id - offset) / mult mod n.
        static[(static_ids - int(g.offset[f])) * pow(int(g.mult[f]), -1, n) % n if n > 1 else static_ids] = True
        group = np.minimum((np.log1p(np.arange(n)) / math.log1p(n) * bins).astype(np.int64), bins - 1) * 2 + static
        rows = np.bincount(group, minlength=2 * bins).astype(np.float64)
        mass = np.bincount(group, weights=probability, minlength=2 * bins)
        kept = rows > 0
        tables.append(
            TableLoad(
                config.name, config.embedding_dim, len(config.feature_names), (int(g.bag_sizes[f]) + 1) / 2,
                mass[kept] / rows[kept], rows[kept], (np.arange(2 * bins) % 2 == 1)[kept],
                plan.table(config.name).cache_slots,
            )  # fmt: skip
        )
    return Workload(tuple(tables), dm.batch_size, state_width, dense_params)


def profile_and_plan(
    dm: SyntheticCTRDataModule, budget: float, world_size: int, batches: int
) -> tuple[AccessStats, HotColdPlan, int, int]:
    """What `HotCacheStrategy` does before training (as benchmarks/scaling.py configures it):
    profile the first ``batches`` training batches and plan. Returns stats, plan, optimizer
    state floats per row and the model's dense parameters."""
    from lightning_hotcache import HotColdPlanner
    from lightning_hotcache.profiling import profile_batches
    from models import DLRM

    model = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                 defer_table_init=True)  # fmt: skip
    optimizer = model.embedding_optimizer_config
    dm.setup("fit")
    stats = profile_batches(dm.train_dataloader(), dm.tables, batches, progress=False)
    # The strategy's planner: prefetch depth 1, plus the batch Lightning's fetcher holds and a validation batch.
    planner = HotColdPlanner(budget, optimizer, world_size=world_size, prefetch_depth=3, cache_policy="lfu")
    state_width = sum(optimizer.state_widths(dm.tables[0].embedding_dim).values())
    return stats, planner.plan(dm.tables, stats), state_width, sum(p.numel() for p in model.dense_parameters())


def designs_for(w: Workload, world_sizes: Sequence[int]) -> dict[str, dict[str, dict[str, Any]]]:
    """Every design; ``hotcache`` with the frequent rows replicated (`replicate_frequent`) and
    ``hotcache_budget_static`` with the plan's static region (chosen for device memory) replicated."""
    results = model_table(w, world_sizes, {k: v for k, v in DESIGNS.items() if k != "hotcache"})
    results["hotcache"] = model_table(replicate_frequent(w), world_sizes, {"hotcache": hotcache})["hotcache"]
    results["hotcache_budget_static"] = model_table(w, world_sizes, {"hotcache": hotcache})["hotcache"]
    return results


def measure_loopback(strategy: str, procs: int, args: argparse.Namespace) -> float:
    """Bytes per step that all processes of one benchmarks/scaling.py job sent each other,
    read off the loopback counter of a network namespace of the job's own."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise RuntimeError("--validate needs `unshare` and `ip` (util-linux, iproute2) to count one job's bytes alone.")
    job = [
        sys.executable, str(Path(__file__).with_name("scaling.py")), "--scale", str(args.validate_scale),
        "--dim", str(args.validate_dim), "--batch-size", str(args.validate_batch_size), "--steps",
        str(args.validate_steps), "--warmup", str(args.validate_warmup), "--strategy", strategy, "--procs", str(procs),
    ]  # fmt: skip
    # Lightning launches the other ranks itself; stale rendezvous settings would misdirect them,
    # and gloo must use the namespace's only interface.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    command = ["unshare", "--net", "--map-root-user", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *job]
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{' '.join(job)} printed no RESULT line:\n{out}")
    return json.loads(match.group(1))["sent_kib_per_step"] * 1024


# benchmarks/scaling.py's strategies, the design that models each, and its device budget.
VALIDATION_JOBS = (("torchrec", torchrec_table_wise, 1.0), ("hotcache@1", today, 1.0), ("hotcache@0.1", today, 0.1))


def validate(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Modelled vs measured bytes per rank per step, for 2 and 4 gloo processes (measured now,
    or taken from the validation of the report ``args.measured``)."""
    from datamodules import SyntheticCTRDataModule

    earlier = None
    if args.measured is not None:
        previous = json.loads(args.measured.read_text())["results"]["validation"] or []
        earlier = {(r["strategy"], r["procs"]): r["measured_bytes_per_rank"] for r in previous}

    rows = []
    for procs in (2, 4):
        dm = SyntheticCTRDataModule(scale=args.validate_scale, embedding_dim=args.validate_dim,
                                    batch_size=args.validate_batch_size, shuffle=False)  # fmt: skip
        for strategy, design, budget in VALIDATION_JOBS:
            # scaling.py's hotcache jobs profile 20 batches; the torchrec model needs no plan.
            stats, plan, state_width, dense = profile_and_plan(dm, budget, procs, batches=20)
            w = workload_from_stats(stats, plan, args.validate_batch_size, state_width, dense)
            modelled = design(w, procs).send_bytes_per_rank
            if earlier is None:
                measured = measure_loopback(strategy, procs, args) / procs
            elif (strategy, procs) in earlier:
                measured = earlier[(strategy, procs)]
            else:
                raise ValueError(f"{args.measured} has no measurement of {strategy} x{procs}: run with --validate.")
            rows.append({"strategy": strategy, "design": design.__name__, "procs": procs, "modelled_bytes_per_rank": modelled,
                         "measured_bytes_per_rank": measured, "error": modelled / measured - 1})  # fmt: skip
            print(f"validate {strategy} x{procs}: modelled {modelled / 2**10:,.0f} KiB, "
                  f"measured {measured / 2**10:,.0f} KiB per rank per step ({modelled / measured - 1:+.1%})", flush=True)  # fmt: skip
    return rows


def estimator_check(stats_w: Workload, exact_w: Workload, world_sizes: Sequence[int]) -> dict[str, Any]:
    """How far the profile-based estimate is from the exact law: distinct rows read per step
    (all tables) by one rank and by all ranks, and each design's bytes, as ratios."""
    def union(w: Workload, n: int) -> float:
        return sum(t.expected_unique(w.lookups(t, n)) for t in w.tables)

    by_stats, exact = designs_for(stats_w, world_sizes), designs_for(exact_w, world_sizes)
    return {
        "unique_rows_ratio": {str(n): union(stats_w, n) / union(exact_w, n) for n in world_sizes},
        "bytes_ratio": {
            d: {str(n): by_stats[d][str(n)]["send_bytes_per_rank"] / exact[d][str(n)]["send_bytes_per_rank"]
                for n in world_sizes if n > 1}
            for d in exact
        },  # fmt: skip
    }


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, by_n in results.items():
        ns = [int(n) for n in by_n if int(n) > 1]  # N = 1 sends nothing: no place on a log axis
        ax.plot(ns, [by_n[str(n)]["send_bytes_per_rank"] / 2**20 for n in ns], marker="o", markersize=3, label=name)
        if name == "torchrec_table_wise":
            busiest = [by_n[str(n)]["max_send_bytes_per_rank"] / 2**20 for n in ns]
            ax.plot(ns, busiest, linestyle="--", color=ax.lines[-1].get_color(), label=f"{name} (busiest rank)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("MiB sent (= received) per rank per step")
    ax.set_title(title, fontsize="medium")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from report import write_report

    from datamodules import SyntheticCTRDataModule

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="times the Criteo Kaggle cardinalities")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8192, help="samples per rank per step")
    parser.add_argument("--budget", type=float, default=0.1, help="device budget, a fraction of the tables' bytes")
    parser.add_argument("--profile-batches", type=int, default=20)
    parser.add_argument("--max-ranks", type=int, default=1024)
    parser.add_argument("--validate", action="store_true", help="also measure 2 and 4 gloo processes (minutes)")
    parser.add_argument("--validate-scale", type=float, default=0.1)
    parser.add_argument("--validate-dim", type=int, default=16)
    parser.add_argument("--validate-batch-size", type=int, default=2048)
    parser.add_argument("--validate-steps", type=int, default=16)
    parser.add_argument("--validate-warmup", type=int, default=6)
    parser.add_argument("--measured", type=Path, help="validate against the measurements in this earlier report")
    parser.add_argument("--out", type=Path, default=RESULTS / "scaling_model.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "scaling_model.png")
    args = parser.parse_args()
    world_sizes = [n for n in WORLD_SIZES if n <= args.max_ranks]

    dm = SyntheticCTRDataModule(scale=args.scale, embedding_dim=args.dim, batch_size=args.batch_size, shuffle=False)
    stats, plan, state_width, dense = profile_and_plan(dm, args.budget, max(world_sizes), args.profile_batches)
    exact = synthetic_workload(dm, plan, state_width, dense)
    results = designs_for(exact, world_sizes)
    names = list(results)
    print(f"MiB sent (= received) per rank per step; busiest rank's in brackets where it differs\n{'N':>5}"
          + "".join(f"{n:>24}" for n in names))  # fmt: skip
    for n in world_sizes:
        cells = []
        for name in names:
            r = results[name][str(n)]
            busiest = r["max_send_bytes_per_rank"]
            extra = f" ({busiest / 2**20:,.0f})" if busiest > 1.01 * r["send_bytes_per_rank"] else ""
            cells.append(f"{r['send_bytes_per_rank'] / 2**20:,.1f}{extra}")
        print(f"{n:>5}" + "".join(f"{c:>24}" for c in cells))
    top, eight = results["hotcache"][str(max(world_sizes))], results["hotcache"]["8"]
    targets = {
        "hotcache_le_torchrec_table_wise": top["send_bytes_per_rank"]
        <= results["torchrec_table_wise"][str(max(world_sizes))]["send_bytes_per_rank"],
        "hotcache_max_over_8_ranks": top["send_bytes_per_rank"] / eight["send_bytes_per_rank"],
    }
    print(f"targets at N = {max(world_sizes)}: {targets}")
    check = estimator_check(workload_from_stats(stats, plan, args.batch_size, state_width, dense), exact, world_sizes)
    print(f"profile-based estimate / exact law, distinct rows per step: {check['unique_rows_ratio']}")
    replicated = replicate_frequent(exact)
    report = {
        "designs": results,
        "targets": targets,
        "replicated_rows": {"frequent": sum(t.static_rows for t in replicated.tables),
                            "budget_static": sum(t.static_rows for t in exact.tables)},  # fmt: skip
        "estimator_check": check,
        "validation": validate(args) if args.validate or args.measured else None,
    }
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(results, args.plot, f"DLRM dim {args.dim}, {args.batch_size} samples/rank, scale {args.scale}, budget {args.budget}")
    write_report("scaling_model", args, report, world_sizes=world_sizes)


if __name__ == "__main__":
    main()
