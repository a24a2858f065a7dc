"""Rotary position embeddings: the frequencies and cos/sin tables of every scaling a supported model's config names.

A ``Rope`` is read from a Hugging Face config (``Rope.from_config``): the base ``theta``, the scaling ``kind`` and its
parameters, and how many of a head's dimensions rotate (``rotary_dim``: Phi-3-style partial rotary keeps the rest
as they are). ``tables(max_len)`` gives cos/sin for every position, computed as transformers computes them:

    default   theta ** (-2i / dim)
    linear    default / factor
    llama3    long wavelengths / factor, short kept, a smooth blend between
    dynamic   NTK-aware: the default within max_position_embeddings (transformers' dynamic update changes nothing
              there; a model is served no longer than that)
    yarn      interpolation blended with extrapolation per dimension, cos/sin times an attention factor
    longrope  Phi-3: short_factor below original_max_position_embeddings, long_factor from there on (per position,
              as transformers' incremental decoding applies them), cos/sin times an attention factor

Gemma 3 keeps a second ``Rope`` for its sliding-window layers (``ModelArgs.rope_local``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

ROPE_KINDS = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


@dataclass(frozen=True)
class Rope:
    theta: float
    rotary_dim: int  # the leading dimensions of a head that rotate (the head size, but for partial rotary)
    kind: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # the scaling's own keys (factor, low_freq_factor, ...)
    max_position_embeddings: int = 2048

    @classmethod
    def from_config(cls, params: dict[str, Any] | None, cfg: dict[str, Any], head_dim: int, theta: float) -> "Rope":
        """The rope of ``params`` (a transformers ``rope_parameters`` or ``rope_scaling`` dict, None for plain RoPE)
        in a model whose config is ``cfg``; ValueError for a kind not in ROPE_KINDS or a missing parameter."""
        params = dict(params or {})
        kind = params.pop("rope_type", params.pop("type", "default")) or "default"
        if kind == "su":  # Phi-3's first configs named longrope so
            kind = "longrope"
        if kind not in ROPE_KINDS:
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_KINDS)})")
        theta = float(params.pop("rope_theta", theta))
        partial = float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor {partial} leaves {rotary_dim} of {head_dim} dims: not even")
        if kind in ("yarn", "longrope") and "original_max_position_embeddings" not in params:
            if "original_max_position_embeddings" not in cfg:
                raise ValueError(f"{kind} rope scaling needs original_max_position_embeddings")
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        needed = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("factor",),
            "longrope": ("long_factor", "short_factor"),
        }.get(kind, ())
        missing = [k for k in needed if params.get(k) is None and not (kind == "yarn" and k == "factor")]
        if missing:
            raise ValueError(f"{kind} rope scaling lacks {', '.join(missing)}")
        if kind == "longrope":
            for key in ("long_factor", "short_factor"):
                if len(params[key]) != rotary_dim // 2:
                    raise ValueError(f"longrope {key} has {len(params[key])} values, expected {rotary_dim // 2}")
        return cls(theta, rotary_dim, kind, params, int(cfg.get("max_position_embeddings", 2048)))

    def _base(self) -> torch.Tensor:
        """theta ** (2i / dim) for i < dim / 2, float32, as transformers computes it."""
        dim = self.rotary_dim
        return self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)

    def inv_freq(self) -> torch.Tensor:
        """Inverse frequencies [rotary_dim / 2] (longrope: the short factors')."""
        inv = 1.0 / self._base()
        p, kind = self.params, self.kind
        if kind == "linear":
            return inv / float(p["factor"])
        if kind == "llama3":
            return _llama3(inv, p)
        if kind == "yarn":
            return _yarn(self, p)[0]
        if kind == "longrope":
            return 1.0 / (torch.tensor(p["short_factor"], dtype=torch.float32) * self._base())
        return inv  # default, and dynamic within max_position_embeddings

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (yarn and longrope; 1 otherwise)."""
        if self.kind == "yarn":
            return _yarn(self, self.params)[1]
        if self.kind == "longrope":
            p = self.params
            if p.get("attention_factor") is not None:
                return float(p["attention_factor"])
            original = p["original_max_position_embeddings"]
            factor = p.get("factor") or self.max_position_embeddings / original
            return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return 1.0

    def tables(self, max_len: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [max_len, rotary_dim] for positions 0 .. max_len-1, in ``dtype`` (computed in float32, scaled
        by the attention factor, then rounded: transformers' order)."""
        pos = torch.arange(max_len, dtype=torch.int64).float()
        freqs = pos[:, None] * self.inv_freq()[None, :]  # [L, dim / 2]
        if self.kind == "longrope":
            original = int(self.params["original_max_position_embeddings"])
            if max_len > original:
                long_inv = 1.0 / (torch.tensor(self.params["long_factor"], dtype=torch.float32) * self._base())
                freqs[original:] = pos[original:, None] * long_inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, dim]
        scale = self.attention_factor
        return (emb.cos() * scale).to(dtype=dtype, device=device), (emb.sin() * scale).to(dtype=dtype, device=device)


def _llama3(inv: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short kept, a smooth blend between."""
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_l)


def _yarn(rope: Rope, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and attention factor (transformers' ``_compute_yarn_parameters``)."""
    dim, base = rope.rotary_dim, rope.theta
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or rope.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope._base()
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)
