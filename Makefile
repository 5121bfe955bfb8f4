# The two commands of the README: `make serve` and `make test` (each sets up .venv first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
SGLANG ?= sglang==0.5.23

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,loadtest,plan]'
	# SGLang's own storage interface, for the adapter tests: the released package without
	# its dependencies (it would pull a CUDA torch and the whole serving stack)
	$(PY) -m pip install -q --no-deps $(SGLANG)
	touch $@

.PHONY: install serve test test-core browser bench loadtest replay plan
install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/sidecar serve $(ARGS)

# `make test` runs the project's suite, then each engine's suite in its own virtualenv
# (ENGINE_TESTS: one target per engine, each building its venv first). `make test-core`
# runs only the project's suite (quick local work).
ENGINE_TESTS ?=
test: browser test-core
	@for t in $(ENGINE_TESTS); do $(MAKE) --no-print-directory $$t || exit 1; done

# The /ui test drives a real headless browser: install Debian's chromium where apt can (CI is
# root on Debian). Quiet, once; without apt or root the test skips.
browser:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 || \
	  echo "chromium could not be installed: the /ui browser test will skip"

test-core: $(VENV)/.installed
	$(PY) -m pytest -q $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m loadtest.bench $(ARGS)

# Locust against a sidecar already running on $(URL) (bounded in users and time)
URL ?= http://127.0.0.1:8411
loadtest: $(VENV)/.installed
	$(VENV)/bin/locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host $(URL) --only-summary

# replay the shared conversation trace against a sidecar started with --no-file-tier
replay: $(VENV)/.installed
	$(VENV)/bin/sidecar replay ../shared/traces/conversation_trace.jsonl --url $(URL) --capacity-pages 20000 $(ARGS)

# hit rate against host pool capacity for the shared conversation trace (offline, no server):
# one shared sidecar beside 4 per-engine caches of the same total; the chart goes to docs/
plan: $(VENV)/.installed
	$(VENV)/bin/sidecar plan ../shared/traces/conversation_trace.jsonl --capacities 2%,5%,10%,20%,40%,80% \
	  --engines 4 --plot docs/plan-conversation-trace.png $(ARGS)
