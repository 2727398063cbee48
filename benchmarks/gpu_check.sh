#!/usr/bin/env bash
# Hybrid GPU/CPU check on a CUDA machine, in under 8 minutes:
#   1. torch with CUDA (installs torch==2.13.0 when torch sees no GPU; PyPI's Linux wheel has CUDA),
#      then this package (compiles the C kernels) and the test tools;
#   2. the CUDA tests (tests named *cuda*: hybrid == CPU sparse on the GPU, the VRAM budget is a
#      promise: peak torch.cuda.max_memory_allocated <= budget), skipped without a GPU;
#   3. Qwen2.5-Coder-1.5B (sparseinfer pull) and a quick sparsity pack for it (calibrated on this
#      repository's own source code, made in the background while the tests run);
#   4. one table: hybrid (hot neurons on the GPU) and the dense layer-offload baseline (-ngl) at
#      VRAM budgets of 0, 25, 50 and 100% of the model's size: prompt and decode tok/s, bytes on
#      the GPU, expected share of FFN activations served by the GPU, peak GPU memory vs budget.
#
# Usage: bash benchmarks/gpu_check.sh        (PYTHON=python3.11 to pick the interpreter)
# Output: the table on stdout, JSON rows in gpu_check.jsonl, logs in gpu_check_logs/.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
PY=${PYTHON:-python3}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
LOGS=gpu_check_logs
mkdir -p "$LOGS"
log() { echo "[gpu_check +$((SECONDS - START))s] $*"; }
left() { echo $((470 - (SECONDS - START))); }   # seconds left of the 8-minute plan (with margin)

# ---------------------------------------------------------------- 1. torch with CUDA, the package
has_cuda() { "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
if ! has_cuda; then
    log "torch does not see a GPU here; installing torch==2.13.0 from PyPI (its Linux wheel is built with CUDA)"
    "$PY" -m pip install -q "torch==2.13.0" >"$LOGS/pip_torch.log" 2>&1 || log "pip install torch failed (see $LOGS/pip_torch.log)"
fi
if ! "$PY" - <<'EOF'
import sys
import torch
print(f"torch {torch.__version__}, built with CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    print("ERROR: torch sees no CUDA GPU. Either this machine has none (check nvidia-smi), or torch is a CPU-only "
          "build (torch.version.cuda is None): install a CUDA build, e.g. "
          "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128", file=sys.stderr)
    sys.exit(1)
p = torch.cuda.get_device_properties(0)
free, total = torch.cuda.mem_get_info()
print(f"GPU: {p.name}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free), compute capability {p.major}.{p.minor}")
EOF
then
    exit 2
fi
log "installing sparseinfer (editable; compiles the C kernels) and test tools"
if ! "$PY" -m pip install -q -e . pytest hypothesis "transformers>=4.45" >"$LOGS/pip.log" 2>&1; then
    log "pip install failed (see $LOGS/pip.log); trying with what is installed"
fi
"$PY" -c "from sparseinfer.kernels import cpu; print('CPU kernels:', cpu.simd_level(), cpu.get_num_threads(), 'threads')" || exit 3

# ---------------------------------------------------------------- 3a. model, pack in the background
log "fetching $MODEL"
GGUF=$("$PY" - "$MODEL" <<'EOF' 2>"$LOGS/pull.log"
import sys
from sparseinfer import catalog
print(catalog.pull(sys.argv[1], quiet=True))
EOF
) || GGUF=""
PREP_PID=""
if [ -z "$GGUF" ]; then
    log "could not fetch $MODEL (see $LOGS/pull.log); the benchmark table will be skipped"
elif [ -f "$GGUF.sparse" ]; then
    log "sparsity pack found: $GGUF.sparse"
else
    # calibration text: this repository's Python sources and docs (a coder model reads code)
    CALIB="$LOGS/calibration.txt"
    find sparseinfer tests benchmarks -name '*.py' -print0 | xargs -0 cat >"$CALIB"
    cat README.md docs/*.md >>"$CALIB" 2>/dev/null
    # as long as the plan allows, keeping ~170 s for the table (2560 tokens: 10 sequences of 256,
    # the fewest for which prepare's train/tune/report split is non-empty)
    PT=$(($(left) - 170)); [ "$PT" -lt 60 ] && PT=60
    log "making a quick sparsity pack in the background, at most ${PT}s ($LOGS/prepare.log)"
    timeout "$PT" "$PY" -m sparseinfer.commands prepare "$GGUF" --data "$CALIB" --target-sparsity 0.6 --tokens 2560 \
        --steps 80 --sizes 64 --no-eval --no-plot >"$LOGS/prepare.log" 2>&1 &
    PREP_PID=$!
fi

# ---------------------------------------------------------------- 2. CUDA tests
log "CUDA tests"
timeout 170 "$PY" -m pytest -q -rs -k cuda tests/test_hybrid.py tests/test_placement.py 2>&1 | tee "$LOGS/pytest.log" | tail -25
TESTS=${PIPESTATUS[0]}
[ "$TESTS" -eq 0 ] && log "CUDA tests passed" || log "CUDA tests FAILED or timed out (exit $TESTS; see $LOGS/pytest.log)"

# ---------------------------------------------------------------- 4. the table
BENCH=1
if [ -n "$GGUF" ]; then
    MODES="neurons,layers"
    if [ -n "$PREP_PID" ]; then
        wait "$PREP_PID" && log "sparsity pack made" || log "prepare failed or timed out (see $LOGS/prepare.log)"
    fi
    if [ ! -f "$GGUF.sparse" ]; then
        log "no sparsity pack: only the dense layer-offload baseline (and CPU) rows"
        MODES="layers"
    fi
    T=$(left)
    [ "$T" -lt 60 ] && T=60
    log "benchmark ($MODES at 0/25/50/100% of the model size; ${T}s left)"
    rm -f gpu_check.jsonl
    timeout "$T" "$PY" -m sparseinfer.commands.hybrid_bench -m "$GGUF" --modes "$MODES" --budgets 0,0.25,0.5,1 \
        -c 1024 --n-prompt 64 --n-gen 32 --json gpu_check.jsonl 2>"$LOGS/bench.log"
    BENCH=$?
    [ "$BENCH" -eq 0 ] || log "benchmark exit $BENCH (1: a peak exceeded its budget; 124: timed out; see $LOGS/bench.log)"
fi
log "done in $((SECONDS - START))s (tests exit $TESTS, benchmark exit $BENCH)"
[ "$TESTS" -eq 0 ] && [ "$BENCH" -eq 0 ]
