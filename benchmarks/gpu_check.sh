#!/usr/bin/env bash
# On the lent GPU machine (no network), from the repo root: install gpu_wheels/ (made by
# `make gpu-wheels`) offline, run the CUDA tests and benchmarks/gpu.py. `make gpu-check` runs
# this; without make: `bash benchmarks/gpu_check.sh`.
#
# The wheels go into a --target folder on PYTHONPATH rather than a venv: that needs nothing
# but pip on the image (no ensurepip), leaves the image's torch, lightning and numpy as they
# are, and with --no-index --no-deps pip never reaches for an index. The repo goes on
# PYTHONPATH too, not `pip install -e .`: pyproject asks for torch>=2.13 (the image has 2.11)
# and a build backend the image may lack.
#
# Everything printed lands in benchmarks/results/gpu_check.log; with $OUT set (the device
# machine's return folder) the log is written there as it goes (a run cut off at the time
# limit still returns it, with every finished benchmark job's line) and gpu.json is copied
# there at the end. Settings: GPU_PYTHON (python3), GPU_BENCH_ARGS (benchmarks/gpu.py's).
set -o pipefail
cd "$(dirname "$0")/.."
PYTHON=${GPU_PYTHON:-python3}
RESULTS=benchmarks/results
(
  set -e
  rm -rf .gpu_site
  "$PYTHON" -m pip install --quiet --no-index --find-links gpu_wheels --no-deps --target .gpu_site -r benchmarks/requirements-gpu.txt
  export PYTHONPATH="$PWD:$PWD/.gpu_site"
  "$PYTHON" -c "import torch, torchrec; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'torchrec', torchrec.__version__)"
  set +e
  "$PYTHON" -m pytest -q -m cuda tests
  tests=$?
  # shellcheck disable=SC2086  # the benchmark's settings, split as on a command line
  "$PYTHON" benchmarks/gpu.py ${GPU_BENCH_ARGS:-}
  bench=$?
  exit $((tests || bench))
) 2>&1 | tee "$RESULTS/gpu_check.log" ${OUT:+"$OUT/gpu_check.log"}
status=$?
if [ -n "${OUT:-}" ] && [ -f "$RESULTS/gpu.json" ]; then cp "$RESULTS/gpu.json" "$OUT/"; fi
exit $status
