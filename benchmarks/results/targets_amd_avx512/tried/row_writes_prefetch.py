import time, numpy as np, numba, torch
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from llvmlite import ir
import sys; sys.path.insert(0, "/work/main")
from lightning_hotcache.host_rows import _copy_rows
from lightning_hotcache.cache.host_arrays import new_host_array

@intrinsic
def prefetch_write(typingctx, array, row):
    if not isinstance(array, types.Array) or array.ndim != 2: return None
    def codegen(context, builder, signature, args):
        at = signature.args[0]
        view = context.make_array(at)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        addr = cgutils.get_item_pointer(context, builder, at, view, [args[1], zero], wraparound=False, boundscheck=False)
        bp = ir.IntType(8).as_pointer(); i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [bp, i32, i32, i32]), "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(addr, bp), i32(1), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.void(array, row), codegen

@numba.njit(nogil=True)
def copy_pf(target, at, rows, ahead):
    width = rows.shape[1]; n = len(at)
    for k in range(n):
        if k + ahead < n:
            prefetch_write(target, at[k + ahead])
        row = at[k]
        for j in range(width):
            target[row, j] = rows[k, j]

N = 33_762_577; dim = 16
table = new_host_array((N, dim), fill=0.0)
mom = new_host_array((N, 1), fill=0.0)
junk = np.zeros(64 << 20 // 8)
rng = np.random.default_rng(0)
res = {}
for trial in range(40):
    rows = rng.random((4000, dim), dtype=np.float32)
    for name, fn in [("plain", lambda at: _copy_rows(table.numpy(), at, rows)), ("pf16", lambda at: copy_pf(table.numpy(), at, rows, 16)), ("pf32", lambda at: copy_pf(table.numpy(), at, rows, 32)), ("pf64", lambda at: copy_pf(table.numpy(), at, rows, 64))]:
        for cold in (False, True):
            at = np.sort(rng.choice(N, 4000, replace=False)).astype(np.int64)
            if cold: junk += 1.0  # push the caches
            t = time.perf_counter(); fn(at); dt = time.perf_counter() - t
            if trial >= 5: res.setdefault((name, cold), []).append(dt * 1e3)
for k, v in sorted(res.items()):
    print(k, "median ms", round(float(np.median(v)), 3))
print("--- after a 2-thread matmul (OMP threads spinning)")
a = torch.randn(2048, 1024); b = torch.randn(1024, 1024)
res2 = {}
for trial in range(40):
    rows = rng.random((4000, dim), dtype=np.float32)
    for name in ("plain_after_mm", "plain_after_sleep"):
        at = np.sort(rng.choice(N, 4000, replace=False)).astype(np.int64)
        a @ b
        if name == "plain_after_sleep": time.sleep(0.005)
        t = time.perf_counter(); _copy_rows(table.numpy(), at, rows); dt = time.perf_counter() - t
        if trial >= 5: res2.setdefault(name, []).append(dt * 1e3)
for k, v in res2.items(): print(k, round(float(np.median(v)), 3))
