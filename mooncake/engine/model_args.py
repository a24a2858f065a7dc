"""ModelArgs: the shape of a decoder our engine runs, read from a Hugging Face config.json.

Supported architectures (one module in model.py; ModelArgs says which parts exist):

    llama        Llama 2/3, SmolLM2
    mistral      llama + a sliding window on every layer
    qwen2        llama + q/k/v projection biases (a sliding window from max_window_layers on, where enabled)
    qwen3        llama + per-head RMSNorm on q and k
    phi3         llama with fused qkv and gate-up projections, partial rotary, longrope
    gemma2       GeGLU, (1 + w) norms, norms after attention and around the MLP, scaled embeddings, attention and
                 final logit soft-capping, alternating sliding-window and global layers
    gemma3_text  gemma2 without soft-capping, with q/k norms and a local rope for its sliding-window layers
    qwen3_moe    qwen3 with a top-k mixture of experts (moe.py) in place of the MLP
    mixtral      mistral with a top-k mixture of experts

Rope scalings: rope.py (linear, llama3, dynamic, yarn, longrope). Quantized weights: quant.py reads the formats (a
format it does not read is refused here, naming it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mooncake.engine.quant import WeightQuant, weight_quant
from mooncake.engine.rope import Rope

SUPPORTED_ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3_text",
    "qwen3_moe",
    "mixtral",
)
GEMMA = ("gemma2", "gemma3_text")
MOE = ("qwen3_moe", "mixtral")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


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
    rope: Rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_local: Rope | None = None  # the sliding-window layers' rope where it differs (Gemma 3)
    layer_windows: tuple[int | None, ...] = ()  # per layer: the keys a query sees (its own included), None: all
    hidden_act: str = "silu"  # "silu" or "gelu_tanh": the gated MLP's activation
    gemma_norms: bool = False  # RMSNorm weights stored as w - 1, applied as (1 + w) in float32
    sandwich_norms: bool = False  # a norm after attention and after the MLP too (Gemma)
    embed_scale: float | None = None  # the embedding times this (Gemma: sqrt(hidden_size))
    query_scale: float | None = None  # the attention's score scale where not head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax
    final_softcap: float | None = None  # the same on the logits
    num_experts: int = 0  # a mixture of experts in place of the MLP (moe.py) on the layers of moe_layers
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the k chosen experts' weights renormalised to sum to 1
    moe_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    quant: WeightQuant | None = None  # the checkpoint's weight quantization (quant.py), None: float weights

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        """Build from a parsed config.json; raise ValueError naming the field for a model this engine cannot run."""
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"model_type {arch!r} is not supported by the mooncake engine (supported: {', '.join(SUPPORTED_ARCHS)};"
                " --engine vllm serves what vLLM serves)"
            )
        quant = weight_quant(cfg)
        if quant is not None and arch in MOE:
            raise ValueError(f"quantized {arch} experts are not read by the mooncake engine yet ({quant.describe()})")
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            intermediate = int(cfg.get("intermediate_size") or 0)
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
        num_kv = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}")
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
        rope, rope_local = _ropes(cfg, arch, head_dim)
        windows = _layer_windows(cfg, arch, num_layers)
        gemma = arch in GEMMA
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        moe = _moe(cfg, arch, num_layers, intermediate)
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
            rope=rope,
            rope_local=rope_local,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            qkv_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "gemma3_text", "qwen3_moe"),
            layer_windows=windows,
            hidden_act=_ACTIVATIONS[act],
            gemma_norms=gemma,
            sandwich_norms=gemma,
            embed_scale=hidden**0.5 if gemma else None,
            query_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5
            if gemma and cfg.get("query_pre_attn_scalar")
            else None,
            attn_softcap=_cap(cfg.get("attn_logit_softcapping")) if arch == "gemma2" else None,
            final_softcap=_cap(cfg.get("final_logit_softcapping")) if gemma else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quant=quant,
            **moe,
        )

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    @property
    def sliding_window(self) -> int | None:
        """The window every layer shares, None when any layer attends globally (then no block can be freed)."""
        if self.layer_windows and all(w is not None for w in self.layer_windows):
            return max(self.layer_windows)
        return None

    def window(self, layer: int) -> int | None:
        """The keys layer ``layer``'s queries see (their own included), None: the whole context."""
        return self.layer_windows[layer] if self.layer_windows else None

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, in float32 (scale by dtype size / 4)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def _ropes(cfg: dict[str, Any], arch: str, head_dim: int) -> tuple[Rope, Rope | None]:
    """(the rope of global layers, that of sliding-window layers where it differs). transformers >= 5 writes rope
    settings into ``rope_parameters`` (per layer type for Gemma 3); older configs use rope_theta + rope_scaling."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta", 10000.0))
    if "full_attention" in params or "sliding_attention" in params:
        full = Rope.from_config(params.get("full_attention"), cfg, head_dim, theta)
        local = params.get("sliding_attention")
        return full, (Rope.from_config(local, cfg, head_dim, theta) if local is not None else None)
    scaling = cfg.get("rope_scaling") or None
    if params.get("rope_type", "default") != "default" or not scaling:
        scaling = {**(scaling or {}), **params}
    rope = Rope.from_config(scaling, cfg, head_dim, float(params.get("rope_theta", theta)))
    local = None
    if arch == "gemma3_text":  # older Gemma 3 configs: the local layers' base apart, unscaled
        local = Rope.from_config(None, cfg, head_dim, float(cfg.get("rope_local_base_freq", 10000.0)))
    return rope, local


def _layer_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global), from ``layer_types`` where the config lists them, else as the
    architecture's own code derives them."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return (None,) * num_layers
    window = int(window)
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not supported (sliding_attention, full_attention)")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if arch == "gemma2":
        return tuple(window if i % 2 == 0 else None for i in range(num_layers))
    if arch == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        first = int(cfg.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers


def _moe(cfg: dict[str, Any], arch: str, num_layers: int, intermediate: int) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelArgs (none for a dense model)."""
    if arch not in MOE:
        return {}
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts < 1 or not 0 < top_k <= experts:
        raise ValueError(f"num_experts {experts} / num_experts_per_tok {top_k}: not a mixture of experts")
    if arch == "mixtral":
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=intermediate,
            norm_topk_prob=True,
            moe_layers=(True,) * num_layers,
        )
    dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or intermediate),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
    )
