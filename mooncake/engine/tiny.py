"""Tiny random-weight models in the Hugging Face layout, for tests and demos.

``make_tiny(out_dir, arch)`` writes a complete model directory (config, safetensors,
tokenizer, chat template, generation config) that transformers and our engine both
load: a few layers of hidden size 64 with grouped-query attention, random weights
from a seeded generator (same seed -> byte-identical files), and a byte-level BPE
tokenizer of ~500 tokens trained offline on the small corpus below, with ChatML
special tokens and template.

Architectures differ as the real ones do: ``qwen2`` has random q/k/v biases, ``qwen3``
per-head q/k RMSNorm weights, ``llama`` an untied ``lm_head`` (the qwens tie it to the
embedding); ``mistral`` a 32-token sliding window; ``phi3`` fused qkv and gate-up tensors;
``gemma2`` and ``gemma3_text`` a sliding layer then a global one, Gemma's norms (stored as
w - 1), GeGLU and soft-capping (gemma2) or q/k norms and a local rope (gemma3_text);
``qwen3_moe`` 8 experts and ``mixtral`` 4, two a token, under their own checkpoint names.
Weight scales are chosen so logits are spread (top-2 gaps well above 1e-3) while
activations stay small; norm weights are random around 1 (Gemma's around 0) so an
engine that forgets one is caught.

The tokenizer follows the architecture too: Qwen-style (NFC + Qwen's regex) for the
qwens, SmolLM2-style splitting for the others.

Does not import transformers (a dev-only dependency).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from mooncake.engine.gguf_vocab import QWEN2_SPLIT_REGEX
from mooncake.engine.tokenizer import bos_eos_post_processor

if TYPE_CHECKING:  # imported where weights are made: `mooncake model --help` and the CLI start without it
    import torch

from mooncake.engine.weights import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    atomic_model_dir,
    save_hf_weights,
    write_json,
)

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "qwen3_moe", "mixtral")
_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
_QWEN = ("qwen2", "qwen3", "qwen3_moe")
_GEMMA = ("gemma2", "gemma3_text")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_VOCAB_SIZE = 512

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system splits prefill from decode.
Prefill is compute bound: it reads the whole prompt at once and writes the KV cache.
Decode is memory bound: each step reads every cached key and value to make one token.
Mooncake keeps the KV cache in a pool of DRAM and SSD shared by all the nodes, so a
prefix computed on one machine can be reused on another by moving blocks instead of
recomputing them. The conductor picks a prefill node and a decode node for each request.
It predicts the time to first token from the queue, the transfer and the prefill time,
and it rejects a request early when the service level objective cannot be met.
Hello world! How are you today? I am fine, thank you. What is the weather like?
It is sunny and warm, about 23 degrees. Tomorrow it will rain, maybe 12 or 15 mm.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 3.14159 2.71828 1e-6 -7.5
def add(a, b):
    return a + b

for i in range(10):
    print(f"step {i}: {add(i, i)}")

class Cache:
    def __init__(self, capacity: int) -> None:
        self.blocks = {}
        self.capacity = capacity
{"role": "user", "content": "Tell me a story about a robot."}
Once upon a time a small robot learned to read. Every night it read one more page,
and every morning it told the other robots what it had learned. They listened, then
they began to read too, and soon the whole city was full of reading robots.
Unicode: café, naïve, über, Größe, señor, 東京, 北京, 大阪, こんにちは, 안녕하세요, Привет мир,
مرحبا, שלום, γειά σου, emoji 🙂 🚀 🎉 ✓ → ∑ ∞ ≈ ≠ ± × ÷ €100 £5 ¥30.
Whitespace:  two spaces,   three,\tone tab,\n\nblank lines and trailing spaces   
"""

_ALLOWED_OVERRIDES = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "sliding_window",
        "tie_word_embeddings",
        "vocab_size",
    }
)
_ROPE_TYPES = ("linear", "llama3", "dynamic", "yarn")


def train_tiny_tokenizer(style: str = "smollm", vocab_size: int = TINY_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE tokenizer on the built-in corpus (deterministic).

    Ids 0-2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (special tokens). No
    BOS is added when encoding. ``style`` picks how text is split before BPE, as in the
    real models: ``"smollm"`` (SmolLM2/Llama: digits one by one, then GPT-2's regex) or
    ``"qwen2"`` (Qwen2/Qwen3: NFC, then Qwen's regex). transformers rebuilds a ``qwen2``
    model's tokenizer with Qwen's splitting whatever tokenizer.json says, so the tiny
    one has to match it.
    """
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be at least 300 (256 bytes + specials + merges), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    if style == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    elif style == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
    else:
        raise ValueError(f"unknown tokenizer style {style!r}; choose 'smollm' or 'qwen2'")
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    eos = ("<|im_end|>", tokenizer.token_to_id("<|im_end|>"))
    tokenizer.post_processor = bos_eos_post_processor(None, eos, add_bos=False, add_eos=False)
    return tokenizer


def tiny_config(arch: str, vocab_size: int, dtype: torch.dtype, overrides: dict[str, Any]) -> dict[str, Any]:
    """The config.json dict for a tiny model; ``ValueError`` for bad arch or overrides."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    unknown = set(overrides) - _ALLOWED_OVERRIDES
    if unknown:
        raise ValueError(f"unknown overrides {sorted(unknown)}; allowed: {sorted(_ALLOWED_OVERRIDES)}")
    shape: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": arch in ("qwen2", "qwen3") or arch in _GEMMA,
        "sliding_window": 32 if arch in ("mistral", *_GEMMA) else None,
    }
    shape.update(overrides)
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        if not isinstance(shape[key], int) or isinstance(shape[key], bool) or shape[key] <= 0:
            raise ValueError(f"{key} must be a positive int, got {shape[key]!r}")
    if shape["vocab_size"] < vocab_size:
        raise ValueError(f"vocab_size {shape['vocab_size']} is smaller than the tokenizer's {vocab_size} tokens")
    if shape["num_attention_heads"] % shape["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if shape["head_dim"] % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {shape['head_dim']}")
    scaling = shape["rope_scaling"]
    if scaling is not None:
        if not isinstance(scaling, dict) or scaling.get("rope_type") not in _ROPE_TYPES or "factor" not in scaling:
            raise ValueError(
                f"rope_scaling must be a dict with rope_type in {_ROPE_TYPES} and a factor, got {scaling!r}"
            )
        if scaling["rope_type"] == "llama3":
            needed = {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
            if not needed <= set(scaling):
                raise ValueError(f"llama3 rope_scaling needs {sorted(needed)}, got {sorted(scaling)}")
    window = shape.pop("sliding_window")
    config: dict[str, Any] = {
        "architectures": [_CLASSES[arch]],
        "model_type": arch,
        **shape,
        "hidden_act": "gelu_pytorch_tanh" if arch in _GEMMA else "silu",
        "attention_bias": arch == "qwen2",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
        "sliding_window": window,
    }
    if arch == "llama":
        config["mlp_bias"] = False
        if window is None:
            del config["sliding_window"]  # as llama's configs are (and as this one was before the other families)
    if arch in _QWEN:
        config["use_sliding_window"] = window is not None
    if arch in _GEMMA:
        config["hidden_activation"] = config.pop("hidden_act")
        config["query_pre_attn_scalar"] = shape["head_dim"]
        config["layer_types"] = [
            "full_attention" if window is None or i % 2 else "sliding_attention"
            for i in range(shape["num_hidden_layers"])
        ]
    if arch == "gemma2":
        config["attn_logit_softcapping"] = 50.0
        config["final_logit_softcapping"] = 30.0
    if arch == "gemma3_text":
        config["rope_local_base_freq"] = 10000.0
    if arch == "qwen3_moe":
        config.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    if arch == "mixtral":
        config.update(num_local_experts=4, num_experts_per_tok=2)
    if arch == "phi3":
        config["original_max_position_embeddings"] = shape["max_position_embeddings"]
        config["pad_token_id"] = 0  # transformers' Phi-3 default (32000) lies outside a tiny vocabulary
    return config


def tiny_weights(config: dict[str, Any], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random weights for ``config`` with HF names, drawn from a generator seeded with ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std + mean).to(dtype)

    hidden = config["hidden_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    arch = config["model_type"]
    proj_std, embed_std, norm_std, bias_std = 0.15, 0.25, 0.1, 0.1
    norm_mean = 0.0 if arch in _GEMMA else 1.0  # Gemma stores w - 1
    weights: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=embed_std)
    }
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = normal(hidden, std=norm_std, mean=norm_mean)
        if arch == "phi3":
            weights[p + "self_attn.qkv_proj.weight"] = normal(q_size + 2 * kv_size, hidden, std=proj_std)
        else:
            weights[p + "self_attn.q_proj.weight"] = normal(q_size, hidden, std=proj_std)
            weights[p + "self_attn.k_proj.weight"] = normal(kv_size, hidden, std=proj_std)
            weights[p + "self_attn.v_proj.weight"] = normal(kv_size, hidden, std=proj_std)
        if config["attention_bias"]:
            weights[p + "self_attn.q_proj.bias"] = normal(q_size, std=bias_std)
            weights[p + "self_attn.k_proj.bias"] = normal(kv_size, std=bias_std)
            weights[p + "self_attn.v_proj.bias"] = normal(kv_size, std=bias_std)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, q_size, std=proj_std)
        if arch in ("qwen3", "qwen3_moe", "gemma3_text"):
            weights[p + "self_attn.q_norm.weight"] = normal(head_dim, std=norm_std, mean=norm_mean)
            weights[p + "self_attn.k_norm.weight"] = normal(head_dim, std=norm_std, mean=norm_mean)
        norms = ["post_attention_layernorm"]  # drawn in this order: the older families' weights stay as they were
        if arch in _GEMMA:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm in norms:
            weights[p + norm + ".weight"] = normal(hidden, std=norm_std, mean=norm_mean)
        weights.update(_mlp_weights(config, p, normal, proj_std))
    weights["model.norm.weight"] = normal(hidden, std=norm_std, mean=norm_mean)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(config["vocab_size"], hidden, std=embed_std)
    return weights


def _mlp_weights(config: dict[str, Any], p: str, normal, std: float) -> dict[str, torch.Tensor]:
    """One layer's MLP (or experts and router) under the architecture's checkpoint names."""
    arch, hidden = config["model_type"], config["hidden_size"]
    if arch == "phi3":
        inter = config["intermediate_size"]
        return {
            p + "mlp.gate_up_proj.weight": normal(2 * inter, hidden, std=std),
            p + "mlp.down_proj.weight": normal(hidden, inter, std=std),
        }
    if arch in ("qwen3_moe", "mixtral"):
        inter = config.get("moe_intermediate_size") or config["intermediate_size"]
        experts = config.get("num_experts") or config["num_local_experts"]
        prefix, names = (
            (p + "mlp.", ("gate_proj", "up_proj", "down_proj"))
            if arch == "qwen3_moe"
            else (p + "block_sparse_moe.", ("w1", "w3", "w2"))
        )
        out = {prefix + "gate.weight": normal(experts, hidden, std=1.0)}  # decisive routing: no near-ties
        for e in range(experts):
            out[f"{prefix}experts.{e}.{names[0]}.weight"] = normal(inter, hidden, std=std)
            out[f"{prefix}experts.{e}.{names[1]}.weight"] = normal(inter, hidden, std=std)
            out[f"{prefix}experts.{e}.{names[2]}.weight"] = normal(hidden, inter, std=std)
        return out
    inter = config["intermediate_size"]
    return {
        p + "mlp.gate_proj.weight": normal(inter, hidden, std=std),
        p + "mlp.up_proj.weight": normal(inter, hidden, std=std),
        p + "mlp.down_proj.weight": normal(hidden, inter, std=std),
    }


def tiny_tokenizer_config(max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for the tiny tokenizer (train_tiny_tokenizer): ChatML, no BOS, ``<|im_end|>`` ends."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHATML_TEMPLATE,
    }


def make_tiny(
    out_dir: str | os.PathLike[str],
    arch: str = "llama",
    seed: int = 0,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight ``arch`` model (one of TINY_ARCHS) to ``out_dir``.

    ``overrides`` replace config values (hidden_size, num_hidden_layers, head_dim,
    rope_scaling such as ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 256}``, ...).
    ``max_shard_bytes`` forces sharded safetensors. The same arguments always give
    byte-identical files. The directory appears atomically (replacing an existing one).
    Returns ``out_dir`` as an absolute path. Raises ``ValueError`` for an unknown arch,
    unknown override keys or inconsistent shapes. ``dtype`` defaults to float32.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    tokenizer = train_tiny_tokenizer("qwen2" if arch in _QWEN else "smollm")
    config = tiny_config(arch, tokenizer.get_vocab_size(with_added_tokens=True), dtype, dict(overrides))
    weights = tiny_weights(config, seed, dtype)
    tokenizer_config = tiny_tokenizer_config(config["max_position_embeddings"])
    generation_config = {"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0}
    with atomic_model_dir(out_dir) as staging:
        write_json(staging / CONFIG_FILE, config)
        write_json(staging / GENERATION_CONFIG_FILE, generation_config)
        write_json(staging / TOKENIZER_CONFIG_FILE, tokenizer_config)
        tokenizer.save(str(staging / TOKENIZER_FILE))
        kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
        save_hf_weights(staging, weights, **kwargs)
    return Path(out_dir).expanduser().absolute()
