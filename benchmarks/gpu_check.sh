#!/usr/bin/env bash
# On the lent GPU machine (no network, a short loan), from the repo root: `make gpu-check`.
# Five stages under a time limit (560 s in all), so that one call fits the loan and a run cut
# off still returns what finished. Each stage has a share of it (below); a stage may run until
# the time left is what the later stages it runs are owed, so time an earlier stage left unused,
# and the shares of stages not run, go to the stages that need them (on a slower H200 host the
# fixed limits cut stage 3 off before its last run). A run at scale 1.0 spends ~45 s before its
# first step (imports, 17 GB of tables initialized into their tiers, profiling; gpu.py records
# each run's `setup_s`), so stages 3 and 4 get most of the time (on an H100 at f229678 stage 3
# needed 150 s, stage 4 more than 90):
#   1. imports and a 2-step CUDA fit of the demo config, without its W&B logger (the image has no
#      wandb; 21 s on an H100; share 30 s);
#   2. a chosen subset of the CUDA tests, those no GPU has run yet first (58-76 s on an H200 for the 22
#      of 861bd68; share 140 s);
#   3. benchmarks/gpu.py at the Criteo Kaggle tables (scale 1.0; steps 80-120 timed, once a 10%
#      cache is full): hotcache at 10% and at 1% (LFU, the caches' directory in GPU memory, the
#      step in one CUDA graph), at 1% eagerly (+eager) and with the directory on the host
#      (+hostdir, the prefetch thread staging), against all tables in GPU memory (auto: its step
#      in one CUDA graph, and eagerly as auto+eager; last, where time is left, under bf16-mixed
#      and with fp32 matmuls, then hotcache at 1% under lookahead, its window in GPU memory), one process, the batches drawn before fit
#      and served from memory (gpu.py's --data; share 220 s, a partial gpu.json after each run: four runs took 160 s on an H200 at
#      861bd68), with the prefetch thread's pieces timed (benchmarks/pieces.py);
#   4. tables larger than the GPU: the same tables with each run's GPU memory capped at 8 GiB,
#      where auto cannot hold them and hotcache at 10% and 1% train (two runs took 86-96 s; share 110 s);
#   5. where a step's time goes: the host's row copies first (benchmarks/row_copy.py: a 1%
#      cache's write-backs on 1, 2, 4 and 8 threads, ~10 s; its JSON goes to the log), the
#      Triton TBE against embedding_bag + the PyTorch row step (benchmarks/triton_tbe.py), then
#      torch.profiler's key averages of auto and hotcache at 10% and 1% at 0.1x the tables
#      (32-42 s on an H200; share 60 s with the two scripts after it): at 1% the H100's steps waited 55 ms each for
#      staging, whose ops (the prefetch thread's too) this shows; last, rows read and stepped
#      in place from host memory and from a registered file mapping (benchmarks/host_rows_in_place.py),
#      and a batch's admission into the device directory alone, then with the lookahead window's
#      announcement (benchmarks/device_directory.py).
# Each stage writes $OUT/stage<k>.log as it goes and appends "stage <k> <name>: rc <rc>,
# <seconds> s (limit <seconds> s)" to $OUT/stages.txt when it ends; stages 3 and 4 write gpu.json and
# beyond_gpu.json there: 8 files in all.
# Without $OUT, benchmarks/results/gpu_check/ takes them.
#
# GPU_CHECK_STAGES picks stages (default "1 2 3 4 5"; the others are reported as skipped):
# two full checks and a machine's start take more than a 15-minute loan, so a session's
# closing check may run "1 2 3" (the CUDA tests and the figures at scale 1.0) alone; the
# shares of the stages left out then go to those run. GPU_CHECK_SECONDS sets the whole check's
# time (default 560: the shares' sum).
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
STAGES=${GPU_CHECK_STAGES:-"1 2 3 4 5"}
for k in $STAGES; do
  case $k in
    [1-5]) ;;
    *) echo "GPU_CHECK_STAGES=\"$STAGES\" names stage '$k'; the stages are 1 to 5 (e.g. GPU_CHECK_STAGES=\"1 2 3\")." >&2; exit 2 ;;
  esac
done
OUT=${OUT:-benchmarks/results/gpu_check}
mkdir -p "$OUT"
: > "$OUT/stages.txt"
rm -f "$OUT"/stage?.log  # the stages append to theirs

if [ -n "${GPU_DRY_RUN:-}" ]; then
  PYTHON=.venv/bin/python
  ACCELERATOR=cpu
  SMALL="--device cpu --scale 0.001 --batch-size 64"
  BENCH_ARGS="$SMALL --steps 5 --rounds 1 --pieces --strategies auto auto+eager hotcache@0.1 hotcache@0.01 hotcache@0.01+eager hotcache@0.01+hostdir auto+bf16-mixed auto+fp32 hotcache@0.01+lookahead"  # stage 3's
  BEYOND_ARGS="$SMALL --steps 5 --rounds 1 --strategies auto hotcache@0.1 hotcache@0.01"  # no cap on a CPU
  PROFILE_ARGS="$SMALL --steps 6 --warmup 2 --profile-steps 2 --strategies auto hotcache@0.1 hotcache@0.01"
  ROW_COPY_ARGS="--table-gib 0.02 --rows 2000 --copies 3 --threads 1 2"
  TBE_ARGS="--kaggle-scale 0.0001 --dim 8 --batch-size 16 --calls 2"  # Triton's interpreter: a check, not a speed
  IN_PLACE_ARGS="--tables 3 --rows-per-table 100 --dim 8 --batch-size 16 --calls 2"
  DIRECTORY_ARGS="--rows 2000 --ids 256 --dim 8 --batches 2 --warmup 1"
  export TRITON_INTERPRET=1
  export PYTHONPATH="$PWD:$PWD/benchmarks/gpu_image"
else
  PYTHON=${GPU_PYTHON:-python3}
  ACCELERATOR=gpu
  # 80 warm-up steps: the first 20 batches are the profiled ones (at 10% all their rows are
  # static), and a 10% cache's dynamic slots fill by ~step 65 (a replay of the batches through
  # its caches); with 20 the timed steps were all filling (no row evicted in any 10% run before
  # 2026-11-29), measuring neither victims nor write-backs. --pieces: where the prefetch
  # thread's time goes (compiled loops and row copies, which torch.profiler does not see).
  BENCH_ARGS=${GPU_BENCH_ARGS:-"--scale 1.0 --steps 120 --warmup 80 --rounds 1 --pieces --strategies auto auto+eager hotcache@0.1 hotcache@0.01 hotcache@0.01+eager hotcache@0.01+hostdir auto+bf16-mixed auto+fp32 hotcache@0.01+lookahead"}
  BEYOND_ARGS="--scale 1.0 --steps 120 --warmup 80 --rounds 1 --device-memory 8 --strategies auto hotcache@0.1 hotcache@0.01"
  PROFILE_ARGS="--scale 0.1 --steps 30 --warmup 20 --profile-steps 5 --strategies auto hotcache@0.1 hotcache@0.01"
  ROW_COPY_ARGS="--table-gib 8 --copies 40 --threads 1 2 4 8"
  TBE_ARGS="--kaggle-scale 1.0 --dim 128 --batch-size 8192 --calls 50"  # the Kaggle tables twice: 35 GB of rows and state in GPU memory
  IN_PLACE_ARGS="--tables 26 --rows-per-table 100000 --dim 128 --batch-size 8192 --calls 10"  # 1.3 GB of rows in each place
  DIRECTORY_ARGS="--rows 8000000 --budget 0.01 --dim 128 --batches 60 --warmup 20"  # 4 GB of host rows, registered
  rm -rf .gpu_site
  "$PYTHON" -m pip install --quiet --no-index --find-links gpu_wheels --no-deps --target .gpu_site -r benchmarks/requirements-gpu.txt \
    2>&1 | tee "$OUT/stage1.log"  # stage 1 appends to it: $OUT holds 8 files at most
  export PYTHONPATH="$PWD:$PWD/.gpu_site"
fi
export WANDB_MODE=offline

# Each stage's share of the check's seconds; GPU_CHECK_SECONDS is their sum unless set.
SHARE=(0 30 140 220 110 60)
BUDGET=${GPU_CHECK_SECONDS:-$((SHARE[1] + SHARE[2] + SHARE[3] + SHARE[4] + SHARE[5]))}
BEGAN=$SECONDS

# stage K NAME COMMAND...: run COMMAND until the time left is what the later stages to run are
# owed (their shares), log it, note how it ended.
stage() {
  local k=$1 name=$2
  shift 2
  if [[ " $STAGES " != *" $k "* ]]; then
    echo "stage $k $name: skipped (GPU_CHECK_STAGES=\"$STAGES\")" | tee -a "$OUT/stages.txt"
    return 0
  fi
  local owed=0 j
  for j in $STAGES; do
    if [ "$j" -gt "$k" ]; then owed=$((owed + SHARE[j])); fi
  done
  local start=$SECONDS
  local limit=$((BUDGET - (start - BEGAN) - owed))
  if [ "$limit" -lt 1 ]; then limit=1; fi
  timeout "$limit" "$@" >> "$OUT/stage$k.log" 2>&1
  local rc=$?
  echo "stage $k $name: rc $rc, $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/stages.txt"
  return $rc
}

stage 1 imports-and-2-step-fit "$PYTHON" -c "
import sys, torch, torchrec, lightning_hotcache
import os, resource
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'torchrec', torchrec.__version__, flush=True)
# What the host rows' page-locking (cudaHostRegister) runs under: the locked-memory limit and the user.
print('ulimit -l', resource.getrlimit(resource.RLIMIT_MEMLOCK), 'uid', os.geteuid(), flush=True)
from lightning_hotcache.cli import main
main(['fit', '-c', 'configs/dlrm_synthetic.yaml', '--trainer.accelerator=$ACCELERATOR', '--trainer.devices=1',
      '--trainer.fast_dev_run=2', '--data.init_args.num_train_samples=4096', '--trainer.logger=false'])
"
first=$?
# Stage 2's tests, in the order they run, so that a stage cut off by its limit loses the last:
# first what no GPU has run yet (the caches' directory in GPU memory, host rows read and stepped
# in place, the graphed steps, their host syncs), then the Triton kernels against the PyTorch
# path and the device directory against a plain set-associative cache, on the GPU's own kernels
# (here in Triton's interpreter), a model against auto at three
# budgets, and the GPU path's checks that ran on an H200 at 861bd68 (pinned staging, resume, a
# checkpoint loading on the CPU, the CPU-lookup baseline, 2 GPUs where there are two). On a CPU
# the CUDA tests skip: the dry run checks that they are found. -v and -s stream each test's name
# and the counts it prints into the log as it runs.
CUDA=tests/test_cuda.py
CUDA_TESTS=(
  "$CUDA::test_gpu_path_device_directory_step_waits_for_no_device"
  "$CUDA::test_gpu_path_device_directory_reads_and_steps_host_rows_in_place_as_the_host_directory_trains"
  "$CUDA::test_gpu_path_triton_reads_and_steps_mapped_host_rows_as_it_does_device_rows"
  "$CUDA::test_the_graphed_hotcache_step_on_cuda_trains_what_its_eager_step_trains"
  "$CUDA::test_the_graphed_hotcache_step_on_cuda_waits_for_no_later_step"
  "$CUDA::test_the_graphed_step_on_cuda_trains_what_the_eager_step_trains"
  "$CUDA::test_the_graphed_step_on_cuda_waits_for_no_later_step"
  "$CUDA::test_gpu_path_logs_its_kernel_and_keeps_within_the_budget"
  "$CUDA::test_whole_training_step_syncs_once"
  "$CUDA::test_gpu_path_keeps_the_host_directory_where_host_rows_cannot_be_mapped"
  "$CUDA::test_plain_tables_in_one_node_are_torchrecs_and_wait_for_no_device"
  "$CUDA::test_the_zoos_lazy_adam_in_the_triton_kernel_learns_what_its_pytorch_step_learns"
  tests/test_triton_tbe.py
  tests/test_device_directory.py
  "$CUDA::test_hotcache_matches_auto_on_cuda[dlrm-0.1-lfu]"
  "$CUDA::test_hotcache_matches_auto_on_cuda[dlrm-minimum-lookahead]"
  "$CUDA::test_hotcache_matches_auto_on_cuda[dlrm-1.0-static]"
  "$CUDA::test_gpu_path_step_of_a_staged_batch_waits_for_no_device"
  "$CUDA::test_gpu_path_staging_a_host_batch_waits_for_no_device"
  "$CUDA::test_gpu_path_moving_a_staged_batch_waits_for_no_device"
  "$CUDA::test_gpu_path_stages_rows_through_pinned_buffers_not_pinned_tables"
  "$CUDA::test_gpu_path_staged_side_by_side_matches_auto"
  "$CUDA::test_gpu_path_resumes_exactly"
  "$CUDA::test_checkpoint_written_on_cuda_loads_without_a_gpu"
  "$CUDA::test_cpu_lookup_baseline_keeps_the_tables_on_the_host_and_learns_what_auto_learns"
  "$CUDA::test_auto_on_cuda_hands_its_gradient_rows_over_and_learns_what_the_cpu_learns"
  "$CUDA::test_a_zoo_model_moved_to_the_gpu_keeps_its_tables_stacked_and_trains_as_on_the_cpu"
  "$CUDA::test_gpu_path_two_gpus_match_one_with_their_batches_together"
)
stage 2 cuda-tests "$PYTHON" -m pytest -v -s -p no:cacheprovider -m "(cuda or kernels) and not full" --timeout 120 "${CUDA_TESTS[@]}"
second=$?
# shellcheck disable=SC2086  # the benchmarks' settings, split as on a command line
stage 3 gpu-benchmark "$PYTHON" benchmarks/gpu.py $BENCH_ARGS --out "$OUT/gpu.json"
third=$?
# shellcheck disable=SC2086
stage 4 tables-larger-than-the-gpu "$PYTHON" benchmarks/gpu.py $BEYOND_ARGS --out "$OUT/beyond_gpu.json"
fourth=$?
# Both run though one fails; the row copy's JSON goes to stage5.log, not a ninth file in $OUT.
# shellcheck disable=SC2016  # expanded by the inner bash, from its arguments
# The Triton TBE's own time against embedding_bag + the PyTorch row step goes to stage5.log too,
# and, last, what rows read and stepped in place in host memory cost the kernels (anonymous and
# memory-mapped file, each registered: benchmarks/host_rows_in_place.py) and what the device
# directory's admission of a batch costs on its own, and with the lookahead window's announcement
# (benchmarks/device_directory.py).
stage 5 profile bash -c '"$0" benchmarks/row_copy.py $1 --out "$2"; copies=$?; "$0" benchmarks/triton_tbe.py $4 --out "$2.tbe"; tbe=$?; "$0" benchmarks/gpu.py $3; profile=$?; "$0" benchmarks/host_rows_in_place.py $5 --out "$2.in_place"; in_place=$?; "$0" benchmarks/device_directory.py $6 --out "$2.directory"; directory=$?; "$0" benchmarks/device_directory.py $6 --policy lookahead --out "$2.window"; exit $((copies || tbe || profile || in_place || directory || $?))' \
  "$PYTHON" "$ROW_COPY_ARGS" "${TMPDIR:-/tmp}/row_copy.json" "$PROFILE_ARGS" "$TBE_ARGS" "$IN_PLACE_ARGS" "$DIRECTORY_ARGS"
fifth=$?
exit $((first || second || third || fourth || fifth))
