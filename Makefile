# gradientflow-repro: every target sets up what it needs on a fresh machine.
#   make reproduce            the paper's comparison on the paper-regime miniature: the experiment's
#                             strategies over the whole schedule on an emulated cluster network (4 gloo
#                             ranks on CPU), timed to the target (MLPerf) and to the schedule's end (the
#                             paper) -> results/REPORT.md; EXPERIMENT=digits_cpu for the digits
#   make reproduce DATA=/imagenet [EXPERIMENT=alexnet_512gpu NPROC=8]
#   make convergence          accuracy over the whole schedule, dense against sparse communication
#                             (3 seeds, on loopback; CONVERGENCE_ARGS for the script) -> results/convergence.md
#   make train                one training run (EXPERIMENT, NPROC, ARGS as Hydra overrides)
#   make test                 the test suite (CI runs it); make test-fast: in-process tests only
#   make lint                 ruff (configured in pyproject.toml), as CI runs it before the tests
#   make bench / reliability  benchmark tables / fault-injection table under results/
#   make gpu-check GPU_CHECK_OUT=DIR/gpu_check.md   on a GPU machine: the CUDA path item by item,
#                             at most 3 minutes -> that file (default: the committed results/gpu_check.md) and its .log
#   make venv CUDA=12         the CUDA 12 stack instead of CUDA 13, for NVIDIA drivers older than 580
#                             (requirements-cu12.txt; docs/clusters.md, "CUDA 12: drivers older than 580")
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The venv's CUDA stack: 13 (requirements.txt, the default) or 12 (requirements-cu12.txt: torch's and
# DALI's CUDA 12 builds). The choice is kept in $(VENV)/.cuda, so that after `make venv CUDA=12` every
# target keeps that stack; `make venv CUDA=13` goes back. A switch rebuilds the venv from scratch: the
# two stacks' CUDA libraries are different packages that would otherwise stay side by side.
# (A variable CUDA in the environment, as some module systems set, counts only when it says 12 or 13.)
ifneq ($(origin CUDA),command line)
CUDA := $(or $(filter 12 13,$(CUDA)),$(shell cat $(VENV)/.cuda 2>/dev/null),13)
endif
ifeq ($(CUDA),13)
REQUIREMENTS := requirements.txt
STAMP := $(VENV)/.installed
else ifeq ($(CUDA),12)
REQUIREMENTS := requirements-cu12.txt
STAMP := $(VENV)/.installed-cu12
else
$(error CUDA=$(CUDA): 13 (the default stack) or 12 (NVIDIA drivers older than 580))
endif
NPROC ?= 4
EXPERIMENT ?= patterns_cpu
DATA ?=
ARGS ?=
REPRO_ARGS ?=
CONVERGENCE_ARGS ?=
DIGITS := data/digits
PATTERNS := data/patterns

.PHONY: venv data reproduce convergence train test test-fast lint bench reliability gpu-check clean

$(STAMP): $(REQUIREMENTS) pyproject.toml
	@if [ -d $(VENV) ] && [ "$$(cat $(VENV)/.cuda 2>/dev/null || echo 13)" != $(CUDA) ]; then \
	  echo "rebuilding $(VENV) for CUDA $(CUDA)"; rm -rf $(VENV); fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# DALI's CUDA 12 build (before the stack moved to CUDA 13) shares its files with the CUDA 13 one
	$(if $(filter 13,$(CUDA)),$(PY) -m pip uninstall --quiet --yes nvidia-dali-cuda120 2>/dev/null || true)
	$(PY) -m pip install --quiet -r $(REQUIREMENTS)
	$(PY) -m pip install --quiet --no-deps -e .
	rm -f $(VENV)/.installed $(VENV)/.installed-cu12
	echo $(CUDA) > $(VENV)/.cuda
	touch $(STAMP)

venv: $(STAMP)

$(DIGITS)/train: | $(STAMP)
	$(PY) -m gradientflow_repro.data.digits $(DIGITS)

$(PATTERNS)/train: | $(STAMP)
	$(PY) -m gradientflow_repro.data.patterns $(PATTERNS)

data: $(DIGITS)/train $(PATTERNS)/train

reproduce: venv $(if $(DATA),,data)
	$(PY) scripts/reproduce.py --report --experiment $(EXPERIMENT) --world $(NPROC) $(REPRO_ARGS) -- \
	  $(if $(DATA),data=imagenet data.root=$(DATA)) $(ARGS)

convergence: venv $(if $(DATA),,data)
	$(PY) scripts/convergence.py --report --experiment $(EXPERIMENT) --world $(NPROC) $(CONVERGENCE_ARGS) -- \
	  $(if $(DATA),data=imagenet data.root=$(DATA)) $(ARGS)

train: venv $(if $(DATA),,data)
	$(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC) -m gradientflow_repro.train \
	  +experiment=$(EXPERIMENT) $(if $(DATA),data=imagenet data.root=$(DATA)) $(ARGS)

test: venv data
	$(PY) -m pytest -ra $(ARGS)

# the fast tier: in-process tests only (a test that would start a Python process skips there)
test-fast: venv data
	$(PY) -m pytest -ra --fast -p no:cacheprovider $(ARGS)

lint: venv
	$(PY) -m ruff check .

# each script writes under results/runs/ unless given --report: these rewrite the committed results/
bench: venv data
	$(PY) scripts/bench_loader.py --report
	$(PY) scripts/bench_allreduce.py --report
	$(PY) scripts/bench_allreduce.py --worlds 2 --max-mb 16 --repeats 3 --ring-segment-kb 1024 512 128 \
	  --name allreduce_segments --report
	$(PY) scripts/bench_comm.py --report
	$(PY) scripts/bench_small_allreduce.py --report
	$(PY) scripts/bench_cluster.py --report
	$(PY) scripts/bench_checkpoint.py --report
	$(PY) scripts/model_check.py --report
	$(PY) scripts/simulate_scaling.py --report

reliability: venv data
	$(PY) scripts/fault_report.py --report

# Installs nothing (offline it could not; online it would replace the stack under test): the
# project's venv where there is one, else the machine's python3 (PYTHON=... names another); run
# from this directory, needing only torch (what else is missing is SKIP).
GPU_CHECK_PY = $(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),$(if $(wildcard $(PY)),$(PY),$(PYTHON)))
gpu-check:
	$(GPU_CHECK_PY) -m gradientflow_repro.gpu_check $(if $(GPU_CHECK_OUT),--out $(GPU_CHECK_OUT),--report) $(ARGS)

clean:
	rm -rf results/runs .pytest_cache
