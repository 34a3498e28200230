"""What every benchmark writes: the machine, versions, settings and commit beside its results."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    """The processor's name as the kernel reports it (``platform.processor()`` is often empty)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """Where a result was measured: ratios between kernels move with the processor (a run on an
    AVX-512 machine and one on an AVX2 machine are not one series), so the CPU model and the
    SIMD level PyTorch dispatches to are recorded with the versions."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "cpu": _cpu_model(),
        "arch": platform.machine(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrec": _version("torchrec"),
        "fbgemm_gpu_cpu": _version("fbgemm-gpu-cpu"),
        "commit": commit or "unknown",
        **_gpu(),
    }


def _gpu() -> dict[str, Any]:
    """The GPU a run could use, its driver and torch's CUDA (nothing on a machine without one)."""
    if not torch.cuda.is_available():
        return {}
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(torch.cuda.current_device())]
        driver = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return {"gpu": torch.cuda.get_device_name(), "gpu_memory_bytes": memory, "gpu_driver": driver, "cuda": torch.version.cuda}


def median_round(runs: list[dict[str, Any]], key: str = "samples_per_s") -> dict[str, Any]:
    """The run with the median ``key`` figure (the upper middle of an even count), with every
    run's figure under ``rounds``: benchmarks repeat their jobs in rounds because this shared
    machine drifts between runs."""
    middle = sorted(runs, key=lambda r: r[key])[len(runs) // 2]
    return {**middle, "rounds": [r[key] for r in runs]}


def job_env() -> dict[str, str]:
    """The environment a job's process runs in: a job's process group is its own, and a
    rendezvous this process set up (Lightning exports its address and port) would be taken
    already."""
    return {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}


def job_result(name: str, stdout: str) -> dict[str, Any]:
    """The JSON line job ``name`` printed last (echoed, so a long run's log keeps every
    finished job)."""
    line = stdout.strip().splitlines()[-1]
    print(f"{name}: {line}", flush=True)
    return json.loads(line)


def job_in_process(script: str | Path, settings: Sequence[str], name: str, wrapper: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``script settings --job name`` in a process of its own (under ``wrapper``, a command
    prefix) and return its `job_result`."""
    command = [*wrapper, sys.executable, str(script), *settings, "--job", name]
    done = subprocess.run(command, capture_output=True, text=True, env=job_env())
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return job_result(name, done.stdout)


def rounds_of_jobs(
    script: str | Path,
    settings: Sequence[str],
    names: Sequence[str],
    rounds: int,
    wrapper: Callable[[str], Sequence[str]] = lambda name: (),
    after_each: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The median round (`median_round`) of each job of ``names``, run ``rounds`` times over
    all of them, every run a process of its own (`job_in_process`): a run's peak memory is then
    its own, memory one fit leaves behind cannot starve the next, and slow drift of the machine
    hits every job alike. Round ``r`` starts at job ``r mod len(names)`` (a rotation): a job's
    place in the round changes from round to round, so whatever its place costs (following
    the largest process, a warm or cold page cache) is spread over every job instead of
    handed to the same one each time. Each result's ``rounds`` are in round order, so
    `add_ratios` can pair them with another job's. ``after_each`` gets the results so far (a
    partial report, so that a run cut off by a time limit keeps what finished): after every job
    of the first round, then after each whole round, so that every job it gets has as many
    rounds as the others (what `add_ratios` pairs)."""
    runs: list[dict[str, dict[str, Any]]] = []
    for r in range(rounds):
        shift = r % len(names)
        runs.append({})
        for name in [*names[shift:], *names[:shift]]:
            runs[-1][name] = job_in_process(script, settings, name, wrapper(name))
            if after_each is not None and (r == 0 or len(runs[-1]) == len(names)):
                after_each({n: median_round([run[n] for run in runs if n in run]) for n in names if n in runs[-1]})
    return {name: median_round([run[name] for run in runs]) for name in names}


def add_ratios(results: dict[str, dict[str, Any]], baselines: Sequence[str]) -> None:
    """``x_<baseline>``: each result's samples/s over the baseline's (NaN where it did not run),
    median rounds against each other; and ``x_<baseline>_paired``, the median over rounds of
    the ratio within a round (`rounds_of_jobs`' results), which the machine's drift between
    rounds does not move."""
    for r in results.values():
        for baseline in baselines:
            base = results.get(baseline)
            r[f"x_{baseline}"] = r["samples_per_s"] / base["samples_per_s"] if base else float("nan")
            if base and "rounds" in r and "rounds" in base:
                r[f"x_{baseline}_paired"] = statistics.median(a / b for a, b in zip(r["rounds"], base["rounds"], strict=True))


def _relative(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it (results are committed: an
    absolute path would name the machine's folders)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def write_report(name: str, args: argparse.Namespace, results: Any, echo: bool = True, **settings: Any) -> dict[str, Any]:
    """Write ``args.out`` as JSON (machine, settings from ``args`` and ``settings``, results) and print it
    (unless ``echo`` is False, e.g. for a partial report written while a long benchmark runs)."""
    report = {
        "benchmark": name,
        "machine": machine(),
        "settings": {**{k: _relative(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, **settings},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if echo:
        print(json.dumps(report))
    return report
