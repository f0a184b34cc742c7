# kb: two commands for a fresh machine (see README.md).
#   make demo   install into .venv, run the Dagster ingest job for the bundled samples, print a search
#   make test   install into .venv, run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
KB_HOME ?= $(CURDIR)/.kb
export KB_HOME

.PHONY: install demo test dev system-packages

install: $(VENV)/.installed

# torch first, from the CPU wheel pip finds locally (an unpinned torch would pull a multi-GB CUDA build);
# then the full lock with --no-deps, so exactly the tested set is installed and nothing else is resolved.
$(VENV)/.installed: requirements/lock.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -r requirements/lock.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

demo: install
	$(BIN)/kb migrate
	$(BIN)/kb source apply samples/kb.toml
	$(BIN)/kb dagster ingest
	$(BIN)/kb status
	$(BIN)/kb search "How many weeks of paid leave does a primary caregiver get?" --k 3

test: install system-packages
	$(BIN)/python -m pytest -q

# The search console is tested in headless Chromium, and kb's errors against a PostgreSQL without pgvector
# (Debian's packages; tests never download a browser).
system-packages:
	command -v chromium >/dev/null && test -x /usr/lib/postgresql/15/bin/postgres || \
	  (apt-get update -q && apt-get install -y -q chromium postgresql-15)

dev: install
	$(BIN)/kb dagster dev
