"""HotColdPlanner: which embedding rows stay on the device, within a memory budget.

Input: the tables, measured access statistics (`AccessStats`), a device budget and the
world size. Output: a `HotColdPlan` saying, per table, whether it lives wholly on the
device or is split into static hot rows (FAE) plus dynamic cache slots (MixCache), with the
expected hit rate. The budget counts rows, their optimizer state and the cache's
bookkeeping. Small tables go whole to the device first (their rows are the hottest per
byte and whole tables need no bookkeeping); the rest of the budget buys hot rows by
marginal coverage per byte across all tables, so a narrow skewed table and a wide flat one
compete on how many lookups each byte saves. Every split table also keeps enough dynamic
slots for the unique rows of the batches in flight (``prefetch_depth + 1`` batches).

Whole-table placement goes through TorchRec's EmbeddingShardingPlanner (data-parallel:
device tables are replicated, as FAE replicates hot rows); its ShardingPlan is kept in the
plan.
"""

from __future__ import annotations

import json
import logging
import math
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence, Union

import numpy as np
import torch
from torchrec import EmbeddingBagConfig

from lightning_hotcache.cache.device import check_cache_policy
from lightning_hotcache.cache.slot_map import SORTED_BYTES_PER_RESIDENT, slot_map_bytes
from lightning_hotcache.rowwise import RowWiseOptimizerConfig

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

    from lightning_hotcache.profiling import AccessStats

Budget = Union[int, float, str]
PLAN_FORMAT_VERSION = 1
# Per dynamic slot: id_of_slot, locks, last_used, frequency (int64) and dirty (bool).
SLOT_BOOKKEEPING_BYTES = 4 * 8 + 1
# The profile's largest unique-rows-per-batch is a sample maximum: later batches exceed it
# (by up to ~20% seen on Zipf data), and a batch that does not fit its cache cannot train.
UNIQUE_ROWS_MARGIN = 1.5
# Dynamic slots per unique row of the batches in flight: headroom so that rows read by
# consecutive batches stay cached between them.
DYNAMIC_HEADROOM = 2
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def format_bytes(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024:
            return f"{num:.1f} {unit}" if unit != "B" else f"{int(num)} B"
        num /= 1024
    return f"{num:.1f} TiB"


def row_bytes(table: EmbeddingBagConfig, optimizer: RowWiseOptimizerConfig) -> int:
    """Bytes of one row plus its optimizer state (float32)."""
    return 4 * (table.embedding_dim + sum(optimizer.state_widths(table.embedding_dim).values()))


def resolve_budget(budget: Budget, total_bytes: int, device: torch.device | str = "cpu") -> int:
    """Bytes from a budget: an int, a string like ``"2GB"``/``"512MiB"``, a fraction in (0, 1]
    of the model's embedding bytes, or ``"auto"`` (half the free device memory)."""
    if isinstance(budget, bool):
        raise ValueError(f"device_budget must be bytes, a size string, a fraction or 'auto'; got {budget!r}.")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"device_budget must be positive, got {budget} bytes.")
        return budget
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(
                f"A float device_budget is a fraction of the embedding bytes and must lie in (0, 1]; got {budget}."
            )
        return max(1, int(budget * total_bytes))
    text = str(budget).strip().lower()
    if text == "auto":
        device = torch.device(device)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        else:
            free = _available_host_memory()
        return max(1, free // 2)
    if re.fullmatch(r"[0-9]+", text):
        return resolve_budget(int(text), total_bytes, device)
    if re.fullmatch(r"[0-9]*\.[0-9]+", text):  # "0.1" from a command line: a fraction
        return resolve_budget(float(text), total_bytes, device)
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)", text)
    if match:
        return max(1, int(float(match.group(1)) * _UNITS[match.group(2)]))
    raise ValueError(
        f"Cannot read device_budget {budget!r}: use bytes (int), a size like '2GB' or '512MiB', "
        "a fraction in (0, 1] of the embedding bytes, or 'auto'."
    )


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


@dataclass(eq=False)
class TablePlan:
    """Placement of one table.

    Attributes:
        name, num_embeddings, embedding_dim: the table.
        static_ids: ids kept on the device for the whole run (all ids: the table is on the device).
        cache_slots: dynamic cache slots (0 for tables wholly on the device).
        device_bytes: what this table costs on the device (rows, state, bookkeeping).
        expected_hit_rate: fraction of lookups expected to find their row on the device.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    static_ids: np.ndarray
    cache_slots: int
    device_bytes: int
    expected_hit_rate: float

    @property
    def on_device(self) -> bool:
        return len(self.static_ids) == self.num_embeddings

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["static_ids"] = "all" if self.on_device else self.static_ids.tolist()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TablePlan":
        ids = data["static_ids"]
        static = np.arange(data["num_embeddings"]) if ids == "all" else np.asarray(ids, dtype=np.int64)
        return cls(**{**data, "static_ids": static})


@dataclass(eq=False)
class HotColdPlan:
    """Per-table placement plus the budget it was made for. Prints as a table, saves as JSON."""

    tables: list[TablePlan]
    budget_bytes: int
    world_size: int = 1
    prefetch_depth: int = 0
    cache_policy: str = "lfu"
    sharding_plan: "ShardingPlan | None" = field(default=None, compare=False)

    def table(self, name: str) -> TablePlan:
        for plan in self.tables:
            if plan.name == name:
                return plan
        raise KeyError(f"The plan has no table {name!r} (it has {[t.name for t in self.tables]}).")

    @property
    def device_bytes(self) -> int:
        return sum(t.device_bytes for t in self.tables)

    def check_tables(self, tables: Sequence[EmbeddingBagConfig]) -> None:
        """Raise if the plan was made for other tables than ``tables``."""
        planned = {t.name: t for t in self.tables}
        for table in tables:
            plan = planned.get(table.name)
            if plan is None:
                raise ValueError(f"Table {table.name!r} is not in the plan (it plans {sorted(planned)}); plan again.")
            if (plan.num_embeddings, plan.embedding_dim) != (table.num_embeddings, table.embedding_dim):
                raise ValueError(
                    f"Table {table.name!r} is {table.num_embeddings}x{table.embedding_dim} in the model but "
                    f"{plan.num_embeddings}x{plan.embedding_dim} in the plan; plan again for this model."
                )

    def __str__(self) -> str:
        header = ("table", "rows", "dim", "static rows", "cache slots", "device bytes", "hit rate")
        rows = [
            (t.name, f"{t.num_embeddings:,}", str(t.embedding_dim),
             "all" if t.on_device else f"{len(t.static_ids):,}", f"{t.cache_slots:,}",
             format_bytes(t.device_bytes), f"{t.expected_hit_rate:.3f}")
            for t in self.tables
        ]  # fmt: skip
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [header, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(
            f"device: {format_bytes(self.device_bytes)} of {format_bytes(self.budget_bytes)} budget; "
            f"world size {self.world_size}, prefetch depth {self.prefetch_depth}, policy {self.cache_policy}"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (what `save` writes; the TorchRec ShardingPlan is not included)."""
        return {
            "format_version": PLAN_FORMAT_VERSION,
            "budget_bytes": self.budget_bytes,
            "world_size": self.world_size,
            "prefetch_depth": self.prefetch_depth,
            "cache_policy": self.cache_policy,
            "tables": [t.to_json() for t in self.tables],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data: dict[str, Any], sharding_plan: "ShardingPlan | None" = None) -> "HotColdPlan":
        """Inverse of `to_dict`."""
        if data.get("format_version") != PLAN_FORMAT_VERSION:
            raise ValueError(f"format version {data.get('format_version')!r}, expected {PLAN_FORMAT_VERSION}")
        return cls(
            tables=[TablePlan.from_json(t) for t in data["tables"]],
            budget_bytes=int(data["budget_bytes"]),
            world_size=int(data["world_size"]),
            prefetch_depth=int(data["prefetch_depth"]),
            cache_policy=str(data["cache_policy"]),
            sharding_plan=sharding_plan,
        )

    @classmethod
    def load(cls, path: str | Path, tables: Sequence[EmbeddingBagConfig] | None = None) -> "HotColdPlan":
        try:
            plan = cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path} is not a readable hot/cold plan ({err}); make it again with `hotcache plan`.") from err
        if tables is not None:
            plan.check_tables(tables)
        return plan


def _unseen_mass(stats: "AccessStats", table: str) -> float:
    """Good-Turing estimate of the share of future lookups that go to rows the profile never
    saw (rows seen exactly once / lookups): coverage of the profile alone is optimistic."""
    _, counts = stats.top_ids(table)
    lookups = stats.num_lookups[table]
    return float((counts == 1).sum()) / lookups if lookups else 0.0


@contextmanager
def _quiet_torchrec_planner() -> Iterator[None]:
    # TorchRec's planner logs warnings meant for its dry-run and GPU paths on every call.
    loggers = [logging.getLogger(n) for n in ("torchrec.distributed.planner", "root")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def torchrec_sharding_plan(
    tables: Sequence[EmbeddingBagConfig], world_size: int, device: torch.device | str
) -> "ShardingPlan | None":
    """TorchRec's data-parallel ShardingPlan for the tables that live wholly on the device."""
    if not tables:
        return None
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.types import ShardingType

    compute_device = "cuda" if torch.device(device).type == "cuda" else "cpu"
    with _quiet_torchrec_planner():
        topology = Topology(world_size=world_size, compute_device=compute_device)
        constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType.DATA_PARALLEL.value]) for t in tables}
        meta = EmbeddingBagCollection(tables=list(tables), device=torch.device("meta"))
        # Our own budget already decided what fits; TorchRec only places the whole tables.
        reservation = FixedPercentageStorageReservation(percentage=0.0)
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, storage_reservation=reservation)
        return planner.plan(meta, [EmbeddingBagCollectionSharder()])


class HotColdPlanner:
    """Makes a `HotColdPlan` for tables, stats and a device budget.

    Args:
        device_budget: bytes, a size string ("2GB"), a fraction in (0, 1] of the tables'
            bytes (rows + optimizer state), or "auto".
        optimizer: the row-wise rule (its state is part of every row's bytes).
        world_size: data-parallel processes (recorded; device tables are replicated).
        prefetch_depth: batches prefetched ahead of the one training.
        cache_policy: ``lfu``, ``lru`` or ``static``.
        device: the device the budget is for ("auto" reads its free memory).
    """

    def __init__(
        self,
        device_budget: Budget = 1.0,
        optimizer: RowWiseOptimizerConfig | None = None,
        world_size: int = 1,
        prefetch_depth: int = 0,
        cache_policy: str = "lfu",
        device: torch.device | str = "cpu",
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        if prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}.")
        check_cache_policy(cache_policy)
        self.device_budget = device_budget
        self.optimizer = optimizer or RowWiseOptimizerConfig()
        self.world_size = world_size
        self.prefetch_depth = prefetch_depth
        self.cache_policy = cache_policy
        self.device = device

    def _min_slots(self, table: EmbeddingBagConfig, stats: "AccessStats | None") -> int:
        if stats is None:
            raise ValueError(
                f"Table {table.name!r} does not fit the device budget whole, so the planner needs access stats "
                "to choose its hot rows: profile first (`hotcache profile -c CONFIG --out stats.npz`)."
            )
        _, max_unique = stats.unique_rows_per_batch(table.name)
        per_batch = math.ceil(max(1, max_unique) * UNIQUE_ROWS_MARGIN)
        return min(table.num_embeddings, per_batch * (self.prefetch_depth + 1))

    def plan(self, tables: Sequence[EmbeddingBagConfig], stats: "AccessStats | None" = None) -> HotColdPlan:
        tables = list(tables)
        if stats is not None:
            stats.check_tables(tables)
        whole = {t.name: t.num_embeddings * row_bytes(t, self.optimizer) for t in tables}
        budget = resolve_budget(self.device_budget, sum(whole.values()), self.device)

        if sum(whole.values()) <= budget:  # everything fits whole: no stats needed
            on_device, split, required, fixed = {t.name for t in tables}, [], {}, sum(whole.values())
        else:
            on_device, split, required, fixed = self._smallest_layout(tables, stats)
        if fixed > budget:
            raise ValueError(
                f"A device budget of {format_bytes(budget)} cannot train these tables: the minimum is "
                f"{format_bytes(fixed)} ({fixed} bytes) for {self.prefetch_depth + 1} batch(es) in flight. "
                "Raise device_budget, lower prefetch_depth or use smaller batches."
            )
        # Headroom slots keep rows read by consecutive batches cached between them; take
        # them when the budget allows (not for the static policy, which empties its slots).
        if self.cache_policy != "static":
            roomy = {n: min(k * DYNAMIC_HEADROOM, t.num_embeddings) for t in split for n, k in [(t.name, required[t.name])]}
            extra = sum(self._split_bytes(t, 0, roomy[t.name]) - self._split_bytes(t, 0, required[t.name]) for t in split)
            if fixed + extra <= budget:
                required, fixed = roomy, fixed + extra
        min_slots = required
        static_rows = self._buy_hot_rows(split, stats, budget - fixed) if split else {}
        if split and self.cache_policy != "static":
            spent = sum(self._split_bytes(t, static_rows[t.name], min_slots[t.name]) for t in split)
            leftover = budget - sum(whole[n] for n in on_device) - spent
            min_slots = self._spread_dynamic(split, stats, static_rows, min_slots, leftover)
        # Headroom and hot rows can make a small table's split cost more than the table
        # itself (its slots then cover every row anyway): such a table goes whole instead.
        for t in list(split):
            if self._split_bytes(t, static_rows[t.name], min_slots[t.name]) >= whole[t.name]:
                split.remove(t)
                on_device.add(t.name)

        plans = []
        for t in tables:
            if t.name in on_device:
                plans.append(TablePlan(t.name, t.num_embeddings, t.embedding_dim, np.arange(t.num_embeddings),
                                       0, whole[t.name], 1.0))  # fmt: skip
                continue
            assert stats is not None
            k = static_rows[t.name]
            ids, _ = stats.top_ids(t.name, k)
            slots = min_slots[t.name]
            reach = k if self.cache_policy == "static" else k + slots
            hit = float(stats.coverage(t.name, min(reach, t.num_embeddings))) * (1.0 - _unseen_mass(stats, t.name))
            plans.append(TablePlan(t.name, t.num_embeddings, t.embedding_dim, np.sort(ids.astype(np.int64)), slots,
                                   self._split_bytes(t, len(ids), slots), hit))  # fmt: skip
        device_tables = [t for t in tables if t.name in on_device]
        return HotColdPlan(
            tables=plans,
            budget_bytes=budget,
            world_size=self.world_size,
            prefetch_depth=self.prefetch_depth,
            cache_policy=self.cache_policy,
            sharding_plan=torchrec_sharding_plan(device_tables, self.world_size, self.device),
        )

    def _smallest_layout(
        self, tables: list[EmbeddingBagConfig], stats: "AccessStats | None"
    ) -> tuple[set[str], list[EmbeddingBagConfig], dict[str, int], int]:
        """Each table whole on the device if that costs no more than its smallest split
        (no static rows, slots for the batches in flight); returns (whole tables, split
        tables, their slots, bytes)."""
        on_device: set[str] = set()
        split: list[EmbeddingBagConfig] = []
        required: dict[str, int] = {}
        fixed = 0
        for t in tables:
            whole = t.num_embeddings * row_bytes(t, self.optimizer)
            slots = self._min_slots(t, stats)
            if whole <= self._split_bytes(t, 0, slots):
                on_device.add(t.name)
                fixed += whole
            else:
                split.append(t)
                required[t.name] = slots
                fixed += self._split_bytes(t, 0, slots)
        return on_device, split, required, fixed

    def minimum_bytes(self, tables: Sequence[EmbeddingBagConfig], stats: "AccessStats") -> int:
        """The smallest device budget `plan` accepts for these tables and stats."""
        return self._smallest_layout(list(tables), stats)[3]

    def _split_bytes(self, table: EmbeddingBagConfig, static_rows: int, cache_slots: int) -> int:
        per_row = row_bytes(table, self.optimizer)
        id_map = slot_map_bytes(table.num_embeddings, static_rows + cache_slots)
        return id_map + static_rows * per_row + cache_slots * (per_row + SLOT_BOOKKEEPING_BYTES)

    def _spread_dynamic(
        self,
        tables: list[EmbeddingBagConfig],
        stats: "AccessStats",
        static_rows: dict[str, int],
        slots: dict[str, int],
        budget: int,
    ) -> dict[str, int]:
        """Budget left after the hot rows becomes extra dynamic slots, shared in proportion to
        the lookups each table's device rows do not yet cover (rows never seen while profiling
        can still be cached when they turn up)."""
        misses = {
            t.name: (1.0 - float(stats.coverage(t.name, min(static_rows[t.name] + slots[t.name], t.num_embeddings))))
            * stats.num_lookups[t.name]
            for t in tables
        }
        total = sum(misses.values())
        out = dict(slots)
        if budget <= 0 or total <= 0:
            return out
        for t in tables:
            per_slot = row_bytes(t, self.optimizer) + SLOT_BOOKKEEPING_BYTES + SORTED_BYTES_PER_RESIDENT
            room = t.num_embeddings - static_rows[t.name] - slots[t.name]
            out[t.name] += max(0, min(room, int(budget * misses[t.name] / total) // per_slot))
        return out

    def _buy_hot_rows(self, tables: list[EmbeddingBagConfig], stats: "AccessStats", budget: int) -> dict[str, int]:
        """Static rows per table maximizing lookups covered within ``budget`` bytes.

        Coverage curves are concave (rows are taken hottest first), so taking curve segments
        across tables in order of lookups-per-byte is the optimal greedy for this knapsack.
        """
        segments = []  # (lookups per byte, table, rows after this segment, bytes of segment)
        for t in tables:
            top_ids, _ = stats.top_ids(t.name)
            seen = len(top_ids)
            if seen == 0:
                continue
            points = np.unique(np.concatenate([[0], np.geomspace(1, seen, num=min(seen, 256)).astype(np.int64), [seen]]))
            lookups = stats.coverage(t.name, points) * stats.num_lookups[t.name]
            # Charged as if the id map were sorted (8 bytes per resident row): never less than
            # what the cheaper map really costs, so the plan stays within the budget.
            per_row = row_bytes(t, self.optimizer) + SORTED_BYTES_PER_RESIDENT
            for (k0, k1), (c0, c1) in zip(zip(points[:-1], points[1:]), zip(lookups[:-1], lookups[1:])):
                cost = int(k1 - k0) * per_row
                segments.append(((c1 - c0) / cost, t.name, int(k0), int(k1), per_row))
        segments.sort(key=lambda s: -s[0])
        rows = {t.name: 0 for t in tables}
        for _, name, k0, k1, per_row in segments:
            if rows[name] != k0 or budget < per_row:
                continue  # a table's segments are taken in order; stop it once one does not fit
            take = min(k1 - k0, budget // per_row)
            rows[name] = k0 + take
            budget -= take * per_row
        return rows
