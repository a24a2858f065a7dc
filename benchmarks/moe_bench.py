"""The mixture-of-experts layer (engine/moe.py: the step's (token, expert) pairs sorted by expert, one matmul pair a
used expert) against a per-expert loop that finds each expert's tokens with a mask (transformers' Qwen3-MoE and
Mixtral ``forward``), on the same weights and tokens, in the same run.

Shapes: one layer shaped like Qwen3-30B-A3B's routing (128 experts, 8 a token) and like Mixtral's (8 experts, 2 a
token), at hidden 1024 so the weights fit a small machine; 32 tokens (a decode step of 32 running requests) and 512
(a prompt chunk). Reports the median time of each over ``--repeat`` interleaved runs and the ratio loop / grouped.

    .venv/bin/python -m benchmarks.moe_bench [--repeat 20] [--device cpu|cuda] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mooncake.engine.moe import SparseMoE

SHAPES = {  # name -> (experts, top_k, intermediate)
    "qwen3-moe-like": (128, 8, 256),
    "mixtral-like": (8, 2, 3584),
}
HIDDEN = 1024


def per_expert_loop(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """transformers' way: each expert hit finds its (token, slot) pairs with a mask, then runs on them."""
    weights, ids = moe.route(x)
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=moe.num_experts).permute(2, 1, 0)  # [E, k, T]
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        e = int(e[0])
        slot, token = torch.where(mask[e])
        gate, up = F.linear(x[token], moe.experts_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(moe.act(gate) * up, moe.experts_down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args()
    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    g = torch.Generator().manual_seed(0)
    results = []
    for name, (experts, top_k, inter) in SHAPES.items():
        moe = SparseMoE(HIDDEN, inter, experts, top_k, True, "silu")
        for p in moe.parameters():
            p.data = (torch.randn(p.shape, generator=g) * 0.02).to(device, dtype)
        for tokens in (32, 512):
            x = torch.randn(tokens, HIDDEN, generator=g).to(device, dtype)
            same = torch.allclose(moe(x), per_expert_loop(moe, x), atol=1e-5 if dtype == torch.float32 else 2e-2)
            grouped, loop = [], []
            for _ in range(opts.repeat):
                grouped.append(timed(lambda: moe(x), device))
                loop.append(timed(lambda: per_expert_loop(moe, x), device))
            row = dict(
                shape=name,
                tokens=tokens,
                grouped_ms=statistics.median(grouped) * 1e3,
                loop_ms=statistics.median(loop) * 1e3,
                same_output=same,
            )
            row["loop_over_grouped"] = row["loop_ms"] / row["grouped_ms"]
            results.append(row)
            print(
                f"{name:>15} {tokens:4d} tokens: grouped {row['grouped_ms']:7.2f} ms, per-expert loop "
                f"{row['loop_ms']:7.2f} ms: {row['loop_over_grouped']:.2f}x  (outputs equal: {same})"
            )
    if opts.out:
        opts.out.write_text(json.dumps({"device": opts.device, "dtype": opts.dtype, "results": results}, indent=2))


if __name__ == "__main__":
    main()
