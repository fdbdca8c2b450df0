# Every target below does its own set-up on a fresh machine: .venv, torch first, then the package.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# Pinned explicitly: this wheel is on the machine, an unpinned torch pulls a multi-GB CUDA build.
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.installed

.PHONY: test test-fast demo docs docs-check lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[cli,dev,hf,keras,tensorboard]'
	touch $(STAMP)

# Two workers: each test runs on one thread (tests/conftest.py), so the suite takes about half the
# time on a 2-core machine. `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=20

# The inner loop: the engine's tests and doctests, which need no extra (no CLI, experiments,
# distributed, integration or benchmark tests, none marked slow); about a minute on 2 cores.
FAST_TESTS := tests src/gradaccum -m 'not slow' --ignore=tests/cli --ignore=tests/distributed \
	--ignore=tests/integrations --ignore=tests/test_report.py --ignore=tests/test_tasks.py \
	--ignore-glob='tests/test_benchmarks_*' --ignore=src/gradaccum/cli \
	--ignore=src/gradaccum/experiments --ignore=src/gradaccum/keras

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(FAST_TESTS)

demo: $(STAMP)
	$(BIN)/gradaccum demo

# README's sample outputs: rerun each command marked `<!-- output: ... -->` and rewrite its block
# (about a minute); docs-check only compares, ignoring timings and CPU-dependent float noise,
# and lists the blocks that differ.
docs: $(STAMP)
	$(BIN)/python scripts/readme_outputs.py

docs-check: $(STAMP)
	$(BIN)/python scripts/readme_outputs.py --check

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples scripts
	$(BIN)/ruff format --check src tests benchmarks examples scripts
	$(BIN)/mypy

# The peers of benchmarks/peers.py come from the bench extra, installed here only (not by test/demo).
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[cli,dev,hf,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/peers.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
