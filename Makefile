# batonlm developer commands. `make help` lists them.
PYTHON ?= python
PIP ?= $(PYTHON) -m pip

.PHONY: help install run test test-all test-quick lint docs bench docker

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install:  ## install batonlm with its test and dev extras (torch 2.13.0 first)
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[dev]"

run:  ## serve the embedded stories260K model on http://127.0.0.1:30000
	batonlm serve

# Both halves run in two worker processes (pytest-xdist). The unit, kernel and bench tests hold
# no server or port, and a core idles while the other runs a test's Python. The integration
# tests go out a file at a time (--dist loadfile: a module's shared server or compiled step is
# built once, in one worker): most of their time is processes starting and waiting on each
# other, so two at once took 488 s where one at a time took 784-819 s, on 2 cores.
test:  ## run the test suite but its slow tier (what .ci/run runs; <= 15 min on 2 cores), then its slowest tests
	$(PYTHON) -m pytest -q -n 2 tests/unit tests/kernels tests/bench -m "not slow" --durations=10
	$(PYTHON) -m pytest -q -n 2 --dist loadfile tests/integration -m "not slow" --durations=20

test-all:  ## every test, the slow tier too (every family compiled, the whole signal matrix, multi-node endings)
	$(PYTHON) -m pytest -q tests --durations=20

test-quick:  ## the unit and kernel tests not marked slow (about 2 minutes): the edit loop
	$(PYTHON) -m pytest -q -n 2 tests/unit tests/kernels -m "not slow" --durations=10

lint:  ## ruff, then the mypy type check of batonlm/
	$(PYTHON) -m ruff check batonlm tests benchmarks
	$(PYTHON) -m mypy batonlm

docs:  ## rewrite docs/flags.md from the settings' declarations
	$(PYTHON) -m batonlm.settings_docs

bench:  ## normal vs overlap loop on stories260K (writes benchmarks/results/local/)
	$(PYTHON) benchmarks/overlap.py

docker:  ## build the GPU image
	docker build -f docker/Dockerfile -t batonlm:latest .
