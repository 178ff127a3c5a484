# Two commands on a fresh machine: `make demo` and `make test` (lint, then the tests). Both go through `make setup`,
# which builds .venv once and does nothing while it is newer than pyproject.toml and this file.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
# pip prints a warning for every package its local mirrors lack; they are noise here.
QUIET_PIP := { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: setup bytecode demo test test-fast lint format docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing shard-ray and its pinned stack into $(VENV) (1 to 2 minutes; pip prints only errors)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]' 2>&1 | $(QUIET_PIP)
	# torchrec's wheel requires the CUDA fbgemm-gpu; fbgemm-gpu-cpu provides the same module here
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps torchrec==1.8.0 2>&1 | $(QUIET_PIP)
	touch $(STAMP)

# Where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), Python writes no bytecode of shard-ray's own
# modules (pip compiled every installed package's), so every process compiled them again: a command 0.2-0.3 s of CPU
# more, and the suite starts hundreds (commands, Ray workers, gang members). Python reads bytecode whatever the
# setting says, so it is compiled here, for the modules that changed since (docs/install.md).
bytecode: setup
	$(PY) -m compileall -q shard_ray experiments

# pytest rewrites every test module's asserts as it collects it, and keeps the result only where Python may write
# bytecode: with PYTHONDONTWRITEBYTECODE set, each of its processes rewrote all of them again (collecting took 6.3 s of
# CPU in a process where it takes 3.0 s with them kept; `make test` starts four). An empty value turns it off.
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

demo: bytecode
	$(VENV)/bin/shard-ray demo

# The suite in two passes. First every test but those marked `alone`, three at a time (pytest-xdist), the slow ones
# handed out first, the longest first, a test or a group (`xdist_group`) at a time as workers free up
# (tests/conftest.py): they wait on subprocesses, Ray starts and links more than they compute. Then the `alone` tests,
# one at a time: they judge measured times (a race's verdict, an A/A twin, prices against a measurement, the emulated
# links' rates), which load beside them would change.
WORKERS ?= 3

test: bytecode lint
	$(PYTEST) -n $(WORKERS) --dist loadgroup -m "not alone"
	$(PYTEST) -m alone

# The quick tests only: the loop to run while changing code.
test-fast: bytecode lint
	$(PYTEST) -n $(WORKERS) -m "not slow"

# ruff's linter and formatter (settings in pyproject.toml); `make format` applies both.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The documentation site (docs/, mkdocs.yml) in site/; --strict fails on a broken link or a page missing from the nav.
# NO_MKDOCS_2_WARNING quiets Material's banner about its successor, printed on every build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) shard-ray-out mlflow.db mlartifacts mlruns .pytest_cache site
