"""The Triton table-batched embedding against what it replaces, per call: ``embedding_bag``'s
forward plus the PyTorch path's row step (each value's gradient row summed at its distinct row,
then gather-step-scatter), on one stack of tables of one width.

Both take the same batch (one-hot features, feature-major bags, as TorchRec's KJT) and the
same output gradient (ids drawn by a cube of uniforms over tables of equal size, or with
``--kaggle-scale`` by the synthetic data's power law over Criteo Kaggle's 26 tables, whose
smallest have 3 and 4 rows: runs of thousands of values on one row in a batch), and both step the rows they read with row-wise Adagrad; they take turns
call by call, so drift hits both alike. Reported: the median milliseconds of a forward, of a
backward with its row step, and of both, and the PyTorch path's time over Triton's (above 1:
Triton is faster). On CUDA it synchronizes around each timed part; on a CPU it runs only under
``TRITON_INTERPRET=1`` (a check that the script works, not a speed).

    python benchmarks/triton_tbe.py [--tables 26] [--rows-per-table 1000000] [--dim 128] [--batch-size 8192] [--calls 50]
    python benchmarks/triton_tbe.py --kaggle-scale 1.0 [--dim 128] [--batch-size 8192] [--calls 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from report import write_report

from datamodules.synthetic import KAGGLE_CARDINALITIES, zipf_ranks

from lightning_hotcache.kernels import triton_tbe
from lightning_hotcache.optim.rowwise import RowWiseOptimizerConfig, step_rows

RESULTS = Path(__file__).parent / "results"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work where it is a GPU (around each timed part)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pytorch_step(weight, momentum, indices, offsets, grad, config) -> None:
    """The PyTorch path's backward: each value's gradient row summed at its distinct row, then the rule."""
    lengths = offsets.diff()
    bag_of_value = torch.repeat_interleave(torch.arange(lengths.numel(), device=weight.device), lengths, output_size=indices.numel())
    rows, inverse = torch.unique(indices, return_inverse=True)
    summed = torch.zeros(rows.numel(), weight.shape[1], device=weight.device).index_add_(0, inverse, grad.index_select(0, bag_of_value))
    step_rows(config, weight, {"momentum": momentum}, rows, summed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows-per-table", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--kaggle-scale", type=float, default=None,
                        help="tables of Criteo Kaggle's sizes times this, ids by the synthetic data's power law (instead of --tables, --rows-per-table)")
    parser.add_argument("--zipf-exponent", type=float, default=1.05, help="the power law's exponent, with --kaggle-scale")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per path")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS / "triton_tbe.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    why = triton_tbe.why_unavailable(device)
    if why is not None:
        raise SystemExit(f"triton_tbe.py: {why}.")
    config = RowWiseOptimizerConfig(name="rowwise_adagrad", lr=0.01)
    if args.kaggle_scale is not None:
        table_rows = [max(1, round(n * args.kaggle_scale)) for n in KAGGLE_CARDINALITIES]
    else:
        table_rows = [args.rows_per_table] * args.tables
    rows, tables = sum(table_rows), len(table_rows)
    gen = torch.Generator(device=device).manual_seed(0)
    initial = torch.randn(rows, args.dim, device=device, generator=gen) * 0.01
    weights = {"triton": initial, "pytorch": initial.clone()}  # the same rows: their difference at the end is the paths'
    momenta = {path: torch.zeros(rows, 1, device=device) for path in ("triton", "pytorch")}
    starts = torch.tensor([0, *table_rows[:-1]], device=device).cumsum(0)
    firsts = starts.repeat_interleave(args.batch_size)
    offsets = torch.arange(tables * args.batch_size + 1, device=device)
    rng = np.random.default_rng(0)
    sizes = np.repeat(np.array(table_rows), args.batch_size)
    times: dict[str, list[float]] = {f"{path} {part}": [] for path in ("triton", "pytorch") for part in ("forward", "backward")}
    for call in range(args.calls + 3):  # the first calls compile
        if args.kaggle_scale is not None:  # the synthetic data's ids: a power law over each table
            ids = torch.from_numpy(zipf_ranks(rng.random(len(sizes)), sizes, args.zipf_exponent)).to(device)
        else:  # a few hot rows read by many samples, as in CTR data
            ids = (torch.rand(tables * args.batch_size, device=device, generator=gen) ** 3 * args.rows_per_table).long()
        indices = ids + firsts
        grad = torch.randn(tables * args.batch_size, args.dim, device=device, generator=gen)
        for path in ("triton", "pytorch"):
            synchronize(device)
            started = time.perf_counter()
            if path == "triton":
                triton_tbe.pooled(weights[path], indices, offsets)
            else:
                torch.nn.functional.embedding_bag(indices, weights[path], offsets, mode="sum", include_last_offset=True)
            synchronize(device)
            forward = time.perf_counter()
            if path == "triton":
                triton_tbe.backward_step(weights[path], grad, indices, offsets, "rowwise_adagrad", config.lr, config.eps,
                                         {"momentum": momenta[path]})
            else:
                pytorch_step(weights[path], momenta[path], indices, offsets, grad, config)
            synchronize(device)
            if call >= 3:
                times[f"{path} forward"].append(forward - started)
                times[f"{path} backward"].append(time.perf_counter() - forward)
    longest = int(torch.unique(indices, return_counts=True)[1].max())  # of the last batch: the most values of one row
    # Both stepped the same rows alike (the sums' order differs: float rounding apart).
    difference = float((weights["triton"] - weights["pytorch"]).abs().max())
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    results = {
        part: {"triton_ms": median[f"triton {part}"], "pytorch_ms": median[f"pytorch {part}"], "pytorch_over_triton": median[f"pytorch {part}"] / median[f"triton {part}"]}
        for part in ("forward", "backward")
    }
    both = {path: median[f"{path} forward"] + median[f"{path} backward"] for path in ("triton", "pytorch")}
    results["forward+backward"] = {"triton_ms": both["triton"], "pytorch_ms": both["pytorch"], "pytorch_over_triton": both["pytorch"] / both["triton"]}
    print(f"{'part':<18} {'triton ms':>10} {'pytorch ms':>11} {'pytorch/triton':>15}   ({tables} tables, {rows:,} rows, longest run {longest:,}, dim {args.dim}, batch {args.batch_size}, {device})")
    for part, r in results.items():
        print(f"{part:<18} {r['triton_ms']:10.3f} {r['pytorch_ms']:11.3f} {r['pytorch_over_triton']:15.2f}")
    print(f"largest difference of a row value between the paths after {args.calls + 3} steps: {difference:.2e}")
    write_report("triton_tbe", args, results, interpreted=triton_tbe.interpreted(), max_abs_difference=difference, longest_run=longest)


if __name__ == "__main__":
    main()
