import sys, time, statistics, os
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main")
import datamodules.synthetic as syn
import lightning_hotcache.strategy as st
T = {"gen": [], "stage": [], "iter": []}
og = syn._SyntheticSplit.batch
def g(self, *a, **k):
    t = time.perf_counter(); o = og(self, *a, **k); T["gen"].append(time.perf_counter() - t); return o
syn._SyntheticSplit.batch = g
os_ = st._PrefetchingLoader._stage
def s(self, *a, **k):
    t = time.perf_counter(); c = time.thread_time(); o = os_(self, *a, **k); T["stage"].append((time.perf_counter() - t, time.thread_time() - c)); return o
st._PrefetchingLoader._stage = s
oi = st._PrefetchingLoader.__iter__
T["next"] = []
def it(self):
    g = oi(self)
    while True:
        t = time.perf_counter()
        try: x = next(g)
        except StopIteration: return
        T["next"].append(time.perf_counter() - t)
        yield x
st._PrefetchingLoader.__iter__ = it
import cpu_throughput, io, contextlib, json
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    cpu_throughput.main(["--job", sys.argv[1], "--steps", "400", "--warmup", "200"])
r = json.loads(buf.getvalue().strip().splitlines()[-1])
med = lambda xs: 1e3 * statistics.median(xs[250:])
print(os.environ.get("HC_OVERLAP"), f"{r['samples_per_s']:.0f}/s gen {med(T['gen']):.2f} stage wall {med([a for a,b in T['stage']]):.2f} cpu {med([b for a,b in T['stage']]):.2f} next {med(T['next']):.2f} step {2048/r['samples_per_s']*1e3 - med(T['next']):.2f}", file=sys.stderr)
