# One tree's median step time (auto, tiny DLRM, batches of 64, SamplesPerSecond attached, as every shipped config attaches it):
# python step_time.py <tree>; run alternately for two trees (git worktree add /tmp/before <commit>).
import sys, time, statistics, json
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import lightning.pytorch as pl, torch
from conftest import tiny_synthetic, cpu_trainer
from models import create_model
from lightning_hotcache import SamplesPerSecond
import lightning_hotcache
assert lightning_hotcache.__file__.startswith(sys.argv[1]), lightning_hotcache.__file__
pl.seed_everything(0)
dm = tiny_synthetic(scale=0.001, num_embeddings_cap=None, num_train_samples=64 * 600, num_val_samples=64, batch_size=64, embedding_dim=16)
model = create_model("dlrm", dm.tables, dm.num_dense_features)
stamps = []
class Stamp(pl.Callback):
    def on_train_batch_start(self, *a): stamps.append(time.perf_counter())
t = cpu_trainer(max_steps=600, callbacks=[Stamp(), SamplesPerSecond()], limit_val_batches=0)
t.fit(model, dm)
d = [b - a for a, b in zip(stamps[100:], stamps[101:])]
print(json.dumps({"tree": sys.argv[1], "step_ms_median": 1e3 * statistics.median(d), "step_ms_mean": 1e3 * statistics.mean(d)}))
