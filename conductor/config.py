"""The Conductor's configuration: policies, SLO classes, the defaults its predictions start from."""

from __future__ import annotations

from pydantic import BaseModel, Field

from conductor.admission import AdmissionKind
from conductor.forecast import ForecastKind
from conductor.local import LocalPrefill
from conductor.policies import PolicyConfig, PolicyKind
from conductor.predictors import PredictorConfig
from conductor.types import DEFAULT_SLO, Slo
from mooncake.budgets import CPU_BATCHED_TOKENS


class ConductorConfig(BaseModel):
    policy: PolicyKind = Field(
        PolicyKind.KVCACHE_CENTRIC, description="prefill placement policy (a value persisted in Redis wins)"
    )
    admission: AdmissionKind = Field(
        AdmissionKind.EARLY_PREDICTIVE,
        description="admission (early rejection) policy (a value persisted in Redis wins); early_wait is "
        "early_predictive whose requests predicted to meet their SLOs if placed a little later wait at their "
        "gateway instead of being refused (conductor.admission)",
    )
    slo_classes: dict[str, Slo] = Field(default_factory=lambda: {"default": DEFAULT_SLO})
    block_bytes: int = Field(
        320 * 1024 * 16,
        gt=0,
        description="bytes of one KV block for transfer estimates until a pool node registers its own (which replaces "
        "this)",
    )
    heartbeat_timeout_s: float = Field(10.0, gt=0, description="seconds of silence before an instance is dead")
    suspect_hold_s: float = Field(
        1.0,
        ge=0,
        description="an instance reported failing gets nothing new until a heartbeat "
        "sent this long after the report (a dead one sends none, and is dead after heartbeat_timeout_s)",
    )
    default_decode_s: float = Field(10.0, gt=0, description="t_d before any decode has finished")
    decode_forecast: ForecastKind = Field(
        ForecastKind.SURVIVAL,
        description="early_predictive's decode forecast: survival (measured decode durations, each request weighed "
        "by how long it has run, plus the joins to come at the recent rate) or uniform (the paper's: every decode "
        "lasts t_d)",
    )
    local_prefill: LocalPrefill = Field(
        LocalPrefill.AUTO,
        description="where prompts are computed: auto (a prefill worker or the decode worker itself, whichever is "
        "predicted to reach the first token sooner with its steps within the TBT SLO, the decode worker only "
        "while it has time to spare (--local-max-load): a short prompt, or a short new part of a prompt whose "
        "prefix is in the pool, skips the hand-off; conductor.local), never (a prefill worker; the paper's "
        "disaggregation) or always (the decode worker, where it runs our engine)",
    )
    narrow_handoff: str = Field(
        "auto",
        pattern="^(auto|always|never)$",
        description="where the pool keeps KV narrower than the caches (--pool-kv-dtype), whether a prompt's KV moves "
        "to its decode worker in the pool's dtype, converted on both sides: auto (when its prefill and decode "
        "workers are on different hosts and the narrower bytes plus the conversions are predicted to arrive "
        "sooner, at the learnt pool bandwidth), always, or never",
    )
    narrow_convert_bytes_per_s: float = Field(
        7.4e8,
        gt=0,
        description="bytes of the cache's dtype a narrow hand-off converts a second, to the pool's dtype and back "
        "(float32 to float8 and back on a 2-core CPU: 3.2 and 0.97 GB/s)",
    )
    local_max_load: float = Field(
        0.5,
        gt=0,
        le=1.0,
        description="auto: a decode worker computes prompts only while its batch's predicted step is at most this "
        "share of the TBT limit (0 < x <= 1; a busier one has no time to spare: every chunk lengthens every running "
        "request's step)",
    )
    local_chunk_tokens: int = Field(
        CPU_BATCHED_TOKENS,
        ge=1,
        description="a decode worker's token budget per step where it registers none (both our engines register "
        "theirs, --max-num-batched-tokens): the most of a prompt it computes itself that one step takes",
    )
    default_handoff_s: float = Field(
        0.0,
        ge=0,
        description="what handing a prompt's KV from a prefill worker to a decode "
        "worker costs before any is measured (decode workers report each; the first replaces this)",
    )
    tbt_headroom: float = Field(
        1.0,
        gt=0,
        le=1.0,
        description="admit while the predicted mean decode step stays under this share of the TBT SLO (0 < x <= 1; "
        "the SLO is on a request's slowest gaps, not its mean); the decode workers' batch cap holds their step at the "
        "same share (decode_cap: the Conductor's step model, sent with each heartbeat's answer)",
    )
    wait_queue: int = Field(
        64,
        ge=1,
        description="early_wait: the most requests of one priority waiting at once (past it they are refused)",
    )
    predictors: PredictorConfig = Field(default_factory=PredictorConfig)
    policy_config: PolicyConfig = Field(default_factory=PolicyConfig)

    model_config = {"arbitrary_types_allowed": True}
