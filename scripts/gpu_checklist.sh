#!/usr/bin/env bash
# The GPU checklist of docs/benchmarks.md in one command, for a machine lent for minutes: the
# environment and `neuron doctor`, the kernel tests compiled for the card, each file of `gpu` tests
# in its own pytest run (so one that hangs or runs long still leaves the others' tracebacks), then
# one bench_gpu.py part. Every phase has its own time limit and the whole run a budget, so it ends
# on time with whatever it reached; each phase's log goes to LOGS (default ./gpu-checklist).
#
#   bash scripts/gpu_checklist.sh                    # about 8 minutes
#   BUDGET=300 BENCH=tp2 bash scripts/gpu_checklist.sh
#   BENCH_RESERVE=200 bash scripts/gpu_checklist.sh  # the test phases leave 200 s for the bench
#   SKIP="doctor kernels" FILES="test_lora test_gpu" bash scripts/gpu_checklist.sh  # what the last lease missed
#
# PYTHON (default python3) must have torch with CUDA and neuron's dependencies importable; on a machine
# without a package index, scripts/gpu_wheels.sh makes the wheels to carry. A collection of every
# `gpu` test runs first and names any module still missing. Failures print their tracebacks as they
# happen (NEURON_TEST_INSTAFAIL), so a phase cut by its limit still says why.
set -u
PYTHON=${PYTHON:-python3}
LOGS=${LOGS:-gpu-checklist}
BUDGET=${BUDGET:-480}   # seconds for the whole run
BENCH=${BENCH-decode}  # the bench_gpu.py part(s) run last with what time is left; empty for none
BENCH_RESERVE=${BENCH_RESERVE:-150}  # seconds the test phases leave for the bench (it needs about 2 minutes)
KERNEL_FILES=${KERNEL_FILES:-test_norm_kernels test_quant_kernels test_paged_attention test_lora_kernels}
FILE_LIMIT=${FILE_LIMIT:-200}  # seconds for each file of `gpu` tests (test_gpu alone has taken 260)
SKIP=${SKIP:-}  # phase names not to run (collect, doctor, kernels (every kernel file), a test file's name)
FILES=${FILES:-test_gpu test_sampling test_paged_kv test_moe test_quant_formats test_quantized test_structured_output \
test_host test_lora test_encoders}  # the files of `gpu` tests, each its own phase, in this order
export PYTHONUNBUFFERED=1 NEURON_LOG_LEVEL=${NEURON_LOG_LEVEL:-WARNING} NEURON_TEST_INSTAFAIL=1
mkdir -p "$LOGS"
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
# what a test phase may use: the time left less the bench's reserve
left_for_tests() { local room; room=$(left); [ -n "$BENCH" ] && room=$((room - BENCH_RESERVE)); echo "$room"; }

# phase NAME LIMIT COMMAND...: runs COMMAND under min(LIMIT, time left), logs it, prints its tail
phase() {
    local name=$1 limit=$2; shift 2
    case " $SKIP " in *" $name "*) echo "== $name: skipped (SKIP)"; return;; esac
    local room; room=$([ "$name" = bench ] && left || left_for_tests)
    [ "$limit" -gt "$room" ] && limit=$room
    if [ "$limit" -lt 15 ]; then echo "== $name: skipped, ${room}s left"; return; fi
    echo "== $name (limit ${limit}s, ${room}s left)"
    timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    [ $rc -eq 124 ] && echo "   timed out after ${limit}s"
    echo "   rc=$rc"
    grep -E "^(FAILED|ERROR|E  )|^==== |passed|failed|selected|Timeout|Error:|error:" "$LOGS/$name.log" | tail -40 | cut -c1-400
}

# pytest with short tracebacks, printed when each run ends
PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider --timeout "${TEST_TIMEOUT:-120}" --tb=short -rfEs)

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} >"$LOGS/environment.log" 2>&1
cat "$LOGS/environment.log"

phase collect 60 "$PYTHON" -m pytest -q -p no:cacheprovider --collect-only -m gpu tests
phase doctor 120 "$PYTHON" -m neuron doctor
# The kernel tests compiled for the card, each file in its own pytest (one crashed the whole phase once).
# The compile matrix (every tile for sm_80..sm_120) needs no GPU and runs in CI; left out here.
case " $SKIP " in *" kernels "*) echo "== kernels: skipped (SKIP)";; *)
    for file in $KERNEL_FILES; do
        phase "$file" 90 "${PYTEST[@]}" "tests/$file.py" -k "not every_tile_the_runtime_picks and not every_supported_gpu"
    done;;
esac
for file in $FILES; do
    phase "$file" "$FILE_LIMIT" "${PYTEST[@]}" -m gpu "tests/$file.py"
done
if [ -n "$BENCH" ]; then
    room=$(($(left) - 10))
    phase bench "$room" "$PYTHON" scripts/bench_gpu.py --shapes 0.6b --only "$BENCH" --attention paged \
        --deadline $((room > 60 ? room - 20 : 40)) --out "$LOGS/bench.json" --md "$LOGS/bench.md"
    [ -f "$LOGS/bench.md" ] && cat "$LOGS/bench.md"
fi
echo "== done in $(($(date +%s) - start)) s; logs in $LOGS"
