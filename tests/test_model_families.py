"""The families of model_args.py as `mooncake model make-tiny` writes them, against Hugging Face transformers.

Each tiny model (random weights, in its architecture's own checkpoint names: Phi-3's fused tensors, Mixtral's
``block_sparse_moe.experts.N.w1``...) loads in transformers, and our engine generates transformers' greedy tokens
with its log-probabilities (soft-capped logits included), through the eager path and the decode-graph path. Configs
we cannot honour are refused naming the field. tests/test_engine_equivalence.py runs the batching, chunking, prefix
and hand-off cases on transformers-built models of the same families.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_greedy_close, make_engine
from typer.testing import CliRunner

from mooncake.cli.model_cmd import app
from mooncake.engine import SamplingParams
from mooncake.engine.model_args import SUPPORTED_ARCHS, ModelArgs
from mooncake.engine.rope import Rope
from mooncake.engine.tiny import TINY_ARCHS, make_tiny
from mooncake.engine.tokenizer import Tokenizer
from mooncake.engine.weights import load_hf_config

transformers = pytest.importorskip("transformers")
PROMPT = [{"role": "user", "content": "Tell me a story about a robot, then count: 1 2 3 4 5 6 7 8 9 10 42 100."}]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {arch: make_tiny(root / arch, arch, seed=i + 2) for i, arch in enumerate(TINY_ARCHS)}


def test_make_tiny_covers_every_family_the_engine_supports():
    assert set(TINY_ARCHS) == set(SUPPORTED_ARCHS)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_each_family_generates_transformers_greedy_tokens_and_log_probabilities(made, arch):
    path = made[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf = hf.eval()
    assert type(hf).__name__ == load_hf_config(path)["architectures"][0]
    prompt = Tokenizer.from_dir(path).encode_chat(PROMPT)
    assert len(prompt) > 40  # longer than the 32-token windows of mistral and gemma
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0)
    for graphs in (False, True):
        engine = make_engine(path, decode_graphs=graphs)
        engine.add_request(prompt, params)
        tokens, logprobs = [], []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.new_logprobs or []]
        assert_greedy_close(tokens, hf, prompt, 24, label=f"{arch} graphs={graphs}")
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert len(logprobs) == len(tokens) >= 12, tokens  # seeds chosen so no family stops early
    assert torch.allclose(torch.tensor(logprobs), want, atol=1e-4), (torch.tensor(logprobs) - want).abs().max()


def test_the_final_soft_cap_bounds_gemma2s_logits(made):
    """Gemma 2 caps its logits at 30 (tanh): greedy tokens cannot show it (tanh keeps the order), log-probabilities
    do; the test above compares them, this one that the cap is applied at all."""
    engine = make_engine(made["gemma2"])
    model = engine.model
    hidden = torch.randn(3, model.args.hidden_size) * 50
    logits = model.compute_logits(hidden)
    assert logits.abs().max() <= 30.0
    raw = (model.model.embed_tokens.weight @ hidden.t()).t()
    assert raw.abs().max() > 30.0


def test_the_cli_makes_each_family(tmp_path):
    out = CliRunner().invoke(app, ["make-tiny", str(tmp_path / "g3"), "--arch", "gemma3_text"])
    assert out.exit_code == 0, out.output
    assert load_hf_config(tmp_path / "g3")["model_type"] == "gemma3_text"


def _config(**overrides) -> dict:
    cfg = dict(
        model_type="llama",
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=300,
    )
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(model_type="deepseek_v3"), "model_type 'deepseek_v3'"),
        (
            dict(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}),
            "quant_method 'bitsandbytes'",
        ),
        (dict(rope_scaling={"rope_type": "mrope", "factor": 2.0}), "rope scaling type 'mrope'"),
        (dict(hidden_act="relu2"), "hidden_act 'relu2'"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3 rope scaling lacks"),
        (dict(sliding_window=8, layer_types=["sliding_attention", "chunked_attention"]), "chunked_attention"),
    ],
)
def test_a_config_the_engine_cannot_honour_is_refused_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModelArgs.from_hf_config(_config(**overrides))


def test_layer_windows_follow_layer_types_or_each_familys_own_rule():
    assert ModelArgs.from_hf_config(_config(model_type="mistral", sliding_window=16)).layer_windows == (16, 16)
    gemma2 = ModelArgs.from_hf_config(_config(model_type="gemma2", sliding_window=16, num_hidden_layers=4))
    assert gemma2.layer_windows == (16, None, 16, None) and gemma2.sliding_window is None
    gemma3 = ModelArgs.from_hf_config(_config(model_type="gemma3_text", sliding_window=16, num_hidden_layers=7))
    assert gemma3.layer_windows == (16,) * 5 + (None, 16)
    qwen2 = _config(model_type="qwen2", sliding_window=16, use_sliding_window=False)
    assert ModelArgs.from_hf_config(qwen2).layer_windows == (None, None)


def test_longrope_switches_to_the_long_factors_past_the_original_context_as_transformers_does():
    """Phi-3's longrope: below original_max_position_embeddings the short factors, from there on the long ones
    (transformers' incremental decoding uses the long factors once the sequence passes it), cos/sin times
    sqrt(1 + ln(factor) / ln(original))."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 2.0], long_factor=[3.0, 5.0])
    hf_cfg = Phi3Config(
        hidden_size=16,
        num_attention_heads=4,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_parameters={**params, "original_max_position_embeddings": 64},
    )
    rope = Rope.from_config(
        dict(params), {"max_position_embeddings": 256, "original_max_position_embeddings": 64}, 4, 10000.0
    )
    cos, _ = rope.tables(128, torch.float32, torch.device("cpu"))
    for seq_len, pos in ((64, 10), (65, 100)):
        inv, scale = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, "cpu", seq_len=seq_len)
        assert math.isclose(scale, rope.attention_factor) and scale > 1
        want = torch.cos(torch.cat([pos * inv, pos * inv])) * scale
        assert torch.allclose(cos[pos], want, atol=1e-6)


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "llama3", "linear"])
def test_each_rope_scaling_has_transformers_frequencies(kind):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type=kind, rope_theta=10000.0, factor=4.0)
    if kind in ("yarn", "llama3"):
        params["original_max_position_embeddings"] = 128
    if kind == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0)
    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=512, rope_parameters=params)
    want, scale = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    rope = Rope.from_config(dict(params), {"max_position_embeddings": 512}, 32, 10000.0)
    assert torch.allclose(rope.inv_freq(), want) and math.isclose(rope.attention_factor, scale)


def test_the_loader_reads_each_tensor_into_place_converting_and_naming_what_does_not_fit(tmp_path):
    """Weights stored in bfloat16 load into a float32 model with exactly their values (Mixtral's per-expert tensors
    into their slices of the stacked experts); a checkpoint missing a tensor or holding a foreign one is refused
    naming it."""
    from safetensors.torch import save_file

    from mooncake.engine.loader import load_model
    from mooncake.engine.weights import load_hf_weights

    path = make_tiny(tmp_path / "m", "mixtral", dtype=torch.bfloat16)
    model = load_model(path, torch.float32, torch.device("cpu"))
    files = load_hf_weights(path, torch.float32)
    w1 = files["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    assert torch.equal(model.model.layers["1"].mlp.experts_gate_up[3, : w1.shape[0]], w1)
    assert torch.equal(model.lm_head.weight, files["lm_head.weight"])
    weights = {n: t.to(torch.bfloat16) for n, t in files.items()}
    del weights["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.mlp.experts_gate_up'\].*mlp.extra"):
        load_model(path, torch.float32, torch.device("cpu"))
