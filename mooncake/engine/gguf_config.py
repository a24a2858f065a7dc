"""A GGUF file's metadata -> the Hugging Face ``config.json`` of the same model.

llama.cpp writes hyperparameters under ``{arch}.*`` keys (``llama.block_count``,
``gemma3.attention.sliding_window``, ...). Most map one to one onto HF fields; the
rest are recovered here:

- Mistral is filed under ``llama`` and told apart by ``general.name``.
- Gemma 3 files usually omit what llama.cpp hard-codes for the architecture: every 6th
  layer global (the rest sliding), a local RoPE base of 10000, and the query scale
  1/sqrt(head_dim) (1/sqrt(hidden / heads) for the 62-layer 27B). Newer files state
  them (``attention.sliding_window_pattern``, ``rope.freq_base_swa``,
  ``attention.scale``), and a stated value wins.
- Llama 3.1-style RoPE scaling is stored as a ``rope_freqs`` tensor of per-frequency
  divisors, not as parameters. :func:`llama3_rope_scaling_from_factors` recovers the
  ``llama3`` parameters from it and checks that they reproduce every stored divisor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mooncake.engine.gguf_vocab import gguf_generation_config

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

ROPE_FREQS_TENSOR = "rope_freqs.weight"

# What llama.cpp assumes for Gemma 3 when the file does not say (llama-model.cpp, LLM_ARCH_GEMMA3).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62

# Llama 3.1's converter defaults (convert_hf_to_gguf.py), used when the stored divisors
# leave a parameter open.
_LLAMA3_ORIGINAL_CONTEXT = 8192
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0


def hf_model_type(metadata: dict[str, Any]) -> str:
    """The HF ``model_type`` of a GGUF file; ``ValueError`` for an architecture we cannot convert."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHS)}")
    # llama.cpp files Mistral under "llama"; transformers tells them apart by name.
    if arch == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
        return "mistral"
    if arch == "gemma3":
        return "gemma3_text"
    return arch


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind not in ("linear", "yarn") or factor is None:
        raise ValueError(f"unsupported GGUF rope scaling {kind!r} (factor {factor!r}); supported: linear, yarn")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def llama3_rope_factors(
    rope_theta: float, rotary_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float, original: int
) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as ``rope_freqs`` for Llama 3.1 scaling.

    Written after ``convert_hf_to_gguf.py`` (LlamaModel.generate_extra_tensors): 1 for
    wavelengths under ``original / high_freq_factor``, ``factor`` above
    ``original / low_freq_factor``, a smooth blend between. Float32 [rotary_dim / 2].
    """
    freqs = 1.0 / (rope_theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(1.0)
        elif wavelen > low_freq_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _round(value: float) -> float:
    """A fitted parameter to 6 significant digits: 0.9999997 -> 1.0, as the source config wrote it."""
    return float(f"{value:.6g}")


def llama3_rope_scaling_from_factors(
    factors: Sequence[float] | np.ndarray, rope_theta: float, original: int | None = None
) -> dict[str, Any] | None:
    """HF ``rope_scaling`` (``rope_type: llama3``) reproducing a GGUF ``rope_freqs`` tensor, or None.

    ``factors`` are the stored divisors (one per rotary pair), ``rope_theta`` the base,
    ``original`` the pre-scaling context if the file states it. The divisors depend on
    the low/high frequency factors only through ``original / low`` and ``original /
    high``, so ``original`` defaults to Llama 3's 8192 and the two factors are fitted
    to the blended divisors (Llama 3's 1 and 4 when fewer than two are blended).
    Returns None when every divisor is 1 (no scaling). Raises ``ValueError`` naming
    ``rope_freqs`` when no llama3 parameters reproduce every stored value.
    """
    stored = np.asarray(factors, dtype=np.float32).reshape(-1)
    if stored.size == 0 or not np.all(np.isfinite(stored)) or np.any(stored <= 0):
        raise ValueError("GGUF rope_freqs holds no positive finite RoPE frequency divisors")
    if np.all(stored == 1.0):
        return None
    rotary_dim = 2 * stored.size
    factor = float(stored.max())
    context = int(original) if original else _LLAMA3_ORIGINAL_CONTEXT
    freqs = 1.0 / (rope_theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    wavelen = 2 * math.pi / freqs
    blended = (stored > 1.0) & (stored < factor)
    candidates = [(_LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR)]
    if blended.sum() >= 2 and factor > 1.0:
        # 1 / r = (1 - s) / factor + s  and  s = (context / wavelen - low) / (high - low), linear in s.
        smooth = (1.0 / stored[blended].astype(np.float64) - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(smooth, context / wavelen[blended], 1)  # context / wavelen = low + s (high - low)
        candidates.insert(0, (_round(intercept), _round(intercept + slope)))
    for low, high in candidates:
        if not 0 < low < high:
            continue
        recomputed = llama3_rope_factors(rope_theta, rotary_dim, factor, low, high, context)
        if np.allclose(recomputed, stored, rtol=1e-6, atol=0.0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": context,
            }
    raise ValueError(
        f"this GGUF's rope_freqs ({stored.size} RoPE frequency divisors, largest {factor:g}) match no Llama 3.1-style "
        "rope scaling (factor, low/high frequency factors, original context); it cannot be converted"
    )


def _gemma3_layer_types(metadata: dict[str, Any], num_layers: int) -> tuple[list[str], int | None]:
    """Per-layer attention kinds, and the period of the pattern when the file states one (or llama.cpp's 6)."""
    pattern = metadata.get("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # one flag per layer, True for a sliding-window layer
        if len(pattern) != num_layers:
            raise ValueError(
                f"gemma3.attention.sliding_window_pattern lists {len(pattern)} layers, the model has {num_layers}"
            )
        return ["sliding_attention" if flag else "full_attention" for flag in pattern], None
    period = int(pattern)
    if period <= 0:
        raise ValueError(f"gemma3.attention.sliding_window_pattern = {period} is not a positive period")
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)], period


def _gemma3_fields(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields beyond the Llama ones (see the module docstring for the defaults)."""
    layer_types, period = _gemma3_layer_types(metadata, config["num_hidden_layers"])
    scale = metadata.get("gemma3.attention.scale")
    if scale:  # llama.cpp's kq scale, 1 / sqrt(query_pre_attn_scalar)
        query_pre_attn_scalar = _round(1.0 / float(scale) ** 2)
    elif config["num_hidden_layers"] == _GEMMA3_27B_LAYERS:
        query_pre_attn_scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        query_pre_attn_scalar = config["head_dim"]
    window = metadata.get("gemma3.attention.sliding_window")
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "sliding_window": int(window) if window else None,
        "layer_types": layer_types,
        "rope_local_base_freq": float(metadata.get("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        "attn_logit_softcapping": metadata.get("gemma3.attn_logit_softcapping"),
        "final_logit_softcapping": metadata.get("gemma3.final_logit_softcapping"),
        "use_bidirectional_attention": False,
    }
    if period is not None:
        fields["sliding_window_pattern"] = period
    if fields["sliding_window"] is None and "sliding_attention" in layer_types:
        raise ValueError("GGUF metadata lacks gemma3.attention.sliding_window but the model has sliding layers")
    return fields


def hf_config_from_gguf(
    metadata: dict[str, Any],
    tensor_names: list[str],
    dtype: torch.dtype = torch.float32,
    rope_freqs: np.ndarray | None = None,
) -> dict[str, Any]:
    """The HF ``config.json`` dict for a GGUF file with this metadata and these tensors.

    ``rope_freqs`` are the values of the file's ``rope_freqs.weight`` tensor, required
    when it has one (Llama 3.1-style scaling, recovered as ``rope_type: llama3``).
    Raises ``ValueError`` for an unsupported architecture, missing required keys, or
    RoPE frequency divisors no llama3 scaling reproduces.
    """
    model_type = hf_model_type(metadata)
    arch = str(metadata["general.architecture"])

    def key(name: str) -> Any:
        value = metadata.get(f"{arch}.{name}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks required key {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv") or num_heads)
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None and model_type in ("llama", "mistral"):
        head_dim = metadata.get(f"{arch}.rope.dimension_count")
    head_dim = int(head_dim or hidden // num_heads)
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    vocab_size = int(metadata.get(f"{arch}.vocab_size") or len(tokens))
    if vocab_size <= 0:
        raise ValueError("GGUF metadata states no vocabulary size and holds no tokens")
    context = int(key("context_length"))
    rope_theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling(metadata, arch)
    if ROPE_FREQS_TENSOR in tensor_names:
        if rope_freqs is None:
            raise ValueError(f"this GGUF has a {ROPE_FREQS_TENSOR} tensor; its values are needed to read the config")
        if rope_scaling is not None:
            raise ValueError(f"this GGUF has both {ROPE_FREQS_TENSOR} and {arch}.rope.scaling.type; cannot combine")
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        rope_scaling = llama3_rope_scaling_from_factors(rope_freqs, rope_theta, original)
    generation = gguf_generation_config(metadata)

    config: dict[str, Any] = {
        "architectures": [HF_CLASSES[model_type]],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": model_type == "qwen2",
        "attention_dropout": 0.0,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": generation.get("bos_token_id"),
        "eos_token_id": generation.get("eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if model_type in ("llama", "mistral"):
        config["mlp_bias"] = False
    if model_type == "mistral":
        config["sliding_window"] = None
    if model_type in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    if model_type == "gemma3_text":
        del config["hidden_act"]
        config.update(_gemma3_fields(metadata, config))
    if "pad_token_id" in generation:
        config["pad_token_id"] = generation["pad_token_id"]
    return config
