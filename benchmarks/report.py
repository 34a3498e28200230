"""What every benchmark writes: the machine, versions, settings and commit beside its results."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrec": _version("torchrec"),
        "fbgemm_gpu_cpu": _version("fbgemm-gpu-cpu"),
        "commit": commit or "unknown",
    }


def median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median ``samples_per_s`` (the upper middle of an even count), with
    every run's figure under ``rounds``: benchmarks repeat their jobs in rounds because this
    shared machine drifts between runs."""
    middle = sorted(runs, key=lambda r: r["samples_per_s"])[len(runs) // 2]
    return {**middle, "rounds": [r["samples_per_s"] for r in runs]}


def write_report(name: str, args: argparse.Namespace, results: Any, echo: bool = True, **settings: Any) -> dict[str, Any]:
    """Write ``args.out`` as JSON (machine, settings from ``args`` and ``settings``, results) and print it
    (unless ``echo`` is False, e.g. for a partial report written while a long benchmark runs)."""
    report = {
        "benchmark": name,
        "machine": machine(),
        "settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, **settings},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if echo:
        print(json.dumps(report))
    return report
