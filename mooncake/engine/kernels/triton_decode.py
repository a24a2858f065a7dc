"""Paged decode attention in Triton: one query token per sequence, K/V read in place through the block table.

The CUDA engine's decode attention (eager steps and CUDA-graph replays alike). Its cost follows each sequence's
real context length, not the longest in the batch, and it reads the cache where it lies: no gathered, padded copy.
Every shape it needs is fixed by the arguments' sizes, and the context lengths are read on the device, so it can be
captured in a CUDA graph and replayed with other lengths.

Work split (flash-decoding): program (b, h, s) takes sequence b, KV head h (and the GROUP query heads that share
it, padded to 16 rows so both products run on the tensor cores: float32 exactly, ``ieee``), and the s-th of
``num_splits`` equal slices of the context. With one split it writes the output directly;
with several, each writes its partial (running max, sum of exponentials, weighted sum of V) and a second kernel
merges them. Few sequences (the latency-bound case) take many splits, so the GPU's SMs are busy either way.

    q:        [B, H, D]                                 H = Hkv * GROUP
    k_cache:  [num_blocks, block_size, Hkv, D]          (v_cache the same)
    table:    [B, W] int    block ids of each sequence, W >= ceil(ctx / block_size); the rest is never read
    ctx_lens: [B] int       tokens each sequence attends to (0: its output is 0)

Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernels on CPU tensors, which is how the tests check
them on a machine without a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_SPLITS = 16  # partial results a sequence's context is cut into, at most
BLOCK_N = 64  # context tokens per inner iteration


@triton.jit
def attend_range(
    q,
    K,
    V,
    table_row,
    lo,
    hi,
    pos,
    kvh,
    d,
    d_ok,
    scale,
    window,
    softcap,
    k_scale,
    v_scale,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
):
    """Flash attention of the query rows ``q`` [ROWS, D] over context tokens [lo, hi) of one sequence (its block ids at
    ``table_row``), KV head ``kvh``, each row seeing the keys at positions up to its ``pos`` [ROWS]: the running max,
    sum of exponentials and weighted sum of V (float32), for the caller to divide or merge. A ``window`` above 0 hides
    the keys at or before ``pos - window`` (a sliding-window layer); ``SOFTCAP`` caps the scores at ``softcap`` (cap *
    tanh(s / cap)). A row that sees no key of a tile keeps its sums; an empty range leaves max -inf and sums 0. ``FP8``:
    the caches hold float8 e4m3, read as their value times ``k_scale`` / ``v_scale`` in float32 and then in q's dtype
    (attention.from_fp8's values). The kernels of triton_decode (one query a sequence) and triton_varlen (a sequence's
    new tokens) share it."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_P], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        block = tl.load(table_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = n % BLOCK_SIZE
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            K + block[:, None] * stride_kb + row[:, None] * stride_kt + kvh * stride_kh + d[None, :],
            mask=kv_ok,
            other=0.0,
        )  # [N, D]
        if FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [ROWS, N], float32
        if SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        seen = n_ok[None, :] & (n[None, :] <= pos[:, None]) & ((window == 0) | (n[None, :] > pos[:, None] - window))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: sums stay 0
        p = tl.exp(s - m_safe[:, None])  # [ROWS, N]
        alpha = tl.exp(m - m_safe)
        v = tl.load(
            V + block[:, None] * stride_vb + row[:, None] * stride_vt + kvh * stride_vh + d[None, :],
            mask=kv_ok,
            other=0.0,
        )  # [N, D]
        if FP8:
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def _decode_partial(
    Q,
    K,
    V,
    Table,
    Ctx,
    Out,
    PartAcc,
    PartMax,
    PartSum,
    scale,
    window,
    softcap,
    k_scale,
    v_scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(Ctx + b).to(tl.int32)
    g = tl.arange(0, GROUP_P)  # the group's query heads, padded to 16 rows for the tensor cores
    d = tl.arange(0, HEAD_DIM_P)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g  # [G]
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0
    )

    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # the window's first key
    span = ctx - first
    per_split = ((span + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # whole tiles per split
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, ctx)
    m, l, acc = attend_range(
        q,
        K,
        V,
        Table + b * stride_tb,
        lo,
        hi,
        tl.zeros([GROUP_P], tl.int32) + ctx - 1,  # one query, at the context's last position: it sees every key
        kvh,
        d,
        d_ok,
        scale,
        window,
        softcap,
        k_scale,
        v_scale,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        BLOCK_SIZE,
        GROUP_P,
        HEAD_DIM_P,
        BLOCK_N,
        PRECISION,
        SOFTCAP,
        FP8,
    )

    if NUM_SPLITS == 1:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        o_ptr = Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        # partials: [B, H, NUM_SPLITS] for max and sum, [B, H, NUM_SPLITS, D] for the weighted V
        base = (b * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split  # [G]
        tl.store(PartMax + base, m, mask=g_ok)
        tl.store(PartSum + base, l, mask=g_ok)
        tl.store(PartAcc + base[:, None] * HEAD_DIM_P + d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _decode_merge(
    PartAcc,
    PartMax,
    PartSum,
    Out,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_P)
    base = (b * tl.num_programs(1) + h) * NUM_SPLITS + s  # [S]
    m = tl.load(PartMax + base)  # [S]; -inf where a split had no tokens
    l = tl.load(PartSum + base)
    acc = tl.load(PartAcc + base[:, None] * HEAD_DIM_P + d[None, :])  # [S, D]
    m_all = tl.max(m, axis=0)
    w = tl.where(l > 0, tl.exp(m - m_all), 0.0)  # [S]
    total = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # [D]
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def num_splits_for(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits that give about two programs per SM (a power of two, at most MAX_SPLITS): many for few sequences."""
    sms = _num_sms(device)
    splits = 1
    while splits < MAX_SPLITS and batch * num_kv_heads * splits < 2 * sms:
        splits *= 2
    return splits


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context (the last ``window`` tokens of it where
    ``window`` > 0; scores soft-capped at ``softcap`` where > 0); returns [B, H, D] in q's dtype. An FP8 cache
    (float8 e4m3) is read through its layer's ``k_scale`` and ``v_scale`` (attend_range).

    ``num_splits`` (a power of two) defaults to ``num_splits_for``; a CUDA graph fixes it when captured. Launches
    one kernel, or two with splits; allocates its output and partials (inside a graph: from the graph's pool).
    """
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    if h % hkv:
        raise ValueError(f"{h} query heads do not share {hkv} KV heads evenly")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous head dimension")
    group = h // hkv
    splits = num_splits or num_splits_for(b, hkv, q.device)
    if splits & (splits - 1) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be a power of two in [1, {MAX_SPLITS}], got {splits}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # dense, whatever q's strides
    if b == 0:
        return out
    d_p = max(16, triton.next_power_of_2(d))
    if splits > 1:
        part_acc = torch.empty(b, h, splits, d_p, dtype=torch.float32, device=q.device)
        part_max = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_max = part_sum = out  # unused
    _decode_partial[(b, hkv, splits)](
        q,
        k_cache,
        v_cache,
        table,
        ctx_lens,
        out,
        part_acc,
        part_max,
        part_sum,
        scale,
        int(window),
        float(softcap),
        float(k_scale or 1.0),
        float(v_scale or 1.0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=splits,
        BLOCK_SIZE=k_cache.shape[1],
        GROUP=group,
        GROUP_P=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        HEAD_DIM_P=d_p,
        BLOCK_N=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=bool(softcap),
        FP8=k_cache.dtype == torch.float8_e4m3fn,
    )
    if splits > 1:
        _decode_merge[(b, h)](
            part_acc,
            part_max,
            part_sum,
            out,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=splits,
            HEAD_DIM=d,
            HEAD_DIM_P=d_p,
        )
    return out
