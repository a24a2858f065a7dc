#!/usr/bin/env bash
# The GPU checks of the engine in one run, for a GPU machine with Python 3.12 and torch but no network
# (benchmarks/README.md, "The engine on a GPU"): the Triton kernel's and the decode graphs' tests, gpu_bench.py, then
# tests/test_cuda.py, tp_bench.py (2 GPUs and more). Needs .whl/ beside it: cp312 wheels of the runtime packages such a machine lacks (fastapi,
# pydantic, grpcio, protobuf, uvicorn, ...: `pip download --python-version 3.12 --only-binary=:all:`, the versions of
# .venv). Logs and the benchmark's JSON go to $OUT.
#   usage: OUT=/tmp/out bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v -i warning | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
t0=$SECONDS
timeout "${GRAPH_TESTS_S:-150}" python3 -m pytest -x -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_decode_graphs.py \
    > "$OUT/tests_graphs.log" 2>&1
echo "== graph and kernel tests rc=$? ($((SECONDS - t0)) s)"; tail -4 "$OUT/tests_graphs.log"
t0=$SECONDS
timeout "${BENCH_S:-330}" python3 -m benchmarks.gpu_bench --json "$OUT/gpu_bench.json" ${BENCH_ARGS:-} > "$OUT/gpu_bench.log" 2>&1
echo "== gpu_bench rc=$? ($((SECONDS - t0)) s)"; grep -v -i -E "warn|^\s*$" "$OUT/gpu_bench.log" | tail -30
t0=$SECONDS
timeout "${CUDA_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py > "$OUT/tests_cuda.log" 2>&1
echo "== test_cuda rc=$? ($((SECONDS - t0)) s)"; tail -6 "$OUT/tests_cuda.log"
t0=$SECONDS
# tensor parallelism (NCCL, a GPU a rank) against one GPU: skipped, saying so, on a machine with one GPU
timeout "${TP_BENCH_S:-240}" python3 -m benchmarks.tp_bench --device cuda --tp 2 --json "$OUT/tp_bench.json" > "$OUT/tp_bench.log" 2>&1
echo "== tp_bench rc=$? ($((SECONDS - t0)) s)"; grep -v -i -E "warn|^\s*$" "$OUT/tp_bench.log" | tail -6
