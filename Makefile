# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test test-fast lint typecheck protos bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	@# an older checkout installed itself as `strata` with top-level coordinator/worker/protos
	-$(BIN)/pip uninstall --quiet --yes strata 2>/dev/null
	@# (setuptools warns of editable installs at every one: PYTHONWARNINGS quiets the build)
	PYTHONWARNINGS=ignore $(BIN)/pip install --quiet -e '.[cpu]'
	touch $@

$(TEST_STAMP): pyproject.toml $(STAMP)
	PYTHONWARNINGS=ignore $(BIN)/pip install --quiet -e '.[cpu,test]'
	touch $@

demo: $(STAMP)
	$(BIN)/strata demo

# The whole suite: lint, types, then every test (the integration tests start real processes).
test: lint typecheck
	$(BIN)/python -m pytest -q -ra --durations=15 $(PYTEST_ARGS)

# The pure tests only: no coordinator, agent or TensorFlow process is started (seconds).
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -ra -m "not integration" $(PYTEST_ARGS)

lint: $(TEST_STAMP)
	$(BIN)/ruff check .

typecheck: $(TEST_STAMP)
	.ci/mypy-stage.sh >/dev/null
	$(BIN)/mypy

protos: $(TEST_STAMP)
	$(BIN)/python -m strata.protos.codegen

bench: $(TEST_STAMP)
	$(BIN)/python bench/service_overhead.py

clean:
	rm -rf $(VENV) .strata build *.egg-info
