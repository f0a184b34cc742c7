# kb: two commands for a fresh machine (see README.md).
#   make demo   install into .venv, materialize the Dagster ingest assets for the bundled samples, print a search
#   make test   install into .venv, run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
KB_HOME ?= $(CURDIR)/.kb
export KB_HOME
export DAGSTER_HOME ?= $(KB_HOME)/dagster

.PHONY: install demo test dev chromium

install: $(VENV)/.installed

# torch first, from the CPU wheel pip finds locally (an unpinned torch would pull a multi-GB CUDA build);
# then the full lock with --no-deps, so exactly the tested set is installed and nothing else is resolved.
$(VENV)/.installed: requirements/lock.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -r requirements/lock.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

demo: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/kb source apply samples/kb.toml
	for source in samples faq; do \
	  $(BIN)/dagster asset materialize -m assets.definitions --select '*published_chunks' --partition $$source || exit 1; \
	done
	$(BIN)/kb status
	$(BIN)/kb search "How many weeks of paid leave does a primary caregiver get?" --k 3

test: install chromium
	$(BIN)/python -m pytest -q

# The search console is tested in headless Chromium (Debian's package; tests never download a browser).
chromium:
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)

dev: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster dev -w workspace.yaml

$(DAGSTER_HOME)/dagster.yaml:
	mkdir -p $(DAGSTER_HOME)
	cp dagster.yaml $@
