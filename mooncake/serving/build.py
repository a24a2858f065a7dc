"""Build the engine a worker hosts (the interface and the kinds: :mod:`mooncake.engine.interface`).

The one module that knows every implementation, so that none of them imports it back.
"""

from __future__ import annotations

from typing import Any

from mooncake.engine.config import EngineConfig
from mooncake.engine.interface import EngineKind, WorkerEngine


def build_engine(
    kind: EngineKind,
    config: EngineConfig,
    *,
    vllm_args: dict[str, Any] | None = None,
    tokenizer=None,
    connector=None,
    kv_cache_buffer=None,
) -> WorkerEngine:
    """Build the worker's engine. ``connector`` is the prefill worker's PoolConnector (None on decode);
    ``kv_cache_buffer`` (native, CPU) places the paged cache in the memory it returns (LLMEngine).

    Raises ValueError for a configuration the engine refuses.
    """
    if kind is EngineKind.NATIVE:
        from mooncake.engine.engine import LLMEngine
        from mooncake.serving.model_support import check_native

        check_native(config.model)  # an architecture ours lacks: refused in one line naming the model
        if config.tensor_parallel_size > 1:
            if kv_cache_buffer is not None:
                raise ValueError("a tensor-parallel engine's cache is its ranks': nothing writes it in place")
            from mooncake.engine.ranks import start_ranks

            leader = start_ranks(config, tokenizer)
            if connector is not None:
                leader.attach(connector)
            return leader
        engine = LLMEngine(config, connector=connector, tokenizer=tokenizer, kv_cache_buffer=kv_cache_buffer)
        if connector is not None:
            connector.bind(engine.kv_cache)
        return engine
    if kind is EngineKind.VLLM:
        from mooncake.vllm_engine.engine import VllmEngine

        if config.pool_kv_dtype != "auto":
            raise ValueError(
                f"--pool-kv-dtype {config.pool_kv_dtype}: our engine only (vLLM's pool blocks are its cache's)"
            )

        return VllmEngine(config, vllm_args or {}, tokenizer=tokenizer, pusher=connector)
    raise ValueError(f"unknown engine {kind!r}")
