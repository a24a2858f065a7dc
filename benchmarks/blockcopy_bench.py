"""Copying KV blocks on the CPU: a gather and a scatter (``index_select`` + ``index_copy_``, what every hand-off did)
against ``mooncake.engine.blockcopy.copy_blocks`` (one ``copy_`` per run of blocks consecutive on both sides).

    python -m benchmarks.blockcopy_bench [--blocks 256] [--layers 30] [--threads 1]

The default shape is SmolLM2-135M's KV (30 layers, 3 KV heads of 64, float32, 16-token blocks) for a 4,096-token
prompt: 188 MiB. Three copies, each timed both ways in the same run (median of ``--reps``):

- cache to cache, one run (a prefill's blocks into a decode engine's cache, both freshly allocated);
- pool slots to a cache, one run (a prefix imported from the pool);
- cache to cache, scattered (every block its own run: copy_blocks falls back to the gather and scatter).

Prints each time and the ratio baseline / copy_blocks (above 1: copy_blocks is faster).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from mooncake.engine.blockcopy import copy_blocks


def timed(fn, reps: int) -> float:
    fn()  # first touch of every page, not counted
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=256, help="blocks copied (4,096 tokens of 16)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the workers run with 1)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, L = args.blocks, args.layers
    shape = (args.block_size, args.kv_heads, args.head_dim)
    src = torch.randn(L, 2, n + 8, *shape)
    dst = torch.zeros(L, 2, n + 16, *shape)
    pool = torch.randn(n + 8, L, 2, *shape)
    mib = n * L * 2 * src[0, 0, 0].numel() * src.element_size() / 2**20
    print(f"{n} blocks x {L} layers = {mib:.0f} MiB per copy, {args.threads} torch thread(s), median of {args.reps}")

    def gather_scatter(dst_ids, src_ids, from_pool=False):
        si, di = torch.tensor(src_ids), torch.tensor(dst_ids)
        for layer in range(L):
            s = pool[:, layer].index_select(0, si).transpose(0, 1) if from_pool else src[layer].index_select(1, si)
            dst[layer].index_copy_(1, di, s)

    def by_runs(dst_ids, src_ids, from_pool=False):
        for layer in range(L):
            copy_blocks(
                dst[layer].transpose(0, 1),
                dst_ids,
                pool[:, layer] if from_pool else src[layer].transpose(0, 1),
                src_ids,
            )

    scattered = random.Random(0).sample(range(n + 8), n)
    cases = {
        "cache -> cache, one run": (list(range(8, 8 + n)), list(range(n)), False),
        "pool slots -> cache, one run": (list(range(8, 8 + n)), list(range(n)), True),
        "cache -> cache, scattered": (list(range(8, 8 + n)), scattered, False),
    }
    for label, (dst_ids, src_ids, from_pool) in cases.items():
        base = timed(lambda: gather_scatter(dst_ids, src_ids, from_pool), args.reps)
        ours = timed(lambda: by_runs(dst_ids, src_ids, from_pool), args.reps)
        print(
            f"{label:<30} gather+scatter {base * 1e3:7.1f} ms   copy_blocks {ours * 1e3:7.1f} ms   "
            f"ratio {base / ours:4.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
