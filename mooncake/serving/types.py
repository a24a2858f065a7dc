"""The contract between the OpenAI gateway and whatever generates tokens behind it.

    gateway (mooncake.gateway) --GenerationRequest--> GenerationBackend.generate()
                               <--GenerationChunk ...-- (an async iterator)

Two backends implement it: ``ClusterBackend`` (mooncake.gateway.cluster_backend: the Conductor
schedules, a decode worker streams, a prefill worker prefills) and ``LocalBackend``
(mooncake.gateway.local_backend: one engine in this process, prefill and decode coupled). Errors
a client should see are ``BackendError`` subclasses carrying the HTTP status and the
OpenAI error type; anything else is a bug (a 500).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from mooncake.engine.request import SamplingParams, TokenLogprob


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One completion to generate: token ids in, tokens and text out."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # the engine's own type: checked once, where the request is made
    cache_salt: str | None = None  # keeps tenants' prefix caches apart (DESIGN §4)
    slo_class: str = "default"
    priority: int = 0  # higher goes first under pressure; below 0: sheddable (conductor.waiting)
    tenant: str = ""  # who sent it (the tenants file's name; "": no tenants)
    tenant_weight: float = 1.0  # its tenant's share under pressure
    follows: str | None = None  # the id of a choice of the same prompt that has its first token (its KV is cached)
    ttft_slo_s: float = 0.0  # its own TTFT target (0: its class's; a looser one is its class's)
    tbt_slo_s: float = 0.0  # and TBT target

    @classmethod
    def of(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        slo_class: str = "default",
        **sampling,
    ) -> GenerationRequest:
        """A request with ``SamplingParams(max_tokens=max_tokens, **sampling)``; ValueError for values it refuses."""
        return cls(
            request_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens, **sampling), cache_salt, slo_class
        )


@dataclass(slots=True)
class GenerationChunk:
    """New tokens of one request (at least one, except in a final chunk), and the usage so far.

    ``text`` is the new text, safe to show: it never runs into a stop string the request
    may still hit. The last chunk has ``finish_reason`` set (``stop`` or ``length``).
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused, not computed
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # "dram", "ssd", "remote" (pulled)
    recovery: Recovery | None = None  # last chunk of a request that outlived a failure: what it took
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # the first chunk: prompt tokens 1.., when the request asked
    quote: Quote | None = None  # the first chunk: what the Conductor predicted for it (a cluster's; None elsewhere)


@dataclass(frozen=True, slots=True)
class Quote:
    """What the Conductor predicted for a request as it placed it, in seconds: its TTFT (from its arrival at the
    gateway, a wait it was told to make included) and the time between its tokens. The gateway's headers carry it."""

    ttft_s: float
    tbt_s: float


@dataclass(slots=True)
class Recovery:
    """What outliving failures cost one request (mooncake.gateway.recovery)."""

    faults: list[str]  # each failure, "decode:decode-0" (kind:instance)
    fault_times: list[float]  # when each was seen (time.monotonic() in the gateway)
    placements: int  # placements made (1 + retries + resumes)
    resumes: int  # placements that went on mid-stream
    loaded_tokens: int = 0  # resumes: tokens of prompt + output whose KV came from the pool
    recomputed_tokens: int = 0  # resumes: tokens the new prefill computed again


class BackendError(Exception):
    """A failure the client should see as an OpenAI-style error."""

    status = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(
        self, message: str, *, code: str | None = None, param: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.retry_after_s = retry_after_s


class InvalidRequest(BackendError):
    """The request cannot be served as asked (too long for the context, bad parameters): HTTP 400."""

    status = 400
    error_type = "invalid_request_error"


class Rejected(BackendError):
    """Turned away to protect the SLOs (the Conductor's early rejection, a full decode batch): HTTP 429. ``offer``:
    what the cluster could serve instead (a later start, another SLO class), for the body."""

    status = 429
    error_type = "rate_limit_error"
    code = "overloaded"

    def __init__(self, message: str, *, offer: Offer | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.offer = offer


@dataclass(frozen=True, slots=True)
class Offer:
    """What a refused request could have instead: a start ``start_in_s`` from now, or (``slo_class``) another SLO class
    at once, whose targets what the Conductor predicts for it meets."""

    start_in_s: float
    slo_class: str | None = None


class Unavailable(BackendError):
    """No worker can take it (none alive, or one died mid-request): HTTP 503."""

    status = 503
    error_type = "service_unavailable"
    code = "unavailable"


class GenerationBackend(abc.ABC):
    """Generates for the gateway. ``generate`` is called once per request, concurrently from one event loop."""

    model_name: str  # the name clients send as ``model``
    max_model_len: int  # prompt + completion tokens at most

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Stream the request's chunks. Closing the generator early (``aclose``), or cancelling the task
        awaiting its next chunk, cancels the request everywhere; both must be safe at any point.

        Raises BackendError subclasses for what the client should see (before the first
        chunk, or during the stream when a worker dies mid-request).
        """

    def shedding(self) -> Rejected | None:
        """The answer for a new request now, before any work on it, when the backend already knows it would be
        refused (a cluster past its SLO for even the cheapest request); None: go ahead."""
        return None

    async def health(self) -> dict:
        """What /health reports, within a few seconds; raise Unavailable when nothing can serve."""
        return {"status": "ok"}

    async def close(self) -> None:
        """Release connections and threads (the gateway calls it at shutdown; a second call does nothing)."""
