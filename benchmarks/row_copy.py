"""Write-backs into a host table of many GB: `put_rows` on one thread against split between several.

A 1% cache's staging writes its evicted rows back to the host table on every batch (on a GPU
host, ~15k rows of dim 128 a batch of 8,192 at the Criteo Kaggle shape), to random rows of
tables far larger than the processor's caches: each row written waits on memory. `put_rows`
splits a large copy between threads where the machine has cores to spare
(`lightning_hotcache._ops.host_rows.copy_threads`). This times it at each of ``--threads``
(``LIGHTNING_HOTCACHE_COPY_THREADS``), the settings taking turns copy by copy, so drift in
the machine hits them all alike, each copy to ids of its own (rows another setting just wrote
would be in the processor's cache); reported: the median milliseconds a copy and each
setting's ratio to the first. torch's ``index_select`` of as many rows (the fetch that
staging makes beside it, parallel by torch) is timed with them.

    python benchmarks/row_copy.py [--table-gib 8] [--dim 128] [--rows 15400] [--threads 1 2 4 8] [--copies 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from report import write_report

from lightning_hotcache.cache.host_arrays import new_host_array
from lightning_hotcache._ops.host_rows import put_rows

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=8.0, help="host table size (GiB of fp32 rows)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=15_400, help="rows written a copy (distinct, random)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--copies", type=int, default=40, help="timed copies per setting")
    parser.add_argument("--out", type=Path, default=RESULTS / "row_copy.json")
    args = parser.parse_args()

    num_rows = int(args.table_gib * 2**30 / (4 * args.dim))
    table = new_host_array((num_rows, args.dim), fill=None)
    step = max(1, 2**28 // (4 * args.dim))
    for start in range(0, num_rows, step):  # random values: pages of one value may be merged by the host
        table[start : start + step].normal_()
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(args.rows, args.dim, generator=gen)

    times: dict[str, list[float]] = {f"put_rows x{t}": [] for t in args.threads}
    times["index_select"] = []
    for i in range(args.copies + 3):
        for threads in [*args.threads, None]:
            ids = torch.randint(0, num_rows, (args.rows,), generator=gen).unique()
            start = time.perf_counter()
            if threads is None:
                table.index_select(0, ids)
            else:
                os.environ["LIGHTNING_HOTCACHE_COPY_THREADS"] = str(threads)
                put_rows(table, ids, rows[: len(ids)])
            if i >= 3:  # the first copies compile and start the helpers
                times["index_select" if threads is None else f"put_rows x{threads}"].append(time.perf_counter() - start)
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    one = median[f"put_rows x{args.threads[0]}"]
    results = {name: {"ms": ms, "x_first": one / ms} for name, ms in median.items()}
    print(f"{'copy':<16} {'ms':>8} {'speed-up':>9}   ({args.rows:,} rows of {args.dim} into {num_rows:,}, {os.cpu_count()} cores)")
    for name, r in results.items():
        print(f"{name:<16} {r['ms']:8.2f} {r['x_first']:9.2f}")
    write_report("row_copy", args, results, num_rows=num_rows, cores=os.cpu_count())


if __name__ == "__main__":
    main()
