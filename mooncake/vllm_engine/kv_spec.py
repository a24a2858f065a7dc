"""A model's KV layout as vLLM serves it, and the rule for what the pool connector can carry.

The connector (connector.py) moves one block table's worth of KV per request, layer by layer, each layer's block
converted to ``[2][block_size][num_kv_heads][head_dim]`` (layout.py). So it carries a model whose every layer keeps
full-attention K and V for every token, with one head count, one head size and the model's dtype. vLLM reads the
model twice here, by the same rule:

    before loading   layout_before_load / layout_of_model_config: vLLM's ModelConfig (its reading of config.json);
                     the launcher sizes the pool nodes' blocks by it, the engine its cache memory
    after loading    layout_of_kv_cache: the KV cache specs vLLM built for the layers it loaded (the scheduler's
                     KVCacheConfig): what the worker reports as its block shape and bytes

Refused, each with one line naming it (mooncake.engine.interface.refuse): MLA latent caches, state-space
(mamba) layers, attention-free models, sliding-window or chunked-local layers that vLLM keeps only a window of,
per-layer different KV head counts or head sizes, quantized or packed caches, more than one KV cache group.
"""

from __future__ import annotations

from typing import Any

from mooncake.engine.interface import EngineKind, KVLayout, refuse

FP8_NAMES = ("fp8", "fp8_e4m3")  # vLLM's names of the float8 e4m3 cache the connector carries

SUPPORTED = (
    "supported: attention layers that keep K and V for every token, one KV head count and head size in every layer, "
    "in the model's dtype (or float8 e4m3 bytes with --kv-cache-dtype fp8)"
)


def _refuse(model: str, what: str) -> ValueError:
    return refuse(model, EngineKind.VLLM, f"{what}: the pool connector cannot carry it; {SUPPORTED}")


def layout_before_load(
    model: str, dtype: str, vllm_args: dict[str, Any], splits: dict[str, int] | None = None
) -> KVLayout:
    """The layout vLLM will give ``model`` in ``dtype`` under ``vllm_args`` (EngineArgs keywords), from vLLM's own
    ModelConfig (imports vLLM, reads config.json through transformers: seconds). Raises ValueError (one line) for a
    model vLLM cannot serve, whose KV the connector cannot carry, or that does not split into one of ``splits``'
    tensor-parallel sizes (by the flag that gave it)."""
    from vllm import EngineArgs
    from vllm.config import ParallelConfig

    given = {k: v for k, v in vllm_args.items() if k not in ("model", "dtype")}
    try:
        engine_args = EngineArgs(model=model, dtype=dtype, **given)
    except TypeError as e:  # a keyword EngineArgs does not have
        raise refuse(model, EngineKind.VLLM, f"vLLM refused the engine arguments: {e}") from None
    try:
        model_config = engine_args.create_model_config()
    except (ValueError, OSError, RuntimeError, KeyError) as e:  # pydantic's ValidationError is a ValueError
        raise refuse(model, EngineKind.VLLM, f"vLLM cannot serve it: {vllm_reason(e)}") from None
    for flag, size in (splits or {}).items():
        try:
            model_config.verify_with_parallel_config(ParallelConfig(tensor_parallel_size=size))
        except (ValueError, NotImplementedError) as e:
            raise refuse(model, EngineKind.VLLM, f"{flag} {size}: {e}") from None
    # the pool's layout: every layer and head, whatever the engine's parallel sizes split among its ranks
    return layout_of_model_config(model, model_config, ParallelConfig(), engine_args.kv_cache_dtype)


def layout_of_model_config(model: str, model_config, parallel_config, cache_dtype: str = "auto") -> KVLayout:
    """The layout from vLLM's ModelConfig (what it will build), refusing what the connector cannot carry."""
    if model_config.use_mla:
        raise _refuse(model, "an MLA latent KV cache (multi-head latent attention)")
    if model_config.is_attention_free:
        raise _refuse(model, "an attention-free model (state-space layers only)")
    if model_config.is_hybrid:
        raise _refuse(model, "state-space (mamba) layers beside its attention layers")
    if str(cache_dtype) not in ("auto", *FP8_NAMES):
        raise _refuse(model, f"kv_cache_dtype {cache_dtype} (fp8 = fp8_e4m3 is carried, as float8 e4m3)")
    import torch

    arch = model_config.model_arch_config
    overrides = getattr(arch, "per_layer_overrides", None)
    if overrides:
        shapes = {(arch[i].total_num_kv_heads, arch[i].head_size) for i in range(len(overrides))}
        if len(shapes) > 1:
            raise _refuse(model, f"per-layer different KV head counts or head sizes {sorted(shapes)}")
    return KVLayout(
        num_layers=model_config.get_num_layers(parallel_config),
        num_kv_heads=model_config.get_num_kv_heads(parallel_config),
        head_dim=model_config.get_head_size(),
        dtype=model_config.dtype if str(cache_dtype) == "auto" else torch.float8_e4m3fn,
    )


def layout_of_kv_cache(model: str, kv_cache_config, model_dtype, cache_dtype: str = "auto") -> KVLayout:
    """The layout of the KV cache vLLM built (``KVCacheConfig``, the scheduler's), the one the worker registers:
    refuses what the connector cannot carry. An FP8 cache (``cache_dtype`` fp8: vLLM's uint8 bytes) is float8 e4m3."""
    import torch

    kept = model_dtype if str(cache_dtype) == "auto" else torch.uint8
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        UniformTypeKVCacheSpecs,
    )

    specs: dict[str, Any] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            specs[name] = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
    if not specs:
        raise _refuse(model, "no KV cache layers")
    for spec in specs.values():
        if isinstance(spec, MLAAttentionSpec):
            raise _refuse(model, "an MLA latent KV cache (multi-head latent attention)")
        if isinstance(spec, MambaSpec):
            raise _refuse(model, "state-space (mamba) layers")
        if not isinstance(spec, AttentionSpec):
            raise _refuse(model, f"a {type(spec).__name__} cache layer")
        if type(spec) is not FullAttentionSpec:
            raise _refuse(model, f"{type(spec).__name__} layers (vLLM keeps only part of their KV)")
        if spec.head_size_v != spec.head_size:
            raise _refuse(model, f"K head size {spec.head_size} and V head size {spec.head_size_v} differ")
        if spec.dtype != kept or spec.num_head_slots is not None or spec.state_content_bytes is not None:
            raise _refuse(model, f"a quantized or packed KV cache ({spec.dtype}; the model's dtype is {model_dtype})")
    shapes = {(s.num_kv_heads, s.head_size) for s in specs.values()}
    if len(shapes) > 1:
        raise _refuse(model, f"per-layer different KV head counts or head sizes {sorted(shapes)}")
    if len(kv_cache_config.kv_cache_groups) > 1:
        raise _refuse(model, f"{len(kv_cache_config.kv_cache_groups)} KV cache groups (one block table per request)")
    heads, head_dim = shapes.pop()
    dtype = model_dtype if kept is model_dtype else torch.float8_e4m3fn
    return KVLayout(num_layers=len(specs), num_kv_heads=heads, head_dim=head_dim, dtype=dtype)


def vllm_reason(e: Exception) -> str:
    """What vLLM said, without pydantic's framing (``1 validation error for ModelConfig ... Value error, ``)."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            return "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in errors())
        except (TypeError, KeyError):
            pass
    return str(e)
