"""OpenAIServing: the gateway's logic, written against GenerationBackend and nothing else.

For every request, called once from its route (app.py):

    prepared = await serving.prepare_chat(body)      # or prepare_completion: check, tokenize,
                                                     # size max_tokens -> a GenerationRequest
    body     = await serving.complete(prepared)      # not streaming: the whole response, or
    stream   = await serving.open_stream(prepared)   # streaming: waits for the first chunk, so
                                                     # a rejection is still an HTTP status
    async for event in stream: ...                   # SSE lines, "data: [DONE]" last
    await stream.aclose()                            # always; closes the backend's stream

Every mistake of the caller is an ApiError (status, OpenAI error type, param), never a
500. A BackendError before the first chunk becomes its HTTP status; after the first SSE
event it becomes one ``data: {"error": ...}`` event and ``[DONE]``.

Closing the backend's iterator early (``aclose``, or cancelling the task awaiting it)
cancels the request everywhere: that is how a client that goes away stops its request.

``max_tokens`` left out: the rest of the context, capped at ``default_max_tokens``
(4096 by default), for chat and completions alike (OpenAI's legacy completions default is
16, which surprises more users than it helps).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from mooncake.engine.tokenizer import Tokenizer
from mooncake.gateway.metrics import GatewayMetrics
from mooncake.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
)
from mooncake.serving.types import BackendError, GenerationBackend, GenerationChunk, GenerationRequest

log = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"

# OpenAI parameters this server cannot honour, and the values that ask for nothing.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


class ApiError(Exception):
    """An error response: HTTP ``status`` and OpenAI's ``{"error": {...}}`` body."""

    def __init__(
        self, status: int, message: str, *, error_type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.error_type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    @classmethod
    def from_backend(cls, error: BackendError) -> ApiError:
        """The response for a backend's error; a 429 always says when to retry (whole seconds, at least 1)."""
        headers = {}
        if error.retry_after_s is not None or error.status == 429:
            retry_after = error.retry_after_s if error.retry_after_s is not None and math.isfinite(error.retry_after_s) else 1
            headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
        return cls(error.status, error.message, error_type=error.error_type, param=error.param, code=error.code,
                   headers=headers)  # fmt: skip


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


# -- response shapes ----------------------------------------------------------------------


class _Format:
    """The fields every response and event of one request repeats."""

    id_prefix = ""

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool) -> None:
        self._head = dict(id=request_id, created=created, model=model)
        self._exclude = None if include_usage else {"usage"}  # events carry "usage": null only if asked


class _ChatFormat(_Format):
    """Chat completion responses and stream events of one request."""

    id_prefix = "chatcmpl-"

    def response(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return ChatCompletionResponse(**self._head, choices=[choice], usage=usage).model_dump()

    def _chunk(self, delta: Delta, finish_reason: str | None = None) -> dict[str, Any]:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(**self._head, choices=[choice]).model_dump(exclude=self._exclude)

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk(Delta(role="assistant", content=""))]

    def text(self, text: str) -> dict[str, Any]:
        return self._chunk(Delta(content=text))

    def finish(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk(Delta(), finish_reason)

    def usage(self, usage: Usage) -> dict[str, Any]:
        return ChatCompletionChunk(**self._head, choices=[], usage=usage).model_dump()


class _CompletionFormat(_Format):
    """Text completion responses and stream events of one request (no role event: OpenAI sends none)."""

    id_prefix = "cmpl-"

    def response(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return CompletionResponse(**self._head, choices=[choice], usage=usage).model_dump()

    def _chunk(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return CompletionResponse(**self._head, choices=[choice]).model_dump(exclude=self._exclude)

    def opening(self) -> list[dict[str, Any]]:
        return []

    def text(self, text: str) -> dict[str, Any]:
        return self._chunk(text)

    def finish(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk("", finish_reason)

    def usage(self, usage: Usage) -> dict[str, Any]:
        return CompletionResponse(**self._head, choices=[], usage=usage).model_dump()


@dataclass(slots=True)
class PreparedRequest:
    """A checked, tokenized request, ready for the backend."""

    generation: GenerationRequest
    format: _ChatFormat | _CompletionFormat
    stream: bool
    include_usage: bool
    arrival: float  # time.monotonic() when the route got it

    @property
    def request_id(self) -> str:
        return self.generation.request_id


# -- one request's backend stream -------------------------------------------------------------


class _Run:
    """One request's stream from the backend, and the metrics it feeds.

    ``status`` is what the request came to: None while it runs, 200 once finished, an
    error's status once it failed. :meth:`close` must be called exactly as ``finally``.
    """

    def __init__(self, backend: GenerationBackend, metrics: GatewayMetrics, prepared: PreparedRequest) -> None:
        self._metrics = metrics
        self._arrival = prepared.arrival
        self.num_prompt_tokens = len(prepared.generation.prompt_token_ids)
        self.num_completion_tokens = 0
        self.last: GenerationChunk | None = None
        self.status: int | None = None
        self._last_token_at: float | None = None
        self._closed = False
        self._chunks: AsyncGenerator[GenerationChunk, None] = backend.generate(prepared.generation)  # type: ignore[assignment]
        metrics.running.inc()

    async def next(self) -> GenerationChunk | None:
        """The next chunk, or None when the backend's stream ended. Raises the backend's BackendError."""
        try:
            chunk = await anext(self._chunks)
        except StopAsyncIteration:
            return None
        except BackendError as e:
            self.status = e.status
            if self.last is None and e.status != 400:
                self._metrics.rejections.labels(e.code or e.error_type).inc()
            raise
        now = time.monotonic()
        if chunk.token_ids:
            if self._last_token_at is None:
                self._metrics.ttft.observe(now - self._arrival)
            else:
                self._metrics.tbt.observe(now - self._last_token_at)
            self._last_token_at = now
            self.num_completion_tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            self.status = 200
            self._metrics.e2e.observe(now - self._arrival)
        self.last = chunk
        return chunk

    def usage(self) -> Usage:
        cached = self.last.cached_tokens if self.last is not None else 0
        return Usage(
            prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_completion_tokens,
            total_tokens=self.num_prompt_tokens + self.num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )  # fmt: skip

    async def close(self) -> None:
        """Close the backend's stream (cancelling the request if it has not finished) and count its tokens."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._chunks.aclose()
        finally:
            m = self._metrics
            m.running.dec()
            if self.last is not None:  # the backend took it: its prompt was (being) prefilled
                m.prompt_tokens.inc(self.num_prompt_tokens)
                for tier, count in self.last.cached_tokens_by_tier.items():
                    m.cached_prompt_tokens.labels(tier).inc(count)
            m.completion_tokens.inc(self.num_completion_tokens)


class EventStream:
    """A streaming response's SSE events (``async for``), and :meth:`aclose`, which ends it.

    ``aclose`` must always be called (app.py does it when the response ends, however it
    ends); it closes the backend's stream, which cancels a request still running.
    """

    def __init__(self, events: AsyncGenerator[str, None], run: _Run, request_id: str) -> None:
        self._events = events
        self._run = run
        self.request_id = request_id

    def __aiter__(self) -> AsyncIterator[str]:
        return self._events

    @property
    def status(self) -> int:
        """200 once finished, an error's status after an error event, 499 if closed before either."""
        return self._run.status if self._run.status is not None else 499

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._run.close()


# -- the serving class ----------------------------------------------------------------------


class OpenAIServing:
    """Chat and text completions over ``backend``. One per app; called concurrently from one event loop."""

    def __init__(
        self, backend: GenerationBackend, tokenizer: Tokenizer, model_name: str, metrics: GatewayMetrics,
        default_max_tokens: int = 4096,
    ) -> None:  # fmt: skip
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens

    # -- preparing --------------------------------------------------------------------------

    async def prepare_chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        """Check ``req`` and render + tokenize its conversation (on a thread). Raises ApiError."""
        arrival = time.monotonic()
        self._check_common(req)
        messages = [_template_message(m, i) for i, m in enumerate(req.messages)]
        try:
            prompt = await asyncio.to_thread(self.tokenizer.encode_chat, messages)
        except ValueError as e:
            raise ApiError(400, f"The chat template cannot render these messages: {e}", param="messages") from None
        if req.max_completion_tokens is not None:
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = req.max_tokens, "max_tokens"
        max_tokens = self._max_tokens(len(prompt), max_tokens, "messages", max_param)
        return self._prepared(req, prompt, max_tokens, _ChatFormat, arrival)

    async def prepare_completion(self, req: CompletionRequest) -> PreparedRequest:
        """Check ``req`` and tokenize its prompt (text on a thread; token ids as given). Raises ApiError."""
        arrival = time.monotonic()
        self._check_common(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ApiError(400, f"Got {len(prompt)} prompts; batches (n > 1) are not supported, send one prompt per "
                               "request", param="prompt")  # fmt: skip
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(self.tokenizer.encode, prompt) if prompt else []
        else:
            ids = list(prompt)
            vocab = self.tokenizer.vocab_size
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise ApiError(400, f"Token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
        max_tokens = self._max_tokens(len(ids), req.max_tokens, "prompt", "max_tokens")
        return self._prepared(req, ids, max_tokens, _CompletionFormat, arrival)

    def _check_common(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.model != self.model_name:
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")  # fmt: skip
        if req.n not in (None, 1):
            raise ApiError(400, f"n={req.n} is not supported: only n=1, send several requests instead", param="n")
        for name, neutral in _NEUTRAL_VALUES.items():
            if name in type(req).model_fields and getattr(req, name) not in neutral:
                raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")

    def _max_tokens(self, num_prompt: int, max_tokens: int | None, prompt_param: str, max_param: str) -> int:
        """The completion's token budget; ApiError when the prompt or prompt + max_tokens overflows the context."""
        limit = self.backend.max_model_len
        if num_prompt == 0:
            raise ApiError(400, "The prompt is empty: at least one token is required", param=prompt_param)
        if num_prompt >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens, and the {prompt_param} have "
                           f"{num_prompt} tokens, which leaves no room for the completion. Shorten the {prompt_param}.",
                           param=prompt_param, code="context_length_exceeded")  # fmt: skip
        if max_tokens is None:
            return min(limit - num_prompt, self.default_max_tokens)
        if num_prompt + max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{num_prompt + max_tokens} tokens ({num_prompt} in the {prompt_param}, {max_tokens} in the "
                           f"completion). Shorten the {prompt_param} or the completion.",
                           param=max_param, code="context_length_exceeded")  # fmt: skip
        return max_tokens

    def _prepared(
        self, req: ChatCompletionRequest | CompletionRequest, prompt: list[int], max_tokens: int,
        format_cls: type[_ChatFormat] | type[_CompletionFormat], arrival: float,
    ) -> PreparedRequest:  # fmt: skip
        request_id = f"{format_cls.id_prefix}{uuid.uuid4().hex}"
        bias = tuple(sorted((int(t), float(b)) for t, b in (req.logit_bias or {}).items()))
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t, _ in bias):
            raise ApiError(400, f"logit_bias names token ids outside the vocabulary [0, {vocab})", param="logit_bias")
        if (req.min_tokens or 0) > max_tokens:
            raise ApiError(400, f"min_tokens ({req.min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens")
        generation = GenerationRequest(
            request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(req.top_k or 0, 0), seed=req.seed, stop=req.stop_sequences(), ignore_eos=req.ignore_eos,
            cache_salt=req.cache_salt, presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty, logit_bias=bias,
            min_tokens=req.min_tokens or 0,
        )  # fmt: skip
        stream = bool(req.stream)
        include_usage = stream and req.include_usage
        fmt = format_cls(request_id, int(time.time()), self.model_name, include_usage)
        return PreparedRequest(generation, fmt, stream, include_usage, arrival)

    # -- vLLM's /tokenize and /detokenize ----------------------------------------------------

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """The token ids of a prompt or a conversation (as the completions would see them). Raises ApiError."""
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "Send either 'prompt' (text) or 'messages' (a conversation), not both or neither",
                           param="prompt")  # fmt: skip
        if req.messages is not None:
            messages = [_template_message(m, i) for i, m in enumerate(req.messages)]
            try:
                ids = await asyncio.to_thread(self.tokenizer.encode_chat, messages, req.add_generation_prompt)
            except ValueError as e:
                raise ApiError(400, f"The chat template cannot render these messages: {e}", param="messages") from None
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt, req.add_special_tokens) if req.prompt else []
        return TokenizeResponse(count=len(ids), max_model_len=self.backend.max_model_len, tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids. Raises ApiError for ids outside the vocabulary."""
        self._check_model(req.model)
        vocab = self.tokenizer.vocab_size
        bad = [i for i in req.tokens if not 0 <= i < vocab]
        if bad:
            raise ApiError(400, f"Token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.tokenizer.decode, req.tokens))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")  # fmt: skip

    # -- generating -------------------------------------------------------------------------

    async def complete(self, prepared: PreparedRequest) -> dict[str, Any]:
        """Generate the whole completion; its response body. Raises ApiError (the backend's errors included).

        Cancelling the awaiting task cancels the request in the backend.
        """
        run = _Run(self.backend, self.metrics, prepared)
        pieces: list[str] = []
        try:
            while (chunk := await run.next()) is not None:
                pieces.append(chunk.text)
                if chunk.finish_reason is not None:
                    return prepared.format.response("".join(pieces), chunk.finish_reason, run.usage())
            raise _unfinished(prepared)
        except BackendError as e:
            raise ApiError.from_backend(e) from None
        finally:
            await run.close()

    async def open_stream(self, prepared: PreparedRequest) -> EventStream:
        """Start generating and wait for the first chunk; the SSE events from there on.

        Raises ApiError if the backend refuses the request before its first chunk (so a
        rejection is still a 429, not an event). The caller must ``aclose()`` the stream.
        """
        run = _Run(self.backend, self.metrics, prepared)
        try:
            first = await run.next()
        except BackendError as e:
            await run.close()
            raise ApiError.from_backend(e) from None
        except BaseException:
            await run.close()
            raise
        return EventStream(self._events(prepared, run, first), run, prepared.request_id)

    async def _events(self, prepared: PreparedRequest, run: _Run, first: GenerationChunk | None) -> AsyncGenerator[str, None]:
        fmt = prepared.format
        for event in fmt.opening():
            yield sse(event)
        chunk = first
        try:
            while chunk is not None:
                if chunk.text:
                    yield sse(fmt.text(chunk.text))
                if chunk.finish_reason is not None:
                    yield sse(fmt.finish(chunk.finish_reason))
                    if prepared.include_usage:
                        yield sse(fmt.usage(run.usage()))
                    yield DONE_EVENT
                    return
                chunk = await run.next()
            raise _unfinished(prepared)
        except BackendError as e:
            log.warning("request %s failed mid-stream: %s", prepared.request_id, e.message)
            error = ApiError.from_backend(e)
        except ApiError as e:
            error = e
        except Exception:
            log.exception("request %s failed mid-stream", prepared.request_id)
            error = ApiError(500, "Internal error while generating", error_type="server_error")
        run.status = error.status
        yield sse(error.body())
        yield DONE_EVENT


def _unfinished(prepared: PreparedRequest) -> ApiError:
    log.error("the backend ended request %s without a finish_reason", prepared.request_id)
    return ApiError(500, "The backend ended the request without finishing it", error_type="server_error")


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """The chat template's view of a message: text content (text parts joined by newlines, as vLLM does)."""
    content = message.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"Content parts of type '{part.type}' are not supported; only 'text' parts are",
                               param=f"messages[{index}].content[{j}]")  # fmt: skip
            texts.append(part.text)
        text = "\n".join(texts)
    rendered: dict[str, Any] = {"role": message.role, "content": text}
    if message.name is not None:
        rendered["name"] = message.name
    return rendered
