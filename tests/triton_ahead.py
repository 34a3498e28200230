"""Triton kernels compiled ahead of time for a CUDA target, on a machine without a GPU.

Triton's compiler (front end, MLIR passes, LLVM, and the ``ptxas`` its package ships) needs no
device: given a kernel's argument types and constexpr values it produces the machine code a GPU
of the target's compute capability runs. The interpreter (``TRITON_INTERPRET=1``), which the
kernels' other tests run in, executes a kernel as Python over NumPy arrays and accepts code the
compiler refuses, so a kernel right in the interpreter can still fail at its first launch on a
GPU. This module must be imported with the interpreter off (a fresh process: Triton reads the
switch when a kernel is defined).

A launch is described by its kernel's name and, per argument, ``["tensor", dtype]``,
``["int", value]``, ``["float", value]``, ``["bool", value]`` or ``["none"]``; `signature_of`
types it as Triton's launcher does (`triton.runtime.jit`): an int is ``i32`` where it fits,
else ``i64``, and an int of 1 is specialized as a constant.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

_POINTER_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def int_type(value: int) -> str:
    """The Triton type of an int argument: ``i32`` where it fits, else ``i64`` (1 is specialized
    as a constant: see `signature_of`)."""
    return "i32" if -(2**31) <= value < 2**31 else "i64"


def signature_of(kernel: Any, arguments: dict[str, list]) -> tuple[dict[str, str], dict[str, Any]]:
    """Triton's ``signature`` and ``constexprs`` of a launch of ``kernel`` (a `JITFunction`)
    with ``arguments`` (its parameters' names to descriptions, as the module's docstring says)."""
    signature, constexprs = {}, {}
    for param in kernel.params:
        kind, *value = arguments[param.name]
        if param.is_constexpr or kind == "none" or (kind == "int" and value[0] == 1):
            signature[param.name] = "constexpr"
            constexprs[param.name] = None if kind == "none" else value[0]
        elif kind == "tensor":
            signature[param.name] = "*" + _POINTER_TYPES[value[0]]
        elif kind == "int":
            signature[param.name] = int_type(value[0])
        elif kind == "float":
            signature[param.name] = "fp32"
        elif kind == "bool":
            signature[param.name] = "i1"
        else:
            raise ValueError(f"argument {param.name} of {kernel.__name__}: no Triton type for {kind!r}")
    return signature, constexprs


def _compile(name: str, arguments: dict[str, list], capability: int) -> str | None:
    """Compile one launch for one compute capability; its error, or None."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, function = name.split(":")
    kernel = getattr(importlib.import_module(module), function)
    signature, constexprs = signature_of(kernel, arguments)
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", capability, 32))
    except Exception as error:  # the compiler's own errors have no common base class
        return f"{name} for sm_{capability} {signature} {constexprs}: {type(error).__name__}: {error}"
    return None if compiled.asm.get("cubin") else f"{name} for sm_{capability} {signature} {constexprs}: no machine code"


def compile_launches(launches: list[tuple[str, dict[str, list]]], capabilities: list[int]) -> list[str]:
    """Compile each launch (a kernel by its module's and its own name, ``module:kernel``, and its
    arguments) for CUDA GPUs of each compute capability (90: H100, H200; 80: A100), a process
    per core (each compile runs on one); the error of each one that does not compile, in order."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(name, arguments, capability) for name, arguments in launches for capability in capabilities]
    if not jobs:
        return []
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        errors = list(pool.map(_compile, *zip(*jobs)))
    return [error for error in errors if error is not None]


if __name__ == "__main__":  # launches as JSON on stdin, capabilities as arguments; failures as JSON on stdout
    print(json.dumps(compile_launches(json.load(sys.stdin), [int(c) for c in sys.argv[1:]])))
