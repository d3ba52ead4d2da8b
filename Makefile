# Two commands do everything on a fresh machine:
#   make demo   set up, then generate a dataset with real SGLang on CPU and verify it
#   make test   set up, then run every check (ruff, format, mypy, the whole pytest suite)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup sglang demo test check lint unit
setup: $(VENV)/.stamp

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

sglang:
	bash scripts/setup-sglang-cpu.sh

demo: setup sglang
	bash scripts/demo.sh

lint: setup
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts
	$(BIN)/mypy

# Quick loop while developing: no real SGLang, no slow suites.
unit: setup
	$(BIN)/python -m pytest -m "not sglang and not slow" -q

test: setup sglang lint
	$(BIN)/python -m pytest -q
