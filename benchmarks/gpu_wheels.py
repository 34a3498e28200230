"""The manifest of the wheels `make gpu-wheels` downloads for the lent GPU machine.

The machine takes the repository plus at most 64 MiB of untracked files, and the wheels
themselves are git-ignored, so their sizes and hashes are kept here, in
``benchmarks/gpu_wheels.json``: `make gpu-wheels` rewrites it after each download, and
``tests/test_gpu_benchmark.py`` checks that it names exactly the pins of
``requirements-gpu.txt`` and that wheels and repository together fit.

    python benchmarks/gpu_wheels.py gpu_wheels    # write the manifest of that folder
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

MANIFEST = Path(__file__).with_name("gpu_wheels.json")
REQUIREMENTS = Path(__file__).with_name("requirements-gpu.txt")
CARRY_LIMIT_BYTES = 64 * 2**20


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares it (``Typing_Inspect`` == ``typing-inspect``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line of requirements-gpu.txt."""
    lines = (line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines())
    return {canonical(name): version for name, version in (line.split("==") for line in lines if line)}


def wheel_pin(filename: str) -> tuple[str, str]:
    """``(name, version)`` of a wheel file name (``name-version-...whl``)."""
    name, version = filename.split("-")[:2]
    return canonical(name), version


def write(folder: Path) -> dict[str, dict[str, int | str]]:
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {folder}: run `make gpu-wheels`")
    manifest = {
        w.name: {"bytes": w.stat().st_size, "sha256": hashlib.sha256(w.read_bytes()).hexdigest()} for w in wheels
    }
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


if __name__ == "__main__":
    written = write(Path(sys.argv[1]))
    total = sum(int(entry["bytes"]) for entry in written.values())
    print(f"{MANIFEST.name}: {len(written)} wheels, {total / 2**20:.1f} MiB")
