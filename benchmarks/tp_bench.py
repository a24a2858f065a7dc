"""Tensor parallelism against one rank, in the same run: a decode step and a step that imports a prompt's KV.

    python -m benchmarks.tp_bench                         # the CPU: 1 rank (every core) against 2 gloo ranks
    python -m benchmarks.tp_bench --device cuda --tp 2    # a machine with 2 GPUs: NCCL, rank r on cuda:r

A random-weight llama (``--hidden``, ``--layers``; ``make_tiny``) serves ``--batch`` requests of ``--context`` tokens
on each engine (``mooncake.serving.build.build_engine``, as a worker builds it: rank 0 here, the others its
processes); it times ``--steps`` decode steps of the batch, then one step that imports a prompt's leading KV (the
pool layout, every head: what a decode worker does with a prompt handed off from a prefill) and computes its last
token. Prints the medians and the ratio TP N / TP 1 (below 1: N ranks are faster), and the bytes of that import
each rank takes into its cache (rank 0 reads all of them and sends each other rank its heads: ``ranks.py``).
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

from mooncake.engine.config import EngineConfig
from mooncake.engine.interface import EngineKind
from mooncake.engine.request import PromptKV, SamplingParams
from mooncake.engine.tiny import make_tiny
from mooncake.serving.build import build_engine


def _engine(model: Path, args: argparse.Namespace, tp: int):
    config = EngineConfig(
        model=str(model),
        device=args.device,
        dtype=args.dtype,
        tensor_parallel_size=tp,
        max_model_len=args.context + args.steps + 128,
        max_num_seqs=args.batch + 1,
        num_kv_blocks=(args.batch + 2) * -(-(args.context + args.steps + 128) // 16),
        num_threads=None,
    )
    return build_engine(EngineKind.NATIVE, config)


def run(model: Path, args: argparse.Namespace, tp: int) -> dict:
    """One engine of ``tp`` ranks: its decode steps' and its import step's seconds."""
    engine = _engine(model, args, tp)
    try:
        rng = random.Random(0)
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 64, ignore_eos=True)
        prompts = [[rng.randrange(10, 400) for _ in range(args.context)] for _ in range(args.batch)]
        ids = [engine.add_request(p, params, request_id=f"b{i}") for i, p in enumerate(prompts)]
        started: set[str] = set()
        while len(started) < len(ids):  # the prompts' prefill
            started |= {o.request_id for o in engine.step()}
        steps = []
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        kv = engine.export_kv(engine.request_block_ids(ids[0]))  # every head, gathered: as the pool holds it
        for rid in ids:
            engine.abort_request(rid)
        engine.step()
        n = args.context - 1
        engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=1), "imp", kv=PromptKV(n, kv))
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        imported = time.perf_counter() - t
        blocks = -(-n // 16)
        per_rank = blocks * engine.block_bytes * max(1, engine.runner.kv_cache.shape[4]) // engine.args.num_kv_heads
        return {"decode_step_s": statistics.median(steps), "import_step_s": imported, "rank_bytes": per_rank}
    finally:
        if hasattr(engine, "close"):
            engine.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp", type=int, default=2, help="ranks to compare against one")
    p.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.device.startswith("cuda") and torch.cuda.device_count() < args.tp:
        print(f"skipped: {torch.cuda.device_count()} GPU(s), {args.tp} ranks need {args.tp}")
        return 0
    with tempfile.TemporaryDirectory() as work:
        heads = args.hidden // 64
        model = make_tiny(
            Path(work) / "llama",
            "llama",
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 3,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            num_key_value_heads=max(args.tp, heads // 4),
            head_dim=64,
            max_position_embeddings=4096,
        )
        results = {tp: run(model, args, tp) for tp in (1, args.tp)}
    shape = f"llama {args.hidden} hidden x {args.layers} layers, {args.dtype}, batch {args.batch} x {args.context}"
    print(f"{args.device}: {shape}")
    for tp, r in results.items():
        print(
            f"  TP {tp}: decode step {r['decode_step_s'] * 1e3:8.2f} ms   "
            f"import step {r['import_step_s'] * 1e3:8.2f} ms   import bytes per rank {r['rank_bytes']:>10,}"
        )
    one, many = results[1], results[args.tp]
    print(
        f"  TP {args.tp} / TP 1: decode step {many['decode_step_s'] / one['decode_step_s']:.2f}x, "
        f"import step {many['import_step_s'] / one['import_step_s']:.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
