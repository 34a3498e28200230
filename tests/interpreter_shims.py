"""Two of Triton's interpreter's loops made faster, for the tests that run the kernels on a CPU.
Written here because the interpreter (Triton's own) has no faster mode; the kernels' code is the
one the GPU compiles, unchanged.

**The associative scan.** The interpreter (``TRITON_INTERPRET=1``) runs ``tl.associative_scan``
with a combine function of the kernel's own (the backward's sums within runs of one row) one
element at a time: a Python call of the combine function per element of the block. `install`
replaces that loop (``ScanOps.generic_scan``) with a Hillis-Steele scan: ``ceil(log2(n))`` calls
of the same combine function on whole shifted blocks. Only the association of the combine
function differs (a tree, as on a GPU, rather than a left fold): results are equal for any
associative combination, and float sums differ by rounding only.

**The language's patching.** Each launch, and each call of a ``@triton.jit`` helper inside one,
lists every member of ``triton.language`` (``inspect.getmembers``) to wrap its builtins for the
interpreter. `install` lists them once per module and wraps the same members, those not
already wrapped by the launch that encloses the call, as Triton does.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np


def _along(data: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    index = [slice(None)] * data.ndim
    index[axis] = slice(start, stop)
    return data[tuple(index)]


def _block_of(value: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """What the combine function returned (a block, or a constant) as an array of ``shape``."""
    data = value.handle.data if hasattr(value, "handle") else np.asarray(value)
    return np.broadcast_to(data, shape).astype(dtype)


def generic_scan(self: Any, input: Any) -> list:
    """``ScanOps.generic_scan``'s contract (an inclusive scan of the tuple ``input`` along
    ``self.axis``, forward: the caller flips for a reverse scan), by doubling strides."""
    dtypes = [arg.dtype for arg in input]
    acc = [np.array(arg.handle.data) for arg in input]
    n = acc[0].shape[self.axis]
    stride = 1
    while stride < n:
        # Blocks keep their power-of-two shape: each element combined with the one ``stride``
        # before it; the first ``stride`` (combined with themselves) keep their value.
        earlier = [self.to_tensor(np.concatenate([_along(a, self.axis, 0, stride), _along(a, self.axis, 0, n - stride)], axis=self.axis), dtype)
                   for a, dtype in zip(acc, dtypes)]  # fmt: skip
        later = [self.to_tensor(a, dtype) for a, dtype in zip(acc, dtypes)]
        combined = self.combine_fn.fn(*earlier, *later)
        combined = combined if isinstance(combined, tuple) else (combined,)
        acc = [np.concatenate([_along(a, self.axis, 0, stride), _along(_block_of(c, a.shape, a.dtype), self.axis, stride, n)], axis=self.axis)
               for a, c in zip(acc, combined)]  # fmt: skip
        stride *= 2
    return [self.to_tensor(a, dtype) for a, dtype in zip(acc, dtypes)]


def patching_builtins_listed_once(patch_attr: Callable[..., None], is_builtin: Callable[[Any], bool]) -> Callable[..., None]:
    """The interpreter's ``_patch_builtin(pkg, builder, scope)``, with ``pkg``'s builtins listed
    at its first call (when nothing is wrapped yet) rather than at every call."""
    listed: dict[Any, list[tuple[str, Any]]] = {}

    def patch_builtin(pkg: Any, builder: Any, scope: Any) -> None:
        if pkg not in listed:
            listed[pkg] = [(name, member) for name, member in inspect.getmembers(pkg) if is_builtin(member)]
        for name, member in listed[pkg]:
            if getattr(pkg, name, None) is member:  # else wrapped already, which Triton's own leaves as it is
                patch_attr(pkg, name, member, builder, scope)

    return patch_builtin


def install() -> None:
    """Replace what this Triton's interpreter has of the two (else keep Triton's own, slower but
    the same)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    scans = getattr(interpreter, "ScanOps", None)
    if scans is not None and hasattr(scans, "generic_scan"):
        scans.generic_scan = generic_scan
    if all(hasattr(interpreter, name) for name in ("_patch_builtin", "_patch_attr")) and hasattr(tl.core, "is_builtin"):
        interpreter._patch_builtin = patching_builtins_listed_once(interpreter._patch_attr, tl.core.is_builtin)
