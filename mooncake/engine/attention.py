"""Attention over the paged KV cache: the one function a faster kernel would replace.

Cache layout per layer (the pool layout of DESIGN §4 with layers split out):

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot s = block_id * block_size + offset  ->  k_cache.view(-1, Hkv, D)[s]

A step's tokens are flattened into one [T] batch, decodes first, then prefill chunks:

    tokens:  | d0 d1 ... d(B-1) | chunk of req p0 ... | chunk of req p1 ... |
             '--- one query each '--- q_len queries at positions ctx-q_len .. ctx-1

On CUDA a step with prompt chunks in it is attended by one kernel call per layer
(kernels/triton_varlen.py: ``StepAttention``), decodes and chunks together, each cached
prefix read in place. Otherwise decodes are attended together: by a kernel that reads K/V
rows in place from their blocks (kernels/triton_decode.py on CUDA, kernels/paged_attention.cpp
on the CPU), or else by one padded SDPA call over gathered blocks (GQA folded into the query
axis, so K/V are never repeated); and each prefill chunk is one causal SDPA call whose key
range is its whole context (cached prefix + the chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSegment:
    """One request's chunk of new tokens in the flattened batch."""

    q_start: int  # first index of the chunk in the [T] batch
    q_len: int  # tokens in this chunk
    ctx_len: int  # tokens attended: cached prefix + this chunk
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)] long, on the device


@dataclass(slots=True)
class StepAttention:
    """Every sequence of a step for one varlen kernel call: where its new tokens start in the [T] batch, how many, the
    context each attends to, its blocks (int32, on the device)."""

    starts: torch.Tensor  # [S]
    q_lens: torch.Tensor  # [S]
    ctx_lens: torch.Tensor  # [S]
    table: torch.Tensor  # [S, W], padded with block 0
    max_q_len: int
    kernel: Callable  # kernels/triton_varlen.paged_varlen

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int,
        softcap: float,
        *dequant: float,
    ) -> torch.Tensor:
        return self.kernel(
            q,
            k_cache,
            v_cache,
            self.starts,
            self.q_lens,
            self.ctx_lens,
            self.table,
            self.max_q_len,
            scale,
            window,
            softcap,
            *dequant,  # an FP8 cache's k_scale and v_scale
        )


@dataclass(slots=True)
class AttentionMetadata:
    """Where the step's tokens live in the cache and whom each attends to.

    Built once per step by the model runner and shared by every layer.
    """

    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    num_decodes: int  # tokens [0, num_decodes) are single-token decodes
    decode_block_table: torch.Tensor | None  # [B, max_blocks] long (padded with block 0)
    decode_ctx_lens: torch.Tensor | None  # [B] long: tokens each decode attends to
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool (torch path only)
    prefills: list[PrefillSegment]
    decode_kernel: Callable | None = None  # compiled in-place kernel (kernels/), else torch
    step: StepAttention | None = None  # the whole step in one call (CUDA, with prompt chunks): the rest left empty


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value: a cast beyond it gives NaN, so values are clamped first


@dataclass(frozen=True, slots=True)
class KVScales:
    """One layer's FP8 cache scales (vLLM's k_scale and v_scale): stored = x / scale, read = stored * scale."""

    k: float = 1.0
    v: float = 1.0


def quantized(cache: torch.Tensor) -> bool:
    """Whether a cache keeps K/V in float8 (``kv_cache_dtype`` fp8)."""
    return cache.dtype == FP8


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` stored in float8 e4m3: divided by ``scale`` in float32 and clamped to e4m3's range."""
    x = x.float()
    if scale != 1.0:
        x = x / scale
    return x.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def from_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored float8 values as ``dtype``, times ``scale`` (in float32, as the compiled kernel's table holds them)."""
    if scale == 1.0:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    scales: KVScales | None = None,
) -> None:
    """Store the new tokens' K/V ([T, Hkv, D] each) at their cache slots (an FP8 cache's: quantized by ``scales``)."""
    nb, bs, hkv, d = k_cache.shape
    if quantized(k_cache):  # bytes copied as bytes: torch has no index_copy for float8 on the CPU
        scales = scales or KVScales()
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k, v = to_fp8(k, scales.k).view(torch.uint8), to_fp8(v, scales.v).view(torch.uint8)
    k_cache.view(nb * bs, hkv, d).index_copy_(0, slots, k)
    v_cache.view(nb * bs, hkv, d).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """Attention of the step's queries over the paged cache.

    q: [T, H, D] (any strides, the last contiguous); k, v: [T, Hkv, D] (this step's new K/V, already written to the
    cache). ``window``: a query at position p sees keys p - window + 1 .. p (0: all up to p); ``softcap``: scores
    become softcap * tanh(scores / softcap) before the softmax (0: not). Returns [T, H, D]. Called once per layer
    per step. An FP8 cache (``scales``: its layer's) is read dequantized, and a prompt chunk attends to its own K/V
    as the cache holds them: so a token's attention is the same whether its context was computed in this step, an
    earlier chunk, another engine or the pool.
    """
    fp8 = quantized(k_cache)
    scales = scales or KVScales()
    ks_, vs_ = (scales.k, scales.v) if fp8 else (None, None)  # None: read as stored
    dequant = (ks_, vs_) if fp8 else ()  # an FP8 cache's scales, for the kernels (each reads float8)
    if meta.step is not None:
        return meta.step(q, k_cache, v_cache, scale, window, softcap, *dequant)
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    group = h // hkv
    b = meta.num_decodes
    kernel = meta.decode_kernel
    if b == t and kernel is not None:  # decodes only: the kernel's output is the step's
        return kernel(
            q, k_cache, v_cache, meta.decode_block_table, meta.decode_ctx_lens, scale, window, softcap, *dequant
        )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if b and kernel is not None:
        bt, ctx = meta.decode_block_table, meta.decode_ctx_lens
        out[:b] = kernel(q[:b], k_cache, v_cache, bt, ctx, scale, window, softcap, *dequant)
    elif b:
        qd = q[:b].view(b, hkv, group, d)  # [B, Hkv, G, D]: a decode's G heads share one K/V head
        bt = meta.decode_block_table
        kd = _read(k_cache[bt], ks_, q.dtype).flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
        vd = _read(v_cache[bt], vs_, q.dtype).flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
        mask = meta.decode_mask
        if window:  # [B, 1, 1, L]: also no key before ctx - window
            keys = torch.arange(mask.shape[-1], device=mask.device)
            mask = mask & (keys[None, :] >= (meta.decode_ctx_lens - window)[:, None])[:, None, None, :]
        out[:b] = _attend(qd, kd, vd, mask, scale, softcap).reshape(b, h, d)
    for seg in meta.prefills:
        s, n = seg.q_start, seg.q_len
        qs = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if seg.ctx_len == n and not fp8:
            # No cached prefix: the chunk's own K/V are the whole context.
            ks = k[s : s + n]  # [n, Hkv, D]
            vs = v[s : s + n]
        else:
            ks = _read(k_cache[seg.block_ids].flatten(0, 1)[: seg.ctx_len], ks_, q.dtype)  # [ctx, Hkv, D]
            vs = _read(v_cache[seg.block_ids].flatten(0, 1)[: seg.ctx_len], vs_, q.dtype)
        ks = ks.transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
        vs = vs.transpose(0, 1).unsqueeze(0)
        if softcap or (window and window < seg.ctx_len):
            # Query i sits at position ctx-n+i and sees keys ctx-n+i-window+1 .. ctx-n+i.
            mask = torch.ones(n, seg.ctx_len, dtype=torch.bool, device=q.device).tril(seg.ctx_len - n)
            if window:
                mask = mask.triu(seg.ctx_len - n - window + 1)
            qg = qs.reshape(1, hkv, group * n, d)  # a K/V head's G query heads one after another
            os_ = _attend(qg, ks, vs, mask.repeat(group, 1), scale, softcap).view(1, h, n, d)
        elif seg.ctx_len == n:
            os_ = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            # Query i sits at position ctx-n+i and sees keys 0..ctx-n+i: causal, aligned to the lower right. On CUDA
            # torch's flash kernel takes that alignment without a mask (a [n, ctx] mask would force a slower kernel).
            if q.is_cuda:
                # imported here: torch.nn.attention.bias brings torch._dynamo, 2 s of every process's start on a CPU
                from torch.nn.attention.bias import causal_lower_right

                mask = causal_lower_right(n, seg.ctx_len)
            else:
                mask = torch.ones(n, seg.ctx_len, dtype=torch.bool, device=q.device).tril(seg.ctx_len - n)
            os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[s : s + n] = os_[0].transpose(0, 1)  # [n, H, D]
    return out


def _read(cached: torch.Tensor, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """K or V read from the cache, in ``dtype`` (dequantized where ``scale`` is given: an FP8 cache)."""
    return cached if scale is None else from_fp8(cached, scale, dtype)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """softmax(cap(q k^T * scale) masked) v, written out (SDPA has no soft-capping): q [..., M, D], k and v
    [..., N, D], mask broadcast to [..., M, N] (True: attend). Scores in float32."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [..., M, N]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
