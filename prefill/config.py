"""A prefill worker's settings: ``PrefillConfig`` (``python -m prefill --help`` fills it, mooncake.cliargs) and
its engine's defaults."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator

from mooncake.engine.config import EngineConfig, nest_engine_fields
from mooncake.engine.interface import EngineKind
from transfer import TransferConfig, TransportChoice

# a prefill worker's engine: a small cache and batch (it holds prompts only while computing them), no prefix
# caching (the pool is its prefix cache), no decode graphs (it never decodes)
PREFILL_ENGINE_DEFAULTS = {
    "kv_cache_memory_gib": 1.0,  # on the CPU (kv_sizing.py), at most 8 full-length prompts
    "max_num_seqs": 8,
    "enable_prefix_caching": False,
    "decode_graphs": False,
}


class PrefillConfig(BaseModel):
    """One prefill worker (``python -m prefill --help`` fills it)."""

    id: str = Field("prefill-0", min_length=1, description="instance id, unique in the cluster")
    engine: EngineKind = Field(EngineKind.NATIVE, description="native: ours; vllm: stock vLLM in this process")
    vllm_args: dict[str, Any] = Field(default_factory=dict, description="vLLM EngineArgs keywords (--engine vllm)")
    kvstore: str = Field(description="gRPC address of this worker's pool node (on this host)")
    engine_config: EngineConfig = Field(
        description="the engine it hosts: its model, device, cache and step budget (also the Conductor's capacity "
        "and a group's chunk); EngineConfig's keywords may also be given flat, over PREFILL_ENGINE_DEFAULTS"
    )
    store_new_blocks: bool = Field(True, description="write the prompt's new full blocks into the pool")
    io_timeout_s: float = Field(TransferConfig.model_fields["io_timeout_s"].default, gt=0)
    reservation_ttl_s: float = Field(
        600.0,
        gt=0,
        description="pool slots reserved for a prefill's blocks expire after "
        "this (a long prompt on a CPU takes minutes; a crashed worker's slots come back then)",
    )
    pipeline_stages: int = Field(
        1,
        ge=1,
        description="run the model as a pipelined prefill group (CPP) of this many stage processes, each a "
        "contiguous range of the layers on one thread (give the worker this many cores); a prompt's chunks of "
        "--max-num-batched-tokens overlap across the stages. The group registers as one instance",
    )
    prefill_timeout_s: float = Field(3600.0, gt=0, description="a group's prefill fails after this")
    drain_timeout_s: float = Field(30.0, gt=0, description="on SIGTERM, seconds to let in-flight prefills end")
    stage_addresses: list[tuple[str, int]] = Field(
        default_factory=list,
        description="a group's stage servers (python -m prefill.stage), in layer order; empty: spawn the stages here",
    )
    stage_key: bytes | None = Field(None, description="the group's key, which its stage servers hold too")
    transport: TransportChoice = Field(default_factory=TransportChoice, description="how KV reaches other hosts")

    @model_validator(mode="before")
    @classmethod
    def _engine_fields(cls, data: Any) -> Any:
        return nest_engine_fields(data, PREFILL_ENGINE_DEFAULTS)
