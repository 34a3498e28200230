"""tests/interpreter_shims.py: the interpreter's scan and patching, replaced for speed, still work as Triton's do."""

from __future__ import annotations

import pytest
import torch

triton_tbe = pytest.importorskip("lightning_hotcache.kernels.triton_tbe")
if triton_tbe.triton is None or not triton_tbe.interpreted():
    pytest.skip("the shims replace loops of the interpreter (a CPU under TRITON_INTERPRET=1)", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from interpreter_shims import generic_scan  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

pytestmark = pytest.mark.kernels


@triton.jit
def _then(a_mul, a_add, b_mul, b_add):
    """``x -> a_mul * x + a_add`` followed by ``x -> b_mul * x + b_add``: associative, not commutative."""
    return a_mul * b_mul, a_add * b_mul + b_add


@triton.jit
def _scan_kernel(mul, add, out_mul, out_add, AXIS: tl.constexpr, REVERSE: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    at = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    m, a = tl.associative_scan((tl.load(mul + at), tl.load(add + at)), AXIS, _then, reverse=REVERSE)
    tl.store(out_mul + at, m)
    tl.store(out_add + at, a)


def folded(mul: torch.Tensor, add: torch.Tensor, axis: int, reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The inclusive scan of `_then` as a left fold, element by element."""
    mul, add = (t.movedim(axis, 0).clone() for t in (mul, add))
    order = range(mul.shape[0] - 1, -1, -1) if reverse else range(mul.shape[0])
    previous = None
    for i in order:
        if previous is not None:
            mul[i], add[i] = mul[previous] * mul[i], add[previous] * mul[i] + add[i]
        previous = i
    return mul.movedim(0, axis), add.movedim(0, axis)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("axis", [0, 1])
def test_the_replaced_scan_equals_a_fold_of_the_combine_function(axis: int, reverse: bool) -> None:
    assert interpreter.ScanOps.generic_scan is generic_scan  # installed by conftest
    generator = torch.Generator().manual_seed(axis + 2 * reverse)
    rows, cols = 8, 32
    mul = torch.randint(-1, 2, (rows, cols), generator=generator, dtype=torch.int64) * 2 + 1  # -1, 1 or 3: no zeros
    add = torch.randint(-5, 6, (rows, cols), generator=generator, dtype=torch.int64)
    out_mul, out_add = torch.empty_like(mul), torch.empty_like(add)
    _scan_kernel[(1,)](mul, add, out_mul, out_add, AXIS=axis, REVERSE=reverse, R=rows, C=cols)
    expected_mul, expected_add = folded(mul, add, axis, reverse)
    assert torch.equal(out_mul, expected_mul) and torch.equal(out_add, expected_add)


@triton.jit
def _doubled(x):
    return x * 2


@triton.jit
def _helper_kernel(src, dst, N: tl.constexpr):
    at = tl.arange(0, N)
    tl.store(dst + at, _doubled(tl.load(src + at)) + tl.sum(tl.load(src + at), 0))


def test_launches_and_their_helpers_run_wrapped_and_leave_the_language_as_it_was() -> None:
    assert interpreter._patch_builtin.__module__ == "interpreter_shims"  # installed by conftest
    load, tensor_add = tl.load, tl.tensor.__add__
    src = torch.arange(8, dtype=torch.float32)
    for _ in range(2):  # the second launch wraps what the first listed
        dst = torch.empty_like(src)
        _helper_kernel[(1,)](src, dst, N=8)
        assert torch.equal(dst, src * 2 + src.sum())
        assert tl.load is load and tl.tensor.__add__ is tensor_add
