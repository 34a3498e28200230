"""What a row read and stepped in place in host memory costs the Triton kernels, against a row
in device memory, and whether a memory-mapped table file can be mapped for them.

The device directory serves a miss whose set has no free way from its host row in place (the
forward reads it, the backward steps it where it lives), and a collection keeps its host rows
page-locked and mapped into the device's address space (`cache.host_mapping`). This times the
same Triton forward + row-wise Adagrad backward of one stack, every location a host row, with the
rows in three places:

- ``device``: the rows in device memory (the cache's slots: the reference);
- ``host memory``: an anonymous host array, registered (``host_storage="memory"``);
- ``host file``: a memory-mapped file, registered (what ``host_storage=<directory>`` would need:
  whether the driver registers a file mapping, and how much of it is then resident).

Per place: the median milliseconds of a forward and of a backward, the rows per second they
serve, the seconds the registration took and the host memory resident after it. Calls take
turns place by place, so drift hits all alike. On a CPU it runs only under
``TRITON_INTERPRET=1``, where nothing is registered (a check that the script works, not a speed).

    python benchmarks/host_rows_in_place.py [--tables 26] [--rows-per-table 100000] [--dim 128] [--batch-size 8192] [--calls 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from report import write_report
from triton_tbe import synchronize

from lightning_hotcache.cache.host_mapping import HostMappingError, map_for_devices
from lightning_hotcache.kernels import triton_tbe

RESULTS = Path(__file__).parent / "results"
PLACES = ("device", "host memory", "host file")


def _resident_gib() -> float:
    """This process's resident memory (anonymous and file pages), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _registered(array: torch.Tensor, device: torch.device) -> dict:
    """Map ``array`` for the kernels where the device is CUDA: whether the driver took it, how
    long it took and the resident memory after."""
    if device.type != "cuda":
        return {"registered": False, "why": "not on CUDA: the interpreter reads host memory as it is"}
    started = time.perf_counter()
    try:
        map_for_devices(array)
    except HostMappingError as error:
        return {"registered": False, "why": str(error)}
    return {"registered": True, "register_s": time.perf_counter() - started, "resident_gib_after": _resident_gib()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows-per-table", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per place")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS / "host_rows_in_place.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    why = triton_tbe.why_unavailable(device)
    if why is not None:
        raise SystemExit(f"host_rows_in_place.py: {why}.")
    rows, dim = args.tables * args.rows_per_table, args.dim
    initial = torch.randn(rows, dim, generator=torch.Generator().manual_seed(0)) * 0.01
    folder = tempfile.TemporaryDirectory(prefix="host_rows_in_place-")
    weights, momenta, setup = {}, {}, {}
    weights["device"], momenta["device"] = initial.to(device), torch.zeros(rows, device=device)
    weights["host memory"], momenta["host memory"] = initial.clone(), torch.zeros(rows)
    on_file = np.memmap(Path(folder.name) / "rows.bin", dtype=np.float32, mode="w+", shape=(rows, dim))
    on_file[:] = initial.numpy()
    on_file.flush()
    weights["host file"], momenta["host file"] = torch.from_numpy(on_file), torch.zeros(rows)
    for place in PLACES[1:]:
        setup[place] = _registered(weights[place], device)
        if setup[place]["registered"]:  # the rows' state with them, where the driver took the rows
            map_for_devices(momenta[place])
    placed = [p for p in PLACES if p == "device" or setup[p]["registered"] or device.type != "cuda"]
    slots = torch.zeros(1, dim, device=device)  # the slots no location names: every row is read where it lives
    slot_momenta = torch.zeros(1, device=device)
    firsts = torch.arange(args.tables, device=device).repeat_interleave(args.batch_size) * args.rows_per_table
    offsets = torch.arange(args.tables * args.batch_size + 1, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    times: dict[str, list[float]] = {f"{place} {part}": [] for place in placed for part in ("forward", "backward")}
    for call in range(args.calls + 3):  # the first calls compile
        # Zipf-like ids, as in CTR data; each value's location is its host row.
        ids = (torch.rand(args.tables * args.batch_size, device=device, generator=gen) ** 3 * args.rows_per_table).long() + firsts
        grad = torch.randn(args.tables * args.batch_size, dim, device=device, generator=gen)
        for place in placed:
            locations = triton_tbe.location_of_host_row(ids)
            synchronize(device)
            started = time.perf_counter()
            triton_tbe.pooled(slots, locations, offsets, host_weight=weights[place])
            synchronize(device)
            forward = time.perf_counter()
            triton_tbe.backward_step(slots, grad, locations, offsets, "rowwise_adagrad", 0.01, 1e-8, {"momentum": slot_momenta},
                                     host_weight=weights[place], host_state={"momentum": momenta[place]})  # fmt: skip
            synchronize(device)
            if call >= 3:
                times[f"{place} forward"].append(forward - started)
                times[f"{place} backward"].append(time.perf_counter() - forward)
    # Every place stepped the same rows alike.
    difference = max(float((weights[p].to(device) - weights["device"]).abs().max()) for p in placed)
    values = args.tables * args.batch_size
    results = {}
    for place in placed:
        forward, backward = (statistics.median(times[f"{place} {part}"]) * 1e3 for part in ("forward", "backward"))
        results[place] = {"forward_ms": forward, "backward_ms": backward, "rows_per_s_forward": values / forward * 1e3,
                          **setup.get(place, {})}  # fmt: skip
    reference = results["device"]["forward_ms"] + results["device"]["backward_ms"]
    print(f"{'rows in':<12} {'forward ms':>11} {'backward ms':>12} {'x device':>9} {'register s':>11} {'resident GiB':>13}   "
          f"({args.tables} tables x {args.rows_per_table:,} rows, dim {dim}, batch {args.batch_size}, {device})")  # fmt: skip
    for place, r in results.items():
        r["over_device"] = (r["forward_ms"] + r["backward_ms"]) / reference
        register = f"{r['register_s']:11.2f}" if "register_s" in r else f"{'-':>11}"
        resident = f"{r['resident_gib_after']:13.2f}" if "resident_gib_after" in r else f"{'-':>13}"
        print(f"{place:<12} {r['forward_ms']:11.3f} {r['backward_ms']:12.3f} {r['over_device']:9.2f} {register} {resident}")
    for place in PLACES[1:]:
        if place not in placed:
            print(f"{place}: not registered ({setup[place]['why']})")
            results[place] = setup[place]
    print(f"largest difference of a row value between the places after {args.calls + 3} steps: {difference:.2e}")
    write_report("host_rows_in_place", args, results, interpreted=triton_tbe.interpreted(), max_abs_difference=difference)
    del weights, momenta, on_file
    folder.cleanup()


if __name__ == "__main__":
    main()
