# Two commands do all the set-up: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Development machines carry the CPU build of this torch locally; GPU machines use their own.
CPU_TORCH := torch==2.13.0
PIP := $(BIN)/python -m pip --disable-pip-version-check --quiet
# uv installs the rest (torch is already there, and a range it satisfies keeps it): a
# fresh venv's ~70 packages take ~20 s with uv, ~2.5 min with pip.
UV := uv>=0.9,<1
# uv compiles the packages' bytecode at install (pip does by default, uv does not), and
# `bytecode` compiles the project's: where PYTHONDONTWRITEBYTECODE is set, Python never
# writes .pyc files, and every process (each gateway, replica and CLI call a test starts)
# would compile every module from source again: ~2 s a gateway start.
PROJECT_CODE := gateway backend tenants migrations bench tests
# Some machines list local package folders that do not exist; pip warns for each.
PIP_NOISE := is ignored: it is neither
# Two test workers a core (at most 8): many tests wait on servers they start, so a second
# worker per core fills those waits.
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(min(8, 2 * len(os.sched_getaffinity(0))))')

.PHONY: setup bytecode run test lint format services browser clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "Tollgate needs Python >= 3.11 (found $$($(PYTHON) --version))"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA found: keeping this machine's torch build"; \
	else \
		echo "no CUDA: installing the CPU build ($(CPU_TORCH))"; \
		set -o pipefail; $(PIP) install "$(CPU_TORCH)" 2>&1 | { grep -v "$(PIP_NOISE)" || true; }; \
	fi
	@set -o pipefail; $(PIP) install "$(UV)" 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	@echo "installing tollgate and its dev tools into $(VENV)"
	@$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[dev]'
	@touch $(STAMP)

bytecode: setup
	@$(BIN)/python -m compileall -q -j 0 $(PROJECT_CODE)

run: setup bytecode
	$(BIN)/tollgate db upgrade
	$(BIN)/tollgate serve

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python scripts/structure_report.py --check  # the gateway's layers, no folder cycles

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

services:
	@bash infra/scripts/ensure-services.sh

browser:  # Debian's chromium, driven by Playwright in the console's browser tests
	@bash infra/scripts/ensure-browser.sh

test: setup bytecode lint services browser
	$(BIN)/pytest -n $(TEST_WORKERS) --dist worksteal

clean:
	rm -rf $(VENV) .tollgate .pytest_cache .mypy_cache .ruff_cache
