"""A faster associative scan for Triton's interpreter, for the tests that run the kernels on a CPU.

The interpreter (``TRITON_INTERPRET=1``) runs ``tl.associative_scan`` with a combine function of
the kernel's own (the backward's sums within runs of one row) one element at a time: a Python
call of the combine function per element of the block, which made it most of the time the
kernels' tests spent. `install` replaces that loop (``ScanOps.generic_scan``) with a
Hillis-Steele scan: ``ceil(log2(n))`` calls of the same combine function on whole shifted
blocks. Written here because Triton's interpreter has no vectorized scan of its own. Only the
association of the combine function differs (a tree, as on a GPU, rather than a left fold);
results are equal for any associative combination, and float sums differ by rounding only.
"""

from __future__ import annotations

from typing import Any

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


def install() -> bool:
    """Replace the interpreter's element-by-element scan where this Triton has it (else keep
    Triton's own, which is slower but the same); whether it was replaced."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    scans = getattr(interpreter, "ScanOps", None)
    if scans is None or not hasattr(scans, "generic_scan"):
        return False
    scans.generic_scan = generic_scan
    return True
