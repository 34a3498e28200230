"""The package's layout: folders in layers, its public face at the top, no figures in its text."""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from pathlib import Path

import pytest

import lightning_hotcache
from lightning_hotcache._compat import MOVED_MODULES

PACKAGE = Path(lightning_hotcache.__file__).parent
# Lowest first: a folder imports only from its own and the folders before it.
LAYERS = ["_ops", "kernels", "optim", "distributed", "cache", "planner", "embedding", "checkpoint", "callbacks", "strategies"]
PUBLIC_FACE = {"__init__.py", "__main__.py", "cli.py", "_compat.py"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def layer_of(module: str) -> int | None:
    """The layer of ``lightning_hotcache.<folder>...``; None for the top level (``_compat``: any layer uses it)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):  # function-level imports count too
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_hotcache"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("lightning_hotcache"))
    return found


def test_only_the_public_face_sits_at_the_top_level() -> None:
    assert {p.name for p in PACKAGE.glob("*.py")} == PUBLIC_FACE
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_runs_from_a_lower_folder_up(path: Path) -> None:
    relative = path.relative_to(PACKAGE)
    if len(relative.parts) == 1:
        return  # the public face imports any part
    own = LAYERS.index(relative.parts[0])
    upward = [m for m in imported_modules(path) if (layer := layer_of(m)) is not None and layer > own]
    assert not upward, f"{relative} ({LAYERS[own]}) imports from a higher folder: {sorted(upward)}"


# A machine, a ratio or a timing: "EPYC", "2-core", "1.15x", "3.2 ms", "~70 us", "H200".
FIGURES = re.compile(r"EPYC|Xeon|2-core|\d\.\d+x\b|\d ?(ms|us)\b|\b[HA]100\b|\bH200\b")


ZOO = [PACKAGE.parent / "models", PACKAGE.parent / "datamodules"]


@pytest.mark.parametrize(
    "path", [*modules(), *(p for folder in ZOO for p in sorted(folder.rglob("*.py")))], ids=lambda p: str(p.relative_to(PACKAGE.parent))
)
def test_the_package_quotes_no_machine_and_no_ratio(path: Path) -> None:
    # Figures belong in benchmarks/README.md; the code says what it does and why.
    hits = [f"{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1) if FIGURES.search(line)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_imports_the_moved_module_with_a_warning(old: str) -> None:
    with pytest.warns(DeprecationWarning, match=re.escape(MOVED_MODULES[old])):
        module = importlib.import_module(old) if old not in __import__("sys").modules else _reimport(old)
    assert module is importlib.import_module(MOVED_MODULES[old])


def _reimport(old: str):
    import sys

    del sys.modules[old]
    return importlib.import_module(old)


def test_the_package_itself_imports_no_old_path() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for path in modules():
            for module in imported_modules(path):
                assert module not in MOVED_MODULES, f"{path.relative_to(PACKAGE)} imports the old path {module}"


def test_every_environment_switch_is_read_through_the_registry() -> None:
    from lightning_hotcache._ops.switches import Switch

    variables = {s.variable for s in Switch}
    for path in modules():
        if path.name == "switches.py":
            continue
        text = path.read_text()
        assert "os.environ.get(\"LIGHTNING_HOTCACHE" not in text and "os.environ[\"LIGHTNING_HOTCACHE" not in text, path
        for found in re.findall(r"LIGHTNING_HOTCACHE_[A-Z_]+", text):
            assert found in variables, f"{path.relative_to(PACKAGE)} names {found}, which Switch does not list"


def test_a_switch_turns_its_mechanism_off_only_at_zero(monkeypatch) -> None:
    from lightning_hotcache._ops.switches import Switch, enabled, setting

    monkeypatch.delenv(Switch.READ_AHEAD.variable, raising=False)
    assert enabled(Switch.READ_AHEAD) and setting(Switch.READ_AHEAD) is None
    monkeypatch.setenv(Switch.READ_AHEAD.variable, "0")
    assert not enabled(Switch.READ_AHEAD)
    monkeypatch.setenv(Switch.COPY_THREADS.variable, "3")
    assert setting(Switch.COPY_THREADS) == "3"
