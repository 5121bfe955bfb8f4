# The two commands of the README: `make serve` and `make test` (each sets up .venv first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

.PHONY: install serve test bench
install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/sidecar serve $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m loadtest.bench $(ARGS)
