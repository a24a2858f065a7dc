#!/usr/bin/env bash
# The GPU checks of the prefill-to-decode hand-off in one run, for a GPU machine with Python 3.12 and torch but no
# network (benchmarks/results/2026-11-26-decode-cache-handoff.md): tests/test_cuda.py (CUDA IPC between two processes, GPU
# clusters whose decode cache is written in place), staging_bench.py (each path against a plain prefill), then
# e2e_bench.py --device cuda (TTFT disaggregated against one engine). Needs .whl/ as
# benchmarks/gpu_check.sh does.
#   usage: OUT=/tmp/out bash benchmarks/handoff_gpu_check.sh
set -u
OUT=${OUT:-/tmp/handoff-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v -i warning | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
MODEL=/tmp/handoff-model
python3 -c "import torch; from benchmarks.gpu_bench import SHAPES; from mooncake.engine.tiny import make_tiny; make_tiny('$MODEL', 'llama', dtype=torch.bfloat16, **SHAPES['llama-1b'])" \
    > "$OUT/model.log" 2>&1 || { echo "make_tiny failed"; tail -5 "$OUT/model.log"; }
t0=$SECONDS
timeout "${CUDA_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > "$OUT/tests_cuda.log" 2>&1
echo "== test_cuda rc=$? ($((SECONDS - t0)) s)"; tail -6 "$OUT/tests_cuda.log"
t0=$SECONDS
timeout "${STAGING_S:-120}" python3 -m benchmarks.staging_bench --model "$MODEL" --device cuda --dtype bfloat16 --tokens 4096 \
    --chunk 4096 --json "$OUT/staging_bench.json" > "$OUT/staging_bench.log" 2>&1
echo "== staging_bench rc=$? ($((SECONDS - t0)) s)"; tail -9 "$OUT/staging_bench.log"
t0=$SECONDS
timeout "${E2E_S:-300}" python3 -m benchmarks.e2e_bench --model "$MODEL" --device cuda --dtype bfloat16 --sizes 1024,4096 \
    --overlap-sizes 4096 --reps 3 --max-tokens 32 --no-progress --json "$OUT/e2e_bench.json" > "$OUT/e2e_bench.log" 2>&1
echo "== e2e_bench rc=$? ($((SECONDS - t0)) s)"; grep -v -i -E "warn|^\s*$" "$OUT/e2e_bench.log" | tail -30
