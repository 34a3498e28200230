"""Trace-driven device hit rate against budget: ours (static + dynamic) vs FAE, LRU, LFU.

For each dataset the first ``--profile-batches`` training batches are profiled, and the
next ``--trace-batches`` are replayed through the device caches (`DeviceCache.acquire` /
`release`, no training: hit rates do not depend on the row values). Budgets are fractions
of the tables' rows; each is turned into bytes for the planner, so every policy gets the
same device memory:

* ``ours``: HotColdPlanner's plan (hot rows from the profile + LFU dynamic slots);
* ``static``: FAE, the planner's static-policy plan (hot rows; misses staged per batch);
* ``lru`` / ``lfu``: no static rows, the same number of device rows per table as ``ours``,
  all dynamic;
* ``belady``: the ceiling of any cache of those rows (Belady's MIN, offline: on a miss, evict
  the row whose next use is farthest in the trace), with the rows of the batch being looked
  up never evicted, as the device caches lock them. The gap between LFU and this is what a
  lookahead cache (which knows the next batches' ids) can win;
* ``lookahead K``: ours' plan under the lookahead policy, each batch announced K batches
  before it is acquired (``closed``: the share of the distance from ``ours``, the same plan
  under LFU, to ``belady`` that it wins);
* ``model lfu`` / ``model la K``: a model of the lookahead cache ahead of building it
  (`lookahead_hits`), on ``ours``' rows: the plan's static rows pinned, its dynamic slots
  evicting a row no batch of the next K reads first (least frequently read since it came
  in, then least recently), else the one read farthest ahead; K = 0 is plain LFU, the
  baseline the window is measured against (``model closed``: the share of the distance from
  it to ``belady`` that the window wins).

* ``paid la K``: the model of a lookahead window kept in device memory, as the device directory
  would need it: its memory (each announced batch's distinct ids outside the static rows, 4
  bytes each, the least such a window could keep) paid in dynamic slots of the real model's rows
  (``--paid-dim``, row-wise Adagrad, the device directory's cell), against ``model lfu`` with
  every slot. Fully associative: the device directory's sets cost no hit rate against it (the
  ``stacked`` table).

The share closed depends on the trace's length against the window: Belady sees the whole
trace, so a window as long as the trace closes all of it. Measure windows on traces several
times their length (``--trace-batches``).

Prints a table and writes benchmarks/results/hit_rate.json.

    python benchmarks/hit_rate.py [--scale 0.05] [--trace-batches 200] [--windows 1 4 16]
"""

from __future__ import annotations

import argparse
import heapq
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from report import write_report
from torchrec import EmbeddingBagConfig

from datamodules import MovieLensDataModule, SyntheticCTRDataModule
from lightning_hotcache import HotColdPlanner, RowWiseOptimizerConfig
from lightning_hotcache.cache import DeviceCache, HostStore
from lightning_hotcache.cache.device_directory import DEVICE_DIRECTORY_BYTES_PER_SLOT, NEXT_READ_BYTES_PER_SLOT, DeviceDirectory, device_window_bytes
from lightning_hotcache.planner.plan import HotColdPlan, TablePlan, row_bytes
from lightning_hotcache.planner.profiling import profile_batches

RESULTS = Path(__file__).parent / "results"
SGD = RowWiseOptimizerConfig(name="sgd")
POLICIES = ("ours", "static", "lru", "lfu", "belady")


def replay(tables: list[EmbeddingBagConfig], plan: HotColdPlan, policy: str, trace: list[Any], window: int = 0) -> float:
    """Fraction of lookups found on the device while replaying ``trace`` (under ``lookahead``,
    each batch announced ``window`` batches before it is acquired, as the strategy's loader does)."""
    caches = {}
    for t in tables:
        p = plan.table(t.name)
        host = None if p.on_device else HostStore(t.name, t.num_embeddings, t.embedding_dim, {})
        caches[t.name] = DeviceCache(
            t.name, t.num_embeddings, t.embedding_dim, SGD, torch.as_tensor(p.static_ids), p.cache_slots,
            policy, host, torch.device("cpu"),
        )  # fmt: skip
    def ids_of(batch: Any, table: EmbeddingBagConfig) -> torch.Tensor:
        by_feature = batch.sparse_features.to_dict()
        return torch.cat([by_feature[f].values() for f in table.feature_names])

    announced = 0
    for b, batch in enumerate(trace):
        while window and announced < min(b + window + 1, len(trace)):
            for t in tables:
                caches[t.name].announce(ids_of(trace[announced], t))
            announced += 1
        for t in tables:
            got = DeviceCache.acquire_all([caches[t.name]], [ids_of(batch, t)], announced=bool(window))[0]
            caches[t.name].release(got.ticket)
    lookups = sum(c.counters.lookups for c in caches.values())
    return sum(c.counters.hits for c in caches.values()) / lookups


def stacked_replay(
    tables: list[EmbeddingBagConfig], plan: HotColdPlan, trace: list[Any], directory: str, window: int = 0, slot_bytes: int = 0,
) -> float:
    """Hit rate over ``trace`` of the split tables stacked in one cache, as a collection stacks
    them (global ids: each table's after the previous one's), under LFU (``window``: the lookahead
    policy, batches announced that far ahead) with the host directory (``directory="host"``,
    fully associative) or the device directory (``"device"``: `DeviceDirectory`, 32-way
    set-associative, its rows of no width, so that only its bookkeeping runs; its lookahead
    window's memory, and each cell's next read, paid in dynamic slots of ``slot_bytes``); the
    tables wholly on the device hit always."""
    split = [t for t in tables if not plan.table(t.name).on_device]
    if not split:
        return 1.0
    starts = np.cumsum([0] + [t.num_embeddings for t in split]).tolist()
    static = torch.cat([torch.as_tensor(plan.table(t.name).static_ids, dtype=torch.int64) + s for t, s in zip(split, starts)])
    dynamic = sum(plan.table(t.name).cache_slots for t in split)
    static = static.unique()

    def ids_of(batch: Any) -> torch.Tensor:
        by_feature = batch.sparse_features.to_dict()
        return torch.cat([by_feature[f].values().to(torch.int64) + s for t, s in zip(split, starts) for f in t.feature_names])

    if directory == "device":
        if window:  # the window as the first announcement sizes it, and 8 bytes a cell
            first = ids_of(trace[0]).unique()
            distinct = int((~torch.isin(first, static)).sum())
            dynamic = int(dynamic - device_window_bytes(window, distinct) / slot_bytes) * slot_bytes // (slot_bytes + NEXT_READ_BYTES_PER_SLOT)
        rows = torch.empty(len(static) + dynamic, 0)
        cache: Any = DeviceDirectory(static, dynamic, "lookahead" if window else "lfu", {"weight": rows},
                                     {"weight": torch.empty(starts[-1], 0)}, window_batches=window)  # fmt: skip
    else:
        cache = DeviceCache("stack", starts[-1], 1, SGD, static, dynamic, "lookahead" if window else "lfu",
                            HostStore("stack", starts[-1], 1, {}), torch.device("cpu"))  # fmt: skip

    whole = sum(len(b.sparse_features.to_dict()[f].values()) for b in trace for t in tables if t not in split for f in t.feature_names)
    announced = 0
    for b, batch in enumerate(trace):
        while window and announced < min(b + window + 1, len(trace)):
            cache.announce(ids_of(trace[announced]))
            announced += 1
        if directory == "device":
            cache.release(cache.admit(ids_of(batch), training=bool(window)))  # a training batch retires its announcement
        else:
            cache.release(DeviceCache.acquire_all([cache], [ids_of(batch)], announced=bool(window))[0].ticket)
    if directory == "device":
        counts = cache.counters()
        hits, lookups = counts["hits"], counts["lookups"]
    else:
        hits, lookups = cache.counters.hits, cache.counters.lookups
    return (hits + whole) / (lookups + whole)


def belady_hits(batches: list[np.ndarray], capacity: int, initial: Iterable[int] = ()) -> int:
    """Lookups found resident by Belady's MIN over ``batches`` (each the ids one batch reads,
    repeats counted) with ``capacity`` rows, ``initial`` resident at the start (a plan's
    profiled static rows: the other policies start with them too): a batch's rows are all
    made resident before the next batch, evicting the rows (not of this batch) whose next use
    is farthest. Optimal where a batch reads each row once; with repeats, hits weigh a row by its
    lookups and a tie between rows read next in the same batch can cost a lookup (the
    lookahead model over the whole trace came 1 lookup in 2,757 above it once).

    Written here because no library ships an offline optimal cache; a heap with lazy deletion
    keeps each eviction O(log rows)."""
    distinct = [np.unique(ids, return_counts=True) for ids in batches]
    # next_use[b][k]: the next batch after b that reads distinct[b][0][k] (len(batches): never).
    next_use: list[np.ndarray] = [np.empty(0, np.int64)] * len(batches)
    upcoming: dict[int, int] = {}
    for b in range(len(batches) - 1, -1, -1):
        ids = distinct[b][0]
        next_use[b] = np.array([upcoming.get(int(i), len(batches)) for i in ids], dtype=np.int64)
        upcoming.update((int(i), b) for i in ids)
    resident = {int(i): upcoming.get(int(i), len(batches)) for i in initial}  # id -> its next use
    if len(resident) > capacity:
        raise ValueError(f"{len(resident)} initial rows, more than the {capacity} the cache holds")
    heap = [(-nxt, i) for i, nxt in resident.items()]  # (-next use, id), stale entries skipped
    heapq.heapify(heap)
    hits = 0
    for b, (ids, counts) in enumerate(distinct):
        now = set(ids.tolist())
        if len(now) > capacity:
            raise ValueError(f"a batch reads {len(now)} rows, more than the {capacity} the cache holds")
        hits += int(counts[[int(i) in resident for i in ids]].sum()) if len(ids) else 0
        for i, nxt in zip(ids.tolist(), next_use[b].tolist()):
            resident[i] = nxt
            heapq.heappush(heap, (-nxt, i))
        kept = []
        while len(resident) > capacity:
            nxt, i = heapq.heappop(heap)
            if resident.get(i) != -nxt:
                continue  # stale: evicted, or its next use moved since
            if i in now:
                kept.append((nxt, i))  # read by this batch: locked
                continue
            del resident[i]
        for entry in kept:
            heapq.heappush(heap, entry)
    return hits


def lookahead_hits(batches: list[np.ndarray], num_rows: int, static: np.ndarray, capacity: int, window: int) -> int:
    """Lookups found resident over ``batches`` (each the ids one batch reads, repeats counted)
    by a model of the lookahead cache: ``static`` rows pinned, ``capacity`` dynamic rows; a
    batch's rows are all made resident before the next batch, evicting dynamic rows it does
    not read: first those no batch of the next ``window`` reads, least frequently read since
    they came in, then least recently; then the one whose next read is farthest. ``window=0``
    is plain LFU.

    A model, not the cache: the decision the policy would make, exactly, per batch (the real
    cache's LFU approximates this with a reserve of victims; see `DeviceCache`)."""
    pinned = np.zeros(num_rows, bool)
    pinned[static] = True
    resident = np.zeros(num_rows, bool)
    frequency = np.zeros(num_rows, np.int64)
    last_read = np.zeros(num_rows, np.int64)
    next_read = np.full(num_rows, np.iinfo(np.int64).max)
    in_batch = np.zeros(num_rows, bool)
    distinct = [np.unique(ids, return_counts=True) for ids in batches]
    hits, num_resident = 0, 0
    for b, (ids, counts) in enumerate(distinct):
        found = pinned[ids] | resident[ids]
        hits += int(counts[found].sum())
        dynamic = ~pinned[ids]
        missing = ids[~found]
        overflow = num_resident + len(missing) - capacity
        if overflow > 0:
            in_batch[ids] = True
            candidates = np.flatnonzero(resident & ~in_batch)
            in_batch[ids] = False
            if len(candidates) < overflow:
                raise ValueError(f"a batch needs {len(missing)} rows; {capacity} dynamic slots cannot hold them")
            ahead = range(min(len(batches) - 1, b + window), b, -1)
            for j in ahead:  # the nearest read wins: written last
                next_read[distinct[j][0]] = j
            upcoming = next_read[candidates]
            never = upcoming == np.iinfo(np.int64).max
            tier = np.where(never, 0, 1 + (b + window - np.where(never, 0, upcoming)))  # farthest read first
            order = np.lexsort((last_read[candidates], frequency[candidates], tier))
            victims = candidates[order[:overflow]]
            resident[victims] = False
            num_resident -= overflow
            for j in ahead:
                next_read[distinct[j][0]] = np.iinfo(np.int64).max
        resident[missing[~pinned[missing]]] = True
        num_resident += int((~pinned[missing]).sum())
        frequency[missing] = 0  # counted since it came in, as the cache does
        frequency[ids[dynamic]] += counts[dynamic]
        last_read[ids] = b
    return hits


def lookahead_model(tables: list[EmbeddingBagConfig], plan: HotColdPlan, trace: list[Any], window: int, slot_bytes: int = 0) -> float:
    """`lookahead_hits`' hit rate over ``trace`` with each table's rows of ``plan``; with
    ``slot_bytes``, the window's device memory (`window_slots`) taken from its dynamic slots."""
    hits = lookups = 0
    for t in tables:
        per_batch = [torch.cat([b.sparse_features.to_dict()[f].values() for f in t.feature_names]).numpy() for b in trace]
        lookups += sum(len(ids) for ids in per_batch)
        p = plan.table(t.name)
        if p.on_device:
            hits += sum(len(ids) for ids in per_batch)
            continue
        static = np.asarray(p.static_ids, np.int64)
        slots = p.cache_slots - (window_slots(per_batch, static, window, slot_bytes) if slot_bytes else 0)
        biggest = max(len(np.setdiff1d(ids, static)) for ids in per_batch)
        if slots < biggest:
            return float("nan")  # the window leaves too few slots for a batch
        hits += lookahead_hits(per_batch, t.num_embeddings, static, slots, window)
    return hits / lookups


def window_slots(per_batch: list[np.ndarray], static: np.ndarray, window: int, slot_bytes: int) -> int:
    """Dynamic slots of ``slot_bytes`` that a device window of ``window`` batches costs: each
    batch's distinct ids outside ``static``, 4 bytes each (the mean batch's)."""
    per = np.mean([len(np.setdiff1d(ids, static)) for ids in per_batch])
    return int(np.ceil(window * per * 4 / slot_bytes))


def belady(tables: list[EmbeddingBagConfig], plan: HotColdPlan, trace: list[Any]) -> float:
    """Belady's hit rate over ``trace`` with each table's device rows of ``plan``, starting from
    its static rows (a table wholly on the device hits always)."""
    hits = lookups = 0
    for t in tables:
        per_batch = [
            torch.cat([b.sparse_features.to_dict()[f].values() for f in t.feature_names]).numpy() for b in trace
        ]
        lookups += sum(len(ids) for ids in per_batch)
        p = plan.table(t.name)
        rows = len(p.static_ids) + p.cache_slots
        hits += sum(len(ids) for ids in per_batch) if p.on_device else belady_hits(per_batch, rows, p.static_ids.tolist())
    return hits / lookups


def all_dynamic(plan: HotColdPlan) -> HotColdPlan:
    """Same device rows per table as ``plan``, none of them static."""
    tables = [
        t if t.on_device else TablePlan(t.name, t.num_embeddings, t.embedding_dim, np.empty(0, np.int64),
                                        len(t.static_ids) + t.cache_slots, t.device_bytes, 0.0)
        for t in plan.tables
    ]  # fmt: skip
    return HotColdPlan(tables, plan.budget_bytes)


def run(name: str, dm: Any, budgets: list[float], profile: int, trace_len: int, windows: list[int], slot_bytes: int) -> list[dict[str, Any]]:
    source = dm.source("train")
    bs = dm.batch_size
    batches = [source.batch(i * bs, (i + 1) * bs) for i in range(min(profile + trace_len, len(source) // bs))]
    stats = profile_batches(batches[:profile], dm.tables, progress=False)
    trace = batches[profile:]
    rows_total = sum(t.num_embeddings for t in dm.tables)
    bytes_per_row = sum(t.num_embeddings * row_bytes(t, SGD) for t in dm.tables) / rows_total
    out = []
    for fraction in budgets:
        budget = max(1, int(fraction * rows_total * bytes_per_row))
        result: dict[str, Any] = {"dataset": name, "budget_rows": fraction}
        try:
            ours = HotColdPlanner(budget, SGD, cache_policy="lfu").plan(dm.tables, stats)
        except ValueError:
            out.append({**result, **{p: None for p in POLICIES}, "model": None})  # below the minimum for one batch
            continue
        result["ours"] = replay(dm.tables, ours, "lfu", trace)
        try:
            static = HotColdPlanner(budget, SGD, cache_policy="static").plan(dm.tables, stats)
            result["static"] = replay(dm.tables, static, "static", trace)
        except ValueError:
            result["static"] = None
        result["lru"] = replay(dm.tables, all_dynamic(ours), "lru", trace)
        result["lfu"] = replay(dm.tables, all_dynamic(ours), "lfu", trace)
        result["belady"] = belady(dm.tables, ours, trace)
        lfu = lookahead_model(dm.tables, ours, trace, 0)
        result["model"] = {"lfu": lfu, **{f"la {k}": lookahead_model(dm.tables, ours, trace, k) for k in windows}}
        result["paid"] = {k: lookahead_model(dm.tables, ours, trace, k, slot_bytes) for k in windows}
        result["lookahead"] = {k: replay(dm.tables, ours, "lookahead", trace, k) for k in windows}
        gap = result["belady"] - lfu
        result["gap_closed"] = {k: (result["model"][f"la {k}"] - lfu) / gap if gap > 1e-12 else None for k in windows}
        built_gap = result["belady"] - result["ours"]
        result["lookahead_closed"] = {k: (result["lookahead"][k] - result["ours"]) / built_gap if built_gap > 1e-12 else None for k in windows}
        # As a collection stacks its split tables: LFU with the host directory, with the device
        # directory (32-way sets), and the lookahead policy (host directory) at the largest window.
        k = max(windows)
        result["stacked"] = {"host lfu": stacked_replay(dm.tables, ours, trace, "host"), "device lfu": stacked_replay(dm.tables, ours, trace, "device"),
                             f"host la {k}": stacked_replay(dm.tables, ours, trace, "host", k),
                             f"device la {k} paid": stacked_replay(dm.tables, ours, trace, "device", k, slot_bytes)}  # fmt: skip
        others = [result[p] for p in ("static", "lru", "lfu") if result[p] is not None]
        result["ours_at_least_best_other"] = bool(result["ours"] >= max(others) - 1e-9)
        out.append(result)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.05, help="synthetic: Criteo Kaggle cardinalities x scale")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--profile-batches", type=int, default=50)
    parser.add_argument("--trace-batches", type=int, default=200)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.001, 0.003, 0.01, 0.03, 0.1, 0.2])
    parser.add_argument("--movielens-budgets", type=float, nargs="+", help="MovieLens' budgets (default: --budgets)")
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 4, 16], help="lookahead windows (batches) to model")
    parser.add_argument("--paid-dim", type=int, default=128, help="the row width the device window's memory is paid in (paid la K)")
    parser.add_argument("--out", type=Path, default=RESULTS / "hit_rate.json")
    args = parser.parse_args()

    # A dynamic slot of the real model on the device directory: its row, row-wise Adagrad's state, its cell.
    slot_bytes = 4 * (args.paid_dim + 1) + DEVICE_DIRECTORY_BYTES_PER_SLOT
    samples = args.batch_size * (args.profile_batches + args.trace_batches)
    results = []
    for s in (0.9, 1.05, 1.2):
        dm = SyntheticCTRDataModule(scale=args.scale, zipf_exponent=s, batch_size=args.batch_size,
                                    embedding_dim=8, num_train_samples=samples)  # fmt: skip
        results += run(f"synthetic zipf {s}", dm, args.budgets, args.profile_batches, args.trace_batches, args.windows, slot_bytes)
    # Small batches: its tables have 21 to 1,682 rows, so one batch of 256 fills 20% of them.
    movielens = MovieLensDataModule(batch_size=32, embedding_dim=8)
    movielens.setup("fit")
    results += run("movielens-100k", movielens, args.movielens_budgets or args.budgets, 200, 2000, args.windows, slot_bytes)

    models = ["lfu", *(f"la {k}" for k in args.windows)]
    print(f"{'dataset':<22}{'budget':>8}" + "".join(f"{p:>9}" for p in POLICIES) + "  ours>=best" + "".join(f"{'model ' + m:>11}" for m in models)
          + "".join(f"{'closed ' + str(k):>10}" for k in args.windows) + "".join(f"{'la ' + str(k):>8}" for k in args.windows)
          + "".join(f"{'closed ' + str(k):>10}" for k in args.windows))  # fmt: skip
    for r in results:
        cells = "".join(f"{r[p]:>9.3f}" if r[p] is not None else f"{'-':>9}" for p in POLICIES)
        model = "".join(f"{r['model'][m]:>11.3f}" if r["model"] else f"{'-':>11}" for m in models)
        closed = "".join(f"{r['gap_closed'][k]:>10.2f}" if r.get("gap_closed") and r["gap_closed"][k] is not None else f"{'-':>10}" for k in args.windows)
        real = "".join(f"{r['lookahead'][k]:>8.3f}" if r.get("lookahead") else f"{'-':>8}" for k in args.windows)
        real += "".join(f"{r['lookahead_closed'][k]:>10.2f}" if r.get("lookahead_closed") and r["lookahead_closed"][k] is not None
                        else f"{'-':>10}" for k in args.windows)  # fmt: skip
        print(f"{r['dataset']:<22}{r['budget_rows']:>8.3f}{cells}  {str(r.get('ours_at_least_best_other', '-')):>10}{model}{closed}{real}")
    print(f"\na window in device memory, paid in slots of {args.paid_dim} floats: {'dataset':<22}{'budget':>8}  model lfu" + "".join(f"{'la ' + str(k):>8}{'paid':>8}" for k in args.windows))
    for r in results:
        if r.get("paid"):
            cells = "".join(f"{r['model'][f'la {k}']:>8.3f}{r['paid'][k]:>8.3f}" for k in args.windows)
            print(f"{'':50}{r['dataset']:<22}{r['budget_rows']:>8.3f}  {r['model']['lfu']:>9.3f}{cells}")
    k = max(args.windows)
    print(f"\nstacked as a collection stacks them: {'dataset':<22}{'budget':>8}  host lfu  device lfu  host la {k}  device la {k} paid")
    for r in results:
        if r.get("stacked"):
            stacked = r["stacked"]
            print(f"{'':37}{r['dataset']:<22}{r['budget_rows']:>8.3f}  {stacked['host lfu']:>8.3f}  {stacked['device lfu']:>10.3f}"
                  f"  {stacked[f'host la {k}']:>9.3f}  {stacked[f'device la {k} paid']:>16.3f}")  # fmt: skip
    write_report("hit_rate", args, results)

if __name__ == "__main__":
    main()
