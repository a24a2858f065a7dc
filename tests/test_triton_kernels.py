"""The Triton kernels of the CUDA engine against torch written out by hand: the paged decode attention
(mooncake/engine/kernels/triton_decode.py and triton_varlen.py), the MLP's fused activation (triton_mlp.py), and the
residual add with its RMSNorm and RoPE in one kernel each (triton_fused.py).

On a CUDA GPU it runs compiled; elsewhere under Triton's interpreter (TRITON_INTERPRET=1, in a child process), which
runs the same kernels on CPU tensors. Skipped where Triton is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mooncake.blocks import blocks_for

CUDA = torch.cuda.is_available()
# Triton reads TRITON_INTERPRET when it defines its own library's kernels, at its first import, which torch may make
# before this module runs: on the CPU this file runs again in a child process that sets it from the start.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
pytest.importorskip("triton", reason="needs Triton")
from mooncake.engine.kernels.triton_decode import paged_decode  # noqa: E402

needs_kernels = pytest.mark.skipif(
    not (CUDA or INTERPRETED), reason="runs compiled on CUDA, or in the interpreter child"
)
# An engine made here runs on the CPU, where only the interpreter runs Triton; on CUDA the engine makes these choices
# itself, and tests/test_cuda.py and test_decode_graphs.py check its tokens against the eager path's.
interpreted_engine = pytest.mark.skipif(not INTERPRETED, reason="a CPU engine through Triton: the interpreter child")


def test_the_kernels_pass_under_the_interpreter_on_a_machine_without_a_gpu():
    if CUDA or INTERPRETED:
        pytest.skip("the kernels' tests run directly here")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout


def reference(q, k_cache, v_cache, table, ctx_lens, scale):
    """Each sequence's context gathered from its blocks, softmax attention in float64, head by head."""
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(ctx_lens[i])
        if n == 0:
            continue
        k = k_cache[table[i]].flatten(0, 1)[:n].double().cpu()  # [n, Hkv, D]
        v = v_cache[table[i]].flatten(0, 1)[:n].double().cpu()
        for head in range(h):
            kv = head // (h // hkv)
            w = (q[i, head].double().cpu() @ k[:, kv].T * scale).softmax(-1)
            out[i, head] = w @ v[:, kv]
    return out


def paged_case(dtype, num_blocks=24, block_size=8, hkv=2, group=3, d=16, ctx=(1, 8, 9, 45, 0, 150), width=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(DEVICE, dtype)
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in ctx]).to(
        DEVICE
    )  # blocks out of order
    q = torch.randn(len(ctx), hkv * group, d, generator=g).to(DEVICE, dtype)
    return q, k_cache, v_cache, table, torch.tensor(ctx, device=DEVICE)


@needs_kernels
@pytest.mark.parametrize("splits", [1, 2, 16])
def test_each_sequence_attends_to_exactly_its_own_blocks_up_to_its_length(splits):
    """Contexts of 1 token, one full block, a block and one, many blocks, none (its output is zero) and more blocks
    than splits x tile; three query heads per KV head (a group that is not a power of two), blocks in any order."""
    q, k, v, table, ctx = paged_case(torch.float32)
    q = torch.cat([q, torch.randn_like(q[:, :2])], dim=1)[:, :6]  # strided like the engine's (q beside k in one tensor)
    out = paged_decode(q, k, v, table, ctx, 0.25, num_splits=splits)
    want = reference(q, k, v, table, ctx, 0.25)
    assert torch.allclose(out.double().cpu(), want, atol=1e-5)
    assert out[4].abs().sum() == 0  # no context: nothing attended


@needs_kernels
def test_blocks_past_a_sequences_length_are_never_read():
    """Garbage (NaN) in the cache beyond each context and in table entries past it changes nothing."""
    q, k, v, table, ctx = paged_case(torch.float32, ctx=(5, 17))
    want = paged_decode(q, k, v, table, ctx, 0.25, num_splits=2)
    for i, n in enumerate((5, 17)):
        last = table[i, (n - 1) // 8]
        k[last, (n - 1) % 8 + 1 :] = float("nan")  # the rest of its last block
        v[last, (n - 1) % 8 + 1 :] = float("nan")
    table[:, 3:] = 10**6  # block ids out of range where no token is
    got = paged_decode(q, k, v, table, ctx, 0.25, num_splits=2)
    assert torch.equal(got, want)


@pytest.mark.skipif(not CUDA, reason="bfloat16 on the interpreter is numpy's emulation; checked on CUDA")
def test_bfloat16_is_float_attention_rounded_once():
    q, k, v, table, ctx = paged_case(torch.bfloat16, hkv=8, group=4, d=64, block_size=16, width=12, ctx=(1, 100, 191))
    out = paged_decode(q, k, v, table, ctx, 64**-0.5)
    want = reference(q, k, v, table, ctx, 64**-0.5)
    assert torch.allclose(out.double().cpu(), want, atol=2e-2)


@needs_kernels
def test_a_bad_split_count_or_head_grouping_is_a_value_error():
    q, k, v, table, ctx = paged_case(torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode(q, k, v, table, ctx, 0.25, num_splits=3)
    with pytest.raises(ValueError, match="share"):
        paged_decode(q[:, :5], k, v, table, ctx, 0.25)


@needs_kernels
def test_the_fused_activation_is_silu_then_mul():
    from mooncake.engine.kernels.triton_mlp import silu_mul

    x = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(DEVICE)  # more than one block a row
    gate, up = x.split(1500, dim=-1)
    assert torch.allclose(silu_mul(x), torch.nn.functional.silu(gate) * up, atol=1e-6)
    assert silu_mul(x[:0]).shape == (0, 1500)


@needs_kernels
def test_the_fused_residual_add_and_norm_is_the_eager_norm_of_the_sum():
    from mooncake.engine.kernels.triton_fused import add_rms_norm
    from mooncake.engine.model import RMSNorm

    g = torch.Generator().manual_seed(3)
    wide = torch.randn(7, 1100, generator=g).to(DEVICE)
    x, delta = wide[:, :1000], torch.randn(7, 1000, generator=g).to(DEVICE)  # x strided as a view of a wider row
    norm = RMSNorm(1000, 1e-5).to(DEVICE)
    norm.weight.data = torch.randn(1000, generator=g).to(DEVICE)
    normed, summed = add_rms_norm(delta, x, norm.weight, norm.eps)
    assert torch.equal(summed, x + delta)
    assert torch.allclose(normed, norm(x + delta), atol=1e-5)
    assert [t.shape for t in add_rms_norm(delta[:0], x[:0], norm.weight, 1e-5)] == [(0, 1000)] * 2
    with pytest.raises(ValueError):
        add_rms_norm(delta[:, :999], x, norm.weight, 1e-5)


@needs_kernels
def test_the_fused_rope_is_the_eager_rotation_of_q_and_k_read_where_the_projection_wrote_them():
    from mooncake.engine.kernels.triton_fused import rope
    from mooncake.engine.model import apply_rope

    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(9, (6 + 2 + 2) * 24, generator=g).to(DEVICE)
    qk = qkv[:, : 8 * 24].view(9, 8, 24)  # q and k heads, rows strided by the whole projection's width
    angles = torch.randn(9, 1, 12, generator=g).to(DEVICE)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    got = rope(qk, cos, sin)
    assert got.is_contiguous() and torch.allclose(got, apply_rope(qk, cos, sin), atol=1e-6)
    assert not torch.allclose(got, qk, atol=1e-2)  # it rotated something
    with pytest.raises(ValueError):
        rope(qk[..., :23], cos, sin)


@interpreted_engine
def test_an_engine_with_the_fused_norms_rope_and_activation_generates_the_eager_paths_greedy_tokens(
    tiny_dir, monkeypatch
):
    """The layers with every add+norm, RoPE and activation through the Triton kernels (as CUDA runs them in a graph
    or a long step), here on the CPU: prompts chunked beside decodes, the same greedy tokens as torch's kernels."""
    from conftest import make_engine

    from mooncake.engine import SamplingParams, model

    prompts = [list(range(5, 45)), list(range(100, 123)), [11, 12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [
        o.output_token_ids
        for o in make_engine(tiny_dir, use_kernels=False, max_num_batched_tokens=16).generate(prompts, params)
    ]
    used = set()

    def always(x, name):
        used.add(name)
        return model._triton_kernels()[name]

    monkeypatch.setattr(model, "fused", always)
    engine = make_engine(tiny_dir, use_kernels=False, max_num_batched_tokens=16)
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == want
    assert used == {"add_rms_norm", "rope", "silu_mul"}


@pytest.mark.skipif(not CUDA, reason="bfloat16 on the interpreter is numpy's emulation; checked on CUDA")
def test_the_fused_norm_and_rope_in_bfloat16_are_the_eager_paths_within_one_rounding():
    from mooncake.engine.kernels.triton_fused import add_rms_norm, rope
    from mooncake.engine.model import RMSNorm, apply_rope

    g = torch.Generator().manual_seed(5)
    x, delta = (torch.randn(300, 2048, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    norm = RMSNorm(2048, 1e-5).to(DEVICE, torch.bfloat16)
    normed, summed = add_rms_norm(delta, x, norm.weight, norm.eps)
    assert torch.equal(summed, x + delta)
    assert torch.allclose(normed.float(), norm(x + delta).float(), rtol=1e-2, atol=1e-2)
    qk = torch.randn(100, 40, 64, generator=g).to(DEVICE, torch.bfloat16)  # under FUSED_MIN_TOKENS: torch's own
    angles = torch.randn(100, 1, 32, generator=g).to(DEVICE)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    assert torch.allclose(rope(qk, cos, sin).float(), apply_rope(qk, cos, sin).float(), rtol=1e-2, atol=1e-2)


def mixed_step(dtype, seqs, num_blocks=40, block_size=8, hkv=2, group=3, d=16, seed=2):
    """A step's q, k, v and cache: ``seqs`` is (new tokens, context) per sequence, decodes (1 new token) first as the
    runner lays them out; each sequence's blocks out of order, its new tokens' K/V written to their slots."""
    from mooncake.engine.attention import write_kv

    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(DEVICE, dtype)
    t = sum(n for n, _ in seqs)
    q = torch.randn(t, hkv * group, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(t, hkv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(t, hkv, d, generator=g).to(DEVICE, dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, starts, row = [], [], [], 0
    for n, ctx in seqs:
        blocks = [perm.pop() for _ in range(blocks_for(ctx, block_size))]
        tables.append(blocks)
        starts.append(row)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx)]
        row += n
    write_kv(k_cache, v_cache, k, v, torch.tensor(slots, device=DEVICE))
    return q, k, v, k_cache, v_cache, tables, starts


def eager(q, k, v, k_cache, v_cache, seqs, tables, starts, scale, num_decodes, window=0, softcap=0.0, scales=None):
    """The engine's own path without kernels: the padded SDPA of the first ``num_decodes`` sequences (one token each)
    and one causal SDPA per prompt chunk after them."""
    from mooncake.engine.attention import AttentionMetadata, PrefillSegment, paged_attention

    width = max(len(t) for t in tables[:num_decodes])
    ctx = torch.tensor([c for _, c in seqs[:num_decodes]], dtype=torch.long)
    mask = torch.arange(width * k_cache.shape[1])[None, :] < ctx[:, None]
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decodes=num_decodes,
        decode_block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables[:num_decodes]]).to(DEVICE),
        decode_ctx_lens=ctx.to(DEVICE),
        decode_mask=mask[:, None, None, :].to(DEVICE),
        prefills=[
            PrefillSegment(starts[i], n, c, torch.tensor(tables[i], device=DEVICE))
            for i, (n, c) in enumerate(seqs)
            if i >= num_decodes
        ],
    )
    return paged_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap, scales)


def varlen(q, k_cache, v_cache, seqs, tables, starts, scale, window=0, softcap=0.0, *dequant):
    from mooncake.engine.kernels.triton_varlen import paged_varlen

    width = max(len(t) for t in tables)
    return paged_varlen(
        q,
        k_cache,
        v_cache,
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor([n for n, _ in seqs], dtype=torch.int32, device=DEVICE),
        torch.tensor([c for _, c in seqs], dtype=torch.int32, device=DEVICE),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE),
        max(n for n, _ in seqs),
        scale,
        window,
        softcap,
        *dequant,
    )


# 3 decodes, of 1, 9 and 64 tokens of context; a chunk of 20 behind a cached prefix of 30 (not a whole block); a
# prompt of 33 with none (more than one tile of new tokens); a chunk of 16 behind 64 (whole blocks); a one-token prompt
MIXED = [(1, 1), (1, 9), (1, 64), (20, 50), (33, 33), (16, 80), (1, 1)]


@needs_kernels
@pytest.mark.parametrize("group", [1, 3, 4])
def test_one_varlen_call_is_the_eager_steps_attention_for_decodes_and_chunks_together(group):
    """Every row of a mixed step, decodes and prompt chunks (cached prefixes read in place through the block table),
    as the eager path computes it: one SDPA per chunk after the decodes' padded one."""
    q, k, v, kc, vc, tables, starts = mixed_step(torch.float32, MIXED, group=group)
    want = eager(q, k, v, kc, vc, MIXED, tables, starts, 0.25, num_decodes=3)
    got = varlen(q, kc, vc, MIXED, tables, starts, 0.25)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@needs_kernels
def test_the_varlen_call_reads_nothing_past_a_sequences_context_nor_after_a_tokens_position():
    """NaN in the cache past each context and in the table past each sequence's blocks changes nothing; nor does a
    later token's K/V for an earlier token (causal): the first chunk alone gives its rows the same outputs."""
    seqs = [(1, 9), (20, 50)]
    q, k, v, kc, vc, tables, starts = mixed_step(torch.float32, seqs, block_size=8)
    want = varlen(q, kc, vc, seqs, tables, starts, 0.25)
    for (n, ctx), blocks in zip(seqs, tables):
        last = blocks[(ctx - 1) // 8]
        kc[last, (ctx - 1) % 8 + 1 :] = float("nan")
        vc[last, (ctx - 1) % 8 + 1 :] = float("nan")
    assert torch.equal(varlen(q, kc, vc, seqs, tables, starts, 0.25), want)
    # the chunk's first 5 tokens as a chunk of their own: the same rows (they never saw the 15 after them)
    short = [(1, 9), (5, 35)]
    got = varlen(q[:6], kc, vc, short, tables, starts, 0.25)
    assert torch.allclose(got, want[:6], atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("window,softcap", [(12, 0.0), (0, 2.0), (7, 1.5)])
def test_a_sliding_window_and_soft_capped_scores_are_the_eager_paths_in_both_kernels(window, softcap):
    """Gemma's and Mistral's attention: each token sees only its last ``window`` keys (a window shorter than a tile,
    than a chunk, and not a multiple of the block size) and the scores are soft-capped, in the decode kernel (with
    splits) and in one varlen call, as the eager path computes it (the path transformers' tokens are checked on)."""
    q, k, v, kc, vc, tables, starts = mixed_step(torch.float32, MIXED, group=2)
    want = eager(q, k, v, kc, vc, MIXED, tables, starts, 0.25, num_decodes=3, window=window, softcap=softcap)
    plain = eager(q, k, v, kc, vc, MIXED, tables, starts, 0.25, num_decodes=3)
    assert not torch.allclose(want, plain, atol=1e-3)  # the window and cap change the answer
    got = varlen(q, kc, vc, MIXED, tables, starts, 0.25, window, softcap)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    width = max(len(t) for t in tables[:3])
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables[:3]], device=DEVICE)
    ctx = torch.tensor([c for _, c in MIXED[:3]], device=DEVICE)
    for splits in (1, 4):
        decoded = paged_decode(q[:3].contiguous(), kc, vc, table, ctx, 0.25, window, softcap, num_splits=splits)
        assert torch.allclose(decoded, want[:3], atol=1e-5), (splits, (decoded - want[:3]).abs().max())


@needs_kernels
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (7, 1.5)])
def test_fp8_caches_are_read_in_both_kernels_as_the_eager_path_reads_them(window, softcap):
    """An FP8 cache (``kv_cache_dtype`` fp8: float8 e4m3, a scale per layer for K and one for V): both kernels read each
    value times its scale, as the eager path dequantizes, for decodes and prompt chunks together."""
    from mooncake.engine.attention import KVScales, to_fp8

    q, k, v, kc, vc, tables, starts = mixed_step(torch.float32, MIXED, group=2)
    scales = KVScales(0.5, 3.0)
    kc8, vc8 = to_fp8(kc, scales.k), to_fp8(vc, scales.v)  # every slot as write_kv stores it
    want = eager(q, k, v, kc8, vc8, MIXED, tables, starts, 0.25, 3, window, softcap, scales)
    full = eager(q, k, v, kc, vc, MIXED, tables, starts, 0.25, 3, window, softcap)
    assert 1e-4 < (want - full).abs().max() < 0.5  # FP8 changes the answer, a little
    got = varlen(q, kc8, vc8, MIXED, tables, starts, 0.25, window, softcap, scales.k, scales.v)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    width = max(len(t) for t in tables[:3])
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables[:3]], device=DEVICE)
    ctx = torch.tensor([c for _, c in MIXED[:3]], device=DEVICE)
    for splits in (1, 4):
        decoded = paged_decode(
            q[:3].contiguous(), kc8, vc8, table, ctx, 0.25, window, softcap, 0.5, 3.0, num_splits=splits
        )
        assert torch.allclose(decoded, want[:3], atol=1e-5), (splits, (decoded - want[:3]).abs().max())


@pytest.mark.skipif(not CUDA, reason="bfloat16 on the interpreter is numpy's emulation; checked on CUDA")
def test_the_varlen_call_in_bfloat16_is_the_eager_path_within_rounding():
    seqs = [(1, 100), (1, 191), (300, 300), (64, 1000)]
    q, k, v, kc, vc, tables, starts = mixed_step(
        torch.bfloat16, seqs, num_blocks=120, block_size=16, hkv=8, group=4, d=64
    )
    want = eager(q, k, v, kc, vc, seqs, tables, starts, 64**-0.5, num_decodes=2)
    got = varlen(q, kc, vc, seqs, tables, starts, 64**-0.5)
    assert torch.allclose(got.float(), want.float(), atol=2e-2)


@interpreted_engine
def test_an_engine_attending_each_mixed_step_in_one_varlen_call_generates_the_same_greedy_tokens(tiny_dir):
    """Four prompts at once through 16-token steps (chunks behind cached prefixes, riding beside decodes, one prompt
    sharing another's blocks) and 8 tokens each: the tokens of the engine whose steps with prompt chunks go through
    kernels/triton_varlen.py (as on CUDA) are the tokens of the eager path's."""
    from conftest import make_engine

    from mooncake.engine import SamplingParams
    from mooncake.engine.kernels.triton_varlen import paged_varlen

    prompts = [list(range(5, 45)), list(range(5, 45)) + [7, 8, 9], list(range(100, 123)), [11, 12, 13]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager_engine = make_engine(tiny_dir, use_kernels=False, max_num_batched_tokens=16)
    want = [o.output_token_ids for o in eager_engine.generate(prompts, params)]
    engine = make_engine(tiny_dir, use_kernels=False, max_num_batched_tokens=16)
    calls = []

    def counted(*args):
        calls.append(args[4].tolist())  # each sequence's new tokens (q_lens)
        return paged_varlen(*args)

    engine.runner.step_kernel = counted  # the CUDA engine's choice (engine.py), made here on the CPU
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == want
    assert any(len(c) > 1 and 1 in c and max(c) > 1 for c in calls)  # a step of decodes and chunks, in one call


@interpreted_engine
def test_an_fp8_engine_through_both_kernels_generates_the_torch_paths_greedy_tokens(tiny_dir):
    """With ``kv_cache_dtype="fp8"``: the engine whose mixed steps go through the varlen kernel and whose decode-only
    steps go through the decode kernel (as on CUDA) gives the greedy tokens of the torch path's FP8 engine."""
    from conftest import make_engine

    from mooncake.engine import SamplingParams
    from mooncake.engine.kernels.triton_varlen import paged_varlen

    prompts = [list(range(5, 45)), list(range(5, 45)) + [7, 8, 9], list(range(100, 123)), [11, 12, 13]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    torch_path = make_engine(tiny_dir, kv_cache_dtype="fp8", use_kernels=False, max_num_batched_tokens=16)
    want = [o.output_token_ids for o in torch_path.generate(prompts, params)]
    engine = make_engine(tiny_dir, kv_cache_dtype="fp8", use_kernels=False, max_num_batched_tokens=16)
    engine.runner.step_kernel, engine.runner.decode_kernel = paged_varlen, paged_decode  # the CUDA engine's choices
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == want


def quantized_layer(kind: str, n: int, k: int, group: int, bias: bool, seed: int = 0):
    """A QuantLinear of random values (``kind`` fp8, int8 or int4) and scales, zero points for the integers."""
    from mooncake.engine.quant import QuantLinear, WeightQuant

    gen = torch.Generator().manual_seed(seed)
    quant = WeightQuant("test", "test", "fp8" if kind == "fp8" else "int", 4 if kind == "int4" else 8, group)
    layer = QuantLinear(k, n, bias, quant, "layer")
    if kind == "fp8":
        layer.qweight.copy_((torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn))
    else:
        layer.qweight.copy_(torch.randint(0, 256, layer.qweight.shape, generator=gen, dtype=torch.uint8))
        layer.zeros.copy_(torch.randint(0, 16 if kind == "int4" else 256, layer.zeros.shape, generator=gen).float())
    layer.scales.copy_(torch.rand(layer.scales.shape, generator=gen) * 0.01 + 1e-4)
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=gen))
    return layer.to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("kind", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_the_quantized_matmul_is_the_dequantized_weights_matmul(kind, tokens):
    """Every shape off the tiles (N 40, K 96 in groups of 32, tokens 1 to 40), with and without a bias."""
    from mooncake.engine.kernels.triton_quant import quant_matmul

    for bias in (False, True):
        layer = quantized_layer(kind, 40, 96, 32, bias, seed=tokens)
        x = torch.randn(tokens, 96, device=DEVICE)
        want = torch.nn.functional.linear(x, layer.dequantized(torch.float32), layer.bias)
        got = quant_matmul(x, layer.qweight, layer.scales, layer.zeros, layer.bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # 16-bit: the weight rounded to x's dtype as the torch path rounds it, summed in float32 (bfloat16 compiled
        # only: the interpreter's tl.dot misreads bfloat16 operands, a 16x16 product off by 1e10 in Triton 3.9)
        for dtype in (torch.float16, torch.bfloat16) if CUDA else (torch.float16,):
            xh, bh = x.to(dtype), None if layer.bias is None else layer.bias.to(dtype)
            want16 = torch.nn.functional.linear(xh, layer.dequantized(dtype), bh)
            got16 = quant_matmul(xh, layer.qweight, layer.scales, layer.zeros, bh)
            torch.testing.assert_close(got16.float(), want16.float(), rtol=2e-2, atol=2e-2)


@interpreted_engine
@pytest.mark.parametrize("scheme", ["int4-group-asym", "fp8-channel"])
def test_an_engine_through_the_quantized_matmul_generates_the_dequantizing_paths_tokens(tiny_models, tmp_path, scheme):
    """A quantized checkpoint (tests/quantized.py) whose layers go through the kernel, as on CUDA: the CPU path's
    greedy tokens (each layer dequantized, then torch's matmul)."""
    from conftest import make_engine
    from quantized import compressed_tensors_checkpoint

    import mooncake.engine.quant as quant
    from mooncake.engine import SamplingParams

    pytest.importorskip("compressed_tensors")
    bits, kind, group = (4, "int", 16) if scheme.startswith("int4") else (8, "float", None)
    strategy = "group" if group else "channel"
    path = compressed_tensors_checkpoint(
        tiny_models["llama"].path,
        tmp_path / scheme,
        bits=bits,
        kind=kind,
        strategy=strategy,
        symmetric=group is None,
        group=group,
    )
    prompts = [list(range(5, 45)), [11, 12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.output_token_ids for o in make_engine(path).generate(prompts, params)]
    calls = []
    kernel = quant._triton_quant()

    def always(x):
        calls.append(x.shape[0])
        return kernel

    original = quant.quant_kernel
    quant.quant_kernel = always
    try:
        got = [o.output_token_ids for o in make_engine(path).generate(prompts, params)]
    finally:
        quant.quant_kernel = original
    assert calls and got == want
