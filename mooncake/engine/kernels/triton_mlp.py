"""The MLP's activation in one Triton kernel on CUDA: silu(gate) * up from the fused gate/up projection's output.

torch runs it as two kernels (``silu_`` then ``mul_``), each reading and writing the [T, intermediate] activations;
in a 4,096-token prefill of a 1B model on an H100 the two took 3.5 of the step's 20.3 ms of GPU time
(benchmarks/gpu_profile.py; benchmarks/README.md, "The engine on a GPU"). The rounding follows torch's: silu in
float32 rounded to the input's dtype, then the product rounded again.

    x:   [T, 2 * I]   gate | up, as model.MLP's gate_up_proj writes them
    out: [T, I]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul(X, Out, stride_x, stride_o, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < I
    gate = tl.load(X + row * stride_x + col, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + I + col, mask=ok, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(Out + row * stride_o + col, (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=ok)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I] (last dimension contiguous); a new [T, I] tensor. One kernel launch."""
    t, two_i = x.shape
    if two_i % 2 or x.stride(-1) != 1:
        raise ValueError(f"expected [T, 2 * intermediate] with a contiguous last dimension, got {tuple(x.shape)}")
    i = two_i // 2
    out = torch.empty(t, i, dtype=x.dtype, device=x.device)
    if t:
        _silu_mul[(t, triton.cdiv(i, BLOCK))](x, out, x.stride(0), out.stride(0), i, BLOCK=BLOCK)
    return out
