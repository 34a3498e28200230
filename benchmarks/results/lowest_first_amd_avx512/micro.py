"""`sorting.lowest_first` against the numpy partition it replaced, on LFU-shaped scores
(Zipf reads x (issued + 1) + last use, 5% locked): the victim scan's shapes (dynamic slots,
eight batches' misses) at 10% of the Kaggle tables in cpu_throughput.py and at 1% in
staging.py's GPU-check shape, a tenth of 330k, 3.3M slots, and nearly all. Medians of 9 calls, ms; checks that both give the same values in the same order.

    PYTHONPATH=. .venv/bin/python benchmarks/results/lowest_first_amd_avx512/micro.py
"""

import time

import numpy as np
import torch

from lightning_hotcache.sorting import lowest_first


def partition_then_sort(values: torch.Tensor, count: int) -> torch.Tensor:
    found = values.numpy()
    lowest = np.argpartition(found, count - 1)[:count]
    return torch.from_numpy(lowest[np.argsort(found[lowest])])


def median_ms(work, calls: int = 9) -> float:
    seconds = []
    for _ in range(calls):
        started = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - started)
    return 1e3 * float(np.median(seconds))


rng = np.random.default_rng(0)
for slots, count, shape in ((361_750, 17_600, "10%, batches of 2,048 (cpu_throughput)"), (196_872, 126_000, "1%, batches of 8,192 (staging.py)"), (330_000, 32_700, "330k slots, a tenth"),
                            (3_300_000, 120_000, "3.3M slots"), (40_000, 39_000, "nearly all")):
    issued = 100_000
    scores = (np.minimum(rng.zipf(1.5, slots), 10_000) - 1) * (issued + 1) + rng.integers(0, issued, slots)
    scores[rng.random(slots) < 0.05] = np.iinfo(np.int64).max
    values = torch.from_numpy(scores)
    assert torch.equal(values[partition_then_sort(values, count)], values[lowest_first(values, count)])
    before, after = median_ms(lambda: partition_then_sort(values, count)), median_ms(lambda: lowest_first(values, count))
    print(f"{shape:40s} lowest {count:>7,} of {slots:>9,}: partition {before:6.2f} ms, lowest_first {after:6.2f} ms ({after / before:.2f}x)")
