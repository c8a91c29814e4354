PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BENCH_ARGS ?=

.PHONY: bench test lint paper clean

$(VENV)/.installed: pyproject.toml tools/bootstrap.sh
	@bash tools/bootstrap.sh $(PYTHON) $(VENV)
	@touch $@

## bench: the main job, the benchmark harness on the embedded default (results in bench/results/)
bench: $(VENV)/.installed
	$(PY) -m bench $(BENCH_ARGS)

## test: the whole test suite (Triton kernels under TRITON_INTERPRET=1 without a GPU)
test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

## paper: regenerate paper/paper.md and its figures from bench/results/
paper: $(VENV)/.installed
	$(PY) paper/build.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis .benchmarks
