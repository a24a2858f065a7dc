"""A quantized layer's matmul on the CPU: our dequantize-then-matmul (quant.QuantLinear) against torch's own int4 and
int8 CPU kernels, and the float32 layer, at decode and prefill sizes.

    python -m benchmarks.quant_matmul_cpu       # a 3,072 x 576 layer (SmolLM2-135M's gate/up), 1 to 256 tokens

Each is timed as the median of 30 calls after one warm-up, one after the other in this process; the ratio printed is
torch's kernel over ours (above 1: ours is faster). What quant.py chose for the CPU comes from this.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mooncake.engine.quant import QuantLinear, WeightQuant


def timed(fn, n: int = 30) -> float:
    fn()
    runs = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=int, default=3072)
    p.add_argument("--inp", type=int, default=576)
    p.add_argument("--group", type=int, default=64)
    args = p.parse_args(argv)
    n, k, g = args.out, args.inp, args.group
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.05
    int4 = QuantLinear(k, n, False, WeightQuant("bench", "bench", "int", 4, g), "int4")
    int4.qweight.copy_(torch.randint(0, 256, int4.qweight.shape, generator=gen, dtype=torch.uint8))
    int4.scales.fill_(0.01), int4.zeros.fill_(8.0)
    int8 = QuantLinear(k, n, False, WeightQuant("bench", "bench", "int", 8, None), "int8")
    int8.qweight.copy_(torch.randint(0, 256, int8.qweight.shape, generator=gen, dtype=torch.uint8))
    int8.scales.fill_(0.01), int8.zeros.fill_(128.0)
    fp8 = QuantLinear(k, n, False, WeightQuant("bench", "bench", "fp8", 8, None), "fp8")
    fp8.qweight.copy_(w.to(torch.float8_e4m3fn)), fp8.scales.fill_(1.0)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    scales_zeros = torch.stack([torch.full((k // g, n), 0.01), torch.zeros(k // g, n)], -1).contiguous()
    w8, s8 = torch.randint(-128, 127, (n, k), dtype=torch.int8), torch.full((n,), 0.01)
    print(f"a {n} x {k} layer, ms a call (median of 30); torch's kernel / ours in brackets")
    print(
        f"{'tokens':>6} {'float32':>8} {'fp8 ours':>9} {'int8 ours':>9} {'int8 torch':>16} "
        f"{'int4 ours':>9} {'int4 torch':>16}"
    )
    for t in (1, 16, 256):
        x = torch.randn(t, k, generator=gen)
        f32 = timed(lambda: torch.nn.functional.linear(x, w))
        ours8, ours4, ours_fp8 = timed(lambda: int8(x)), timed(lambda: int4(x)), timed(lambda: fp8(x))
        torch8 = timed(lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8))
        torch4 = timed(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, g, scales_zeros))
        print(
            f"{t:>6} {f32:>8.3f} {ours_fp8:>9.3f} {ours8:>9.3f} {torch8:>8.3f} ({torch8 / ours8:>4.1f}x) "
            f"{ours4:>9.3f} {torch4:>8.3f} ({torch4 / ours4:>4.1f}x)"
        )


if __name__ == "__main__":
    main()
