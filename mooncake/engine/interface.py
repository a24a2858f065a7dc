"""The engine a worker hosts: one small interface, three implementations (ours, stock vLLM, and a pipelined prefill
group's stages, ``prefill.group.GroupEngine``, whose step is one request's whole prefill).

A prefill or decode worker needs only this of its engine; ``EngineLoop`` steps it on one
thread, and every call below happens on that thread:

    add_request(prompt_token_ids, sampling_params, request_id,
                kv=PromptKV(n, kv),                          the prompt's leading KV, in the pool layout,
                options=RequestOptions(...))                 imported layer by layer; salt, outputs already
                                                             generated, chunking, ahead (vLLM: ignored)
    add_request(..., kv=PromptKV.landing(n))                 the whole sequence's KV comes from a prefill
    request_block_ids(id), land(id, token, kv)               elsewhere: it waits for it (ours: in blocks given
                                                             it now, written in place; or kv from slots), then
                                                             the prefill's token goes out as a sampled one
    step() -> [RequestOutput]                                 one scheduling step
    abort_request(request_id), has_unfinished(), load(), set_max_num_seqs(n)

and, fixed at start-up: ``block_size``, ``block_shape`` and ``block_bytes`` (a block in the
pool layout, DESIGN §4), ``fingerprint`` (the root of our block keys), ``max_model_len``,
``eos_token_ids``, ``num_free_blocks``, ``vocab_size``, and ``kv_cache`` (ours: its paged cache, which
prefills may write in place; None for vLLM). New KV leaves the engine through the prefill
worker's ``PoolConnector``, which each engine calls after every layer of a step.

``--engine native`` (the default) is ``mooncake.engine.LLMEngine``; ``--engine vllm`` is
``mooncake.vllm_engine.VllmEngine``, which imports vLLM only when chosen. A third engine
is one more class with these members and one more branch in ``mooncake.serving.build``'s
``build_engine``: this module is the interface the engines implement, and imports none of them.

The engine kind is part of the model fingerprint, so a native worker and a vLLM worker
never share pool blocks (their KV differs in the last bits) and a gateway that computed
keys for the other engine finds nothing instead of wrong KV.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mooncake.blocks import model_fingerprint
from mooncake.engine.request import PromptKV, RequestOptions, SamplingParams
from mooncake.engine.weights import model_identity

if TYPE_CHECKING:  # the gateway, the launcher and the CLI read this module and do not import torch
    import torch

    from mooncake.engine.engine import RequestOutput


class EngineKind(str, enum.Enum):
    NATIVE = "native"
    VLLM = "vllm"


class WorkerEngine(Protocol):
    block_size: int
    block_bytes: int
    pool_block_bytes: int  # a block as the pool keeps it (fewer bytes where --pool-kv-dtype keeps it narrower)
    fingerprint: bytes
    max_model_len: int
    eos_token_ids: frozenset[int]

    @property
    def block_shape(self) -> tuple[int, ...]: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """Its paged cache [L, 2, blocks, bs, Hkv, D] where prefills may write it in place (ours); None where the
        engine keeps it to itself (vLLM)."""
        ...

    vocab_size: int

    num_landing_blocks: int  # cache blocks held for KV still to arrive (remote_kv requests); 0 where none are

    @property
    def step_tokens(self) -> int:
        """Its token budget per step (0: the engine does not say): a decode worker registers it with the Conductor."""
        ...

    last_step_tokens: int  # tokens its last step computed (the engine loop's step-time samples)

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        kv: PromptKV | None = None,  # KV computed elsewhere: leading tokens to import, or the whole sequence landing
        options: RequestOptions | None = None,  # cache salt, outputs generated elsewhere, chunk_tokens, ahead
    ) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort_request(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def load(self) -> tuple[int, int]: ...

    def set_max_num_seqs(self, n: int) -> None: ...

    def request_block_ids(self, request_id: str) -> list[int]:
        """The blocks of ``kv_cache`` a request holds (a ``remote_kv`` one's: where a prefill may write its KV in place;
        none where the engine lends none: vLLM's KV lands in slots)."""
        ...

    def land(self, request_id: str, token: int, kv: Any = None) -> RequestOutput | None:
        """A ``remote_kv`` request's KV is here (in its blocks, or ``kv`` from landing slots) and its prefill sampled
        ``token``: the token's output, checked as any sampled token's. None when the request was aborted."""
        ...

    def reclaim(self) -> None:
        """Free the blocks its connector let go of (held past a request's end while a writer might still write)."""
        ...

    def computed_blocks(self, request_id: str, first_block: int) -> tuple[list[bytes], torch.Tensor | None]:
        """A running request's computed full blocks from ``first_block`` on: (block keys, pool-layout KV).
        Engine thread only, between steps (the decode worker's write-behind)."""
        ...

    def close(self) -> None: ...


def engine_fingerprint(
    kind: EngineKind,
    model: str,
    dtype: str | torch.dtype,
    kv_dtype: str | torch.dtype | None = None,
    pool_dtype: str | torch.dtype | None = None,
) -> bytes:
    """The 16-byte fingerprint behind every block key of a cluster running ``kind`` on ``model`` in ``dtype``, its
    KV kept in ``kv_dtype`` (default: ``dtype``; torch dtypes or their names), its pool's in ``pool_dtype`` (default:
    ``kv_dtype``)."""
    identity = model_identity(model, dtype, kv_dtype, pool_dtype)
    return model_fingerprint(identity if kind is EngineKind.NATIVE else f"{kind.value}:{identity}")


def flags_fingerprint(
    kind: EngineKind, model: str, dtype: str, kv_cache_dtype: str = "auto", pool_kv_dtype: str = "auto"
) -> bytes:
    """``engine_fingerprint`` from the workers' flags (--dtype, --kv-cache-dtype, --pool-kv-dtype): what a gateway
    keys prompts with, equal to the workers' engines' own."""
    from mooncake.engine.config import kv_dtype_name

    kv = kv_dtype_name(dtype, kv_cache_dtype)
    pool = kv if pool_kv_dtype == "auto" else kv_dtype_name(dtype, pool_kv_dtype)
    return engine_fingerprint(kind, model, dtype, kv, pool)


def parse_vllm_args(pairs: Sequence[str]) -> dict[str, Any]:
    """``--vllm-arg key=value`` pairs into vLLM EngineArgs keywords (values parsed as JSON when they parse)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--vllm-arg wants key=value, got {pair!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key.strip().lstrip("-").replace("-", "_")] = value
    return out


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One token's KV as the pool carries it: every layer the same, ``num_kv_heads`` K and V vectors of ``head_dim``
    each, in ``dtype``. A block is ``[num_layers][2][block_size][num_kv_heads][head_dim]`` (DESIGN §4)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def block_shape(self, block_size: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim)

    def block_bytes(self, block_size: int) -> int:
        return math.prod(self.block_shape(block_size)) * self.dtype.itemsize


def refuse(model: str | Path, engine: EngineKind | str, what: str) -> ValueError:
    """The one-line error for a model ``engine`` cannot serve: ``what`` names the field and what is supported."""
    kind = engine.value if isinstance(engine, EngineKind) else engine
    return ValueError(f"model {model} (--engine {kind}): {_one_line(what)}")


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
