"""Where a collection's rows live on the device, decided once when it is built.

A `Layout` names the caches (one per table, or one stack per embedding width holding every
split table of that width, or a few: "parts" below), the device tables that hold their slots (FBGEMM TBE tables, or
a cache's own arrays on the PyTorch path) and each cache's region in them, and the column
of every feature in the output. The parts of a step (staging, lookup, update) read it and
never test the configuration again.

Stacks: a width's split tables are one `DeviceCache` over global ids, a table's id plus
where its table starts; tables start at multiples of the world size, so that a global id's
owner (``id % world``) is its table row's owner (see `RowSharding`). Across processes there
are stacks wherever a table is split; in one process where the stack's ids fit the hash map's
32 bits (`INT32_IDS_BELOW`; past it, each table keeps a map of its own).

Parts: a width's split tables can be stacked in several caches instead of one
(``parts``, the strategy's ``staging_threads``), each with a directory of its own, so that
threads stage a batch's caches side by side (`lightning_hotcache.cache.side_by_side`). Each
part takes tables whole and about the same number of dynamic slots, which the planner spread
in proportion to the misses each table is expected to have: a part's staging work is mostly
its misses. The parts are regions of the width's one device table, so a step still reads and
updates a width at once (across processes each part's global ids are keys of their own in
the owners' key space: `OwnedRows`).

Shared device tables: one device table per width, holding that width's stack first, then
each whole table of that width ("regions"), so that a step reads (one ``embedding_bag`` per
pooling on the PyTorch path) and updates a width's rows at once, whatever the number of
tables. Everywhere but FBGEMM's kernel in one process with nothing stacked, where every cache
is a table of its own (FBGEMM's one call reads them all alike).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor
from torchrec import EmbeddingBagConfig
from torchrec.modules.embedding_modules import get_embedding_names_by_table

from lightning_hotcache.cache.slot_map import INT32_IDS_BELOW


def stack_key(dim: int, part: int = 0, parts: int = 1) -> str:
    """Cache key of the stack of split tables of width ``dim`` (its ``part`` of ``parts``)."""
    return f"<split tables of dim {dim}>" if parts == 1 else f"<split tables of dim {dim}, part {part + 1} of {parts}>"


def balanced_parts(members: Sequence[EmbeddingBagConfig], weights: dict[str, int], parts: int) -> list[list[EmbeddingBagConfig]]:
    """``members`` in at most ``parts`` groups of about equal ``weights``, each group in the order
    of ``members`` (the heaviest table to the lightest group first: greedy, within 4/3 of the best)."""
    groups: list[list[EmbeddingBagConfig]] = [[] for _ in range(min(parts, len(members)))]
    filled = [0] * len(groups)
    for table in sorted(members, key=lambda t: -weights[t.name]):  # stable: ties keep the tables' order
        lightest = filled.index(min(filled))
        groups[lightest].append(table)
        filled[lightest] += weights[table.name]
    order = {t.name: k for k, t in enumerate(members)}
    return [sorted(group, key=lambda t: order[t.name]) for group in groups]


@dataclass(frozen=True)
class Region:
    """A cache's slots inside a device table: rows ``[start, start + rows)`` of table ``table``."""

    table: int
    start: int
    rows: int


@dataclass(frozen=True)
class Layout:
    # The module's output keys, in order: its features, with ``feature@table`` for a feature
    # that several tables read (TorchRec's names); "feature" below means one of these.
    features: list[str]
    input_of: dict[str, str]  # feature -> the input (KJT) key it reads
    table_of: dict[str, EmbeddingBagConfig]  # feature -> its table
    columns: list[int]  # where each feature's pooled rows start in the output (and the end)
    shared: bool  # several caches share a device table (one per width)
    stacks: dict[str, list[EmbeddingBagConfig]]  # stack key -> its split tables, in order
    id_starts: dict[str, int]  # split table in a stack -> its first global id there
    stack_ids: dict[str, int]  # stack key -> global ids it spans (last table's end)
    regions: dict[str, Region]  # cache key -> its slots in a device table
    device_rows: list[int]  # rows of each device table
    device_dims: list[int]  # width of each device table
    cache_of_feature: dict[str, str]  # feature -> key of the cache its ids go to

    @property
    def cache_keys(self) -> list[str]:
        return list(self.regions)

    def positions(self, key: str) -> list[int]:
        """Positions (in feature order) of the features cache ``key`` reads."""
        return [k for k, f in enumerate(self.features) if self.cache_of_feature[f] == key]

    def device_table_of_feature(self) -> list[int]:
        return [self.regions[self.cache_of_feature[f]].table for f in self.features]

    def value_base(self) -> Tensor | None:
        """Added to each feature's ids to give what its cache and the lookup read (a stacked
        feature's global id; a whole table's row in a shared device table); None when ids
        are read as they are."""
        if not (self.stacks or self.shared):
            return None
        base = [
            self.id_starts[t.name] if t.name in self.id_starts else self.regions[t.name].start
            for t in (self.table_of[f] for f in self.features)
        ]
        return torch.tensor(base, dtype=torch.int64)


def padded(rows: int, world: int) -> int:
    return math.ceil(rows / world) * world


def build_layout(
    tables: Sequence[EmbeddingBagConfig], slots: dict[str, int], split: set[str], fused: bool, world: int,
    parts: int = 1, dynamic: dict[str, int] | None = None,
) -> Layout:  # fmt: skip
    """The layout of ``tables`` whose caches hold ``slots[table]`` rows, the ``split`` ones
    cached from host stores, on FBGEMM's kernel (``fused``) or PyTorch's, across ``world`` ranks,
    each width's split tables stacked in up to ``parts`` caches of about equal ``dynamic``
    slots (default: ``slots``)."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}.")
    names = get_embedding_names_by_table(tables)
    features = [name for table_names in names for name in table_names]
    input_of = {name: f for t, table_names in zip(tables, names) for name, f in zip(table_names, t.feature_names)}
    table_of = {name: t for t, table_names in zip(tables, names) for name in table_names}
    columns = np.cumsum([0] + [table_of[f].embedding_dim for f in features]).tolist()
    dims = sorted({t.embedding_dim for t in tables})
    stacks = {}
    for d in dims:
        groups = balanced_parts([t for t in tables if t.name in split and t.embedding_dim == d], dynamic or slots, parts)
        stacks.update({stack_key(d, k, len(groups)): group for k, group in enumerate(groups)})
    id_starts: dict[str, int] = {}
    stack_ids: dict[str, int] = {}
    for key, members in stacks.items():
        starts = np.cumsum([0] + [padded(t.num_embeddings, world) for t in members]).tolist()
        id_starts.update({t.name: s for t, s in zip(members, starts)})
        stack_ids[key] = starts[-1]
    if world == 1 and stacks and max(stack_ids.values()) >= INT32_IDS_BELOW:
        stacks, id_starts, stack_ids = {}, {}, {}
    stack_of = {t.name: key for key, members in stacks.items() for t in members}
    cache_of = {f: stack_of.get(table_of[f].name, table_of[f].name) for f in features}
    unstacked = [t for t in tables if t.name not in id_starts]
    # Across ranks the owners' update reads one device table per width as one set of rows
    # (`OwnedRows`), and the PyTorch path reads and updates a width at once: only FBGEMM's
    # kernel in one process, with no stack, keeps a table per cache.
    if fused and world == 1 and not stacks:
        keys = [*stacks, *(t.name for t in unstacked)]
        rows = {**{key: sum(slots[t.name] for t in members) for key, members in stacks.items()}, **{t.name: slots[t.name] for t in unstacked}}
        dims_of = {**{key: members[0].embedding_dim for key, members in stacks.items()}, **{t.name: t.embedding_dim for t in unstacked}}
        regions = {key: Region(k, 0, rows[key]) for k, key in enumerate(keys)}
        return Layout(
            features, input_of, table_of, columns, False, stacks, id_starts, stack_ids, regions,
            [rows[key] for key in keys], [dims_of[key] for key in keys], cache_of,
        )  # fmt: skip
    regions = {}
    device_rows, device_dims = [], []
    for d in dims:
        table, start = len(device_rows), 0
        for key in (key for key, members in stacks.items() if members[0].embedding_dim == d):  # the width's stacks first
            regions[key] = Region(table, start, sum(slots[t.name] for t in stacks[key]))
            start += regions[key].rows
        for t in unstacked:
            if t.embedding_dim == d:
                regions[t.name] = Region(table, start, slots[t.name])
                start += slots[t.name]
        device_rows.append(start)
        device_dims.append(d)
    return Layout(features, input_of, table_of, columns, True, stacks, id_starts, stack_ids, regions, device_rows, device_dims, cache_of)
