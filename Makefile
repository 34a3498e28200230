# Two commands on a fresh machine: `make demo` and `make test` (both set up .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline

.PHONY: setup demo test bench clean

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

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) wandb lightning_logs checkpoints .pytest_cache
