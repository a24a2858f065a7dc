"""Native workers on a CUDA GPU: the engine against transformers, the prefill connector's pushes from a CUDA cache
(pinned host staging on a side stream), and whole clusters whose workers run on the GPU (``--device cuda``), a single
prefill worker and a pipelined group, against one engine alone on the same GPU.

Skipped where torch sees no GPU (CI, this project's VMs); run on a lent GPU machine with
``pytest tests/test_cuda.py`` (benchmarks/results/2026-11-26-native-workers-h200.md gives
the command used and its results).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from clusters import backend, generate, instances, reference_tokens, start_cluster, tokens
from conftest import assert_greedy_close, make_engine, run_to_completion

from mooncake.blocks import blocks_for
from mooncake.engine.request import SamplingParams

# MOONCAKE_TEST_DEVICE=cpu runs the same tests on the CPU (a dry run of their logic on a machine without a GPU)
DEVICE = os.environ.get("MOONCAKE_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs a CUDA GPU")


def prompt_of(n: int, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


# -- the engine ---------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [5, 70, 400])
def test_the_engine_on_cuda_is_transformers_greedy(tiny, length):
    engine = make_engine(tiny.path, device=DEVICE, max_model_len=1024)
    assert engine.runner.kv_cache.device.type == torch.device(DEVICE).type
    prompt = prompt_of(length, seed=length, vocab=tiny.vocab_size)
    engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.0), request_id="r")
    out = run_to_completion(engine)["r"]
    assert_greedy_close(out.output_token_ids, tiny.hf, prompt, 16, label=f"{tiny.name} cuda")


def test_a_cuda_batch_is_each_request_alone(tiny_llama):
    """Continuous batching on the GPU: eight prompts of different lengths stepped together give each one's tokens."""
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 40, 90, 129, 200, 257, 300)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    batched = make_engine(tiny_llama.path, device=DEVICE, max_model_len=1024)
    for i, p in enumerate(prompts):
        batched.add_request(p, params, request_id=str(i))
    together = run_to_completion(batched)
    for i, p in enumerate(prompts):
        alone = make_engine(tiny_llama.path, device=DEVICE, max_model_len=1024)
        alone.add_request(p, params, request_id="a")
        assert list(together[str(i)].output_token_ids) == list(run_to_completion(alone)["a"].output_token_ids)


def test_a_step_attended_in_one_varlen_call_gives_the_chunk_by_chunk_tokens(tiny_llama):
    """A CUDA engine attends a step with prompt chunks in one kernel call (kernels/triton_varlen.py); without it, one
    SDPA call a chunk after the decodes': the same greedy tokens for prompts chunked behind cached prefixes and
    riding beside decodes (a shared prefix among them)."""
    base = prompt_of(150, seed=9)
    prompts = [base, base + prompt_of(40, seed=10), prompt_of(33, seed=11), prompt_of(5, seed=12)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for varlen in (True, False):
        engine = make_engine(tiny_llama.path, device=DEVICE, max_model_len=1024)
        assert (engine.runner.step_kernel is not None) == DEVICE.startswith("cuda")  # the CUDA engine's default
        if not varlen:
            engine.runner.step_kernel = None
        outputs.append([o.output_token_ids for o in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]


# -- the prefill connector's pushes from a CUDA cache ---------------------------------------------


def test_pushes_from_a_cuda_cache_land_what_the_cache_holds(tiny_llama):
    """Every layer of every block, copied out on the staging stream while the next layer computes, lands in the landing
    segment and the pool slots: the bytes equal the GPU cache's blocks read back at the end (a copy raced against the
    compute, or made before the layer was written, would not), and match the CPU's pushes to float32 rounding."""
    from test_prefill_connector import _push

    prompt = [(7 * i) % 280 + 10 for i in range(70)]  # 5 blocks, the last partial; 3 engine steps
    cuda_landing, cuda_pool, cache_blocks = _push(tiny_llama.path, prompt, staged=True, device=DEVICE)
    cpu_landing, cpu_pool, _ = _push(tiny_llama.path, prompt, staged=False)
    got = torch.frombuffer(bytearray(cuda_landing), dtype=torch.float32).view(len(cache_blocks), *cache_blocks[0].shape)
    assert torch.equal(got, torch.stack(cache_blocks))  # byte for byte what the GPU holds
    assert torch.equal(cuda_pool[5], got[0]) and torch.equal(cuda_pool[1], got[2])  # pool slots of blocks 0 and 2
    want = torch.frombuffer(bytearray(cpu_landing), dtype=torch.float32).view_as(got)
    assert got.abs().sum() > 0 and torch.allclose(got, want, rtol=1e-3, atol=1e-4)
    assert torch.equal(cpu_pool[5], want[0]) and torch.equal(cpu_pool[1], want[2])


# -- clusters on the GPU ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["single", "group"])
def gpu_cluster(request, tiny_dir, tmp_path_factory):
    """A cluster whose workers run on the GPU: one prefill worker, or a 2-stage pipelined group, and one decode
    worker."""
    group = dict(prefill_groups=1, group_size=2) if request.param == "group" else {}
    c = start_cluster(
        tiny_dir,
        tmp_path_factory.mktemp(f"cuda-{request.param}"),
        prefill=1,
        decode=1,
        device=DEVICE,
        max_num_batched_tokens=64,
        **group,
    )
    c.kind = request.param
    yield c
    c.stop()


@pytest.mark.parametrize("length", [5, 300, 900])
def test_greedy_through_gpu_workers_equals_one_gpu_engine(gpu_cluster, tiny_dir, length):
    if gpu_cluster.kind == "group":
        assert instances(gpu_cluster)["prefill-0"].pipeline_stages == 2
    prompt = prompt_of(length, seed=1000 + length, vocab=450)
    got = generate(
        backend(gpu_cluster), f"cuda-{gpu_cluster.kind}-{length}", prompt, 16, temperature=0.0, ignore_eos=True
    )
    assert tokens(got) == reference_tokens(tiny_dir, prompt, 16, device=DEVICE)


def test_a_prefix_from_the_pool_is_loaded_into_the_gpu_cache(gpu_cluster, tiny_dir):
    shared = prompt_of(256, seed=77, vocab=450)
    be = backend(gpu_cluster)
    generate(
        be, f"cuda-{gpu_cluster.kind}-a", shared + prompt_of(20, seed=1, vocab=450), 4, temperature=0.0, ignore_eos=True
    )
    prompt = shared + prompt_of(100, seed=2, vocab=450)
    got = generate(be, f"cuda-{gpu_cluster.kind}-b", prompt, 16, temperature=0.0, ignore_eos=True)
    assert got[-1].cached_tokens == 256
    assert tokens(got) == reference_tokens(tiny_dir, prompt, 16, device=DEVICE)


def test_a_prompt_chunk_over_a_cached_prefix_attends_like_the_masked_reference():
    """A chunk of 44 queries at the end of a 300-token context whose blocks lie out of order: on CUDA in bfloat16 it
    goes through torch's flash kernel with lower-right causal alignment, no mask; the reference is the explicit mask in
    float32."""
    import torch.nn.functional as F

    from mooncake.engine.attention import AttentionMetadata, PrefillSegment, paged_attention

    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if DEVICE.startswith("cuda") else torch.float32
    nb, bs, hkv, h, d, ctx, n = 40, 16, 2, 8, 64, 300, 44
    kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    blocks = torch.randperm(nb, generator=g)[: blocks_for(ctx, bs)].to(DEVICE)
    q = torch.randn(n, h, d, generator=g).to(DEVICE, dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.long, device=DEVICE),
        num_decodes=0,
        decode_block_table=None,
        decode_ctx_lens=None,
        decode_mask=None,
        prefills=[PrefillSegment(0, n, ctx, blocks)],
    )
    out = paged_attention(q, q[:, :hkv], q[:, :hkv], kc, vc, meta, d**-0.5)  # [n, H, D]
    keys, values = (c[blocks].flatten(0, 1)[:ctx].float().transpose(0, 1)[None] for c in (kc, vc))  # [1, Hkv, ctx, D]
    mask = torch.ones(n, ctx, dtype=torch.bool, device=DEVICE).tril(ctx - n)
    want = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True
    )
    assert torch.allclose(out.float(), want[0].transpose(0, 1), atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


# -- the hand-off into a decode engine's CUDA cache ------------------------------------------------


def _export_and_report(conn) -> None:
    """A spawned process: export a CUDA tensor by IPC, wait for the other side's writes, send back what it holds."""
    from mooncake.serving.cuda_ipc import export_cuda_tensor

    cache = torch.zeros(4, 8, device="cuda")
    conn.send(export_cuda_tensor(cache))
    conn.recv()
    torch.cuda.synchronize()
    conn.send(cache.cpu().tolist())


def test_a_cuda_cache_exported_by_ipc_is_written_in_place_by_another_process():
    """What the decode worker exports (JSON, no pickle) another process maps and writes; the exporter sees the bytes."""
    if not DEVICE.startswith("cuda"):
        pytest.skip("CUDA IPC needs a GPU")
    import multiprocessing

    from mooncake.serving.cuda_ipc import open_cuda_tensor

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_export_and_report, args=(there,))
    child.start()
    try:
        mapped = open_cuda_tensor(here.recv())
        assert tuple(mapped.shape) == (4, 8)
        mapped[1].fill_(3.0)
        torch.cuda.synchronize()
        here.send("written")
        assert here.poll(60)
        got = here.recv()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert got[1] == [3.0] * 8 and got[0] == [0.0] * 8 and got[2] == [0.0] * 8
