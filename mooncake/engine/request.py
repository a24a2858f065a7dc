"""Requests and sampling parameters: the engine's unit of work (pure, no torch)."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake.blocks import KeyChain


class RequestStatus(enum.Enum):
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # its blocks given, a prefill elsewhere writing its KV into them
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS / stop token / stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability under the model (log-softmax of its raw logits), and the likeliest
    tokens'."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), likeliest first


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (after temperature); 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0  # OpenAI's: minus this from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often a token was generated
    repetition_penalty: float = (
        1.0  # vLLM's and HF's: prompt and output tokens' logits divided (or, if negative, times) by it
    )
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    min_tokens: int = 0  # no EOS or stop token before this many tokens
    logprobs: int | None = None  # each sampled token's log-probability, and this many of the likeliest (at most 20)
    prompt_logprobs: int | None = None  # each prompt token's (after the first), and this many of the likeliest; the
    # whole prompt is then computed (no prefix-cache hits, no imported KV)
    grammar: str | None = None  # llguidance grammar text the output must follow (mooncake.engine.grammar.grammar_for)
    skip_special_tokens: bool = True  # the output's text leaves special tokens (EOS, control tokens) out

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        bias = tuple(
            (int(t), float(b))
            for t, b in (self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias)
        )
        if any(not -100.0 <= b <= 100.0 for _, b in bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes(self) -> bool:
        """Whether the logits depend on the tokens seen so far (repetition, frequency or presence penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, biases, min_tokens)."""
        return bool(self.penalizes or self.logit_bias or self.min_tokens)


def checked_prompt(
    prompt_token_ids, params: SamplingParams, max_model_len: int, vocab_size: int, has_tokenizer: bool
) -> list[int]:
    """The prompt as ints, or ValueError for what no engine can serve (every engine's ``add_request`` calls this)."""
    prompt = [int(t) for t in prompt_token_ids]
    if not prompt:
        raise ValueError("prompt is empty: at least one token is required")
    if len(prompt) > max_model_len:
        raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len is {max_model_len}")
    if any(t < 0 or t >= vocab_size for t in prompt):
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab_size})")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need an engine built with a tokenizer")
    return prompt


@dataclass(frozen=True, slots=True)
class PromptKV:
    """KV of a request's leading tokens computed elsewhere (``add_request(kv=)``).

    ``kv`` [n, L, 2, block_size, Hkv, D] (the pool layout, or an engine's own view of pool slots) holds the first
    ``num_tokens`` tokens' KV, imported as the request is admitted (fewer than the whole sequence: the rest is
    computed). ``remote``: the whole sequence's KV is on its way from a prefill elsewhere; the request is given its
    blocks now and waits for it (``land``)."""

    num_tokens: int
    kv: Any = None
    remote: bool = False

    @classmethod
    def landing(cls, num_tokens: int) -> "PromptKV":
        return cls(num_tokens, remote=True)


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """The rest of what ``add_request`` takes: ``cache_salt`` (the root of its block keys), ``outputs`` (tokens already
    generated elsewhere: a prefill's first token, a resumed stream's; they count toward max_tokens),
    ``chunk_tokens`` (the most of its tokens one step computes; 0: the step's budget) and ``ahead`` (it starts before
    the requests already waiting: a retry that outlived a failure), ``hold`` (its blocks outlive its end until
    ``release_held``: a decode worker's write-behind reads them after a short answer ended)."""

    cache_salt: str | None = None
    outputs: tuple[int, ...] = ()
    chunk_tokens: int = 0
    ahead: bool = False
    hold: bool = False


@dataclass(eq=False)
class Request:
    """One generation request and its progress.

    ``num_computed_tokens`` chases ``num_tokens``: tokens whose KV is in the cache. A
    request in prefill has many tokens to go; in decode exactly one (the token sampled
    last step). There is no separate "phase". Owned by the scheduler.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    key_chain: KeyChain
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_imported_tokens: int = 0  # tokens whose KV came from ``external_kv``
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    external_kv: Any = None  # KV of leading blocks to import (engine-specific; see engine.py)
    num_external_tokens: int = 0
    num_landed_tokens: int = 0  # leading tokens whose KV is already in ``block_ids`` (written there by a prefill)
    chunk_tokens: int = (
        0  # the most of its tokens one step computes (0: the step's budget): a decode worker computing a
    )
    # prompt keeps each step of its batch within the TBT SLO (conductor.local)
    ahead: bool = False  # queued before the requests waiting when it came (a retry that outlived a failure)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.. (prompt_logprobs asked)

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def all_token_ids(self) -> Sequence[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def block_keys(self) -> list[bytes]:
        """Keys of the request's full blocks so far (hashed once per block)."""
        self.key_chain.extend(self._all_token_ids)
        return self.key_chain.keys
