# `make run` and `make test` create .venv when it is absent, install the package into it, then run.
# CPU machines: torch is pinned to 2.13.0 so that pip takes the CPU build and never downloads CUDA wheels.
# CUDA machines: the same pin gives PyPI's CUDA build; override with `make run TORCH=torch==2.x.y` if needed.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
EXTRAS ?= dev
BIN := $(VENV)/bin
STAMP := $(VENV)/.lightning_4d-installed
DOCS_STAMP := $(VENV)/.lightning_4d-docs-installed

.PHONY: run test check lint install clean docs docs-figures

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/lightning-4d fit --config configs/tiny.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q -s --durations=40 tests

# the quick tier for the edit-test loop: lint, then every test not marked slow (pyproject.toml's markers: no process
# launches, no training runs); under 5 minutes on 2 cores. `make test` is the whole suite.
check: lint
	$(BIN)/python -m pytest -q -m "not slow" --durations=15 tests

# lint: ruff check (pyproject's [tool.ruff]: pycodestyle errors and warnings, pyflakes, import order; line length
# 120) and ruff format --check (apply with: .venv/bin/ruff format lightning_4d tests benchmarks examples docs)
lint: $(STAMP)
	$(BIN)/ruff check lightning_4d tests benchmarks examples docs
	$(BIN)/ruff format --check lightning_4d tests benchmarks examples docs

# the docs extra, on top of the install above (its own stamp, so `make test` and `make lint` install what they did)
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS),docs]"
	touch $(DOCS_STAMP)

# the docs site into site/ (mkdocs.yml): strict, so a broken link or anchor, a page left out of the nav, a `:::`
# reference to a missing object or a docstring griffe cannot parse fails; the CLI reference is generated from
# `lightning-4d <command> --help` (docs/hooks.py). NO_MKDOCS_2_WARNING: mkdocs-material's notice about MkDocs 2.0
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# regenerate every figure the docs quote between <!-- figure: ... --> markers (benchmarks/docs_figures.py;
# tests/test_docs.py fails when one is stale, or when a command the docs show exits otherwise than they say)
docs-figures: $(STAMP)
	$(BIN)/python benchmarks/docs_figures.py

clean:
	rm -rf $(VENV) checkpoints lightning_logs site
