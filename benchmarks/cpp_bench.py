"""Chunked pipeline parallelism: TTFT of one long prompt through X pipeline stages against one stage, same run.

    python -m benchmarks.cpp_bench [--quick] [--model NAME|DIR] [--long 8192] [--short 256] [--chunk 512]
                                   [--stages 2 3] [--processes | --cluster] [--json PATH]

Each stage computes with one thread (``torch.set_num_threads(1)``), so X stages use X
cores; the baseline is the same code with one stage holding every layer, on one core.
Stages run as threads of this process (mooncake/engine/pipeline.py: torch releases the
GIL inside its kernels; the hidden states of a chunk pass in memory), or with
``--processes`` as processes (prefill/stage_process.py: a chunk's hidden states
through the transfer engine, shm here), the baseline then a single stage process too.
TTFT here is the prefill alone (from the first chunk to the first token), the median
of ``--repeats`` runs (``--long-repeats`` for the long prompt). With ``--cluster`` it is
the whole system's: ``mooncake up``'s cluster (Conductor, pool node, one prefill worker,
one decode worker, gateway; every worker one thread) whose prefill worker is a single
engine, then a group of X stage processes, a streamed completion's first token as the
client sees it over HTTP (each prompt new to the pool). Results and what they
do not include: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.benchutil import describe_machine, resolve_model
from mooncake.blocks import blocks_for
from mooncake.engine.model_args import ModelArgs
from mooncake.engine.pipeline import LocalPipeline
from mooncake.engine.request import SamplingParams
from mooncake.engine.stage import PipelineStage, split_layers
from mooncake.engine.weights import load_hf_config
from prefill.stage_process import ProcessPipeline, StageRequest, StageSpec

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def ttft(pipeline: LocalPipeline, prompt: list[int], chunk: int, repeats: int) -> tuple[float, int]:
    times, token = [], None
    for r in range(repeats):
        t = time.perf_counter()
        out = pipeline.prefill(f"r{r}", prompt, GREEDY, chunk)
        times.append(time.perf_counter() - t)
        if token is not None and out.first_token != token:
            raise RuntimeError("two runs of the same prompt gave different first tokens")
        token = out.first_token
    return statistics.median(times), token


class _Processes:
    """ProcessPipeline under LocalPipeline's prefill signature (the first token only: no KV comes back)."""

    def __init__(self, pipeline: ProcessPipeline) -> None:
        self.pipeline = pipeline

    def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, chunk: int):
        return self.pipeline.prefill(StageRequest(request_id, prompt, params, chunk))


def _close(pipeline) -> None:
    if isinstance(pipeline, _Processes):
        pipeline.pipeline.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory or registry name (default smollm2-135m)")
    ap.add_argument("--quick", action="store_true", help="a tiny random model and short prompts: a smoke run")
    ap.add_argument("--long", type=int, default=8192, help="the long prompt's tokens")
    ap.add_argument("--short", type=int, default=256, help="the short prompt's tokens")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3], help="pipeline sizes to measure against 1")
    ap.add_argument("--repeats", type=int, default=5, help="runs of the short prompt per configuration")
    ap.add_argument("--long-repeats", type=int, default=1, help="runs of the long prompt per configuration")
    ap.add_argument(
        "--processes", action="store_true", help="each stage a process (hidden states through the transfer engine)"
    )
    ap.add_argument("--cluster", action="store_true", help="the whole system over HTTP: a prefill worker, then a group")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if args.quick:
        args.long, args.short, args.chunk = 512, 32, 64
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, model_name = resolve_model(args, Path(tmp))
        num_layers = ModelArgs.from_hf_config(load_hf_config(model_dir)).num_layers
        rng = random.Random(0)
        vocab = 250 if args.quick else 40000
        long_prompt = [rng.randrange(3, vocab) for _ in range(args.long)]
        short_prompt = long_prompt[: args.short]
        blocks = blocks_for(args.long, 16) + 8

        def pipeline(x: int):
            if args.processes:
                specs = [
                    StageSpec(
                        str(model_dir),
                        layers,
                        num_blocks=blocks,
                        block_size=16,
                        max_model_len=args.long + 16,
                        max_chunk=args.chunk,
                    )
                    for layers in split_layers(num_layers, x)
                ]
                return _Processes(ProcessPipeline(specs))
            return LocalPipeline(
                [
                    PipelineStage(
                        str(model_dir), layers, num_blocks=blocks, block_size=16, max_model_len=args.long + 16
                    )
                    for layers in split_layers(num_layers, x)
                ]
            )

        if args.cluster:
            return _cluster_bench(args, model_dir, model_name, num_layers, vocab)
        rows = []
        base = pipeline(1)
        base_long, token = ttft(base, long_prompt, args.chunk, args.long_repeats)
        base_short, short_token = ttft(base, short_prompt, args.chunk, args.repeats)
        _close(base)
        print(
            f"1 stage: {args.long} tokens {base_long:.2f} s, {args.short} tokens {1000 * base_short:.1f} ms", flush=True
        )
        for x in [x for x in args.stages if x <= num_layers]:
            group = pipeline(x)
            long_s, t_long = ttft(group, long_prompt, args.chunk, args.long_repeats)
            short_s, t_short = ttft(group, short_prompt, args.chunk, args.repeats)
            if (t_long, t_short) != (token, short_token):
                raise RuntimeError(f"{x} stages gave another first token than one stage")
            rows.append(
                {
                    "stages": x,
                    "long_ttft_s": round(long_s, 3),
                    "long_speedup": round(base_long / long_s, 3),
                    "short_ttft_ms": round(1000 * short_s, 1),
                    "short_slowdown": round(short_s / base_short, 3),
                }
            )
            print(
                f"{x} stages: {args.long} tokens {long_s:.2f} s ({base_long / long_s:.2f}x faster), {args.short} "
                f"tokens {1000 * short_s:.1f} ms ({short_s / base_short:.2f}x the single stage's)",
                flush=True,
            )
            _close(group)
        result = {
            "model": model_name,
            "layers": num_layers,
            "long_tokens": args.long,
            "short_tokens": args.short,
            "chunk": args.chunk,
            "threads_per_stage": 1,
            "stages_as": "processes" if args.processes else "threads",
            "single_long_ttft_s": round(base_long, 3),
            "single_short_ttft_ms": round(1000 * base_short, 1),
            "pipelines": rows,
            "machine": describe_machine(),
        }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def _cluster_bench(args, model_dir: Path, model_name: str, num_layers: int, vocab: int) -> None:
    import httpx

    from conductor.local import LocalPrefill
    from mooncake.cluster.config import ClusterConfig
    from mooncake.cluster.launcher import LocalCluster

    def first_token_s(endpoint: str, prompt: list[int]) -> float:
        t = time.perf_counter()
        body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{endpoint}/completions", json=body, timeout=3600) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    return time.perf_counter() - t
        raise RuntimeError("the stream ended without a token")

    rng = random.Random(1)
    rows = []
    limit = ModelArgs.from_hf_config(load_hf_config(model_dir)).max_position_embeddings
    if args.long + 2 > limit:  # the prompt and its two output tokens must fit the model's positions
        print(f"the long prompt is cut to {limit - 2} tokens: the model has {limit} positions", flush=True)
        args.long = limit - 2
    with tempfile.TemporaryDirectory() as work:
        for x in [1, *[x for x in args.stages if x <= num_layers]]:
            # every prompt through the prefill group (local_prefill never): it is what is measured
            config = ClusterConfig(
                model=str(model_dir),
                model_name="m",
                workdir=Path(work) / f"x{x}",
                port=0,
                threads=1,
                prefill=1,
                prefill_groups=1 if x > 1 else 0,
                group_size=max(x, 2),
                decode=1,
                max_model_len=min(args.long + 64, limit),
                max_num_batched_tokens=args.chunk,
                pool_dram_mib=max(64, 2 * args.long // 16 + 64),
                ready_timeout_s=600,
                ttft_slo_s=3600,
                local_prefill=LocalPrefill.NEVER,
            )
            cluster = LocalCluster(config).start()
            try:
                first_token_s(cluster.endpoint, [rng.randrange(3, vocab) for _ in range(16)])  # warm: the first request
                long_s = statistics.median(
                    first_token_s(cluster.endpoint, [rng.randrange(3, vocab) for _ in range(args.long)])
                    for _ in range(args.long_repeats)
                )
                short_s = statistics.median(
                    first_token_s(cluster.endpoint, [rng.randrange(3, vocab) for _ in range(args.short)])
                    for _ in range(args.repeats)
                )
            finally:
                cluster.stop()
            rows.append({"stages": x, "long_ttft_s": round(long_s, 3), "short_ttft_ms": round(1000 * short_s, 1)})
            print(
                f"{'one engine' if x == 1 else f'a {x}-stage group'}: {args.long} tokens {long_s:.2f} s, "
                f"{args.short} tokens {1000 * short_s:.1f} ms",
                flush=True,
            )
    base = rows[0]
    for row in rows[1:]:
        row["long_speedup"] = round(base["long_ttft_s"] / row["long_ttft_s"], 3)
        row["short_slowdown"] = round(row["short_ttft_ms"] / base["short_ttft_ms"], 3)
    result = {
        "model": model_name,
        "layers": num_layers,
        "long_tokens": args.long,
        "short_tokens": args.short,
        "chunk": args.chunk,
        "threads_per_worker": 1,
        "measured": "TTFT over HTTP through the whole cluster",
        "single_long_ttft_s": base["long_ttft_s"],
        "single_short_ttft_ms": base["short_ttft_ms"],
        "pipelines": rows[1:],
        "machine": describe_machine(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
