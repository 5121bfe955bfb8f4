# The two commands of the README: `make serve` and `make test` (each sets up .venv first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
SGLANG ?= sglang==0.5.23

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,loadtest]'
	# SGLang's own storage interface, for the adapter tests: the released package without
	# its dependencies (it would pull a CUDA torch and the whole serving stack)
	$(PY) -m pip install -q --no-deps $(SGLANG)
	touch $@

.PHONY: install serve test test-core bench loadtest replay
install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/sidecar serve $(ARGS)

# `make test` runs the project's suite, then each engine's suite in its own virtualenv
# (ENGINE_TESTS: one target per engine, each building its venv first). `make test-core`
# runs only the project's suite (quick local work).
ENGINE_TESTS ?=
test: test-core
	@for t in $(ENGINE_TESTS); do $(MAKE) --no-print-directory $$t || exit 1; done

test-core: $(VENV)/.installed
	$(PY) -m pytest -q $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m loadtest.bench $(ARGS)
	$(PY) -m loadtest.bench_socket

# Locust against a sidecar already running on its default engine socket (bounded in users
# and time); set ENGINE_URL=unix:///path/to/socket for another one
ENGINE_URL ?= unix://$(shell $(PY) -c 'from sidecar.config import Config; print(Config().socket)')
loadtest: $(VENV)/.installed
	$(VENV)/bin/locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host $(ENGINE_URL) --only-summary

# replay the shared conversation trace against a sidecar started with --no-file-tier
replay: $(VENV)/.installed
	$(VENV)/bin/sidecar replay ../shared/traces/conversation_trace.jsonl --url $(ENGINE_URL) --capacity-pages 20000 $(ARGS)
