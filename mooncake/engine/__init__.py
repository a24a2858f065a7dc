"""The inference engine: Llama-family models over a paged KV cache with continuous batching.

Public surface: ``LLMEngine``, ``EngineConfig``, ``SamplingParams``, ``RequestOutput``,
``KVConnector``. Everything else is an implementation module.
"""

import importlib

# Each public name's module, imported on first use: the gateway and the Conductor read the tokenizer and the step
# budgets without paying for torch and the model code (seconds at every start).
_MODULES = {
    "ConnectorStep": "connector",
    "EngineConfig": "config",
    "EngineStats": "engine",
    "FinishReason": "request",
    "KVConnector": "connector",
    "LLMEngine": "engine",
    "RequestOutput": "engine",
    "SamplingParams": "request",
    "StepRequest": "connector",
}

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


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    globals()[name] = value
    return value
