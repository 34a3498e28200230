#!/usr/bin/env bash
# On the lent GPU machine (no network, a short loan), from the repo root: `make gpu-check`.
# Three stages, each under a time limit of its own, so that one call fits the loan and a run
# cut off still returns what finished:
#   1. imports and a 2-step CUDA fit of the demo config, without its W&B logger (the image has no
#      wandb; seconds; limit 75 s);
#   2. a chosen subset of the CUDA tests (limit 3 minutes);
#   3. benchmarks/gpu.py at a size that finishes in under 4 minutes (limit 225 s): hotcache at 10% and 1%
#      against all tables in HBM (auto) and FAE's CPU-embedding baseline, one process.
# Each stage writes $OUT/stage<k>.log as it goes and appends "stage <k> <name>: rc <rc>,
# <seconds> s" to $OUT/stages.txt when it ends; gpu.json is copied to $OUT after stage 3.
# Without $OUT, benchmarks/results/gpu_check/ takes them.
#
# GPU_DRY_RUN=1 runs every stage here, on the CPU, with the project's .venv and tiny sizes,
# writing the same files (tests/test_gpu_benchmark.py runs it), so the script is known to
# work before a GPU machine is lent. The packages that machine's image lacks are hidden from
# the dry run (benchmarks/gpu_image/sitecustomize.py), so a stage that needs one fails here too.
#
# On the GPU machine the wheels of gpu_wheels/ (`make gpu-wheels` here) go into a --target
# folder on PYTHONPATH rather than a venv: that needs nothing but pip on the image, leaves its
# torch, lightning and numpy as they are, and with --no-index --no-deps pip never reaches for
# an index. The repo goes on PYTHONPATH too, not `pip install -e .` (pyproject asks for a torch
# the image lacks). Settings: GPU_PYTHON (python3), GPU_BENCH_ARGS (stage 3's gpu.py settings).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu_check}
mkdir -p "$OUT"
: > "$OUT/stages.txt"

if [ -n "${GPU_DRY_RUN:-}" ]; then
  PYTHON=.venv/bin/python
  ACCELERATOR=cpu
  BENCH_ARGS="--device cpu --scale 0.001 --steps 5 --rounds 1 --batch-size 64 --strategies auto cpu-lookup hotcache@0.1 hotcache@0.01"
  export PYTHONPATH="$PWD:$PWD/benchmarks/gpu_image"
else
  PYTHON=${GPU_PYTHON:-python3}
  ACCELERATOR=gpu
  BENCH_ARGS=${GPU_BENCH_ARGS:-"--scale 0.1 --steps 60 --rounds 1 --strategies auto cpu-lookup hotcache@0.1 hotcache@0.01"}
  rm -rf .gpu_site
  "$PYTHON" -m pip install --quiet --no-index --find-links gpu_wheels --no-deps --target .gpu_site -r benchmarks/requirements-gpu.txt \
    2>&1 | tee "$OUT/install.log"
  export PYTHONPATH="$PWD:$PWD/.gpu_site"
fi
export WANDB_MODE=offline

# stage K NAME SECONDS COMMAND...: run COMMAND under a time limit, log it, note how it ended.
stage() {
  local k=$1 name=$2 limit=$3
  shift 3
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/stage$k.log" 2>&1
  local rc=$?
  echo "stage $k $name: rc $rc, $((SECONDS - start)) s" | tee -a "$OUT/stages.txt"
  return $rc
}

stage 1 imports-and-2-step-fit 75 "$PYTHON" -c "
import sys, torch, torchrec, lightning_hotcache
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'torchrec', torchrec.__version__, flush=True)
from lightning_hotcache.cli import main
main(['fit', '-c', 'configs/dlrm_synthetic.yaml', '--trainer.accelerator=$ACCELERATOR', '--trainer.devices=1',
      '--trainer.fast_dev_run=2', '--data.init_args.num_train_samples=4096', '--trainer.logger=false'])
"
first=$?
# The GPU path's own checks first (kernel, budget, host syncs per step, pinned staging,
# resume, 2 GPUs where there are two; -rP keeps the sync count they print), then one model
# at every budget against auto, a checkpoint written on the GPU loading on the CPU, and the
# CPU-lookup baseline (skipped on a CPU: the dry run checks that they are found).
stage 2 cuda-tests 180 "$PYTHON" -m pytest -q -rP -m cuda tests/test_cuda.py -k "gpu_path or dlrm- or checkpoint_written_on_cuda or cpu_lookup"
second=$?
# shellcheck disable=SC2086  # the benchmark's settings, split as on a command line
stage 3 gpu-benchmark 225 "$PYTHON" benchmarks/gpu.py $BENCH_ARGS --out "$OUT/gpu.json"
third=$?
exit $((first || second || third))
