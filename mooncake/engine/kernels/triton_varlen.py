"""Paged attention for a whole mixed step in one Triton call: every sequence's new tokens, a decode's one and a prompt
chunk's many, over its paged context, K/V read in place through its block table.

The CUDA engine's attention for steps that carry prompt chunks (a decode-only step keeps triton_decode.py's kernel and
its CUDA graphs): one launch per layer where the eager path made one SDPA call per chunk, plus the decodes', and
gathered each cached prefix into a copy first.

    q:        [T, H, D]                               the step's tokens, sequence after sequence (any order)
    k_cache:  [num_blocks, block_size, Hkv, D]        (v_cache the same); this step's K/V already written there
    starts:   [S] int   each sequence's first row in q
    q_lens:   [S] int   its new tokens (1 for a decode)
    ctx_lens: [S] int   the tokens it attends to: its cached prefix and its new tokens
    table:    [S, W] int  its block ids, W >= ceil(ctx / block_size); the rest is never read

New token i of sequence s sits at position ctx - q_len + i and attends to positions 0 .. that one (causal, aligned to
the lower right, as the eager path's mask). Program (s, kv head, m) takes BLOCK_M of sequence s's new tokens, times
the GROUP query heads that share the KV head (padded to a power of two), as the rows of one tile, and walks the keys
up to its last row's position in tiles of BLOCK_N with an online softmax (flash attention). Programs past a
sequence's new tokens return at once.

Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernel on CPU tensors: how the tests check it against the
eager path on a machine without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mooncake.engine.kernels.triton_decode import attend_range

BLOCK_M = 16  # new tokens of one sequence per program (times the group's heads: at least tl.dot's 16 rows)
BLOCK_N = 64  # context tokens per inner iteration


@triton.jit
def _varlen_attention(
    Q,
    K,
    V,
    Out,
    Starts,
    QLens,
    CtxLens,
    Table,
    scale,
    window,
    softcap,
    k_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_tb,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    mblk = tl.program_id(2)
    q_len = tl.load(QLens + s).to(tl.int32)
    if mblk * BLOCK_M >= q_len:
        return
    start = tl.load(Starts + s).to(tl.int32)
    ctx = tl.load(CtxLens + s).to(tl.int32)

    r = tl.arange(0, BLOCK_M * GROUP_P)  # rows: token-major, the group's heads within each token
    i = mblk * BLOCK_M + r // GROUP_P  # the token's index among the sequence's new tokens
    g = r % GROUP_P
    d = tl.arange(0, HEAD_DIM_P)
    row_ok = (i < q_len) & (g < GROUP)
    d_ok = d < HEAD_DIM
    pos = ctx - q_len + i  # its position in the sequence: it sees keys 0 .. pos
    heads = kvh * GROUP + g
    q = tl.load(
        Q + (start + i)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [R, D]

    hi = tl.minimum(ctx, ctx - q_len + tl.minimum((mblk + 1) * BLOCK_M, q_len))  # past the tile's last position
    # with a window, the keys before the tile's first row's window no row sees: start at that tile
    lo = tl.where(window > 0, tl.maximum(ctx - q_len + mblk * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
    m, l, acc = attend_range(
        q,
        K,
        V,
        Table + s * stride_tb,
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
        BLOCK_SIZE,
        BLOCK_M * GROUP_P,
        HEAD_DIM_P,
        BLOCK_N,
        PRECISION,
        SOFTCAP,
        FP8,
    )
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        Out + (start + i)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def paged_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    starts: torch.Tensor,
    q_lens: torch.Tensor,
    ctx_lens: torch.Tensor,
    table: torch.Tensor,
    max_q_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> torch.Tensor:
    """Attention of every sequence's new tokens over its paged context (see the module docstring; ``window``,
    ``softcap`` and an FP8 cache's ``k_scale`` and ``v_scale`` as triton_decode.attend_range's, 0 or None for none);
    returns [T, H, D] in q's dtype. ``max_q_len`` (the
    most new tokens of any sequence) sizes the launch; rows of q that no sequence names are left unwritten. One
    launch."""
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    if h % hkv:
        raise ValueError(f"{h} query heads do not share {hkv} KV heads evenly")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous head dimension")
    group = h // hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = starts.shape[0]
    if t == 0 or num_seqs == 0:
        return out
    _varlen_attention[(num_seqs, hkv, triton.cdiv(max_q_len, BLOCK_M))](
        q,
        k_cache,
        v_cache,
        out,
        starts,
        q_lens,
        ctx_lens,
        table,
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
        out.stride(0),
        out.stride(1),
        table.stride(0),
        BLOCK_SIZE=k_cache.shape[1],
        GROUP=group,
        GROUP_P=triton.next_power_of_2(group),
        HEAD_DIM=d,
        HEAD_DIM_P=max(16, triton.next_power_of_2(d)),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=bool(softcap),
        FP8=k_cache.dtype == torch.float8_e4m3fn,
    )
    return out
