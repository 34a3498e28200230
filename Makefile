# Two commands on a fresh machine: `make demo` and `make test` (both set up .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline

.PHONY: setup demo test test-all bench clean gpu-wheels gpu-check

setup: $(STAMP)

# FBGEMM's CPU build goes in first and torchrec with --no-deps: torchrec's metadata asks for
# the CUDA fbgemm-gpu wheel (~465 MB, needs a CUDA torch). torch==2.13.0 is pinned here
# because a bare `torch` requirement pulls a multi-GB CUDA build on Linux.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 fbgemm-gpu-cpu==1.8.0
	$(PY) -m pip install --quiet --no-deps torchrec==1.8.0 recbole==1.2.1
	$(PY) -m pip install --quiet -e ".[cpu,test]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/hotcache fit -c configs/dlrm_synthetic.yaml

# The full products of the exactness matrices are marked `full`: `make test-all` runs them too.
test: setup
	$(PY) -m pytest -q -m "not full" --durations=25 tests

test-all: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) wandb lightning_logs checkpoints .pytest_cache .gpu_site

# ---- A GPU machine without network access (benchmarks/requirements-gpu.txt says what it has and lacks). Here,
# `make gpu-wheels` downloads the wheels it lacks into $(GPU_WHEELS) (git-ignored: carry it
# with the working tree); there, `make gpu-check` installs them offline and runs the CUDA
# tests and benchmarks/gpu.py (benchmarks/gpu_check.sh: how, and what it writes).
GPU_WHEELS := gpu_wheels
GPU_PYTHON ?= python3

gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download --quiet --dest $(GPU_WHEELS) --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp --abi cp312 --abi none \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
		-r benchmarks/requirements-gpu.txt
	$(PYTHON) benchmarks/gpu_wheels.py $(GPU_WHEELS)  # sizes and hashes -> benchmarks/gpu_wheels.json (commit it)

gpu-check:
	GPU_PYTHON="$(GPU_PYTHON)" GPU_BENCH_ARGS="$(GPU_BENCH_ARGS)" GPU_DRY_RUN="$(GPU_DRY_RUN)" GPU_CHECK_STAGES="$(GPU_CHECK_STAGES)" GPU_CHECK_SECONDS="$(GPU_CHECK_SECONDS)" bash benchmarks/gpu_check.sh
