# The two commands for a fresh machine are `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)

.PHONY: setup demo test test-unit controlplane bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -e '.[engine,test]'
	touch $@

setup: $(STAMP)

controlplane:
	bash tests/controlplane/setup.sh

demo: setup
	$(BIN)/kvtune demo

test: setup controlplane
	$(BIN)/python -m pytest tests

test-unit: setup
	$(BIN)/python -m pytest tests -m "not integration"
