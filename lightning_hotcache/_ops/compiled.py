"""Host loops compiled by numba to run without the GIL, for what staging does on its threads.

hotcache stages batches on threads beside the training loop, which on a GPU host runs Python
for most of a step. Each torch call a staging thread makes hands the GIL over and must take it
back, which beside a thread running Python means waiting for that thread to give it up,
far longer than the call's own work (`benchmarks/staging.py --beside-python`). A loop compiled
with ``nogil=True`` is one call that holds no GIL while it runs, and passes over a batch's ids
once where torch ops pass once per op. Written as loops over numpy views of the host tensors
(`Tensor.numpy()` shares memory).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

F = TypeVar("F", bound=Callable[..., object])


def without_gil(function: F) -> F:
    """``function`` compiled to run without the GIL, at its first call. Cached on disk (next to
    its file, or in the user's cache directory), so that a machine compiles it once, not every
    process; where neither is writable numba refuses to cache, and each process compiles."""
    try:
        return numba.njit(nogil=True, cache=True)(function)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(nogil=True)(function)


@intrinsic
def prefetch(typingctx, array, index):  # type: ignore[no-untyped-def]
    """``prefetch(array, index)`` in a compiled loop: start loading the cache line of
    ``array[index]`` (1-D) without waiting for it, so that a loop over random places, each
    a cache miss, has several loads in flight instead of one. numba has no prefetch of its own;
    this emits LLVM's ``llvm.prefetch`` (a hint: it reads and changes no value)."""
    if not isinstance(array, types.Array) or array.ndim != 1 or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        address = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]], wraparound=False, boundscheck=False)
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        hint = ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32])
        function = cgutils.get_or_insert_function(builder.module, hint, "llvm.prefetch.p0i8")
        # Read (0), keep in every cache level (3), data (1).
        builder.call(function, [builder.bitcast(address, byte_pointer), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen
