"""A decode worker's settings: ``DecodeConfig`` (``python -m decode --help`` fills it, mooncake.cliargs) and its
engine's defaults."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator

from mooncake.engine.config import EngineConfig, nest_engine_fields
from mooncake.engine.interface import EngineKind
from mooncake.runtime.channels import DETECT_S, LOCAL_HOST
from transfer import TransferConfig, TransportChoice

# a decode worker's engine: prompts arrive computed (the pool is the prefix cache, so none of its own); its cache sized
# from memory (kv_sizing.py): on the CPU 2 GiB, at most 32 full-length sequences
DECODE_ENGINE_DEFAULTS = {"kv_cache_memory_gib": 2.0, "max_num_seqs": 32, "enable_prefix_caching": False}


class DecodeConfig(BaseModel):
    """One decode worker (``python -m decode --help`` fills it)."""

    id: str = Field("decode-0", min_length=1, description="instance id, unique in the cluster")
    engine: EngineKind = Field(EngineKind.NATIVE, description="native: ours; vllm: stock vLLM in this process")
    vllm_args: dict[str, Any] = Field(default_factory=dict, description="vLLM EngineArgs keywords (--engine vllm)")
    host: str = Field(LOCAL_HOST, description="address of its transfer server (landing slots over tcp)")
    engine_config: EngineConfig = Field(
        description="the engine it hosts: its model, device, cache and batch (max_num_seqs: the most requests in "
        "it); EngineConfig's keywords may also be given flat, over DECODE_ENGINE_DEFAULTS"
    )

    landing_slots: int | None = Field(
        None, ge=1, description="landing slots (blocks); default: two full-context prompts"
    )
    tbt_slo_s: float | None = Field(
        None,
        gt=0,
        description="ignored, kept so that earlier command lines parse: the batch cap comes from the Conductor's step "
        "model at its TBT SLO and headroom (its answer to each heartbeat), one fit for every decode worker",
    )
    prefill_timeout_s: float = Field(300.0, gt=0, description="longest a prefill may take")
    drain_timeout_s: float = Field(60.0, gt=0, description="on SIGTERM, seconds to let running requests finish")
    detect_s: float = Field(
        DETECT_S,
        gt=0,
        description="a prefill worker silent this long (a host off the network) fails "
        "the request's prefill, about a second later; the gateway places it again",
    )
    write_behind: bool = Field(
        True,
        description="write each generated block into the pool as it fills, on the prefill's "
        "node (a stream resumed elsewhere then loads it instead of recomputing it)",
    )
    direct_landing: bool = Field(
        True,
        description="native engine: prefills write a prompt's KV into the engine's own cache "
        "(shared memory on the CPU, CUDA IPC on a GPU), not into landing slots copied again",
    )
    write_grace_s: float = Field(
        3.0,
        gt=0,
        description="how often a prefill that did not answer (cancelled, timed out, unreachable) is asked again "
        "whether its writes are over: its cache blocks and slots stay held, never given to another request, until "
        "it says so or its process is gone (decode/fence.py)",
    )
    shm_dir: str = Field(
        TransferConfig.model_fields["shm_dir"].default, description="tmpfs directory of the landing segment"
    )
    transport: TransportChoice = Field(default_factory=TransportChoice, description="how KV reaches other hosts")

    @model_validator(mode="before")
    @classmethod
    def _engine_fields(cls, data: Any) -> Any:
        return nest_engine_fields(data, DECODE_ENGINE_DEFAULTS)
