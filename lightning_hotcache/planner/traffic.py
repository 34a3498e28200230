"""Communication model: the bytes each rank sends and receives per training step, against the
number of ranks N, for the ways to train embedding tables across data-parallel ranks.

`hotcache plan --world-size N` prints it for a plan and its access stats, and
benchmarks/scaling_model.py tabulates it from 1 to 1024 ranks and validates it against
loopback bytes measured with 2 and 4 gloo processes.

Designs (every one also all-reduces the dense layers' gradients, as DDP does):

- ``hotcache``: lightning_hotcache as built (owner updates; see `hotcache`).
- ``all_gather``: lightning_hotcache before owner updates: misses with their optimizer state
  from their round-robin owners (three all-to-alls), then an all-gather of every rank's
  (id, gradient row) pairs (three all-gathers), so every copy of a row got every update.
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

Workload: for every table, groups of rows sharing a lookup probability ``p`` (iid lookups),
flagged static or not. With ``m`` lookups a row is read at least once with probability
``1 - (1 - p)^m``; the expected distinct rows of N ranks' batches (iid, B samples each) is
the sum of that over rows with ``m = N x B x lookups per sample``. `workload_from_stats`
takes ``p`` from profiled counts (`AccessStats`) by Good-Turing (`seen_probabilities`), with
the unseen mass (rows seen once / lookups, as the planner) spread evenly over the rows never
seen: for a skewed table that overestimates the distinct rows of unions much larger than the
profile (an even spread maximizes distinct rows for a given mass). Cache misses of
``all_gather`` follow Che's approximation of an LRU cache of the plan's dynamic slots (the
cache is LFU/LRU; an approximation). Counts are expectations: the padding of all-gathers to
the largest rank and TCP/gloo headers are not modelled.

Mean per-rank sent and received bytes are equal (every byte sent is received once); both
are reported, with the busiest rank's where it differs. Collectives count the calls per
step on each rank. Written by hand: TorchRec's planner estimates its own shardings'
communication per table (`EmbeddingPerfEstimator`) but models neither a cache nor owner
updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    from torchrec import EmbeddingBagConfig

    from lightning_hotcache.planner.plan import HotColdPlan
    from lightning_hotcache.planner.profiling import AccessStats
    from lightning_hotcache.optim.rowwise import RowWiseOptimizerConfig

FLOAT_BYTES = 4  # float32 rows, gradients and optimizer state
ID_BYTES = 8  # int64 ids and counts
LENGTH_BYTES = 4  # int32 bag lengths of a KeyedJaggedTensor
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb: one all-reduce per bucket


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


def all_gather(w: Workload, ranks: int) -> Traffic:
    """lightning_hotcache before owner updates (up to 2026-11): misses with their optimizer
    state fetched from their owners in staging, every rank's gradient rows all-gathered in
    backward so that every copy of a row got every update."""
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


def hotcache(w: Workload, ranks: int) -> Traffic:
    """As built on FBGEMM's kernel (`lightning_hotcache.embedding.update.OwnersUpdate`): every
    row is updated by its owner. Forward fetches the current weights of the other ranks' rows
    that a rank's batch reads (counts, ids, rows: one exchange per step, with a count per
    device table, i.e. per embedding width); backward sends those rows' gradients back along
    the fetch's route (rows only: the owners have the ids). Both follow the distinct rows one
    rank reads, so only the counts grow with N."""
    _check_ranks(ranks)
    if ranks == 1:
        return Traffic({}, 0)
    read = [t.expected_unique(w.lookups(t)) for t in w.tables]  # distinct rows of one rank's batch
    remote_ids = _remote(ranks) * sum(read) * ID_BYTES
    remote_rows = _remote(ranks) * sum(u * t.dim * FLOAT_BYTES for u, t in zip(read, w.tables))
    parts = {
        "fetch_counts": (ranks - 1) * len({t.dim for t in w.tables}) * ID_BYTES,
        "fetch_ids": remote_ids,
        "fetch_rows": remote_rows,
        "gradient_rows": remote_rows,
    }
    return _with_dense(w, ranks, parts, 4)


DESIGNS: dict[str, Callable[[Workload, int], Traffic]] = {
    "all_gather": all_gather,
    "torchrec_table_wise": torchrec_table_wise,
    "torchrec_row_wise": torchrec_row_wise,
    "hotcache": hotcache,
}


def model_table(
    w: Workload, world_sizes: Sequence[int], designs: dict[str, Callable[[Workload, int], Traffic]] = DESIGNS
) -> dict[str, dict[str, dict[str, Any]]]:
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


def per_rank_report(
    plan: HotColdPlan,
    stats: AccessStats,
    tables: Sequence[EmbeddingBagConfig],
    optimizer: RowWiseOptimizerConfig,
    batch_size: int,
    dense_params: int,
) -> str:
    """What each of ``plan.world_size`` ranks holds and sends per step (modelled from the
    profile, ``batch_size`` samples per rank), as a readable table."""
    from lightning_hotcache.planner.plan import format_bytes, row_bytes

    ranks = plan.world_size
    split = [t for t in tables if not plan.table(t.name).on_device]
    host = sum(-(-t.num_embeddings // ranks) * row_bytes(t, optimizer) for t in split)  # rank 0's shard, the largest
    state_width = max(sum(optimizer.state_widths(t.embedding_dim).values()) for t in tables)
    workload = workload_from_stats(stats, plan, batch_size, state_width, dense_params)
    traffic = {name: design(workload, ranks) for name, design in DESIGNS.items()}
    lines = [
        f"per rank of {ranks}: device {format_bytes(plan.device_bytes)}, host {format_bytes(host)} (its shard of the split tables)",
        f"modelled bytes sent (= received) per rank per step, {batch_size} samples per rank (lightning_hotcache.planner.traffic):",
    ]
    for name, t in traffic.items():
        busiest = ""
        if t.max_send_bytes_per_rank > 1.01 * t.send_bytes_per_rank:
            busiest = f" (busiest rank {format_bytes(round(t.max_send_bytes_per_rank))})"
        label = {"hotcache": "hotcache (this plan)", "all_gather": "all_gather (hotcache before owner updates)"}.get(name, name)
        lines.append(f"  {label:<44} {format_bytes(round(t.send_bytes_per_rank)):>10}{busiest}, {t.collectives} collectives")
    return "\n".join(lines)
