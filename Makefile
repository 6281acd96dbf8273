# gradientflow-repro: every target sets up what it needs on a fresh machine.
#   make reproduce            the paper's comparison on the paper-regime miniature: the experiment's
#                             strategies over the whole schedule on an emulated cluster network (4 gloo
#                             ranks on CPU), timed to the target (MLPerf) and to the schedule's end (the
#                             paper) -> results/REPORT.md; EXPERIMENT=digits_cpu for the digits
#   make reproduce DATA=/imagenet [EXPERIMENT=alexnet_512gpu NPROC=8]
#   make convergence          accuracy over the whole schedule, dense against sparse communication
#                             (3 seeds, on loopback; CONVERGENCE_ARGS for the script) -> results/convergence.md
#   make train                one training run (EXPERIMENT, NPROC, ARGS as Hydra overrides)
#   make test                 the test suite
#   make lint                 ruff (configured in pyproject.toml), as CI runs it before the tests
#   make bench / reliability  benchmark tables / fault-injection table under results/
#   make gpu-check            on a GPU machine: the CUDA path item by item -> results/gpu_check.md
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?= 4
EXPERIMENT ?= patterns_cpu
DATA ?=
ARGS ?=
REPRO_ARGS ?=
CONVERGENCE_ARGS ?=
DIGITS := data/digits
PATTERNS := data/patterns

.PHONY: venv data reproduce convergence train test lint bench reliability gpu-check clean

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# DALI's CUDA 12 build (before the stack moved to CUDA 13) shares its files with the CUDA 13 one
	$(PY) -m pip uninstall --quiet --yes nvidia-dali-cuda120 2>/dev/null || true
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

$(DIGITS)/train: | $(STAMP)
	$(PY) -m gradientflow_repro.data.digits $(DIGITS)

$(PATTERNS)/train: | $(STAMP)
	$(PY) -m gradientflow_repro.data.patterns $(PATTERNS)

data: $(DIGITS)/train $(PATTERNS)/train

reproduce: venv $(if $(DATA),,data)
	$(PY) scripts/reproduce.py --experiment $(EXPERIMENT) --world $(NPROC) $(REPRO_ARGS) -- \
	  $(if $(DATA),data=imagenet data.root=$(DATA)) $(ARGS)

convergence: venv $(if $(DATA),,data)
	$(PY) scripts/convergence.py --experiment $(EXPERIMENT) --world $(NPROC) $(CONVERGENCE_ARGS) -- \
	  $(if $(DATA),data=imagenet data.root=$(DATA)) $(ARGS)

train: venv $(if $(DATA),,data)
	$(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC) -m gradientflow_repro.train \
	  +experiment=$(EXPERIMENT) $(if $(DATA),data=imagenet data.root=$(DATA)) $(ARGS)

test: venv data
	$(PY) -m pytest -ra $(ARGS)

lint: venv
	$(PY) -m ruff check .

bench: venv data
	$(PY) scripts/bench_loader.py
	$(PY) scripts/bench_allreduce.py
	$(PY) scripts/bench_comm.py
	$(PY) scripts/bench_small_allreduce.py
	$(PY) scripts/bench_cluster.py
	$(PY) scripts/bench_checkpoint.py
	$(PY) scripts/model_check.py
	$(PY) scripts/simulate_scaling.py --report

reliability: venv data
	$(PY) scripts/fault_report.py

# Installs nothing (offline it could not; online it would replace the stack under test): the
# project's venv where there is one, else the machine's python3 (PYTHON=... names another); run
# from this directory, needing only torch (what else is missing is SKIP).
GPU_CHECK_PY = $(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),$(if $(wildcard $(PY)),$(PY),$(PYTHON)))
gpu-check:
	$(GPU_CHECK_PY) -m gradientflow_repro.gpu_check $(ARGS)

clean:
	rm -rf results/runs .pytest_cache
