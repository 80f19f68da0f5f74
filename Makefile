# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test protos bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[cpu]'
	touch $@

$(TEST_STAMP): pyproject.toml $(STAMP)
	$(BIN)/pip install --quiet -e '.[cpu,test]'
	touch $@

demo: $(STAMP)
	$(BIN)/strata demo

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

protos: $(TEST_STAMP)
	$(BIN)/python -m strata.protos.codegen

bench: $(TEST_STAMP)
	$(BIN)/python bench/service_overhead.py

clean:
	rm -rf $(VENV) .strata build *.egg-info
