"""The id -> slot maps of a CPU cache, alone: a batch's distinct ids looked up, a step's fetches
inserted and its evictions removed, in the dense array, our hash table (`HashedSlotMap`), and
FBGEMM's CPU hash table (`pruned_hashmap_lookup` / `_insert`, the map before; its lookup alone,
without the check for evicted ids' entries it needed, so a lower bound of what it cost).

Resident ids are drawn at random from a table of ``--rows`` (default: the Kaggle stack's
33.8M), ``--ids`` distinct ids a batch (default 30k, a 1% cache's batch of 2,048 at scale 1.0),
``--hit`` of them resident, and ``--fetched`` ids a step replaced. Medians of ``--repeats``
calls, the maps interleaved; one thread. Prints a table and writes
benchmarks/results/slot_map.json.

    python benchmarks/slot_map.py [--slots 338000 3380000] [--ids 30000] [--fetched 3600]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from report import write_report
from torch import Tensor

from lightning_hotcache.cache.slot_map import DenseSlotMap, HashedSlotMap

RESULTS = Path(__file__).parent / "results"


def _median_ms(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():  # interleaved: the machine's drift hits every map alike
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


class _FbgemmMap:
    """FBGEMM's CPU hash table as `HashedSlotMap` used it before (2 cells of int32 id and slot a slot)."""

    def __init__(self, num_slots: int) -> None:
        self.table = torch.full((2 * num_slots, 2), -1, dtype=torch.int32)
        self.offsets = torch.tensor([0, len(self.table)], dtype=torch.int64)

    def lookup(self, ids: Tensor) -> Tensor:
        bag = torch.tensor([0, len(ids)], dtype=torch.int32)
        return torch.ops.fbgemm.pruned_hashmap_lookup(ids.int(), bag, self.table, self.offsets)

    def assign(self, ids: Tensor, slots: Tensor) -> None:
        bag = torch.tensor([0, len(ids)], dtype=torch.int32)
        torch.ops.fbgemm.pruned_hashmap_insert(ids.int(), slots.int(), bag, self.table, self.offsets)


def measure(rows: int, slots: int, ids: int, hit: float, fetched: int, repeats: int) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(0)
    drawn = torch.randperm(rows, generator=g)[: slots + ids + repeats * fetched]
    resident, spare = drawn[:slots], drawn[slots:]
    at = torch.arange(slots)
    dense, hashed = DenseSlotMap(rows, resident, slots, torch.device("cpu")), HashedSlotMap(rows, resident, slots, torch.device("cpu"))
    maps: dict[str, object] = {"dense": dense, "hashed": hashed}
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

        maps["fbgemm"] = _FbgemmMap(slots)
        maps["fbgemm"].assign(resident, at)  # type: ignore[attr-defined]
    except ImportError:
        pass
    hits = int(ids * hit)
    batch = torch.cat([resident[torch.randperm(slots, generator=g)[:hits]], spare[: ids - hits]]).sort().values
    for name, m in maps.items():
        found = m.lookup(batch)  # type: ignore[attr-defined]
        assert int((found >= 0).sum()) == hits, name
    lookup = _median_ms({name: (lambda m=m: m.lookup(batch)) for name, m in maps.items()}, repeats)  # type: ignore[attr-defined]
    # A step's turnover: `fetched` resident ids leave, as many new ones come into their slots
    # (FBGEMM's table has no removal: its inserts alone, without the rebuilds that needed).
    turnover: dict[str, list[float]] = {name: [] for name in maps}
    id_of_slot, new_ids = resident.clone(), spare[ids:]
    for step in range(repeats):
        freed = torch.randperm(slots, generator=g)[:fetched]
        gone, arriving = id_of_slot[freed], new_ids[step * fetched : (step + 1) * fetched]
        for name, m in maps.items():
            started = time.perf_counter()
            if name != "fbgemm":
                m.remove(gone)  # type: ignore[attr-defined]
            m.assign(arriving, freed)  # type: ignore[attr-defined]
            turnover[name].append(time.perf_counter() - started)
        id_of_slot[freed] = arriving
    assert torch.equal(hashed.lookup(id_of_slot), at) and torch.equal(dense.lookup(id_of_slot), at)
    out = {name: {"lookup_ms": ms} for name, ms in lookup.items()}
    for name, values in turnover.items():
        out[name]["turnover_ms"] = 1e3 * statistics.median(values)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=33_762_577)
    parser.add_argument("--slots", type=int, nargs="+", default=[338_000, 3_380_000])
    parser.add_argument("--ids", type=int, default=30_000)
    parser.add_argument("--hit", type=float, default=0.6)
    parser.add_argument("--fetched", type=int, default=3_600)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", type=Path, default=RESULTS / "slot_map.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {str(slots): measure(args.rows, slots, args.ids, args.hit, args.fetched, args.repeats) for slots in args.slots}
    print(f"{'slots':>10} {'map':>7} {'lookup ms':>10} {'turnover ms':>12}")
    for slots, by_map in results.items():
        for name, figures in by_map.items():
            print(f"{int(slots):>10,} {name:>7} {figures['lookup_ms']:>10.3f} {figures['turnover_ms']:>12.3f}")
    write_report("slot_map", args, results, echo=False, threads=1)


if __name__ == "__main__":
    main()
