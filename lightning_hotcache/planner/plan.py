"""HotColdPlanner: which embedding rows stay on the device, within a memory budget.

Input: the tables, measured access statistics (`AccessStats`), a device budget and the
world size. Output: a `HotColdPlan` saying, per table, whether it lives wholly on the
device or is split into static hot rows (FAE) plus dynamic cache slots (MixCache), with the
expected hit rate. The budget counts rows, their optimizer state and the cache's
bookkeeping. Small tables go whole to the device first (their rows are the hottest per
byte and whole tables need no bookkeeping); the rest of the budget buys hot rows by
marginal coverage per byte across all tables, so a narrow skewed table and a wide flat one
compete on how many lookups each byte saves. Every split table also keeps enough dynamic
slots for the unique rows of the batches in flight (`batches_in_flight`, the count the
strategy holds). Budget left once every profiled row is a static row puts split tables whole
on the device, then becomes cache slots for the rows the profile never saw; what stays
unused is explained in the plan's ``note``.

Whole-table placement goes through TorchRec's EmbeddingShardingPlanner (data-parallel:
device tables are replicated, as FAE replicates hot rows); its ShardingPlan is kept in the
plan.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import math
import os
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence, Union

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torchrec import EmbeddingBagConfig

from lightning_hotcache.cache.device import check_cache_policy
from lightning_hotcache.cache.lookahead import DEFAULT_WINDOW_BATCHES
from lightning_hotcache.cache.device_directory import DEVICE_DIRECTORY_BYTES_PER_SLOT, NEXT_READ_BYTES_PER_SLOT, device_window_bytes
from lightning_hotcache.cache.slot_map import sparse_map_bytes_per_resident
from lightning_hotcache.optim.rowwise import RowWiseOptimizerConfig

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

    from lightning_hotcache.planner.profiling import AccessStats

Budget = Union[int, float, str]
PLAN_FORMAT_VERSION = 2
# Per slot of a split table, static ones included: id_of_slot, last_used, frequency (int64),
# holders (int32) and dirty (bool) (see DeviceCache). Like the id -> slot map, on the host: the
# device budget pays for them only where the device is the CPU (`directory_bytes_per_slot`).
SLOT_BOOKKEEPING_BYTES = 3 * 8 + 4 + 1
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


# Tables from this size on stage on the prefetch thread on a CPU: large tables' staging is
# long enough for the cores the step leaves idle to take it (benchmarks/README.md, cpu_throughput).
LARGE_TABLES_BYTES = 2**30


@dataclass(frozen=True)
class StagingChoice:
    """How the hotcache strategy stages training batches: on a background thread or not, and
    how many batches ahead."""

    thread: bool
    depth: int


def tables_bytes(tables: Sequence[EmbeddingBagConfig]) -> int:
    """The float32 bytes of ``tables``' rows."""
    return sum(t.num_embeddings * t.embedding_dim for t in tables) * 4


def staging_choice(
    prefetch_thread: bool | None, prefetch_depth: int | None, device: torch.device | str, table_bytes: int
) -> StagingChoice:
    """The staging the hotcache strategy runs, the user's choices first. By default: the
    prefetch thread on CUDA devices, and on a CPU for tables of `LARGE_TABLES_BYTES` or more
    where there are two cores or more, three batches ahead there (the thread runs in the
    cores the step leaves idle, and batches staged further ahead absorb the steps where it is
    late); else one batch ahead. Staging runs no collective (across ranks it reads only the
    rank's own rows), so the thread works across processes too."""
    kind = torch.device(device).type
    large_on_cpu = kind == "cpu" and table_bytes >= LARGE_TABLES_BYTES and (os.cpu_count() or 1) >= 2
    chosen = prefetch_thread is None and large_on_cpu
    if prefetch_thread is None:
        prefetch_thread = kind == "cuda" or large_on_cpu
    if prefetch_depth is None:
        prefetch_depth = 3 if chosen else 1
    return StagingChoice(prefetch_thread, prefetch_depth)


class StatsNeededError(ValueError):
    """The plan splits a table and so needs access stats, and none were given: callers that
    can profile the training data do so and plan again."""


def batches_in_flight(prefetch_depth: int, prefetch_thread: bool) -> int:
    """Batches whose rows the device cache holds at once while the hotcache strategy trains:
    the one training, ``prefetch_depth`` staged ahead of it, the one Lightning's data fetcher
    holds ahead, a validation batch between them, and the one a prefetch thread is staging."""
    if prefetch_depth < 0:
        raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}.")
    return prefetch_depth + 3 + int(prefetch_thread)


def row_bytes(table: EmbeddingBagConfig, optimizer: RowWiseOptimizerConfig) -> int:
    """Bytes of one row plus its optimizer state (float32)."""
    return 4 * (table.embedding_dim + sum(optimizer.state_widths(table.embedding_dim).values()))


# A budget in plain bytes this many times below the minimum is refused even with
# grow_budget_to_minimum: no one sizes device memory in bytes a thousandfold short, but
# `device_budget: 2` meant as 2 GB or as "all" (2 bytes) would otherwise train at the minimum
# with only a warning.
BYTES_BUDGET_GROWTH_LIMIT = 1000


def _bytes_without_unit(budget: Budget) -> bool:
    """Whether ``budget`` is a number of bytes with no unit (an int, or digits on a command line)."""
    return re.fullmatch(r"\s*[0-9]+\s*", str(budget)) is not None


def resolve_budget(budget: Budget, total_bytes: int, device: torch.device | str = "cpu") -> int:
    """Bytes from a budget: an int, a string like ``"2GB"``/``"512MiB"``, a fraction in (0, 1]
    of the model's embedding bytes, or ``"auto"`` (half the free device memory)."""
    if isinstance(budget, bool):
        raise ValueError(f"device_budget must be bytes, a size string, a fraction or 'auto'; got {budget!r}.")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"device_budget must be positive, got {budget} bytes.")
        if budget == 1:  # YAML's `device_budget: 1` is an int: meant as the whole tables, never as one byte
            raise ValueError("device_budget=1 means 1 byte; write 1.0 for the whole tables or '1GB'.")
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
        size = int(float(match.group(1)) * _UNITS[match.group(2)])
        if size < 1:
            raise ValueError(f"device_budget {budget!r} is less than one byte; give a positive size such as '2GB'.")
        return size
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
    """Per-table placement plus the run it was made for. Prints as a table, saves as JSON.

    Attributes:
        tables: one `TablePlan` per table.
        budget_bytes: the device budget planned within.
        minimum_bytes: the smallest budget these tables and stats can train with.
        world_size, prefetch_depth, cache_policy: the run's settings.
        batches_in_flight: batches whose rows the cache slots hold at once (`batches_in_flight`).
        batch_size: samples per batch of the stats the plan was made from (None: made without).
        lookahead_batches: under ``cache_policy="lookahead"``, the batches announced ahead.
        window_bytes: host memory those batches and the window's books take (an estimate from
            the profile; see `HotColdPlanner.window_bytes`).
        note: why part of the budget is left unused, if it is.
        sharding_plan: TorchRec's plan for the whole tables (not saved).
    """

    tables: list[TablePlan]
    budget_bytes: int
    minimum_bytes: int = 0
    world_size: int = 1
    prefetch_depth: int = 1
    cache_policy: str = "lfu"
    batches_in_flight: int = field(default_factory=lambda: batches_in_flight(1, prefetch_thread=False))
    batch_size: int | None = None
    lookahead_batches: int = 0
    window_bytes: int = 0
    note: str = ""
    sharding_plan: "ShardingPlan | None" = field(default=None, compare=False)

    def table(self, name: str) -> TablePlan:
        for plan in self.tables:
            if plan.name == name:
                return plan
        raise KeyError(f"The plan has no table {name!r} (it has {[t.name for t in self.tables]}).")

    @property
    def device_bytes(self) -> int:
        return sum(t.device_bytes for t in self.tables)

    def check_tables(self, tables: Sequence[EmbeddingBagConfig], whole_model: bool = True) -> None:
        """Raise if the plan was made for other tables than ``tables``; with ``whole_model=False``
        they are one collection's, and the plan may hold the model's other collections too."""
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
        extra = sorted(planned.keys() - {t.name for t in tables})
        if extra and whole_model:
            raise ValueError(f"Tables in the plan but not in the model: {', '.join(extra)}; plan again with `hotcache plan`.")

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
            f"world size {self.world_size}, prefetch depth {self.prefetch_depth} "
            f"({self.batches_in_flight} batches in flight), policy {self.cache_policy}"
        )
        if self.lookahead_batches:
            lines.append(f"lookahead window: {self.lookahead_batches} batches, ~{format_bytes(self.window_bytes)} of host memory")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (what `save` writes; the TorchRec ShardingPlan is not included)."""
        return {
            "format_version": PLAN_FORMAT_VERSION,
            "budget_bytes": self.budget_bytes,
            "minimum_bytes": self.minimum_bytes,
            "world_size": self.world_size,
            "prefetch_depth": self.prefetch_depth,
            "cache_policy": self.cache_policy,
            "batches_in_flight": self.batches_in_flight,
            "batch_size": self.batch_size,
            "lookahead_batches": self.lookahead_batches,
            "window_bytes": self.window_bytes,
            "note": self.note,
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
            minimum_bytes=int(data["minimum_bytes"]),
            world_size=int(data["world_size"]),
            prefetch_depth=int(data["prefetch_depth"]),
            cache_policy=str(data["cache_policy"]),
            batches_in_flight=int(data["batches_in_flight"]),
            batch_size=None if data["batch_size"] is None else int(data["batch_size"]),
            lookahead_batches=int(data.get("lookahead_batches", 0)),  # plans saved before the lookahead policy lack them
            window_bytes=int(data.get("window_bytes", 0)),
            note=str(data["note"]),
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


def _expected_hit_rate(stats: "AccessStats", table: EmbeddingBagConfig, reach: int) -> float:
    """Share of lookups expected to find their row among ``reach`` device rows, the hottest
    profiled rows first. Rows the profile never saw take the `_unseen_mass` of the lookups;
    device rows beyond the profiled ones (cache slots, which fill with such rows as they come)
    are credited with that mass in proportion to the unseen rows they can hold, as if it
    were spread evenly: a cache does better, since the rows that recur are the ones it keeps."""
    seen = len(stats.top_ids(table.name)[0])
    unseen = _unseen_mass(stats, table.name)
    hit = float(stats.coverage(table.name, min(reach, table.num_embeddings))) * (1.0 - unseen)
    if reach > seen and table.num_embeddings > seen:
        hit += unseen * (min(reach, table.num_embeddings) - seen) / (table.num_embeddings - seen)
    return min(hit, 1.0)


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
            bytes (rows + optimizer state), or "auto". An int is bytes: 1 is refused (write
            1.0 for the whole tables), and so is growing one far below the minimum.
        optimizer: the row-wise rule (its state is part of every row's bytes).
        world_size: data-parallel processes (recorded; device tables are replicated).
        prefetch_depth: batches prefetched ahead of the one training (the strategy's).
        cache_policy: ``lfu``, ``lru`` or ``static``.
        device: the device the budget is for ("auto" reads its free memory).
        grow_budget_to_minimum: plan with the minimum (the unique rows of the batches in
            flight, see `minimum_bytes`) when ``device_budget`` is below it, with a warning,
            instead of failing. For budgets given as a share of tables of any size (the
            fractional strategy presets).
        prefetch_thread: whether the strategy stages on a background thread (the
            strategy's option: None is on for CUDA devices; never across processes). With
            ``prefetch_depth`` it sets `batches_in_flight`, which the cache slots must hold.
    """

    def __init__(
        self,
        device_budget: Budget = 1.0,
        optimizer: RowWiseOptimizerConfig | None = None,
        world_size: int = 1,
        prefetch_depth: int = 1,
        cache_policy: str = "lfu",
        device: torch.device | str = "cpu",
        grow_budget_to_minimum: bool = False,
        prefetch_thread: bool | None = None,
        lookahead_batches: int = DEFAULT_WINDOW_BATCHES,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        self.prefetch_thread = staging_choice(prefetch_thread, prefetch_depth, device, 0).thread
        self.batches_in_flight = batches_in_flight(prefetch_depth, self.prefetch_thread)
        check_cache_policy(cache_policy)
        self.device_budget = device_budget
        self.optimizer = optimizer or RowWiseOptimizerConfig()
        self.world_size = world_size
        self.prefetch_depth = prefetch_depth
        self.cache_policy = cache_policy
        self.device = device
        self.grow_budget_to_minimum = grow_budget_to_minimum
        self.lookahead_batches = lookahead_batches if cache_policy == "lookahead" else 0

    def _min_slots(self, table: EmbeddingBagConfig, stats: "AccessStats | None") -> int:
        if stats is None:
            raise StatsNeededError(
                f"Table {table.name!r} does not fit the device budget whole, so the planner needs access stats "
                "to choose its hot rows: profile first (`hotcache profile -c CONFIG --out stats.npz`)."
            )
        _, max_unique = stats.unique_rows_per_batch(table.name)
        per_batch = math.ceil(max(1, max_unique) * UNIQUE_ROWS_MARGIN)
        return min(table.num_embeddings, per_batch * self.batches_in_flight)

    def plan(
        self, tables: Sequence[EmbeddingBagConfig], stats: "AccessStats | None" = None, batch_size: int | None = None
    ) -> HotColdPlan:
        """The plan for ``tables``. ``stats`` (needed unless every table fits whole) must be
        for these tables, hold batches, and, when ``batch_size`` (the run's) is given, have
        been profiled with that batch size; else a ValueError says to profile again."""
        tables = list(tables)
        if stats is not None:
            stats.check_run(tables, batch_size)
        whole = {t.name: self._whole_bytes(t) for t in tables}
        budget = resolve_budget(self.device_budget, sum(whole.values()), self.device)

        if sum(whole.values()) <= budget:  # everything fits whole: no stats needed
            on_device, split, required, fixed = {t.name for t in tables}, [], {}, sum(whole.values())
        else:
            on_device, split, required, fixed = self._smallest_layout(tables, stats)
            fixed += self._device_window_bytes(split, stats)
        minimum = fixed
        if fixed > budget and self.grow_budget_to_minimum:
            self._check_growable(budget, fixed)
            rank_zero_warn(
                f"The device budget of {format_bytes(budget)} ({self.device_budget!r}) is below the minimum "
                f"{format_bytes(fixed)} for {self.batches_in_flight} batches in flight: planning with the minimum."
            )
            budget = fixed
        elif fixed > budget:
            raise ValueError(
                f"A device budget of {format_bytes(budget)} cannot train these tables: the minimum is "
                f"{format_bytes(fixed)} ({fixed} bytes) for {self.batches_in_flight} batches in flight. "
                "Raise device_budget, lower prefetch_depth, use smaller batches, or pass grow_budget_to_minimum=True."
            )
        # Each round either settles the split tables or puts one more table whole, so at most
        # one round per table.
        while True:
            room = budget - sum(whole[n] for n in on_device) - self._device_window_bytes(split, stats)
            static_rows, slots = self._hot_rows_and_slots(split, stats, required, room)
            leftover = room - sum(self._split_bytes(t, static_rows[t.name], slots[t.name]) for t in split)
            whole_next = self._table_to_put_whole(split, stats, static_rows, slots, whole, leftover)
            if whole_next is None and self.cache_policy != "static":
                slots = self._spread_dynamic(split, stats, static_rows, slots, leftover)
                # Headroom and hot rows can make a small table's split cost more than the table
                # itself (its slots then cover every row anyway): such a table goes whole instead.
                grown = (t for t in split if self._split_bytes(t, static_rows[t.name], slots[t.name]) >= whole[t.name])
                whole_next = next(grown, None)
            if whole_next is None:
                break
            split.remove(whole_next)
            on_device.add(whole_next.name)

        plans = []
        for t in tables:
            if t.name in on_device:
                plans.append(TablePlan(t.name, t.num_embeddings, t.embedding_dim, np.arange(t.num_embeddings),
                                       0, whole[t.name], 1.0))  # fmt: skip
                continue
            assert stats is not None
            k = static_rows[t.name]
            ids, _ = stats.top_ids(t.name, k)
            reach = k if self.cache_policy == "static" else k + slots[t.name]
            plans.append(TablePlan(t.name, t.num_embeddings, t.embedding_dim, np.sort(ids.astype(np.int64)),
                                   slots[t.name], self._split_bytes(t, len(ids), slots[t.name]),
                                   _expected_hit_rate(stats, t, reach)))  # fmt: skip
        device_tables = [t for t in tables if t.name in on_device]
        window = self.window_bytes(plans, stats)
        available = _available_host_memory()
        if window > available:
            raise ValueError(
                f"A lookahead window of {self.lookahead_batches} batches needs ~{format_bytes(window)} of host memory, "
                f"but {format_bytes(available)} is available: lower lookahead_batches."
            )
        return HotColdPlan(
            tables=plans,
            budget_bytes=budget,
            minimum_bytes=minimum,
            world_size=self.world_size,
            prefetch_depth=self.prefetch_depth,
            cache_policy=self.cache_policy,
            batches_in_flight=self.batches_in_flight,
            batch_size=stats.batch_size if stats is not None and split else None,
            lookahead_batches=self.lookahead_batches,
            window_bytes=window,
            note=self._unused_budget_note(plans, stats, whole, budget),
            sharding_plan=torchrec_sharding_plan(device_tables, self.world_size, self.device),
        )

    def window_bytes(self, plans: Sequence[TablePlan], stats: "AccessStats | None") -> int:
        """Host memory the lookahead window takes (0 without one), from the profile's mean
        lookups and most distinct rows a batch: per announced batch, its ids as the loader
        gives them and as staging prepares them (values, slots, each cache's ids: 8 bytes a
        lookup each) and, for a split table, each id's place among the distinct ones, and
        the distinct ids, their counts and their ring entries (up to twice as many: its
        length is a power of two); per row of a split table, the place of its latest announced
        read (4 bytes), and per slot its next read (8). The batches announced are the window's,
        the one read before the oldest is handed on, and with a prefetch thread two more, the
        most a reader thread holds ahead of it (counted wherever the prefetch thread runs: the
        planner is not told whether a reader thread does). The batches' dense features and
        labels, which the loader holds too, are not counted."""
        if not self.lookahead_batches or stats is None:
            return 0
        per_batch = fixed = 0.0
        num_lookups = stats.num_lookups  # a dict built per read
        for t in plans:
            lookups = num_lookups[t.name] / max(1, stats.num_batches)
            per_batch += 4 * 8 * lookups
            if not t.on_device:
                per_batch += 8 * lookups + 4 * 8 * stats.unique_rows_per_batch(t.name)[1]
                fixed += 4 * t.num_embeddings + 8 * (len(t.static_ids) + t.cache_slots)
        announced = self.lookahead_batches + 1 + 2 * int(self.prefetch_thread)
        return int(fixed + announced * per_batch)

    def _check_growable(self, budget: int, minimum: int) -> None:
        """Refuse to grow a budget given in plain bytes from far below the minimum (see
        `BYTES_BUDGET_GROWTH_LIMIT`): that is a unit mistake, not a size."""
        if _bytes_without_unit(self.device_budget) and minimum > BYTES_BUDGET_GROWTH_LIMIT * budget:
            raise ValueError(
                f"device_budget={self.device_budget!r} means {budget} bytes, {minimum // budget:,}x below the minimum "
                f"{format_bytes(minimum)}: too far to be a size meant in bytes, so it is not grown to the minimum. "
                "Write the size with a unit ('2GB') or a fraction of the tables (0.1; 1.0 for the whole tables)."
            )

    def check_plan(self, plan: HotColdPlan, tables: Sequence[EmbeddingBagConfig], batch_size: int | None = None) -> None:
        """Raise ValueError, saying what differs, unless ``plan`` (made earlier, e.g. by
        ``hotcache plan``) can train ``tables`` in this planner's run: the same tables, world
        size and cache policy, slots for at least this run's batches in flight, device bytes
        within ``device_budget``, a lookahead window no longer than the one whose host memory
        it counted, and, when ``batch_size`` (the run's) is given, the batch size of the stats
        it was made from."""
        plan.check_tables(tables)
        problems = self._impossible_slots(plan)
        plan = self.with_this_runs_bytes(plan, tables)
        whole = sum(map(self._whole_bytes, tables))
        budget = resolve_budget(self.device_budget, whole, self.device)
        if self.grow_budget_to_minimum and plan.minimum_bytes > budget:  # as `plan` would have grown it
            self._check_growable(budget, plan.minimum_bytes)
            budget = plan.minimum_bytes
        if plan.world_size != self.world_size:
            problems.append(f"it was made for world size {plan.world_size} but this run has {self.world_size}")
        if plan.cache_policy != self.cache_policy:
            problems.append(f"it was made for cache_policy {plan.cache_policy!r} but this run uses {self.cache_policy!r}")
        if plan.batches_in_flight < self.batches_in_flight:
            problems.append(
                f"its cache slots hold {plan.batches_in_flight} batches in flight but this run has "
                f"{self.batches_in_flight} (prefetch_depth {self.prefetch_depth}, see `batches_in_flight`)"
            )
        # A longer window than planned would take host memory nobody checked (`window_bytes`); a
        # shorter one takes less. Plans saved before the window was counted say 0: not checked.
        if self.lookahead_batches > plan.lookahead_batches > 0:
            problems.append(
                f"its lookahead window of {plan.lookahead_batches} batches was counted as "
                f"~{format_bytes(plan.window_bytes)} of host memory but this run reads {self.lookahead_batches} "
                "batches ahead (lookahead_batches)"
            )
        if plan.device_bytes > budget:
            problems.append(
                f"it needs {format_bytes(plan.device_bytes)} on the device but device_budget {self.device_budget!r} "
                f"allows {format_bytes(budget)}"
            )
        if plan.batch_size is not None and batch_size is not None and plan.batch_size != batch_size:
            problems.append(
                f"it was made from stats of batches of {plan.batch_size} samples but this run's batches have {batch_size}"
            )
        if problems:
            raise ValueError(
                f"The hot/cold plan does not fit this run: {'; '.join(problems)}. Plan again with `hotcache plan` "
                "for this run's settings, or set them to the plan's."
            )

    def _hot_rows_and_slots(
        self, split: list[EmbeddingBagConfig], stats: "AccessStats | None", required: dict[str, int], room: int
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Static rows and cache slots of the split tables within ``room`` bytes: the
        slots the batches in flight need, their headroom if it fits, then the hottest rows."""
        slots = dict(required)
        fixed = sum(self._split_bytes(t, 0, slots[t.name]) for t in split)
        # Headroom slots keep rows read by consecutive batches cached between them; take
        # them when the budget allows (not for the static policy, which empties its slots).
        if self.cache_policy != "static":
            roomy = {t.name: min(required[t.name] * DYNAMIC_HEADROOM, t.num_embeddings) for t in split}
            roomy_bytes = sum(self._split_bytes(t, 0, roomy[t.name]) for t in split)
            if roomy_bytes <= room:
                slots, fixed = roomy, roomy_bytes
        assert stats is not None or not split  # `_min_slots` asked for stats
        static_rows = self._buy_hot_rows(split, stats, room - fixed) if split else {}
        return static_rows, slots

    def _table_to_put_whole(
        self,
        split: list[EmbeddingBagConfig],
        stats: "AccessStats | None",
        static_rows: dict[str, int],
        slots: dict[str, int],
        whole: dict[str, int],
        leftover: int,
    ) -> EmbeddingBagConfig | None:
        """The split table that ``leftover`` bytes (the budget hot rows left: every profiled
        row of the split tables is a static row then) can put whole on the device, the one
        that saves the most expected misses per extra byte; None if none fits. A whole table
        serves every lookup, rows never profiled included, and needs no id map or slot
        bookkeeping, so it beats spending the same bytes on cache slots."""
        best, best_value = None, -1.0
        for t in split:
            extra = whole[t.name] - self._split_bytes(t, static_rows[t.name], slots[t.name])
            if extra <= 0:
                return t
            if extra > leftover:
                continue
            assert stats is not None
            reach = static_rows[t.name] + (0 if self.cache_policy == "static" else slots[t.name])
            value = (1.0 - _expected_hit_rate(stats, t, reach)) * stats.num_lookups[t.name] / extra
            if value > best_value:
                best, best_value = t, value
        return best

    def _unused_budget_note(
        self, plans: list[TablePlan], stats: "AccessStats | None", whole: dict[str, int], budget: int
    ) -> str:
        """Why part of the budget stays unused, when the reason is more than rounding."""
        unused_bytes = budget - sum(p.device_bytes for p in plans)
        unused = format_bytes(unused_bytes)
        split = [p for p in plans if not p.on_device]
        if not split:
            return f"every table is whole on the device: {unused} of the budget unused." if unused_bytes else ""
        assert stats is not None
        if self.cache_policy == "static" and all(len(p.static_ids) == len(stats.top_ids(p.name)[0]) for p in split):
            cheapest = min(split, key=lambda p: whole[p.name] - p.device_bytes)
            return (
                f"every profiled row of the split tables ({', '.join(p.name for p in split)}) is a static row and the "
                f"static policy has no cache slots for rows never profiled: {unused} of the budget unused (putting "
                f"{cheapest.name} whole needs {format_bytes(whole[cheapest.name] - cheapest.device_bytes)} more)."
            )
        return ""

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
            whole = self._whole_bytes(t)
            slots = self._min_slots(t, stats)
            if whole <= self._split_bytes(t, 0, slots):
                on_device.add(t.name)
                fixed += whole
            else:
                split.append(t)
                required[t.name] = slots
                fixed += self._split_bytes(t, 0, slots)
        return on_device, split, required, fixed

    @staticmethod
    def _impossible_slots(plan: HotColdPlan) -> list[str]:
        """What no run of ``plan``'s tables can hold: more device rows than a table has, or static
        ids outside it (a plan file edited by hand)."""
        problems = []
        for t in plan.tables:
            if not t.on_device and len(t.static_ids) + t.cache_slots > t.num_embeddings:
                problems.append(
                    f"table {t.name} has {len(t.static_ids):,} static rows and {t.cache_slots:,} cache slots but only "
                    f"{t.num_embeddings:,} rows"
                )
            if len(t.static_ids) and (t.static_ids.min() < 0 or t.static_ids.max() >= t.num_embeddings):
                problems.append(f"table {t.name} has static ids outside its {t.num_embeddings:,} rows")
        return problems

    def with_this_runs_bytes(self, plan: HotColdPlan, tables: Sequence[EmbeddingBagConfig]) -> HotColdPlan:
        """``plan`` with each table's device bytes as this run counts them (its rows, slots,
        optimizer state and device), not as the plan file says."""
        by_name = {t.name: t for t in tables}

        def counted(table: TablePlan) -> int:
            config = by_name[table.name]
            if table.on_device:
                return self._whole_bytes(config)
            return self._split_bytes(config, len(table.static_ids), table.cache_slots)

        return dataclasses.replace(plan, tables=[dataclasses.replace(t, device_bytes=counted(t)) for t in plan.tables])

    def minimum_bytes(self, tables: Sequence[EmbeddingBagConfig], stats: "AccessStats") -> int:
        """The smallest device budget `plan` accepts for these tables and stats."""
        return self._smallest_layout(list(tables), stats)[3]

    def _whole_bytes(self, table: EmbeddingBagConfig) -> int:
        """What ``table`` costs wholly on the device: its rows and their optimizer state."""
        return table.num_embeddings * row_bytes(table, self.optimizer)

    def _split_bytes(self, table: EmbeddingBagConfig, static_rows: int, cache_slots: int) -> int:
        return (static_rows + cache_slots) * (row_bytes(table, self.optimizer) + self._directory_bytes_per_slot(table))

    def _device_window_bytes(self, split: Sequence[EmbeddingBagConfig], stats: "AccessStats | None") -> int:
        """GPU memory the device directory's lookahead window takes on CUDA under lookahead
        (`device_window_bytes`, its width from the profile's most distinct ids a batch of the
        split tables), charged whichever directory the collection keeps; else 0."""
        if torch.device(self.device).type != "cuda" or not self.lookahead_batches or not split or stats is None:
            return 0
        return device_window_bytes(self.lookahead_batches, sum(stats.unique_rows_per_batch(t.name)[1] for t in split))

    def _directory_bytes_per_slot(self, table: EmbeddingBagConfig) -> int:
        """What a split table's directory (id -> slot map and per-slot bookkeeping) costs the
        device budget per slot: on a CPU the host directory's, which lives on the device there
        (see `DeviceCache`); on CUDA the device directory's cells. The host map counts as
        sparse, even where a dense one would cost less: a collection's split tables may be
        stacked into one cache (lightning_hotcache.cache.group), whose map is sparse unless
        dense costs less for all of them together."""
        if torch.device(self.device).type == "cuda":
            # Where the directory is in GPU memory (`DeviceDirectory`; the Triton path's default
            # there) each slot has a cell of it, or a static id: charged on every CUDA plan, so
            # that the budget holds whichever directory the collection keeps.
            return DEVICE_DIRECTORY_BYTES_PER_SLOT + (NEXT_READ_BYTES_PER_SLOT if self.cache_policy == "lookahead" else 0)
        if torch.device(self.device).type != "cpu":
            return 0
        return sparse_map_bytes_per_resident(table.num_embeddings) + SLOT_BOOKKEEPING_BYTES

    def _spread_dynamic(
        self,
        tables: list[EmbeddingBagConfig],
        stats: "AccessStats",
        static_rows: dict[str, int],
        slots: dict[str, int],
        budget: int,
    ) -> dict[str, int]:
        """Budget left after the hot rows becomes extra dynamic slots, shared in proportion to
        the lookups each table's device rows are expected to miss (rows never seen while
        profiling can still be cached when they turn up)."""
        misses = {
            t.name: (1.0 - _expected_hit_rate(stats, t, static_rows[t.name] + slots[t.name])) * stats.num_lookups[t.name]
            for t in tables
        }
        total = sum(misses.values())
        out = dict(slots)
        if budget <= 0 or total <= 0:
            return out
        for t in tables:
            k, base = static_rows[t.name], slots[t.name]
            share = int(budget * misses[t.name] / total)
            cost = self._split_bytes(t, k, base)
            # The most slots whose bytes (the id map's included) fit the share; bytes grow with slots.
            room = range(t.num_embeddings - k - base + 1)
            out[t.name] += bisect.bisect_right(room, share, key=lambda n: self._split_bytes(t, k, base + n) - cost) - 1
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
            # Charged as if the row were split (its slot's directory): never less than what it
            # really costs, so the plan stays within the budget.
            per_row = row_bytes(t, self.optimizer) + self._directory_bytes_per_slot(t)
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
