"""What the GIL costs a thread of many small torch calls beside a thread that runs Python.

hotcache's staging threads make a few hundred torch calls a batch, and each call hands the GIL
over and takes it back; the training loop beside them runs Python for most of a step. A thread
taking the GIL back waits until its holder releases it, or until Python's switch interval
(5 ms by default) forces it to. This times ``--calls`` tiny torch ops (an add on ``--numel``
floats) made from Python, alone and beside a thread that only runs Python, at each switch
interval of ``--intervals``; and the same ops as one TorchScript function, which takes the GIL
once a call: the lever a staging written that way would have. Median of ``--reps`` calls.

    python benchmarks/gil_handover.py [--calls 200] [--intervals 0.005 0.001 0.0002]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from report import write_report

RESULTS = Path(__file__).parent / "results"


def _adds(x: torch.Tensor, calls: int) -> torch.Tensor:
    for _ in range(calls):
        x = x + 1
    return x


def _timed(work: Callable[[], object], reps: int, beside_python: bool) -> float:
    """Median milliseconds of ``work``, alone or while another thread runs Python."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, name="python-loop")
    if beside_python:
        spinner.start()
    times = []
    try:
        for _ in range(reps):
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
    finally:
        stop.set()
        if beside_python:
            spinner.join()
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="torch calls per timed call")
    parser.add_argument("--numel", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--intervals", type=float, nargs="+", default=[0.005, 0.001, 0.0002], help="switch intervals, seconds")
    parser.add_argument("--out", type=Path, default=RESULTS / "gil_handover.json")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.reps < 1 or any(not i > 0 for i in args.intervals):
        parser.error("--calls and --reps must be >= 1 and every --intervals value > 0 (seconds)")
    x = torch.zeros(args.numel)
    scripted = torch.jit.script(_adds)
    scripted(x, args.calls)  # compiled before timing
    works = {"python calls": lambda: _adds(x, args.calls), "one TorchScript call": lambda: scripted(x, args.calls)}
    previous, threads = sys.getswitchinterval(), torch.get_num_threads()
    torch.set_num_threads(1)  # one core each: what is left to measure is the GIL
    results = []
    try:
        for interval in args.intervals:
            sys.setswitchinterval(interval)
            for name, work in works.items():
                alone, beside = _timed(work, args.reps, False), _timed(work, args.reps, True)
                results.append({"interval_ms": 1e3 * interval, "work": name, "alone_ms": alone, "beside_python_ms": beside})
    finally:
        sys.setswitchinterval(previous)
        torch.set_num_threads(threads)
    print(f"{'interval ms':>12}  {'work':<22}{'alone ms':>10}{'beside Python ms':>18}")
    for r in results:
        print(f"{r['interval_ms']:>12g}  {r['work']:<22}{r['alone_ms']:>10.2f}{r['beside_python_ms']:>18.2f}")
    return write_report("gil_handover", args, results)


if __name__ == "__main__":
    main()
