import sys, time, functools, collections, json
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
import torch
import lightning_hotcache.cache.device as dev
import lightning_hotcache.cache.directory as directory
import lightning_hotcache.cache.host as host
import lightning_hotcache.cache.slot_map as sm
import lightning_hotcache.embedding.staging as stg
T = collections.Counter(); N = collections.Counter()
def wrap(owner, name, label):
    f = getattr(owner, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: T[label] += time.perf_counter() - t; N[label] += 1
    setattr(owner, name, g)
for n in ["dirty_by_id", "vacate", "split_hits", "look_up_and_split_hits", "install", "unread", "eviction_scores", "count_reads", "let_go", "occupied", "window_victims", "scores_of"]:
    if hasattr(directory, n): wrap(directory, n, "dir." + n)
wrap(host, "put_rows", "host.put_rows")
wrap(dev, "put_rows", "dev.put_rows")
wrap(dev, "unique", "unique")
wrap(dev, "lowest_first", "lowest_first")
for m in ["_write_back", "_read_own", "release", "_evict", "_choose_victims", "_begin_acquire", "_finish_acquire", "mark_updated", "update_host_rows"]:
    wrap(dev.DeviceCache, m, m)
for m in ["stage", "announce"]:
    wrap(stg.Staging, m, "Staging." + m)
for cls in [c for c in vars(sm).values() if isinstance(c, type)]:
    for m in ["remove", "lookup", "assign"]:
        if m in cls.__dict__: wrap(cls, m, f"{cls.__name__}.{m}")
import cpu_throughput
import contextlib, io
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    cpu_throughput.main(sys.argv[1:])
print(json.dumps({"T": T, "N": N}))
