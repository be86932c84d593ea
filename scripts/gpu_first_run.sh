#!/usr/bin/env bash
# A first GPU run in one command: install the wheels the GPU image lacks, print the
# versions, run checks/gpu_check.py (kernels, fp8 KV, bandwidth, graph memory, graphs,
# sampling, cuda:N, the KV tiers; then the model and the services), the CUDA IPC test,
# the GPU tests of the worker and the tier tests, each step's log under one folder, the whole run
# within --budget-s (default 530 s: under 9 minutes on one H200).
#
#   scripts/gpu_first_run.sh --prepare [--dry-run]   # on a CPU machine: wheels into .gpu-wheels/
#   scripts/gpu_first_run.sh                         # on the GPU machine, from the repository root
#   scripts/gpu_first_run.sh --out /tmp/logs --no-install --budget-s 300
#   scripts/gpu_first_run.sh --step gpu_check_services --step tier_stack_tests   # only these GPU steps
#
# Logs: $OUT if set (the device tool brings it back), else ./gpu-first-run/; one
# <step>.log each, and summary.txt: a line a step (ok, FAIL rc, SKIP why). Exit 0 when
# every step that ran passed and at least one GPU step ran; 1 when a step failed; 2 on a
# bad argument, or when no CUDA device was found (each GPU step then says it was skipped).
set -uo pipefail

usage() {
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    echo
    echo "options: --prepare  --dry-run  --wheels DIR (default .gpu-wheels)  --out DIR  --no-install"
    echo "         --budget-s SECONDS (default 530)  --python PYTHON (default python3)"
    echo "         --step NAME (repeatable; only these GPU steps: $GPU_STEPS)  -h, --help"
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS=".gpu-wheels"
LOGS="${OUT:-$ROOT/gpu-first-run}"
INSTALL=1
PREPARE=0
DRY_RUN=0
BUDGET_S=530
PYTHON="${PYTHON:-python3}"
GPU_STEPS="gpu_check_kernels gpu_check_services cuda_ipc_and_worker_tests tier_stack_tests"
SELECTED=""

need_value() {
    if [[ $# -lt 2 || -z "$2" || "$2" == --* ]]; then
        echo "gpu_first_run.sh: $1 needs a value" >&2
        exit 2
    fi
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --prepare) PREPARE=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --no-install) INSTALL=0; shift ;;
        --wheels) need_value "$@"; WHEELS="$2"; shift 2 ;;
        --out) need_value "$@"; LOGS="$2"; shift 2 ;;
        --python) need_value "$@"; PYTHON="$2"; shift 2 ;;
        --step)
            need_value "$@"
            if ! [[ " $GPU_STEPS " == *" $2 "* ]]; then
                echo "gpu_first_run.sh: --step '$2' is not one of: $GPU_STEPS" >&2
                exit 2
            fi
            SELECTED="$SELECTED $2 "; shift 2 ;;
        --budget-s)
            need_value "$@"
            if ! [[ "$2" =~ ^[0-9]+$ ]] || (( $2 < 60 )); then
                echo "gpu_first_run.sh: --budget-s must be a whole number of seconds, at least 60; got '$2'" >&2
                exit 2
            fi
            BUDGET_S="$2"; shift 2 ;;
        *) echo "gpu_first_run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done

cd "$ROOT" || exit 2
if (( DRY_RUN && !PREPARE )); then
    echo "gpu_first_run.sh: --dry-run goes with --prepare (it lists the wheels it would download)" >&2
    exit 2
fi
if (( PREPARE )); then
    exec "$PYTHON" scripts/gpu_wheels.py download --dest "$WHEELS" $( ((DRY_RUN)) && echo --dry-run )
fi

mkdir -p "$LOGS" || { echo "gpu_first_run.sh: cannot create $LOGS" >&2; exit 2; }
SUMMARY="$LOGS/summary.txt"
: > "$SUMMARY"
STARTED=$SECONDS
FAILED=0
GPU_STEPS_RAN=0
# The processes this script starts import the project from here (the launcher may have
# replaced PYTHONPATH; the wheels went into site-packages, not here).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME CAP_S COMMAND...: runs COMMAND with its output in NAME.log, for at most CAP_S
# seconds or what is left of the budget.
step() {
    local name="$1" cap="$2"
    shift 2
    local left=$(( BUDGET_S - (SECONDS - STARTED) ))
    if (( left < 20 )); then
        note "SKIP $name: out of time (--budget-s $BUDGET_S)"
        return
    fi
    local limit=$(( cap < left ? cap : left ))
    echo "== $name (at most ${limit} s) -> $LOGS/$name.log"
    local begun=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$LOGS/$name.log"
    if (( rc == 0 )); then
        note "ok   $name ($(( SECONDS - begun )) s)"
    else
        FAILED=1
        note "FAIL $name: rc $rc$( ((rc == 124 || rc == 137)) && echo " (timed out after ${limit} s)" ) ($(( SECONDS - begun )) s)"
    fi
}

# gpu_step: a step that needs a CUDA device; skipped, and said so, without one.
gpu_step() {
    if [[ -n "$SELECTED" && "$SELECTED" != *" $1 "* ]]; then
        note "SKIP $1: not among --step"
        return
    fi
    if (( ! HAVE_CUDA )); then
        note "SKIP $1: no CUDA device ($CUDA_WHY)"
        return
    fi
    GPU_STEPS_RAN=1
    step "$@"
}

if (( INSTALL )); then
    step install 150 "$PYTHON" scripts/gpu_wheels.py install --dest "$WHEELS"
else
    note "SKIP install: --no-install"
fi

step versions 60 "$PYTHON" - <<'EOF'
import importlib.metadata as metadata
import platform
print("python", platform.python_version())
for name in ("torch", "triton", "transformers", "numpy", "grpcio", "structlog", "pyzmq", "fastapi", "xgrammar"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "NOT INSTALLED")
import torch
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count(),
      "cuda", torch.version.cuda)
for index in range(torch.cuda.device_count()):
    print(f"cuda:{index}", torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))
EOF

# Read from the versions step's log: one torch import fewer.
HAVE_CUDA=0
if grep -q "^cuda available True" "$LOGS/versions.log" 2> /dev/null; then
    HAVE_CUDA=1
elif grep -q "^cuda available False" "$LOGS/versions.log" 2> /dev/null; then
    CUDA_WHY="torch.cuda.is_available() is False"
else
    CUDA_WHY="torch did not report; see $LOGS/versions.log"
fi

gpu_step gpu_check_kernels 330 "$PYTHON" checks/gpu_check.py --only kernels --only fp8_kv --only bandwidth \
    --only graph_memory --only graphs --only sampling --only cuda_n --only tiers
gpu_step gpu_check_services 330 "$PYTHON" checks/gpu_check.py --only model --only services \
    --services-logs "$LOGS/services"
# The device tool brings back at most 8 files: the services' logs travel as one.
if [[ -d "$LOGS/services" ]]; then
    for log in "$LOGS"/services/*.log; do
        [[ -e "$log" ]] && { echo "==> $(basename "$log")"; cat "$log"; }
    done > "$LOGS/services.log"
    rm -rf "$LOGS/services"
fi
# --timeout: a hung test fails with its stack and the next one runs, inside the step's time.
gpu_step cuda_ipc_and_worker_tests 120 "$PYTHON" -m pytest -q -p no:cacheprovider --timeout 60 -rfE \
    tests/test_pool_memory.py tests/test_cuda_threads.py tests/test_warmup_workspace.py -k "cuda or gpu or GPU"
gpu_step tier_stack_tests 150 "$PYTHON" -m pytest -q -p no:cacheprovider --timeout 40 -rfE tests/test_kv_tiers.py \
    tests/test_kv_tiers_cuda.py tests/test_kv_tiers_stack.py

note "total $(( SECONDS - STARTED )) s of --budget-s $BUDGET_S; logs in $LOGS"
if (( FAILED )); then
    exit 1
fi
if (( ! GPU_STEPS_RAN )); then
    note "nothing checked on a GPU: no CUDA device ($CUDA_WHY)"
    exit 2
fi
exit 0
