"""What the device directory's bookkeeping costs a step on its own: `DeviceDirectory.admit`
(a batch's distinct ids found, victims chosen, dirty victims written back to their host rows and
missed rows read in by one kernel an array) and `release`, on one stack of tables.

A step on the device directory admits its batch before its forward; whether admitting the next
batch ahead (on a side stream, while the current one trains) could pay is bounded by this time.
The stack's rows and row-wise Adagrad state live in host memory (registered, as a collection
maps them, on CUDA) and its cache in device memory; the hottest ids (ids are drawn Zipf-like
by rank, so the hottest are the lowest) take half the cache as static rows, as a plan gives
them, the rest are dynamic slots. Reported: the median milliseconds of an admission with its
release, timed with events on the device (a host sync only around each timed batch), with its
ids found and victims chosen by the `set_kernels` and, batch by batch in turns, by the torch ops
they replace (both give the same cells, so the cache goes on alike), rows
fetched and written back a batch, and the hit rate of the timed batches. Under ``--policy
lookahead`` each batch is announced ``--window`` batches ahead of its admission, and the time is
that of an announcement with an admission and its release (what the window adds a step). On a
CPU it runs only under ``TRITON_INTERPRET=1`` (a check that the script works, not a speed).

    python benchmarks/device_directory.py [--rows 4000000] [--budget 0.01] [--dim 128] [--ids 212992] [--batches 60] [--warmup 20]
    python benchmarks/device_directory.py --policy lookahead --window 64   # the lookahead window's cost
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from report import write_report

from lightning_hotcache.cache.device_directory import DEVICE_POLICIES, DeviceDirectory
from lightning_hotcache.cache.host_mapping import HostMappingError, map_for_devices
from lightning_hotcache.kernels import triton_tbe

RESULTS = Path(__file__).parent / "results"


def _zipf_ids(rows: int, n: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` ids of ``rows``, id ``r`` drawn with weight ``(r + 1) ** -exponent``."""
    ranks = rng.zipf(exponent, size=n * 2)
    ranks = ranks[ranks <= rows][:n]
    while len(ranks) < n:  # a heavy tail can leave too few in range
        more = rng.zipf(exponent, size=n)
        ranks = np.concatenate([ranks, more[more <= rows]])[:n]
    return ranks - 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4_000_000, help="rows of the stack")
    parser.add_argument("--budget", type=float, default=0.01, help="the cache's slots, a fraction of the rows")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--ids", type=int, default=26 * 8192, help="ids a batch reads (26 features x batch 8,192)")
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--batches", type=int, default=60, help="timed batches")
    parser.add_argument("--warmup", type=int, default=20, help="batches admitted first, untimed (the cache fills)")
    parser.add_argument("--policy", default="lfu", choices=DEVICE_POLICIES)
    parser.add_argument("--window", type=int, default=64, help="under lookahead, batches announced ahead (the default at batches of 8,192)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS / "device_directory.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    why = triton_tbe.why_unavailable(device)
    if why is not None:
        raise SystemExit(f"device_directory.py: {why}.")
    slots_total = max(2, int(args.rows * args.budget))
    num_static = slots_total // 2
    host = {"weight": torch.zeros(args.rows, args.dim), "momentum": torch.zeros(args.rows, 1)}
    if device.type == "cuda":
        try:
            for array in host.values():
                map_for_devices(array)
        except HostMappingError as error:  # the kernels cannot reach the host rows: no figure, and why
            print(f"device_directory.py: the host rows could not be mapped for the kernels: {error}", flush=True)
            write_report("device_directory", args, {"mapped": False, "why": str(error)}, interpreted=triton_tbe.interpreted())
            return
    slots = {key: torch.zeros(slots_total, array.shape[1], device=device) for key, array in host.items()}
    window = args.window if args.policy == "lookahead" else 0
    directory = DeviceDirectory(torch.arange(num_static), slots_total - num_static, args.policy, slots, host, window_batches=window)
    rng = np.random.default_rng(0)
    batches = [torch.from_numpy(_zipf_ids(args.rows, args.ids, args.zipf, rng)).to(device) for _ in range(args.warmup + args.batches + window)]
    for ids in batches[:window]:
        directory.announce(ids)
    before: dict[str, int] = {}
    times: dict[bool, list[float]] = {True: [], False: []}  # by whether the set kernels ran
    for b, ids in enumerate(batches[: args.warmup + args.batches]):
        if b == args.warmup:
            before = directory.counters()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
        directory.set_kernels = b % 2 == 0
        started = time.perf_counter()
        if window:  # the loader announces the batch a window ahead as this one is admitted
            directory.announce(batches[b + window])
        directory.release(directory.admit(ids, training=True))
        if device.type == "cuda":
            ended.record()
            torch.cuda.synchronize(device)
            elapsed = began.elapsed_time(ended)
        else:
            elapsed = (time.perf_counter() - started) * 1e3
        if b >= args.warmup:
            times[directory.set_kernels].append(elapsed)
    after = directory.counters()
    moved = {key: (after[key] - before[key]) / args.batches for key in after}
    results = {
        "admit_and_release_ms": statistics.median(times[True]),
        "admit_and_release_torch_sets_ms": statistics.median(times[False]),
        "hit_rate": moved["hits"] / moved["lookups"],
        "fetched_rows_per_batch": moved["fetched_rows"],
        "written_back_rows_per_batch": moved["written_back_rows"],
        "from_host_rows_per_batch": moved["from_host_rows"],
        "distinct_ids_per_batch": float(np.mean([len(torch.unique(ids)) for ids in batches[args.warmup : args.warmup + args.batches]])),
        "window_bytes": 0 if directory.window is None else directory.window.numel() * 4,
    }
    timed = "announce+admit+release ms" if window else "admit+release ms"
    print(f"{timed:>26} {'(torch set ops)':>16} {'hit rate':>9} {'fetched':>9} {'written back':>13} {'from host':>10}   "
          f"({args.rows:,} rows x dim {args.dim}, {args.budget:g} cached, {args.ids:,} ids a batch, zipf {args.zipf}, {args.policy}, {device})")  # fmt: skip
    print(f"{results['admit_and_release_ms']:26.3f} {results['admit_and_release_torch_sets_ms']:16.3f} {results['hit_rate']:9.3f} "
          f"{moved['fetched_rows']:9.0f} {moved['written_back_rows']:13.0f} {moved['from_host_rows']:10.0f}")  # fmt: skip
    write_report("device_directory", args, results, interpreted=triton_tbe.interpreted())


if __name__ == "__main__":
    main()
