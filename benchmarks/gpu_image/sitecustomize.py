"""The GPU check's dry run as the GPU machine's image sees it: what that image lacks cannot be imported.

The GPU machine (no network) has Python with torch, lightning, torchmetrics, numpy, numba, triton
and pytest (`IMAGE`, with what they require), plus the wheels of benchmarks/requirements-gpu.txt that
travel with the repository. The project's .venv has more (wandb, recbole, matplotlib, ...): a
stage that imports one of them passes the dry run here and fails there (the first GPU run lost
its stage 1 to the demo config's WandbLogger). `benchmarks/gpu_check.sh` puts this folder on
PYTHONPATH for GPU_DRY_RUN=1, so Python runs this file at start-up and every import of a
package that the project's own requirements bring in, and that neither the image nor the wheel
set has, fails as it would there.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

IMAGE = ("torch", "lightning", "torchmetrics", "numpy", "numba", "triton", "pytest")
BENCHMARKS = Path(__file__).resolve().parents[1]


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _closure(roots: list[Requirement]) -> set[str]:
    """The distributions ``roots`` need, with their extras, as installed here (missing ones skipped)."""
    found: set[str] = set()
    todo = list(roots)
    while todo:
        requirement = todo.pop()
        name = _name(requirement.name)
        key = f"{name}[{','.join(sorted(requirement.extras))}]"
        if key in found:
            continue
        found.update({key, name})
        try:
            requires = metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            needed = Requirement(line)
            extras = requirement.extras or {""}
            if needed.marker is None or any(needed.marker.evaluate({"extra": extra}) for extra in extras):
                todo.append(needed)
    return {n for n in found if "[" not in n}


def hidden_distributions() -> set[str]:
    """What the project requires here that the GPU machine will not have."""
    wheels = [line.split("#")[0].strip() for line in (BENCHMARKS / "requirements-gpu.txt").read_text().splitlines()]
    there = _closure([Requirement(n) for n in IMAGE]) | {_name(Requirement(w).name) for w in wheels if w}
    # recbole: the Makefile installs it beside the project, with --no-deps, for its MovieLens data.
    ours = _closure([Requirement("lightning-hotcache[test]"), Requirement("recbole")]) - {"lightning-hotcache"}
    return ours - there


class _PathFinderWithout:
    """The interpreter's PathFinder, to which ``hidden`` top-level modules and distributions do
    not exist: an import fails, ``importlib.util.find_spec`` gives None and the metadata is not
    found, as where they are not installed (libraries probe all three)."""

    def __init__(self, modules: set[str], distributions: set[str]) -> None:
        self.modules, self.distributions = modules, distributions

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201 (the finder protocol)
        if fullname.partition(".")[0] in self.modules:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, path, target)

    def find_distributions(self, context=metadata.DistributionFinder.Context()):  # noqa: ANN001, ANN201, B008
        if context.name is not None and _name(context.name) in self.distributions:
            return iter(())
        found = importlib.machinery.PathFinder.find_distributions(context)
        return (d for d in found if _name(d.metadata["Name"]) not in self.distributions)

    def invalidate_caches(self) -> None:
        importlib.machinery.PathFinder.invalidate_caches()


def _hide() -> None:
    hidden = hidden_distributions()
    modules = {m for m, dists in metadata.packages_distributions().items() if all(_name(d) in hidden for d in dists)}
    sys.meta_path[:] = [
        _PathFinderWithout(modules, hidden) if finder is importlib.machinery.PathFinder else finder
        for finder in sys.meta_path
    ]


_hide()
