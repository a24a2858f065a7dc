"""Where a GPU engine's time goes: per-step times of gpu_bench.py's throughput workload, and one 4,096-token prefill
under torch's profiler.

    python -m benchmarks.gpu_profile        # on a CUDA machine; prints, writes nothing

Makes gpu_bench.py's random-weight llama-1b, runs its 64 x 512/128 workload stepping the engine by hand and timing
each step (split into steps that mix prefill chunks with decodes and pure decode steps, by batch size), then a
decode step at 1, 32 and 64 running requests, a 4,096-token prompt at 512 and 4,096-token steps, and the profiler's
table of that prompt's kernels (top 18 by CUDA time). benchmarks/README.md, "The engine on a GPU", quotes a run
of it (on an H100, before the tensor-core decode kernel and the fused MLP activation).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_bench import SHAPES, engine_for, ours_decode_step, ours_ttft, prompts
from mooncake.engine import SamplingParams
from mooncake.engine.tiny import make_tiny


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    model_dir = Path(tempfile.mkdtemp(prefix="gpu-profile-")) / "model"
    make_tiny(model_dir, "llama", dtype=torch.bfloat16, **SHAPES["llama-1b"])
    engine = engine_for(model_dir, "cuda", "bfloat16")
    vocab = SHAPES["llama-1b"]["vocab_size"]
    engine.generate(prompts(4, 64, vocab, 7), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))

    steps = []  # [decodes, prefill tokens, execute s, step s]
    execute = engine.runner.execute

    def timed_execute(out, connector):
        decodes = sum(1 for s in out.scheduled if s.num_new_tokens == 1)
        prefill = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        result = execute(out, connector)
        torch.cuda.synchronize()
        steps.append([decodes, prefill, time.perf_counter() - t, 0.0])
        return result

    engine.runner.execute = timed_execute
    for p in prompts(64, 512, vocab, 8):
        engine.add_request(p, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps[-1][3] = time.perf_counter() - t
    wall = time.perf_counter() - start
    engine.runner.execute = execute
    print(f"throughput run: {len(steps)} steps, wall {wall:.3f} s, {64 * 128 / wall:.0f} tok/s")
    mixed = [x for x in steps if x[1]]
    pure = [x for x in steps if not x[1]]
    for name, group in (("mixed/prefill", mixed), ("decode-only", pure)):
        print(
            f"  {name} steps: {len(group)}, execute {sum(x[2] for x in group):.3f} s, step "
            f"{sum(x[3] for x in group):.3f} s"
        )
    for b in sorted({x[0] for x in pure}, reverse=True)[:6]:
        xs = [x for x in pure if x[0] == b]
        print(
            f"    batch {b}: {len(xs)} steps, execute median {statistics.median(x[2] for x in xs) * 1e3:.2f} ms, "
            f"step median {statistics.median(x[3] for x in xs) * 1e3:.2f} ms"
        )
    print(
        "  first 12 steps (decodes, prefill tokens, execute ms, step ms):",
        [(a, b, round(c * 1e3, 1), round(d * 1e3, 1)) for a, b, c, d in steps[:12]],
    )
    for b in (1, 32, 64):
        print(f"decode step at {b}: {ours_decode_step(engine, b, vocab, 30) * 1e3:.2f} ms")
    for budget in (512, 4096):
        print(f"4096-token prompt at {budget}-token steps: {ours_ttft(engine, vocab, budget, 3) * 1e3:.2f} ms")
    engine.scheduler.max_num_batched_tokens = 4096
    prompt = prompts(1, 4096, vocab, 999)[0]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
