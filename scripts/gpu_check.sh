#!/usr/bin/env bash
# The GPU check (issue 46, docs/gpu.md): on a CUDA node, with the wheels of `make gpu-wheels`
# in .whl/, prove the CUDA paths in one command under a hard limit (8 minutes by default):
#
#   env       the device, torch, cuda-bindings, whether the sidecar sees CUDA
#   wheels    .whl/*.whl into a temporary site (PYTHONPATH), imports of the server's modules
#   build     sidecar/_kvcopy.c built in place if it is not (the CUDA copies' C submission)
#   sidecar   one sidecar started: ready, host pool cudaHostRegister-ed
#   gpu       the `gpu`-marked CUDA IPC tests (registration, set/get byte-exact between two
#             engine processes, a page of one process restored into another's)
#   linker    the SGLang linker's device path (pools registered once, copies gated on events)
#   bench     CUDA IPC set/get of 64 x 2 MiB against torch's pinned copy; registration time
#   sweep     the copy path's sweep (issue 54): 8 KiB to 2 MiB pages, contiguous and scattered,
#             against one raw cudaMemcpyAsync of the same bytes; submission time a 1,000 runs
#
# Every step runs even when one before failed, prints one summary line, and writes its full
# log under $OUT (when set, else a temp dir). `--dry` (a CPU machine, the suite's test) runs
# every step, the device-free half of each: the gpu tests skip, the bench says no device,
# the sweep runs on host memory (`--dry-run`).
#   usage: bash scripts/gpu_check.sh [--dry]      env: PYTHON, GPU_CHECK_LIMIT (s), OUT
set -u
cd "$(dirname "$0")/.." || exit 2
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
PY=${PYTHON:-python3}
LIMIT=${GPU_CHECK_LIMIT:-480}
LOGS=${OUT:-$(mktemp -d -t gpu-check-XXXXXX)}
mkdir -p "$LOGS"
SITE=$(mktemp -d -t gpu-site-XXXXXX)
START=$(date +%s)
SUMMARY="$LOGS/summary.txt"
: > "$SUMMARY"
FAILED=0
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False

left() { echo $(( LIMIT - ($(date +%s) - START) )); }

line() {   # one summary line, printed and kept
    echo "$*" | tee -a "$SUMMARY"
}

step() {   # a step's summary line; a step that did not end well fails the check
    [ "$RC" -ne 0 ] && FAILED=1
    line "$@"
}

# run NAME BUDGET CMD...: the command under min(BUDGET, time left), its output in NAME.log;
# sets RC (124: out of time) and TOOK
run() {
    local name=$1 budget=$2 t0
    shift 2
    local room=$(( $(left) - 5 ))
    [ "$room" -lt "$budget" ] && budget=$room
    t0=$(date +%s)
    if [ "$budget" -le 0 ]; then
        RC=124
        echo "no time left" > "$LOGS/$name.log"
    else
        timeout -k 5 "$budget" "$@" > "$LOGS/$name.log" 2>&1
        RC=$?
    fi
    TOOK=$(( $(date +%s) - t0 ))
    return 0
}

status() {   # "ok", "TIMEOUT" or "FAIL rc=N", for RC
    case $RC in 0) echo ok ;; 124|137) echo TIMEOUT ;; *) echo "FAIL rc=$RC" ;; esac
}

pytest_tail() {   # pytest's last counts line of a log
    grep -E "[0-9]+ (passed|failed|skipped|error)" "$1" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//'
}

line "gpu_check: $( [ $DRY = 1 ] && echo 'dry run (no device used)' || echo 'device run') at $(date -u +%FT%TZ), limit ${LIMIT}s, logs in $LOGS"

# -- env ------------------------------------------------------------------------------------
run env 60 "$PY" - <<'EOF'
import importlib.metadata as m, platform
def v(name):
    try:
        return m.version(name)
    except Exception:
        return "absent"
print("python", platform.python_version(), "torch", v("torch"), "cuda-bindings", v("cuda-bindings"),
      "cuda-python", v("cuda-python"))
print("image:", ", ".join(f"{n} {v(n)}" for n in ("anyio", "h11", "click", "typing-extensions", "uvloop",
                                                  "xxhash", "prometheus-client", "annotated-doc", "pytest",
                                                  "pytest-timeout", "numpy", "cupy-cuda13x", "cuda-core")))
try:
    import torch
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
except Exception as exc:
    dev = f"torch: {exc}"
from sidecar.transports.cuda_ipc import bindings, cuda_available
rt, _ = bindings()
print(f"env: {dev}; kernel {platform.release()}; cuda bindings {getattr(rt, '__name__', None)}; "
      f"sidecar sees CUDA: {cuda_available()}")
EOF
command -v nvidia-smi > /dev/null && nvidia-smi -L >> "$LOGS/env.log" 2>&1
step "env: $(status) (${TOOK}s) $(grep '^env:' "$LOGS/env.log" | tail -1 | cut -c6-) | $(grep '^python' "$LOGS/env.log" | tail -1)"

# -- wheels ---------------------------------------------------------------------------------
WHEELS=$(ls .whl/*.whl 2>/dev/null | wc -l)
if [ "$WHEELS" -eq 0 ]; then
    RC=0; TOOK=0
    line "wheels: none in .whl/ (run \`make gpu-wheels\` here and carry .whl): using what $PY has"
else
    PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$PYVER" = "3.12" ]; then
        run wheels 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl
        [ "$RC" -eq 0 ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    else   # a dry run on another Python: the same install for 3.12, not put on the path
        run wheels 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --target "$SITE" .whl/*.whl
    fi
    INSTALLED=$(ls -d "$SITE"/*.dist-info 2>/dev/null | wc -l)
    IMPORTS="(imports not checked: Python $PYVER)"
    if [ "$RC" -eq 0 ] && [ "$PYVER" = "3.12" ]; then
        "$PY" -c "import fastapi, fastapi_offline, starlette, pydantic, uvicorn, httptools, orjson, uvloop, xxhash, prometheus_client" \
            >> "$LOGS/wheels.log" 2>&1 && IMPORTS="imports ok" || { IMPORTS="IMPORTS FAIL"; FAILED=1; }
    fi
    step "wheels: $(status) (${TOOK}s) $WHEELS wheels, $INSTALLED installed into $SITE; $IMPORTS"
fi

# -- build: the C copy path ------------------------------------------------------------------
# sidecar/_kvcopy.c hands a plan to the driver in one call (issue 54). A tree copied to the
# node has no build for its Python: build it in place. Not a failure when it cannot be built
# (no compiler): CUDA copies then go a run at a time from Python, and the sweep says so.
run build 120 bash -c '"$1" -c "import sidecar._kvcopy" 2>/dev/null && { echo "kvcopy: built already"; exit 0; }
"$1" setup.py -q build_ext --inplace && "$1" -c "import sidecar._kvcopy" && echo "kvcopy: built here"' _ "$PY"
KV=$(grep '^kvcopy:' "$LOGS/build.log" | tail -1 | cut -c9-)
line "build: $([ "$RC" -eq 0 ] && echo ok || echo 'not built') (${TOOK}s) sidecar/_kvcopy.c ${KV:-NOT BUILT (CUDA copies one Python call a run; see build.log)}"

# -- sidecar --------------------------------------------------------------------------------
run sidecar 90 "$PY" - <<'EOF'
import time
t = time.perf_counter()
from api.engine.client import SidecarClient
from loadtest.kit.procs import start_sidecar
side = start_sidecar("--host-pool", "1GiB", "--no-file-tier")
try:
    ready = time.perf_counter() - t
    stats = SidecarClient(side.socket_url).stats()
    print(f"sidecar: ready in {ready:.1f} s; 1 GiB host pool cudaHostRegister-ed: {stats['cuda_host_registered']}")
finally:
    side.stop()
EOF
step "sidecar: $(status) (${TOOK}s) $(grep '^sidecar:' "$LOGS/sidecar.log" | tail -1 | cut -c10-)"

# -- the gpu tests --------------------------------------------------------------------------
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts=-ra --timeout 150)
run gpu 200 "${PYTEST[@]}" tests/api/test_cuda_ipc_gpu.py tests/sidecar/test_cuda_ipc.py
step "gpu tests: $(status) (${TOOK}s) $(pytest_tail "$LOGS/gpu.log")"

run linker 150 "${PYTEST[@]}" tests/engines/adapters/test_linker_cuda_gpu.py tests/engines/adapters/test_linker_cuda.py
step "linker device path: $(status) (${TOOK}s) $(pytest_tail "$LOGS/linker.log")"

# -- bench ----------------------------------------------------------------------------------
run bench 150 "$PY" -m loadtest.micro.cuda_copy
if [ $DRY = 1 ] && [ "$RC" -eq 2 ]; then RC=0; fi   # no device: nothing to measure, as expected
step "bench: $(status) (${TOOK}s) $(grep '^bench_cuda:' "$LOGS/bench.log" | tail -1 | cut -c13-)"
[ "$RC" -eq 0 ] && grep -E '^(set|get|registration|device|sweep)' "$LOGS/bench.log" | sed 's/^/  /' | tee -a "$SUMMARY"

SWEEP=(--sweep)
[ $DRY = 1 ] && SWEEP=(--sweep --dry-run)
run sweep 150 "$PY" -m loadtest.micro.cuda_copy "${SWEEP[@]}"
step "sweep: $(status) (${TOOK}s) $(grep '^bench_cuda sweep:' "$LOGS/sweep.log" | tail -1 | cut -c19-)"
[ "$RC" -eq 0 ] && grep -E '^(sweep|  *(page|[0-9]+ [KM]iB) )' "$LOGS/sweep.log" | sed 's/^/  /' | tee -a "$SUMMARY"

rm -rf "$SITE"
line "gpu_check: $( [ $FAILED = 0 ] && echo PASS || echo FAIL) in $(( $(date +%s) - START ))s"
exit $FAILED
