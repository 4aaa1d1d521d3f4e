#!/usr/bin/env bash
# The GPU path in one command, from a fresh clone on a bare GPU machine.
# Steps, most valuable first, each under its own wall-clock limit:
#
#   step                 limit (full / --quick)
#   install                60 / 60 s   pip install --no-deps --no-build-isolation -e .
#                                      over the machine's torch and Triton
#   import                 45 / 45 s   fluidserve.engine and the Triton kernels import
#   engine GPU tests      180 / 120 s  pytest -m gpu over every test module outside
#                                      tests/kernels that has gpu tests
#   kernel GPU tests      240 / 90 s   pytest -m gpu tests/kernels (the whole suite)
#   batch-1 decode        150 / 90 s   Llama-3-8B-shaped dummy model, eager, with
#                                      decode CUDA graphs, and graphs with async
#                                      scheduling, against the HBM roofline; then
#                                      eager without the row kernels and without
#                                      relaunching, graphs without the direct
#                                      (merge-free) graphs (what each saves), and
#                                      graphs + async and eager with the GEMVs
#                                      launched as programmatic dependents (with an
#                                      L2 prefetch, and the attention letting the
#                                      next launch start), and with n-gram drafts:
#                                      synchronous, beside async scheduling, and
#                                      verifying as piecewise graphs
#   batch-1 linears        60 / 45 s   benchmarks/linear_bandwidth.py --parts chain: a
#                                      token's GEMVs in a row in one graph, launched
#                                      plainly and as programmatic dependents (with
#                                      and without the L2 prefetch)
#   mixed steps            90 / 60 s   benchmarks/mixed_steps.py: prefill chunks beside
#                                      decodes, eager (the layers' batch path, and
#                                      through the modules) against piecewise graphs
#                                      (and decode-only against decode graphs)
#   kernel benchmark       90 / 60 s   benchmarks/kernel_bench.py (--quick: short sweep):
#                                      decode, prefill against SDPA, a mixed step's plans
#   MoE experts            90 / 60 s   benchmarks/kernel_bench.py --moe: the Triton grouped
#                                      GEMM, eager and in a graph, against the torch
#                                      reference at Qwen3-30B-A3B's and Mixtral-8x7B's
#                                      layers (--quick: 1 and 512 tokens), then over
#                                      experts held as stored (int4, e4m3) against
#                                      dense bf16
#   int linears            60 / 45 s   benchmarks/int_linear_bandwidth.py: GPTQ/AWQ-style
#                                      4- and 8-bit and float8 weights kept as stored
#                                      (kernels/int_linear.py, fp8_linear.py) against
#                                      bf16 cuBLAS and the bf16 GEMV at Llama-3-8B's
#                                      linears
#   packed decode         120 / 90 s   benchmarks/packed_weights.py --preset llama3-8b:
#                                      a random 4-bit GPTQ checkpoint served packed
#                                      against dequantized, decode at batch 1 and 8
#   throughput            180 / 90 s   offline, graphs on, against transformers:
#                                      64 prompts x 128 tokens, and again with
#                                      async scheduling, and (last) with piecewise
#                                      graphs (--quick: 32 x 64, no generate_batch,
#                                      no async or piecewise run)
#   decode profile         90 / 60 s   benchmarks/profile_decode.py: torch's profiler
#                                      over batch-1 decode in the same three modes (GPU idle
#                                      time, launches, top kernels and host ops)
#   swap copy              45 / 30 s   benchmarks/swap_copy.py: KV swaps against a
#                                      pinned copy, and a step beside a swap
#   packed MoE decode     120 / 90 s   benchmarks/packed_weights.py --moe: a random
#                                      Qwen3-MoE (Qwen3-30B-A3B's layers, 8 of them)
#                                      of 4-bit GPTQ experts served packed against
#                                      dequantized, decode at batch 1 and 8
#
# The whole run has a budget: 540 s (--quick 225 s), so it ends within 9 (4)
# minutes; --budget SECONDS sets another (a machine with less time left). A
# step gets its limit or what is left of the budget, whichever is less, and
# is skipped with under 30 s left: when time runs short, the least valuable
# steps go. Each step's results are written as it ends, so a run cut
# off part-way keeps what it finished; in --results DIR (benchmarks/results):
#   gpu_check_<device>.md, .json   the summary: step, verdict, time, headline
#                                  figure (rewritten after every step)
#   gpu_check_<device>.log         every step's output
#   gpu_tests_engine_<device>.json, gpu_tests_kernels_<device>.json
#                                  counts, failures, and where the time went:
#                                  the slowest tests and modules
#   batch1_decode_<device>.json, .md
#   mixed_steps_<device>.json, .md
#   throughput-<device>-llama3-8b-graphs.json, .md
#   kernels_<device>.json, .md
#   gemv_chain_<device>.json, .md
#   profile_decode_<device>.json, .md
#   swap_copy_<device>.json, .md
#   int_linear_bandwidth_<device>.json, .md
#   packed_weights-<device>-llama3-8b.json, .md
#   packed_weights-<device>-moe.json, .md
# <device> is torch.cuda.get_device_name() in lower case, other characters
# as _. Without CUDA it stops at once (status 1) before installing or writing
# anything. The status is 0 only if every step ran and passed.
#
# --skip STEP[,STEP...] leaves steps out (recorded as skipped), by the keys
# of the summary: engine_tests kernel_tests batch1_decode linears mixed_steps
# kernel_bench moe int_linears packed_decode throughput profile swap_copy
# packed_moe; for a rerun that spends a short lease on what changed.
#
# Usage: benchmarks/gpu_check.sh [--quick] [--budget SECONDS] [--skip STEPS] [--results DIR] [--help]
# (--throughput is accepted for older callers and changes nothing: throughput always runs.)
set -uo pipefail

START=$SECONDS
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
RESULTS=benchmarks/results
QUICK=0
BUDGET_ARG=""
SKIP=","

while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK=1; shift ;;
        --throughput) shift ;;
        --results)
            [ $# -ge 2 ] || { echo "gpu_check: --results needs a directory" >&2; exit 2; }
            RESULTS=$2; shift 2 ;;
        --budget)
            [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || { echo "gpu_check: --budget needs a number of seconds" >&2; exit 2; }
            BUDGET_ARG=$2; shift 2 ;;
        --skip)
            [ $# -ge 2 ] || { echo "gpu_check: --skip needs step names, comma-separated" >&2; exit 2; }
            SKIP="$SKIP$2,"; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

if [ "$QUICK" -eq 1 ]; then
    MODE=quick BUDGET=225
    INSTALL_LIMIT=60 IMPORT_LIMIT=45 ENGINE_TESTS_LIMIT=120 KERNEL_TESTS_LIMIT=90
    DECODE_LIMIT=90 THROUGHPUT_LIMIT=90 BENCH_LIMIT=60 LINEAR_LIMIT=45 PROFILE_LIMIT=60 SWAP_LIMIT=30 MOE_LIMIT=60
    INT_LIMIT=45 PACKED_LIMIT=90
    MIXED_LIMIT=60 MIXED_ARGS=(--reps 10)
    THROUGHPUT_SIZE=(--num-prompts 32 --output-len 64 --skip-continuous)
    BENCH_ARGS=(--quick)
    PROFILE_ARGS=(--output-len 32 --python-top 0)
    SWAP_ARGS=(--repeats 5)
else
    MODE=full BUDGET=540
    INSTALL_LIMIT=60 IMPORT_LIMIT=45 ENGINE_TESTS_LIMIT=180 KERNEL_TESTS_LIMIT=240
    DECODE_LIMIT=150 THROUGHPUT_LIMIT=180 BENCH_LIMIT=90 LINEAR_LIMIT=60 PROFILE_LIMIT=90 SWAP_LIMIT=45 MOE_LIMIT=90
    INT_LIMIT=60 PACKED_LIMIT=120
    MIXED_LIMIT=90 MIXED_ARGS=()
    THROUGHPUT_SIZE=(--num-prompts 64 --output-len 128 --async-scheduling --piecewise-graphs)
    BENCH_ARGS=()
    PROFILE_ARGS=()
    SWAP_ARGS=()
fi
BUDGET=${BUDGET_ARG:-$BUDGET}
GRACE=10     # timeout's TERM, then KILL this much later
RESERVE=5    # for the summary after the last step
MIN_SLOT=30  # a step given less would only time out

export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the kernels must compile, not run in the interpreter

fail() { echo "gpu_check: $*" >&2; exit 1; }

# A CUDA device, or stop here; one interpreter start for the device's name
# and the versions.
PROBE=$(timeout 120 "$PY" - <<'EOF'
import re
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(3)
name = torch.cuda.get_device_name()
try:
    import triton

    triton_version = triton.__version__
except ImportError:
    triton_version = "absent"
print(name)
print(re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_"))  # as benchmarks/kernel_bench.py names its files
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton_version}")
EOF
)
rc=$?
[ "$rc" -eq 3 ] && fail "torch sees no CUDA device (torch.cuda.is_available() is False); this check needs a GPU"
[ "$rc" -eq 0 ] || fail "could not ask $PY's torch for its CUDA device (exit $rc)"
{ read -r DEVICE; read -r SLUG; read -r VERSIONS; } <<< "$PROBE"
echo "gpu_check: $DEVICE; $VERSIONS; $MODE run, budget $BUDGET s"

mkdir -p "$RESULTS" || fail "cannot create $RESULTS"
LOG="$RESULTS/gpu_check_${SLUG}.log"
SUMMARY="$RESULTS/gpu_check_${SLUG}.json"
: > "$LOG"
SCRATCH=$(mktemp -d) || fail "cannot create a scratch folder"
REPORT=("$PY" benchmarks/gpu_check_report.py)
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ "$COMMIT" != unknown ] && ! git diff --quiet HEAD 2>/dev/null; then
    COMMIT="$COMMIT with uncommitted changes"
fi

declare -A NAMES=(
    [install]="install (pip --no-deps -e .)"
    [import]="import"
    [engine_tests]="engine GPU tests"
    [kernel_tests]="kernel GPU tests"
    [batch1_decode]="batch-1 decode, eager, graphs, graphs + async, eager variants, dependent GEMVs, drafts"
    [mixed_steps]="mixed steps, eager (batch path, modules) vs piecewise graphs"
    [throughput]="throughput vs transformers, graphs"
    [kernel_bench]="kernel benchmark"
    [moe]="MoE experts, Triton vs torch"
    [int_linears]="int4, int8 and fp8 linears vs bf16"
    [packed_decode]="packed GPTQ weights vs dequantized, decode"
    [linears]="batch-1 linears in a row, plain and dependent"
    [profile]="decode profile"
    [swap_copy]="swap copy"
    [packed_moe]="packed GPTQ experts vs dequantized, decode"
)
ORDER=(install import engine_tests kernel_tests batch1_decode linears mixed_steps kernel_bench moe int_linears
       packed_decode throughput profile swap_copy packed_moe)
IFS=, read -ra SKIPPED <<< "${SKIP#,}"
for key in "${SKIPPED[@]}"; do
    [[ -n ${NAMES[$key]+set} ]] || fail "--skip: no step named $key (see --help)"
done
PLAN=()
for key in "${ORDER[@]}"; do PLAN+=("$key=${NAMES[$key]}"); done
"${REPORT[@]}" init --summary "$SUMMARY" --device "$DEVICE" --versions "$VERSIONS" --commit "$COMMIT" \
    --mode "$MODE" --budget "$BUDGET" --log "$(basename "$LOG")" --plan "${PLAN[@]}" \
    || fail "cannot write $SUMMARY"

trap 'rm -rf "$SCRATCH"' EXIT
# A run stopped from outside records the step in progress (which its own
# limit bounds), skips the rest and still prints its summary.
STOPPED=""
trap 'STOPPED="the run was stopped"' INT TERM

SETUP_FAILED=""
# run_step KEY CAP RESULT_JSON JUNIT_XML CMD...: run under min(CAP, budget
# left), log, time, and record in the summary with the headline read from
# RESULT_JSON (from JUNIT_XML first, for tests).
run_step() {
    local key=$1 cap=$2 result=$3 junit=$4
    shift 4
    local name=${NAMES[$key]} limit rc t0 took
    if [[ $SKIP == *",$key,"* ]]; then
        echo "== $name: skipped (--skip)" | tee -a "$LOG"
        "${REPORT[@]}" step --summary "$SUMMARY" --key "$key" --skipped "left out with --skip"
        return 0
    fi
    if [ -n "$SETUP_FAILED$STOPPED" ]; then
        "${REPORT[@]}" step --summary "$SUMMARY" --key "$key" --skipped "${STOPPED:-$SETUP_FAILED}"
        return 1
    fi
    limit=$(( BUDGET - (SECONDS - START) - GRACE - RESERVE ))
    [ "$limit" -gt "$cap" ] && limit=$cap
    if [ "$limit" -lt "$MIN_SLOT" ]; then
        echo "== $name: skipped, ${limit} s of the budget left" | tee -a "$LOG"
        "${REPORT[@]}" step --summary "$SUMMARY" --key "$key" --limit "$cap" \
            --skipped "no time left (${limit} s of the ${BUDGET} s budget)"
        return 1
    fi
    [ -n "$junit" ] && rm -f "$junit"
    echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
    t0=$(date +%s)
    timeout -k "$GRACE" "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    took=$(( $(date +%s) - t0 ))
    echo "== $name: exit $rc after ${took} s" | tee -a "$LOG"
    "${REPORT[@]}" step --summary "$SUMMARY" --key "$key" --rc "$rc" --seconds "$took" --limit "$limit" \
        --since "$t0" --command="$*" ${result:+--result "$result"} ${junit:+--junit "$junit"}
    return "$rc"
}

# pytest that takes timeout's TERM as an interrupt, so that it still writes
# its report of the tests that ran before the limit.
PYTEST=("${REPORT[@]}" pytest -q -m gpu -p no:cacheprovider -rfEs)
# Most of the tests' time is Triton compiling a kernel variant per tested
# shape, one CPU core each: spread them over a worker per core (up to 16)
# where pytest-xdist is installed (the workers share Triton's on-disk cache;
# the tests' models are small, so 16 CUDA contexts fit one GPU).
if "$PY" -c "import xdist" 2>/dev/null; then
    PYTEST+=(-n "$(( $(nproc) < 16 ? $(nproc) : 16 ))")
fi

run_step install "$INSTALL_LIMIT" "" "" \
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
    || SETUP_FAILED="the install failed"
run_step import "$IMPORT_LIMIT" "" "" \
    "$PY" -c "import fluidserve.kernels.paged_attention, fluidserve.engine" \
    || SETUP_FAILED=${SETUP_FAILED:-"fluidserve does not import"}

# Engine tests: modules are found, not listed, but only outside
# tests/kernels, so that server tests needing packages this machine lacks
# are never collected.
mapfile -t ENGINE_MODULES < <(grep -rl --include='test_*.py' 'mark.gpu' tests | grep -v '^tests/kernels/' | sort)
if [ "${#ENGINE_MODULES[@]}" -eq 0 ]; then
    "${REPORT[@]}" step --summary "$SUMMARY" --key engine_tests --skipped "no module outside tests/kernels has gpu tests"
else
    run_step engine_tests "$ENGINE_TESTS_LIMIT" "$RESULTS/gpu_tests_engine_${SLUG}.json" "$SCRATCH/engine.xml" \
        "${PYTEST[@]}" --junitxml="$SCRATCH/engine.xml" "${ENGINE_MODULES[@]}"
fi
run_step kernel_tests "$KERNEL_TESTS_LIMIT" "$RESULTS/gpu_tests_kernels_${SLUG}.json" "$SCRATCH/kernels.xml" \
    "${PYTEST[@]}" --junitxml="$SCRATCH/kernels.xml" tests/kernels

run_step batch1_decode "$DECODE_LIMIT" "$RESULTS/batch1_decode_${SLUG}.json" "" \
    "$PY" benchmarks/kernel_bench.py --batch1-decode --decode-modes eager graphs graphs-async \
    eager-cublas eager-no-relaunch graphs-async-always-merge graphs-async-pdl graphs-async-pdl-l2 \
    graphs-async-pdl-l2-attention eager-pdl graphs-drafts graphs-async-drafts graphs-async-drafts-piecewise \
    --out "$RESULTS"

run_step linears "$LINEAR_LIMIT" "$RESULTS/gemv_chain_${SLUG}.json" "" \
    "$PY" benchmarks/linear_bandwidth.py --parts chain --out "$RESULTS"

run_step mixed_steps "$MIXED_LIMIT" "$RESULTS/mixed_steps_${SLUG}.json" "" \
    "$PY" benchmarks/mixed_steps.py --out "$RESULTS" "${MIXED_ARGS[@]}"

run_step kernel_bench "$BENCH_LIMIT" "$RESULTS/kernels_${SLUG}.json" "" \
    "$PY" benchmarks/kernel_bench.py --out "$RESULTS" "${BENCH_ARGS[@]}"

run_step moe "$MOE_LIMIT" "$RESULTS/moe_${SLUG}.json" "" \
    "$PY" benchmarks/kernel_bench.py --moe --out "$RESULTS" "${BENCH_ARGS[@]}"

run_step int_linears "$INT_LIMIT" "$RESULTS/int_linear_bandwidth_${SLUG}.json" "" \
    "$PY" benchmarks/int_linear_bandwidth.py --out "$RESULTS"

run_step packed_decode "$PACKED_LIMIT" "$RESULTS/packed_weights-${SLUG}-llama3-8b.json" "" \
    "$PY" benchmarks/packed_weights.py --preset llama3-8b --device cuda --rounds 1 --reply-tokens 16 \
    --decode-tokens 32

run_step throughput "$THROUGHPUT_LIMIT" "$RESULTS/throughput-${SLUG}-llama3-8b-graphs.json" "" \
    "$PY" benchmarks/throughput.py --preset llama3-8b --device cuda --no-enforce-eager "${THROUGHPUT_SIZE[@]}" \
    --out "$RESULTS"

run_step profile "$PROFILE_LIMIT" "$RESULTS/profile_decode_${SLUG}.json" "" \
    "$PY" benchmarks/profile_decode.py --out "$RESULTS" "${PROFILE_ARGS[@]}"

run_step swap_copy "$SWAP_LIMIT" "$RESULTS/swap_copy_${SLUG}.json" "" \
    "$PY" benchmarks/swap_copy.py --out "$RESULTS" "${SWAP_ARGS[@]}"

run_step packed_moe "$PACKED_LIMIT" "$RESULTS/packed_weights-${SLUG}-moe.json" "" \
    "$PY" benchmarks/packed_weights.py --moe --device cuda --rounds 1 --reply-tokens 16 --decode-tokens 32

"${REPORT[@]}" finish --summary "$SUMMARY"
status=$?
echo "gpu_check: wrote ${SUMMARY%.json}.md and .json; log $LOG"
[ -z "$STOPPED" ] || exit 130
exit "$status"
