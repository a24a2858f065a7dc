"""The elementwise work between a layer's matmuls in one Triton kernel each, on CUDA: the residual add with the
RMSNorm after it, and RoPE.

On an H100 a 4,096-token prefill of a 1B model took 1.9x its compute limit, the rest being elementwise kernels
between the matmuls (issue 32; benchmarks/gpu_profile.py), and a captured decode step is bound by how many kernels
it runs. torch runs the add and the norm as three kernels (add, rms_norm, times the weight) and RoPE as three (x *
cos, then an addcmul per half), each reading and writing the activations again; these run one each.

The rounding follows the eager path's (model.py), so a fused step computes what the eager one does up to the order
of a float32 sum:

- ``add_rms_norm``: x + delta rounded to the activations' dtype (the residual stream), normalised in float32 and
  rounded, then times the weight and rounded again (transformers' order).
- ``rope``: x * cos rounded, then each half's ``+- other half * sin`` added in float32 and rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(Delta, X, W, Normed, Summed, stride_d, stride_x, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    ok = col < H
    x = tl.load(X + row * stride_x + col, mask=ok, other=0.0)
    s = (x.to(tl.float32) + tl.load(Delta + row * stride_d + col, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
    tl.store(Summed + row * H + col, s, mask=ok)
    sf = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / H + eps)
    n = (sf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(Normed + row * H + col, (n * w).to(x.dtype), mask=ok)


def add_rms_norm(delta: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + delta) * weight, x + delta) for x, delta [T, H] (last dimension contiguous), two new [T, H]
    tensors in x's dtype. One kernel launch."""
    t, h = x.shape
    if delta.shape != x.shape or x.stride(-1) != 1 or delta.stride(-1) != 1 or weight.shape != (h,):
        raise ValueError(
            f"expected x and delta [T, H] with contiguous rows and weight [H], got {tuple(x.shape)}, "
            f"{tuple(delta.shape)} and {tuple(weight.shape)}"
        )
    normed, summed = (torch.empty(t, h, dtype=x.dtype, device=x.device) for _ in range(2))
    if t:
        block = triton.next_power_of_2(h)
        _add_rms_norm[(t,)](delta, x, weight, normed, summed, delta.stride(0), x.stride(0), h, eps, BLOCK=block)
    return normed, summed


@triton.jit
def _rope(X, Cos, Sin, Out, stride_xt, stride_xh, stride_ct, HEADS, HALF, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    col = tl.arange(0, BLOCK)
    ok = col < HALF
    x = X + t * stride_xt + head * stride_xh
    x1 = tl.load(x + col, mask=ok, other=0.0)
    x2 = tl.load(x + HALF + col, mask=ok, other=0.0)
    c = Cos + t * stride_ct
    s = Sin + t * stride_ct
    c1 = tl.load(c + col, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF + col, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(s + col, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(s + HALF + col, mask=ok, other=0.0).to(tl.float32)
    a1 = (x1.to(tl.float32) * c1).to(x1.dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(x1.dtype).to(tl.float32)
    out = Out + (t * HEADS + head) * 2 * HALF
    tl.store(out + col, (a1 - x2.to(tl.float32) * s1).to(x1.dtype), mask=ok)
    tl.store(out + HALF + col, (a2 + x1.to(tl.float32) * s2).to(x1.dtype), mask=ok)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, D] (any row and head strides, D contiguous) by cos, sin [T, 1, D]: a new
    contiguous [T, heads, D] tensor, model.apply_rope's result. One kernel launch."""
    t, heads, d = x.shape
    if d % 2 or x.stride(-1) != 1 or cos.shape != (t, 1, d) or sin.shape != cos.shape or cos.stride() != sin.stride():
        raise ValueError(
            f"expected x [T, heads, D] (D even and contiguous) and cos, sin [T, 1, D] alike, got {tuple(x.shape)}, "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.stride(-1) != 1:
        raise ValueError("cos and sin must be contiguous in their last dimension")
    out = torch.empty(t, heads, d, dtype=x.dtype, device=x.device)
    if t and heads:
        half = d // 2
        grid = (t, heads)
        _rope[grid](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), heads, half, BLOCK=triton.next_power_of_2(half)
        )
    return out
