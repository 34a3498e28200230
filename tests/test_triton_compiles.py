"""Every launch of the Triton kernels a training step makes compiles for the GPUs they are for.

The other kernel tests run the kernels in Triton's interpreter, which accepts code the compiler
refuses. Here the launches real callers make (the device directory's admissions and both
tiers' lookups and steps, the host directory's Triton path, the zoo's tables under `auto`,
mixed dims, mean pooling, per-sample weights) are recorded in the interpreter, and each distinct
signature is compiled ahead of time for an H100/H200 (sm_90) and an A100 (sm_80) by Triton's
own compiler, in a fresh process with the interpreter off (`triton_ahead`). No GPU is needed.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

triton_tbe = pytest.importorskip("lightning_hotcache.kernels.triton_tbe")
if triton_tbe.triton is None or not triton_tbe.interpreted():
    pytest.skip("records launches in Triton's interpreter (a CPU under TRITON_INTERPRET=1)", allow_module_level=True)

from test_device_directory_collection import trained  # noqa: E402
from triton_ahead import int_type  # noqa: E402
from test_embedding_exactness import SUM_TABLES, UPSTREAM, make_plan, train_hotcache, zipf_batches  # noqa: E402

from lightning_hotcache import RowWiseOptimizerConfig  # noqa: E402
from lightning_hotcache._ops.switches import Switch  # noqa: E402

pytestmark = pytest.mark.kernels
TBE = "lightning_hotcache.kernels.triton_tbe"
KERNELS = [f"{TBE}:_pooled_kernel", f"{TBE}:_backward_chunks_kernel", f"{TBE}:_long_runs_kernel", f"{TBE}:_move_rows_kernel",
           "lightning_hotcache.kernels.set_kernels:_find_in_sets_kernel", "lightning_hotcache.kernels.set_kernels:_victim_ways_kernel"]  # fmt: skip
CAPABILITIES = [90, 80]
TESTS = Path(__file__).resolve().parent


def describe(value: Any) -> list:
    """A launch argument as `triton_ahead` takes it."""
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype).removeprefix("torch.")]
    if value is None:
        return ["none"]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    if isinstance(value, float):
        return ["float", value]
    raise TypeError(f"a launch argument of type {type(value).__name__}")


class Recorded:
    """A kernel that, launched as ``kernel[grid](*args, **kwargs)``, notes each distinct
    signature into ``seen`` (runtime ints by the Triton type they get, so that sizes and strides
    do not make every launch distinct; constexprs by their values) and runs the kernel."""

    def __init__(self, kernel: Any, name: str, seen: dict[str, tuple[str, dict[str, list]]]) -> None:
        self.kernel, self.name, self.seen = kernel, name, seen
        parameters = inspect.signature(kernel.fn).parameters.items()  # the interpreter's kernel keeps its function
        self.constexprs = {name for name, parameter in parameters if "constexpr" in str(parameter.annotation)}

    def __getitem__(self, grid: Any):
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            arguments = {name: describe(value) for name, value in zip(self.kernel.arg_names, args)}
            arguments.update({name: describe(value) for name, value in kwargs.items()})
            typed = {n: d if n in self.constexprs else _typed(d) for n, d in arguments.items()}
            key = json.dumps([self.name, typed], sort_keys=True)
            self.seen.setdefault(key, (self.name, arguments))
            return launch(*args, **kwargs)

        return run


def _typed(description: list) -> list:
    if description[0] == "int" and description[1] != 1:
        return ["int", int_type(description[1])]
    if description[0] == "float":
        return ["float"]
    return description


@pytest.fixture
def launches(monkeypatch) -> dict[str, tuple[str, dict[str, list]]]:
    seen: dict[str, tuple[str, dict[str, list]]] = {}
    for name in KERNELS:
        module, function = name.split(":")
        monkeypatch.setattr(f"{module}.{function}", Recorded(getattr(importlib.import_module(module), function), name, seen))
    return seen


def compiled_ahead(launches: list[tuple[str, dict[str, list]]], capabilities: list[int]) -> list[str]:
    """`triton_ahead.compile_launches` in a fresh process with the interpreter off."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(TESTS / "triton_ahead.py"), *map(str, capabilities)],
        input=json.dumps(launches), capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_kernel_launch_of_a_training_step_compiles_for_the_gpus(launches, monkeypatch) -> None:
    from test_triton_tbe import _zoo_fit

    monkeypatch.setenv(Switch.DEVICE_DIRECTORY.variable, "1")
    monkeypatch.setenv(Switch.SET_KERNELS.variable, "1")  # as on CUDA
    trained("rowwise_adagrad", "10%", "lookahead", 2, steps=2)  # the device directory: both tiers, admissions, mean bags
    batches = zipf_batches(steps=2, weighted=True, seed=3)
    plan = make_plan(batches, None, 2, "lfu", tables=SUM_TABLES)
    for directory in ("1", "0"):  # weighted, on the device directory (both tiers), then on the host directory (slots)
        monkeypatch.setenv(Switch.DEVICE_DIRECTORY.variable, directory)
        for optimizer in ("sgd", "adam"):
            config = RowWiseOptimizerConfig(name=optimizer, lr=0.05)
            train_hotcache(config, batches, UPSTREAM[:2], plan, "lfu", "memory", 2, tables=SUM_TABLES, weighted=True, kernel="triton")
    _zoo_fit("dlrm", {"name": "rowwise_adagrad", "lr": 0.05}, True, monkeypatch)  # the zoo's tables under `auto`

    recorded = list(launches.values())
    assert {name for name, _ in recorded} == set(KERNELS)
    steps = {(a["RULE"][1], a["TWO_TIERS"][1]) for name, a in recorded if name.endswith(":_backward_chunks_kernel")}
    assert steps == {(rule, tiers) for rule in range(3) for tiers in (True, False)}  # every rule on one tier and on two
    tiers = {arguments["TWO_TIERS"][1] for name, arguments in recorded if "TWO_TIERS" in arguments}
    weighted = {arguments["HAS_WEIGHTS"][1] for name, arguments in recorded if name.endswith(":_pooled_kernel")}
    windows = {arguments["LOOKAHEAD"][1] for name, arguments in recorded if name.endswith(":_victim_ways_kernel")}
    assert tiers == {True, False} and weighted == {True, False} and windows == {True, False}
    assert compiled_ahead(recorded, CAPABILITIES) == []


def test_a_launch_the_compiler_refuses_is_reported() -> None:
    """What the check above relies on: a launch that cannot compile comes back as a failure
    (here `_move_rows_kernel` with a float stride, which a pointer cannot be offset by)."""
    slots = torch.zeros(4, 8)
    arguments = {
        "slots_array": describe(slots), "host_array": describe(slots), "slots": describe(torch.zeros(2, dtype=torch.int64)),
        "write_rows": describe(torch.zeros(2, dtype=torch.int64)), "fill_rows": describe(torch.zeros(2, dtype=torch.int64)),
        "count": describe(2), "width": describe(8), "slot_stride": describe(8), "host_stride": describe(8),
        "ROWS": describe(8), "BLOCK": describe(16),
    }  # fmt: skip
    good, bad = arguments, {**arguments, "slot_stride": describe(8.0)}
    move_rows = f"{TBE}:_move_rows_kernel"
    failures = compiled_ahead([(move_rows, good), (move_rows, bad)], [90])
    assert len(failures) == 1 and failures[0].startswith(f"{move_rows} for sm_90"), failures
