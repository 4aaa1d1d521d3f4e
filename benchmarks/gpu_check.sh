#!/usr/bin/env bash
# The GPU path in one command, from a fresh clone on a GPU machine:
#   1. checks that torch sees a CUDA device (exit 1 at once if not);
#   2. installs fluidserve over the machine's own torch and Triton
#      (pip install --no-deps --no-build-isolation -e .: no registry needed);
#   3. runs every GPU test (the whole kernel suite, fp32 included, and the
#      engine's Triton-vs-reference tests in fp32 and bf16);
#   4. runs the kernel benchmark (decode vs a device copy, prefill vs SDPA,
#      mixed batch with and without packing, compiled variants);
#   5. times batch-1 decode of a Llama-3-8B-shaped dummy model through the
#      engine against its HBM roofline;
#   6. with --throughput, the offline throughput benchmark against
#      transformers on a Llama-3-8B-shaped dummy model;
# and writes benchmarks/results/gpu_check_<device>.md (plus the benchmark's
# kernels_<device>.json/.md, batch1_decode_<device>.json/.md and the log)
# naming the device as torch reports it. Steps 1-5 are capped to fit in 10
# minutes; the exit status is non-zero if any step failed.
#
# Usage: benchmarks/gpu_check.sh [--quick] [--throughput] [--results DIR]
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
RESULTS=benchmarks/results
QUICK=()
THROUGHPUT=0
# Wall-clock limits per step (seconds): together well under 10 minutes.
TEST_LIMIT=300
BENCH_LIMIT=150
DECODE_LIMIT=120
THROUGHPUT_LIMIT=600

while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK=(--quick); shift ;;
        --throughput) THROUGHPUT=1; shift ;;
        --results) RESULTS=$2; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the kernels must compile, not run in the interpreter

fail() { echo "gpu_check: $*" >&2; exit 1; }

# 1. A CUDA device, or stop here.
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    fail "torch sees no CUDA device (torch.cuda.is_available() is False); this check needs a GPU"
fi
DEVICE=$("$PY" -c "import torch; print(torch.cuda.get_device_name())")
SLUG=$(printf '%s' "$DEVICE" | tr 'A-Z' 'a-z' | sed 's/[^a-z0-9]\{1,\}/_/g; s/^_//; s/_$//')
VERSIONS=$("$PY" -c "import sys, torch, triton; print(f'python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}')")
echo "gpu_check: $DEVICE; $VERSIONS"
mkdir -p "$RESULTS" || fail "cannot create $RESULTS"
LOG="$RESULTS/gpu_check_${SLUG}.log"
SUMMARY="$RESULTS/gpu_check_${SLUG}.md"
: > "$LOG"

declare -a STEPS=()
STATUS=0
step() {  # step NAME LIMIT CMD...: run, log, time, record
    local name=$1 limit=$2 rc t0
    shift 2
    echo "== $name" | tee -a "$LOG"
    t0=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    local took=$(( $(date +%s) - t0 ))
    local verdict="ok"
    if [ "$rc" -eq 124 ]; then verdict="TIMED OUT after ${limit} s"; elif [ "$rc" -ne 0 ]; then verdict="FAILED (exit $rc)"; fi
    [ "$rc" -ne 0 ] && STATUS=1
    STEPS+=("| $name | $verdict | ${took} s |")
    echo "== $name: $verdict in ${took} s" | tee -a "$LOG"
    return "$rc"
}

# 2. Install over the machine's torch/Triton; nothing is downloaded.
step "install (pip --no-deps -e .)" 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
    || fail "pip install --no-deps --no-build-isolation -e . failed; see $LOG"
step "import" 60 "$PY" -c "import fluidserve.kernels.paged_attention, fluidserve.engine" \
    || fail "the installed package does not import; see $LOG"

# 3. GPU tests: the kernel suite (every test there is marked gpu) and every
#    other module that has gpu tests. Modules are named, not discovered, so
#    that server tests needing packages this machine lacks are not collected.
#    Most of their time is Triton compiling one kernel variant per tested
#    shape, one CPU core each: spread the tests over workers when
#    pytest-xdist is there (workers share Triton's on-disk cache).
mapfile -t GPU_MODULES < <(grep -rl --include='test_*.py' 'mark.gpu' tests | grep -v '^tests/kernels/' | sort)
PARALLEL=()
if "$PY" -c "import xdist" 2>/dev/null; then
    PARALLEL=(-n "$(( $(nproc) < 8 ? $(nproc) : 8 ))")
fi
step "GPU tests (pytest -m gpu ${PARALLEL[*]} tests/kernels ${GPU_MODULES[*]})" "$TEST_LIMIT" \
    "$PY" -m pytest -q -m gpu -p no:cacheprovider -rfEs "${PARALLEL[@]}" tests/kernels "${GPU_MODULES[@]}"

# 4. Kernel benchmark.
step "kernel benchmark (benchmarks/kernels.py ${QUICK[*]})" "$BENCH_LIMIT" \
    "$PY" benchmarks/kernels.py --out "$RESULTS" "${QUICK[@]}"

# 5. Batch-1 decode of an 8B-shaped model against the HBM roofline.
step "batch-1 decode (benchmarks/kernels.py --batch1-decode)" "$DECODE_LIMIT" \
    "$PY" benchmarks/kernels.py --batch1-decode --out "$RESULTS"

# 6. Throughput against transformers (minutes of its own; on request).
if [ "$THROUGHPUT" -eq 1 ]; then
    step "throughput (benchmarks/throughput.py --preset llama3-8b)" "$THROUGHPUT_LIMIT" \
        "$PY" benchmarks/throughput.py --preset llama3-8b --out "$RESULTS"
fi

{
    echo "# GPU check on $DEVICE"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'); $VERSIONS; commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo
    echo "| step | result | time |"
    echo "|---|---|---:|"
    printf '%s\n' "${STEPS[@]}"
    echo
    echo "Test summary: $(grep -E '^[0-9]+ (passed|failed|errors?|skipped)|^=+ .* in [0-9.]+s' "$LOG" | tail -1)"
    for f in "kernels_${SLUG}.md" "batch1_decode_${SLUG}.md"; do
        [ -f "$RESULTS/$f" ] && echo && echo "See $f (and .json) beside this file."
    done
    echo
    echo "Full log: $(basename "$LOG")."
} > "$SUMMARY"
echo "gpu_check: wrote $SUMMARY"
[ "$STATUS" -eq 0 ] || echo "gpu_check: some steps failed; see $SUMMARY and $LOG" >&2
exit "$STATUS"
