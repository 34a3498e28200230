# One tree's median step time (a tiny DLRM, batches of 64, SamplesPerSecond attached, as every
# shipped config attaches it; on a CPU a step is mostly its Python, as a GPU step bound by its host):
#   python step_time.py <tree> [auto|hotcache]
# run alternately for two trees (git worktree add /tmp/before <commit>).
import json
import statistics
import sys
import time

sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import lightning.pytorch as pl  # noqa: E402
from conftest import cpu_trainer, tiny_synthetic  # noqa: E402

import lightning_hotcache  # noqa: E402
from lightning_hotcache import HotCacheStrategy, SamplesPerSecond  # noqa: E402
from models import create_model  # noqa: E402

assert lightning_hotcache.__file__.startswith(sys.argv[1]), lightning_hotcache.__file__
strategy = sys.argv[2] if len(sys.argv) > 2 else "auto"
pl.seed_everything(0)
dm = tiny_synthetic(scale=0.001, num_embeddings_cap=None, num_train_samples=64 * 600, num_val_samples=64, batch_size=64, embedding_dim=16)
model = create_model("dlrm", dm.tables, dm.num_dense_features)
stamps = []


class Stamp(pl.Callback):
    def on_train_batch_start(self, *args):
        stamps.append(time.perf_counter())


chosen = HotCacheStrategy(device_budget=0.1, profile_batches=4) if strategy == "hotcache" else "auto"
trainer = cpu_trainer(strategy=chosen, max_steps=600, callbacks=[Stamp(), SamplesPerSecond()], limit_val_batches=0)
trainer.fit(model, dm)
steps = [b - a for a, b in zip(stamps[100:], stamps[101:])]
print(json.dumps({"tree": sys.argv[1], "strategy": strategy, "step_ms_median": 1e3 * statistics.median(steps), "step_ms_mean": 1e3 * statistics.mean(steps)}))
