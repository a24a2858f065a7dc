"""The inference engine: Llama-family models over a paged KV cache with continuous batching.

Public surface: ``LLMEngine``, ``EngineConfig``, ``SamplingParams``, ``RequestOutput``,
``KVConnector``. Everything else is an implementation module.
"""

from mooncake.engine.config import EngineConfig
from mooncake.engine.connector import ConnectorStep, KVConnector, StepRequest
from mooncake.engine.engine import EngineStats, LLMEngine, RequestOutput
from mooncake.engine.request import FinishReason, SamplingParams

__all__ = [
    "ConnectorStep",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "KVConnector",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StepRequest",
]
