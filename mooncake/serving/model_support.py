"""Which models each engine serves, and the KV layout a model's blocks have under it.

Every component that reads a model directory before an engine has loaded it asks here:

    the launcher      kv_layout(engine, model, ...)  the pool nodes' block bytes, before any worker starts
    a worker          check_native(model)            ours refuses what it cannot build, naming the model
    the gateway       context_length(config)         it tokenizes and checks lengths, needs no engine

The architecture list (``SUPPORTED_ARCHS``, mooncake.engine.model_args) is our engine's alone: ``--engine vllm``
serves what vLLM serves, its layout read by vLLM (mooncake.vllm_engine.kv_spec), before loading here and from the
KV cache vLLM built once loaded (what the worker registers). A layout the pool connector cannot carry is refused
with a ``ValueError`` of one line naming the model, the field and what is supported; every entry point prints it as
``error: ...`` and exits 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mooncake.engine.interface import EngineKind, KVLayout, refuse  # noqa: F401 - KVLayout: this module's callers'

# keys that bound a model's context in config.json, as vLLM reads them (the smallest present wins)
CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def check_native(model: str | Path):
    """Our engine's arguments for ``model`` (mooncake.engine.model_args.ModelArgs); raises ValueError naming the model
    when our engine cannot build it (an architecture outside SUPPORTED_ARCHS, a config it cannot honour)."""
    from mooncake.engine.model_args import ModelArgs
    from mooncake.engine.weights import load_hf_config

    try:
        return ModelArgs.from_hf_config(load_hf_config(model))
    except ValueError as e:
        hint = "" if "vllm" in str(e).lower() else " (--engine vllm serves what vLLM serves)"
        raise refuse(model, EngineKind.NATIVE, f"{e}{hint}") from None


def kv_layout(
    engine: EngineKind | str,
    model: str | Path,
    dtype: str,
    vllm_args: dict[str, Any] | None = None,
    splits: dict[str, int] | None = None,
    kv_cache_dtype: str = "auto",
) -> KVLayout:
    """The KV layout ``engine`` will give ``model`` in ``dtype`` (a name: float32, bfloat16, float16) with its KV kept
    as ``kv_cache_dtype`` says (auto: in ``dtype``; fp8: float8 e4m3), read before any engine loads it (the launcher
    sizes the pool nodes' blocks by it). Raises ValueError (one line) for a model the engine cannot serve, whose KV
    the pool cannot carry, or that does not split into one of ``splits``' tensor-parallel sizes (``{flag: size}``,
    named by its flag). For vLLM this imports vLLM and reads the model's config through it (seconds); the worker
    checks the layout again from the cache vLLM built."""
    from mooncake.engine.config import dtype_of, kv_dtype_name

    kind = EngineKind(engine)
    if kind is EngineKind.NATIVE:
        args = check_native(model)
        for flag, size in (splits or {}).items():
            from mooncake.engine.parallel import TensorParallel

            try:
                TensorParallel(0, size).check(args)
            except ValueError as e:
                raise ValueError(f"{flag} {size}: {e}") from None
        return KVLayout(
            args.num_layers, args.num_kv_heads, args.head_dim, dtype_of(kv_dtype_name(dtype, kv_cache_dtype))
        )
    from mooncake.vllm_engine.kv_spec import layout_before_load

    given = {**(vllm_args or {}), **({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype != "auto" else {})}
    return layout_before_load(str(model), dtype, given, splits)


def context_length(config: dict[str, Any], model: str | Path = "") -> int:
    """The context a model was built for, from its config.json (``text_config`` for a multimodal one), as vLLM
    reads it: the smallest of CONTEXT_KEYS present. Raises ValueError when it names none."""
    sources = [config, config.get("text_config") or {}]
    found = [int(src[key]) for src in sources for key in CONTEXT_KEYS if isinstance(src.get(key), int | float)]
    if not found:
        raise ValueError(
            f"model {model}: config.json names no context length ({', '.join(CONTEXT_KEYS)}); give --max-model-len"
        )
    return min(found)
