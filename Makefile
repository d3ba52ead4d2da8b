# Two commands do everything on a fresh machine:
#   make demo   set up, then generate a dataset with real SGLang on CPU and verify it
#   make test   set up, then run every check (ruff, format, mypy, the whole pytest suite)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup sglang trainers demo test check lint unit browser
setup: $(VENV)/.stamp

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

sglang:
	bash scripts/setup-sglang-cpu.sh

# speculators 0.9.0 and SpecForge 0.2.0 (--no-deps) for the export tests, on .venv-sglang's CPU torch.
trainers: sglang
	bash scripts/setup-trainers.sh

demo: setup sglang
	bash scripts/demo.sh

lint: setup
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts
	$(BIN)/mypy

# Quick loop while developing: no real SGLang, no slow suites.
unit: setup
	$(BIN)/python -m pytest -m "not sglang and not slow" -q

# A headless Chromium for the test that opens `stats --html` in a real browser (Debian's package; needs
# root). Best effort: without it that one test is skipped with the reason.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >/dev/null 2>&1 \
	    && echo "installed chromium"; } || echo "chromium not installed: the browser test will be skipped"

test: setup sglang trainers lint browser
	$(BIN)/python -m pytest -q
