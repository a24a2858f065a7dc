#!/usr/bin/env bash
# The whole cluster on one GPU, in one run of at most 10 minutes (each step bounded below; issue 46), for a GPU machine
# with Python 3.12 and torch but no network and no vLLM. Needs .whl/ beside it, as benchmarks/gpu_check.sh does:
#   1. the CUDA tests: the Triton kernels, the decode graphs, tests/test_cuda.py (CUDA IPC, GPU clusters)
#   2. gpu_bench.py: the engine against transformers and the device's limits (llama-1b shape, bfloat16)
#   3. staging_bench.py: each hand-off path against a plain prefill (4,096 tokens)
#   4. e2e_bench.py --device cuda: TTFT disaggregated against one engine, cold, warm and layer-wise
#   5. compare.py --device cuda: the conversation replay at x1 and x2 (the trace at benchmarks/trace.py's GPU_SCALE),
#      a prefill and a decode worker sharing the GPU against one coupled engine on it, early rejection live
# Not yet run on a GPU when written (2026-11-29). Logs and JSON go to $OUT.
#   usage: OUT=/tmp/out bash benchmarks/gpu_cluster_check.sh
set -u
OUT=${OUT:-/tmp/gpu-cluster-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v -i warning | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
MODEL=/tmp/cluster-model
python3 -c "import torch; from benchmarks.gpu_bench import SHAPES; from mooncake.engine.tiny import make_tiny; make_tiny('$MODEL', 'llama', dtype=torch.bfloat16, **SHAPES['llama-1b'])" \
    > "$OUT/model.log" 2>&1 || { echo "make_tiny failed"; tail -5 "$OUT/model.log"; }

step() {  # step NAME SECONDS LOG COMMAND...: run it bounded, say how it ended and how long it took
    local name=$1 limit=$2 log=$3
    shift 3
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$log" 2>&1
    echo "== $name rc=$? ($((SECONDS - t0)) s of $limit)"
}
step "CUDA tests" "${CUDA_TESTS_S:-150}" tests.log python3 -m pytest -q -p no:cacheprovider \
    tests/test_triton_kernels.py tests/test_decode_graphs.py tests/test_cuda.py
tail -6 "$OUT/tests.log"
step gpu_bench "${BENCH_S:-120}" gpu_bench.log python3 -m benchmarks.gpu_bench --model-dir "$MODEL-bench" --no-compiled \
    --json "$OUT/gpu_bench.json"
grep -v -i -E "warn|^\s*$" "$OUT/gpu_bench.log" | tail -20
step staging_bench "${STAGING_S:-60}" staging_bench.log python3 -m benchmarks.staging_bench --model "$MODEL" \
    --device cuda --dtype bfloat16 --tokens 4096 --chunk 4096 --json "$OUT/staging_bench.json"
tail -9 "$OUT/staging_bench.log"
step e2e_bench "${E2E_S:-120}" e2e_bench.log python3 -m benchmarks.e2e_bench --model "$MODEL" --device cuda \
    --dtype bfloat16 --sizes 1024,4096 --overlap-sizes 4096 --reps 3 --max-tokens 32 --no-progress \
    --json "$OUT/e2e_bench.json"
grep -v -i -E "warn|^\s*$" "$OUT/e2e_bench.log" | tail -20
step compare "${COMPARE_S:-150}" compare.log python3 -m benchmarks.compare --model "$MODEL" --device cuda \
    --systems coupled,disaggregated --policies kvcache_centric --preset conversation --limit "${COMPARE_LIMIT:-100}" \
    --sweep 1,2 --no-progress --keep-logs --json "$OUT/compare.json"
grep -v -i -E "warn|^\s*$" "$OUT/compare.log" | tail -25
