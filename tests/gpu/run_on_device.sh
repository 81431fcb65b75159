#!/usr/bin/env bash
# The whole GPU check in one command, from the repository root, on a machine with an NVIDIA GPU:
#
#     bash tests/gpu/run_on_device.sh
#
# Four parts, in this order, each under its own time limit, all within BUDGET_S seconds (default 540):
#   1. env      python3's torch, CUDA, NCCL, the GPU (nvidia-smi, read only), pytest's plugins;
#               without a CUDA GPU it stops here (exit 2) and says so
#   2. pytest   python3 -m pytest tests/gpu -q -rs: every one-GPU check runs; a one-GPU check that
#               skips is a failure; the 2-GPU ones skip on one GPU and say why
#   3. cli      compare --device cuda --world-size 1 (our FSDP vs torch FSDP1, then --impl fsdp2) and
#               the refusal of more ranks than GPUs, their output shown (pytest ran them too, and
#               bench fsdp --device cuda --config tiny, silently; part 4 runs the bench itself)
#   4. bench    bench fsdp --device cuda --config 85m,300m --precision fp32,bf16 --world-sizes 1
#               (one spawn per config and precision; its JSON is rewritten after each one)
# What it writes goes to $OUT (default out/device), one folder, 6 files: env.txt, pytest.log, cli.log,
# bench.log, bench_fsdp_cuda.json, summary.txt.  The last lines it prints are summary.txt.
# Exit status: 0 if every part passed, 1 if one failed, 2 if there is no GPU.
#
# DEVICE=cpu runs the same plumbing on a machine without a GPU (how this script is checked there):
# pytest expects every GPU test to skip, the CLI runs --device cpu, the bench is a tiny CPU one.
set -u -o pipefail

DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-out/device}"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-540}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/minifsdp_device.XXXXXX")"
: >"$SUMMARY"
START=$SECONDS
FAILED=0

say() { echo "[$(date +%H:%M:%S) +$((SECONDS - START))s] $*"; }
note() { echo "$*" | tee -a "$SUMMARY"; }

# limit WANT: WANT seconds, or what is left of the budget (at least 10), whichever is less
limit() {
    local want=$1 left=$((BUDGET_S - (SECONDS - START)))
    ((left < want)) && want=$left
    ((want < 10)) && want=10
    echo "$want"
}

# run LOG SECONDS CMD...: CMD under `timeout` (it signals the whole process group: ranks and fork server
# too), its output shown and appended to LOG; sets RC (124 or 137: it ran out of time)
run() {
    local log=$1 secs
    secs=$(limit "$2")
    shift 2
    say "\$ $* (limit ${secs}s)" | tee -a "$log"
    timeout -k 15 "$secs" "$@" 2>&1 | tee -a "$log"
    RC=${PIPESTATUS[0]}
    ((RC == 124 || RC == 137)) && say "TIMED OUT after ${secs}s: $*" | tee -a "$log"
    return 0
}

# ---------------------------------------------------------------- 1. env
say "part 1/4: env (DEVICE=$DEVICE, OUT=$OUT, budget ${BUDGET_S}s)"
{
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no .git)')"
    echo "host: $(cat /etc/hostname 2>/dev/null || echo '?'), $(nproc) CPUs, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    command -v nvidia-smi >/dev/null && timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv
    timeout 120 "$PY" - <<'EOF'
import importlib.util, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuda available {torch.cuda.is_available()}, GPUs {torch.cuda.device_count()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU 0: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}, "
          f"{p.multi_processor_count} SMs; NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
for m in ("pytest", "pytest_timeout", "matplotlib", "numpy", "tqdm"):
    print(f"{m}: {'yes' if importlib.util.find_spec(m) else 'MISSING'}")
EOF
} 2>&1 | tee "$OUT/env.txt"
NGPU=$(timeout 60 "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [[ "$DEVICE" == cuda && "$NGPU" -lt 1 ]]; then
    note "env: NO CUDA GPU visible to $PY (see $OUT/env.txt): this script is for a machine with an NVIDIA GPU;"
    note "     DEVICE=cpu bash tests/gpu/run_on_device.sh checks its plumbing on a CPU"
    exit 2
fi
note "env: $(grep -m1 '^python' "$OUT/env.txt"); $(grep -m1 '^GPU 0' "$OUT/env.txt" || echo 'no GPU (DEVICE=cpu)')"
TIMEOUT_OPT=()
grep -q '^pytest_timeout: yes' "$OUT/env.txt" && TIMEOUT_OPT=(--timeout 300)

# ---------------------------------------------------------------- 2. pytest tests/gpu
say "part 2/4: pytest tests/gpu"
LOG="$OUT/pytest.log"
: >"$LOG"
run "$LOG" 330 "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider ${TIMEOUT_OPT[@]+"${TIMEOUT_OPT[@]}"}
LAST=$(grep -E '(passed|failed|skipped|error)' "$LOG" | tail -1)
ONE_GPU_SKIPS=$(grep -c 'needs one GPU' "$LOG")
TWO_GPU_SKIPS=$(grep -c 'needs 2 GPUs' "$LOG")
if [[ "$DEVICE" == cuda ]]; then
    if ((RC != 0 || ONE_GPU_SKIPS > 0)); then STATUS=FAIL; FAILED=1; else STATUS=ok; fi
else  # no GPU: everything must be collected (no import error) and skip with its reason
    if ((RC != 0 || ONE_GPU_SKIPS == 0 || TWO_GPU_SKIPS == 0)); then STATUS=FAIL; FAILED=1; else STATUS=ok; fi
fi
note "pytest: $STATUS (exit $RC): $LAST; skip lines: $ONE_GPU_SKIPS 'needs one GPU', $TWO_GPU_SKIPS 'needs 2 GPUs'"
grep -E '^(FAILED|ERROR) ' "$LOG" | head -20 | sed 's/^/    /' | tee -a "$SUMMARY"

# ---------------------------------------------------------------- 3. the command line
say "part 3/4: the command line"
LOG="$OUT/cli.log"
: >"$LOG"
cli_check() {  # NAME EXPECTED_RC PATTERN CMD...: pass if CMD exits EXPECTED_RC and its output has PATTERN
    local name=$1 want=$2 pattern=$3 mark
    shift 3
    mark=$(wc -l <"$LOG")
    run "$LOG" 150 "$@"
    local found
    found=$(tail -n +"$((mark + 1))" "$LOG" | grep -E -m1 "$pattern")
    if [[ "$RC" == "$want" && -n "$found" ]]; then
        note "cli: ok   $name: $found"
    else
        FAILED=1
        note "cli: FAIL $name (exit $RC, wanted $want; '$pattern' ${found:+found}${found:-not found})"
    fi
}
M=("$PY" -m minifsdp)
cli_check "compare, our FSDP vs torch FSDP1" 0 '^VERDICT' \
    "${M[@]}" compare --device "$DEVICE" --world-size 1 --out "$SCRATCH/compare"
cli_check "compare --impl fsdp2" 0 '^VERDICT' \
    "${M[@]}" compare --device "$DEVICE" --world-size 1 --impl fsdp2 --out "$SCRATCH/compare2"
cli_check "train, 30 steps, then generate" 0 '^done: step 30/30' \
    "${M[@]}" train --device "$DEVICE" --world-size 1 --model mini --steps 30 --checkpoint-dir "$SCRATCH/run"
cli_check "generate from the run" 0 '^FSDP ' \
    "${M[@]}" generate --device "$DEVICE" --checkpoint "$SCRATCH/run" --prompt "FSDP " --tokens 60
if [[ "$DEVICE" == cuda ]]; then
    cli_check "more ranks than GPUs is refused" 2 'error: --device cuda' \
        "${M[@]}" compare --device cuda --world-size "$((NGPU + 1))" --out "$SCRATCH/compare3"
else
    cli_check "--device cuda without a GPU is refused" 2 'error: --device cuda' \
        "${M[@]}" compare --device cuda --world-size 1 --out "$SCRATCH/compare3"
fi

# ---------------------------------------------------------------- 4. the bench
say "part 4/4: bench fsdp"
LOG="$OUT/bench.log"
: >"$LOG"
if [[ "$DEVICE" == cuda ]]; then
    JSON="$OUT/bench_fsdp_cuda.json"
    run "$LOG" 600 "${M[@]}" bench fsdp --device cuda --config 85m,300m --precision fp32,bf16 --world-sizes 1 \
        --json "$JSON"
else
    JSON="$OUT/bench_fsdp_cpu.json"
    run "$LOG" 600 "${M[@]}" bench fsdp --config tiny --world-sizes 2 --steps 1 --warmup 0 --trainers ours_torch,fsdp1 \
        --json "$JSON"
fi
if ((RC == 0)) && [[ -s "$JSON" ]]; then STATUS=ok; else STATUS=FAIL; FAILED=1; fi
note "bench: $STATUS (exit $RC), $(grep -c '"trainer"' "$JSON" 2>/dev/null || echo 0) rows in $JSON"
sed -n '/^step time x torch FSDP1/,$p' "$LOG" | tee -a "$SUMMARY"
grep -E '^FAILED: ' "$LOG" | tee -a "$SUMMARY"

rm -rf "$SCRATCH"
note "total: $((SECONDS - START)) s of a ${BUDGET_S} s budget; $([[ $FAILED == 0 ]] && echo 'every part passed' || echo 'SOMETHING FAILED: see above and the logs')"
echo "===== $SUMMARY ====="
cat "$SUMMARY"
exit "$FAILED"
