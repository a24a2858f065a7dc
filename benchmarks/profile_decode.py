"""Where a steady-state decode step spends its time: step timings plus a torch profile.

    python -m benchmarks.profile_decode [--batch 32] [--prompt-len 512] [--model-dir DIR]

Prefills ``--batch`` random prompts, then times 15 pure-decode steps (min and median)
and profiles 5 more with torch.profiler (aten ops only: the compiled attention kernel
does not appear in the table, so the gap between the step time and the ops' total is
mostly attention). A diagnostic, not a benchmark: it has no baseline.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mooncake.engine import EngineConfig, LLMEngine, SamplingParams
from mooncake.engine.registry import default_cache_dir, pull


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--no-kernel", action="store_true", help="use the pure-torch decode attention")
    args = parser.parse_args()
    model_dir = args.model_dir or pull("smollm2-135m", default_cache_dir())
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            kv_cache_memory_gib=2,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,
            use_kernels=not args.no_kernel,
        )
    )
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request(torch.randint(100, 49000, (args.prompt_len,), generator=gen).tolist(), params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"decode step at batch {args.batch}: min {times[0] * 1e3:.1f} ms, median {times[7] * 1e3:.1f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
