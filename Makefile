# `make demo` and `make test` work on a fresh machine: each creates .venv when missing and installs the
# project (with its serve and test extras) from pyproject.toml.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-stamp
PYTEST  := JAX_PLATFORMS=cpu $(PY) -m pytest

.PHONY: setup demo test test-slow clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[serve,test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	JAX_PLATFORMS=cpu $(PY) -m tlaloc_jax.demo

test: setup
	$(PYTEST) -q

test-slow: setup
	$(PYTEST) -q -m slow

clean:
	rm -rf $(VENV)
