"""fp32 matmul speed on the shapes of a decode step, in both operand orders.

    python -m benchmarks.matmul_shapes [--rows 32] [--model-dir DIR]

For each weight of the model (fused qkv, o_proj, fused gate/up, down, LM head) it times
``h @ W^T`` (``F.linear``) and ``W @ h^T`` at ``--rows`` rows and prints GFLOP/s and
the ratio. This is the measurement behind computing the LM head as ``W @ h^T``
(model.py ``compute_logits``) and behind the README's small-M GFLOP/s figure. A
diagnostic with its own baseline (the other operand order), not a benchmark of the engine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mooncake.engine.model_args import ModelArgs
from mooncake.engine.registry import default_cache_dir, pull
from mooncake.engine.weights import load_hf_config


def best_ms(fn, repeats: int = 30) -> float:
    """Best wall time of ``fn`` in ms over ``repeats`` runs, after a warm-up."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--model-dir", type=Path)
    args = parser.parse_args()
    model_dir = args.model_dir or pull("smollm2-135m", default_cache_dir())
    m = ModelArgs.from_hf_config(load_hf_config(model_dir))
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    shapes = {
        "qkv_proj": (q + 2 * kv, m.hidden_size),
        "o_proj": (m.hidden_size, q),
        "gate_up_proj": (2 * m.intermediate_size, m.hidden_size),
        "down_proj": (m.hidden_size, m.intermediate_size),
        "lm_head": (m.vocab_size, m.hidden_size),
    }
    print(f"{'weight':<14}{'N x K':>14}{'h @ W^T ms':>12}{'GFLOP/s':>9}{'W @ h^T ms':>12}{'GFLOP/s':>9}{'ratio':>7}")
    for name, (n, k) in shapes.items():
        w, h = torch.randn(n, k), torch.randn(args.rows, k)
        flop = 2 * args.rows * n * k
        a = best_ms(lambda: F.linear(h, w))
        b = best_ms(lambda: w @ h.t())
        print(
            f"{name:<14}{f'{n} x {k}':>14}{a:>12.2f}{flop / a / 1e6:>9.0f}{b:>12.2f}{flop / b / 1e6:>9.0f}{a / b:>7.2f}"
        )


if __name__ == "__main__":
    main()
