import torch, time, statistics, sys, concurrent.futures, ctypes
from pathlib import Path
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
x = torch.randn(2048, 512)
table = torch.randn(2_000_000, 16)
mode = sys.argv[1]
gomp = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libgomp.so.1"))
def init():
    if mode == "thread_omp1":
        torch.zeros(1).add_(1)  # ATen sets this thread's OpenMP threads on its first parallel op
        table[:10].sum()
        gomp.omp_set_num_threads(1)
ex = concurrent.futures.ThreadPoolExecutor(1, initializer=init)
def side():
    idx = torch.randint(0, len(table), (200_000,))
    return table.index_select(0, idx).sum()
ts = []
for i in range(200):
    if mode.startswith("thread"): ex.submit(side).result()
    elif mode == "inline": side()
    t = time.perf_counter()
    for _ in range(3):
        loss = mlp(x).sum(); loss.backward()
    ts.append(time.perf_counter() - t)
print(mode, f"step {1e3*statistics.median(ts[30:]):.2f} ms")
