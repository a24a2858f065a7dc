"""ModelArgs: the shape of a Llama-family decoder, read from a Hugging Face config.json.

Supported architectures (all share one module in model.py):

    llama    Llama 2/3 (rope scaling: linear, llama3), SmolLM2
    mistral  as llama (sliding window is ignored; see ``sliding_window``)
    qwen2    llama + q/k/v projection biases
    qwen3    llama + per-head RMSNorm on q and k, no qkv bias
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        """Build from a parsed config.json; raise ValueError for an unsupported model."""
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model_type {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            intermediate = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
        num_kv = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}")
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        # transformers >= 5 writes rope settings into rope_parameters; older configs use
        # rope_theta + rope_scaling. Accept both.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or None
        theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind == "default":
                rope_scaling = None
            elif kind not in ("linear", "llama3"):
                raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            arch=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, in float32 (scale by dtype size / 4)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies [head_dim / 2], computed exactly as transformers does."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        sc = self.rope_scaling
        if sc is None:
            return inv
        kind = sc.get("rope_type", sc.get("type"))
        factor = float(sc["factor"])
        if kind == "linear":
            return inv / factor
        # llama3: long wavelengths divided by factor, short kept, a smooth blend between.
        low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_ctx = sc["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, inv_l)
