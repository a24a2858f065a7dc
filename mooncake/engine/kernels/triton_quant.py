"""A weight-only quantized matmul in one Triton kernel on CUDA: ``x @ dequantize(W).T (+ bias)`` for a
``quant.QuantLinear``, dequantizing each tile of W as it is loaded, never a whole dequantized copy.

    x:        [T, K]       the activations (float32, bfloat16 or float16)
    qweight:  [N, K]       FP8 e4m3 (read as its bytes), or unsigned 8-bit integers; 4-bit: [N, K / 2], two a byte,
                           the even column in the low nibble
    scales:   [N, K / g]   float32, one a group of g input columns
    zeros:    [N, K / g]   float32 (integers), or None (FP8)
    out:      [T, N]       in x's dtype

Each weight is ``(q - zero) * scale`` in float32, rounded to x's dtype (as QuantLinear.dequantized and then F.linear
round it), and the products are summed in float32 (IEEE-exact for float32 inputs: no TF32). FP8 is decoded from its
bits (shifted into a float16's, whose value is e4m3's over 256), so no GPU's float8 support is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8, INT8, INT4 = 0, 1, 2


@triton.jit
def _quant_matmul(
    X,
    W,
    S,
    Z,
    B,
    Out,
    T,
    N,
    K,
    GROUP,
    stride_x,
    stride_w,
    stride_s,
    stride_o,
    KIND: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rows, cols = rm[:, None].to(tl.int64), rn[:, None].to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(X + rows * stride_x + rk[None, :], mask=(rm[:, None] < T) & (rk[None, :] < K), other=0.0)
        ok = (rn[:, None] < N) & (rk[None, :] < K)
        if KIND == 2:
            byte = tl.load(W + cols * stride_w + rk[None, :] // 2, mask=ok, other=0).to(tl.int32)
            v = ((byte >> ((rk[None, :] % 2) * 4)) & 15).to(tl.float32)
        elif KIND == 1:
            v = tl.load(W + cols * stride_w + rk[None, :], mask=ok, other=0).to(tl.float32)
        else:
            byte = tl.load(W + cols * stride_w + rk[None, :], mask=ok, other=0).to(tl.int16)
            half = ((byte & 0x7F) << 7) | ((byte & 0x80) << 8)
            v = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        group = rk[None, :] // GROUP
        if HAS_ZERO:
            v = v - tl.load(Z + cols * stride_s + group, mask=ok, other=0.0)
        w = (v * tl.load(S + cols * stride_s + group, mask=ok, other=0.0)).to(x.dtype)  # [BN, BK]
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = Out + rm[:, None].to(tl.int64) * stride_o + rn[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=(rm[:, None] < T) & (rn[None, :] < N))


def quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` [T, K] times the dequantized weight [N, K] transposed, plus ``bias`` [N]: [T, N] in x's dtype. One
    kernel launch; tiles of 16 to 64 token rows as T grows."""
    t, k = x.shape
    if x.stride(-1) != 1 or qweight.stride(-1) != 1:
        raise ValueError("x and the weight need a contiguous last dimension")
    n = qweight.shape[0]
    if qweight.dtype == torch.float8_e4m3fn:
        kind, w = FP8, qweight.view(torch.uint8)
    else:
        kind, w = (INT4 if qweight.shape[1] * 2 == k else INT8), qweight
    if w.shape[1] != (k // 2 if kind == INT4 else k) or k % scales.shape[1]:
        raise ValueError(
            f"weight {tuple(qweight.shape)} and scales {tuple(scales.shape)} do not fit x {tuple(x.shape)}"
        )
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    bm = 16 if t <= 16 else 32 if t <= 32 else 64
    bn, bk = 64, 64
    grid = (triton.cdiv(t, bm), triton.cdiv(n, bn))
    _quant_matmul[grid](
        x,
        w,
        scales,
        scales if zeros is None else zeros,
        x if bias is None else bias,
        out,
        t,
        n,
        k,
        k // scales.shape[1],
        x.stride(0),
        w.stride(0),
        scales.stride(0),
        out.stride(0),
        KIND=kind,
        HAS_ZERO=zeros is not None,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BM=bm,
        BN=bn,
        BK=bk,
    )
    return out
