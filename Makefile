# Two commands set everything up on a fresh machine:
#   make demo   installs rayload in .venv and runs `rayload demo` (local Ray, no services)
#   make test   installs rayload with its test extras (+ Chromium for the HTML test) and runs the tests
#   make test-fast  the everyday loop: no Ray cluster, no browser, no test marked slow
VENV ?= .venv
PYTHON ?= python3
# The CPU build of torch, installed first so a plain `torch` requirement does not pull CUDA.
# On a GPU machine: make TORCH_SPEC='torch' ...
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/rayload demo

test: setup
	./scripts/install-system-deps.sh
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q --fast

lint: setup
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks
	$(BIN)/mypy

bench: setup
	$(BIN)/rayload bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
