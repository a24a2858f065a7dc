"""OpenAIServing: the gateway's logic, written against GenerationBackend and nothing else.

For every request, called once from its route (app.py):

    prepared = await serving.prepare_chat(body)      # or prepare_completion: check, tokenize,
                                                     # size max_tokens -> a GenerationRequest per
                                                     # choice (n, best_of, a batch of prompts)
    body     = await serving.complete(prepared)      # not streaming: the whole response, or
    stream   = await serving.open_stream(prepared)   # streaming: waits for the first chunk, so
                                                     # a rejection is still an HTTP status
    async for event in stream: ...                   # SSE lines, "data: [DONE]" last
    await stream.aclose()                            # always; closes the backend's stream

Every mistake of the caller is an ApiError (status, OpenAI error type, param), never a
500. A BackendError before the first chunk becomes its HTTP status; after the first SSE
event it becomes one ``data: {"error": ...}`` event and ``[DONE]``.

Choices run as separate backend generations that share the prompt's KV (runs.Fanout).
Log-probabilities, response_format and forced tool calls are the engine's (a grammar,
mooncake.engine.grammar); tools are rendered and parsed here (tools.py).

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
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from mooncake.engine.grammar import JSON_OBJECT_SCHEMA, grammar_for
from mooncake.engine.request import SamplingParams, TokenLogprob
from mooncake.engine.tokenizer import Tokenizer
from mooncake.gateway import tenants, tools
from mooncake.gateway.errors import ApiError
from mooncake.gateway.formats import ChatFormat, ChoiceResult, CompletionFormat, Echo, TokenTexts
from mooncake.gateway.messages import template_message
from mooncake.gateway.metrics import GatewayMetrics
from mooncake.gateway.protocol import (
    SEED_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from mooncake.gateway.runs import Fanout
from mooncake.gateway.tools import ToolPlan
from mooncake.serving.types import BackendError, GenerationBackend, GenerationChunk, GenerationRequest

log = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"

MAX_PROMPTS = 64  # generations per request: prompts x (best_of or n)
INLINE_CHARS = 16_384  # shorter texts tokenize on the event loop (see _off_loop_if_long)
TOP_K_MAX = 2**31 - 1  # a top_k over the vocabulary cuts nothing; larger ones are clamped to fit the wire


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class PreparedRequest:
    """A checked, tokenized request, ready for the backend: one generation per choice (``per_prompt`` per prompt)."""

    request_id: str
    generations: list[GenerationRequest]
    per_prompt: int  # generations per prompt (best_of, else n)
    n: int  # choices returned per prompt (the likeliest ``n`` of ``best_of``)
    format: ChatFormat | CompletionFormat
    stream: bool
    include_usage: bool
    arrival: float  # time.monotonic() when the route got it
    echo: list[str] | None = None  # completions' echo: each prompt's text, shown before its choices
    tools: ToolPlan | None = None

    @property
    def generation(self) -> GenerationRequest:
        return self.generations[0]


class EventStream:
    """A streaming response's SSE events (``async for``), and :meth:`aclose`, which ends it.

    ``aclose`` must always be called (app.py does it when the response ends, however it
    ends); it closes the backend's streams, which cancels requests still running.
    """

    def __init__(
        self, events: AsyncGenerator[str, None], fanout: Fanout, request_id: str, predicted_ttft_s: float | None = None
    ) -> None:
        self._events = events
        self._fanout = fanout
        self.request_id = request_id
        self.predicted_ttft_s = predicted_ttft_s  # the Conductor's, for the first choice (a cluster backend's)

    def __aiter__(self) -> AsyncIterator[str]:
        return self._events

    @property
    def status(self) -> int:
        """200 once finished, an error's status after an error event, 499 if closed before either."""
        status = self._fanout.status
        return status if status is not None else 499

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._fanout.close()


# -- the serving class ----------------------------------------------------------------------


class OpenAIServing:
    """Chat and text completions over ``backend``. One per app; called concurrently from one event loop."""

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Tokenizer,
        model_name: str,
        metrics: GatewayMetrics,
        default_max_tokens: int = 4096,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.token_texts = TokenTexts(tokenizer)

    # -- preparing --------------------------------------------------------------------------

    async def prepare_chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        """Check ``req``, render its conversation (with its tools) and tokenize it (a long one on a thread). Raises
        ApiError."""
        arrival = time.monotonic()
        self._check_common(req)
        self._refuse_if_shedding()
        try:
            tool_plan = tools.plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        except ValueError as e:
            param, message = str(e).split("\t", 1)
            raise ApiError(400, message, param=param) from None
        native = tools.template_supports_tools(self.tokenizer.chat_template)
        messages, variables = tools.render_messages(
            [template_message(m, i) for i, m in enumerate(req.messages)], tool_plan, native
        )
        try:
            chars = sum(len(str(m.get("content") or "")) for m in messages)
            prompt = await _off_loop_if_long(chars, self.tokenizer.encode_chat, messages, True, **variables)
        except ValueError as e:
            raise ApiError(400, f"The chat template cannot render these messages: {e}", param="messages") from None
        if req.max_completion_tokens is not None:
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = req.max_tokens, "max_tokens"
        max_tokens = self._max_tokens(len(prompt), max_tokens, "messages", max_param)
        grammar = self._chat_grammar(req, tool_plan)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prepared = self._prepared(req, [prompt], max_tokens, ChatFormat, arrival, logprobs=logprobs, grammar=grammar)
        prepared.tools = tool_plan
        return prepared

    def _chat_grammar(self, req: ChatCompletionRequest, tool_plan: tools.ToolPlan | None) -> str | None:
        """The grammar the output must follow (response_format, or a forced tool call); ApiError when it does not
        compile."""
        fmt = req.response_format
        lark = tools.lark_grammar(tool_plan) if tool_plan is not None else None
        if lark is not None and fmt is not None and fmt.type != "text":
            raise ApiError(
                400, "response_format cannot be combined with a tool_choice that forces a call", param="response_format"
            )
        try:
            if lark is not None:
                return grammar_for(lark=lark)
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return grammar_for(json_schema=JSON_OBJECT_SCHEMA)
            if fmt.json_schema is None:
                raise ApiError(
                    400, "response_format of type json_schema needs 'json_schema'", param="response_format.json_schema"
                )
            return grammar_for(json_schema=fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {})
        except ValueError as e:
            param = "tools" if lark is not None else "response_format"
            raise ApiError(
                400,
                f"The {'tools' if lark is not None else 'schema'} cannot be compiled into a grammar: {e}",
                param=param,
            ) from None

    async def prepare_completion(self, req: CompletionRequest) -> PreparedRequest:
        """Check ``req`` and tokenize its prompts (long text on a thread; token ids as given). Raises ApiError."""
        arrival = time.monotonic()
        self._check_common(req)
        self._refuse_if_shedding()
        if req.suffix:
            raise ApiError(
                400,
                "'suffix' (insertion) is not supported by this server",
                param="suffix",
                code="unsupported_parameter",
            )
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ApiError(400, "The prompt is empty: at least one token is required", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(400, f"At most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
        ids_list = []
        vocab = self.tokenizer.vocab_size
        for prompt in prompts:
            if isinstance(prompt, str):
                ids = await _off_loop_if_long(len(prompt), self.tokenizer.encode, prompt) if prompt else []
            else:
                ids = list(prompt)
                bad = [i for i in ids if not 0 <= i < vocab]
                if bad:
                    raise ApiError(400, f"Token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
            ids_list.append(ids)
        max_tokens = min(self._max_tokens(len(ids), req.max_tokens, "prompt", "max_tokens") for ids in ids_list)
        # echo with logprobs: the prompt's too (each prompt is then computed whole, never from a cache)
        prompt_logprobs = req.logprobs if req.echo else None
        prepared = self._prepared(
            req,
            ids_list,
            max_tokens,
            CompletionFormat,
            arrival,
            logprobs=req.logprobs,
            best_of=req.best_of,
            prompt_logprobs=prompt_logprobs,
        )
        if req.echo:
            prepared.echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]
        return prepared

    def _refuse_if_shedding(self) -> None:
        """A 429 before any work (template, tokens, keys) while the backend knows every request is refused now."""
        rejected = self.backend.shedding()
        if rejected is not None:
            self.metrics.rejections.labels(rejected.code or rejected.error_type).inc()
            raise ApiError.from_backend(rejected)

    def _check_common(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.model != self.model_name:
            raise ApiError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def _max_tokens(self, num_prompt: int, max_tokens: int | None, prompt_param: str, max_param: str) -> int:
        """The completion's token budget; ApiError when the prompt or prompt + max_tokens overflows the context."""
        limit = self.backend.max_model_len
        if num_prompt == 0:
            raise ApiError(400, "The prompt is empty: at least one token is required", param=prompt_param)
        if num_prompt >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens, and the {prompt_param} have "
                f"{num_prompt} tokens, which leaves no room for the completion. Shorten the {prompt_param}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return min(limit - num_prompt, self.default_max_tokens)
        if num_prompt + max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the {prompt_param}, {max_tokens} in the "
                f"completion). Shorten the {prompt_param} or the completion.",
                param=max_param,
                code="context_length_exceeded",
            )
        return max_tokens

    def _prepared(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        max_tokens: int,
        format_cls: type[ChatFormat] | type[CompletionFormat],
        arrival: float,
        *,
        logprobs: int | None,
        grammar: str | None = None,
        best_of: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> PreparedRequest:
        request_id = f"{format_cls.id_prefix}{uuid.uuid4().hex}"
        bias = tuple(sorted((int(t), float(b)) for t, b in (req.logit_bias or {}).items()))
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t, _ in bias):
            raise ApiError(400, f"logit_bias names token ids outside the vocabulary [0, {vocab})", param="logit_bias")
        if (req.min_tokens or 0) > max_tokens:
            raise ApiError(
                400, f"min_tokens ({req.min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens"
            )
        n = req.n or 1
        per_prompt = best_of or n
        if per_prompt < n:
            raise ApiError(400, f"best_of ({best_of}) must be at least n ({n})", param="best_of")
        stream = bool(req.stream)
        if stream and per_prompt > n:
            raise ApiError(
                400, "best_of > n cannot be streamed: the best choices are known only at the end", param="best_of"
            )
        if per_prompt * len(prompts) > MAX_PROMPTS:
            raise ApiError(
                400,
                f"At most {MAX_PROMPTS} generations per request, got {len(prompts)} prompts x {per_prompt}",
                param="n",
            )
        # best_of ranks its candidates by their summed log-probabilities
        sampled_logprobs = logprobs if per_prompt == n else max(logprobs or 0, 0)
        try:  # one choice's sampling (the seeds differ: _choice_seed); the engine's own checks, as a 400
            sampling = [
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=min(max(req.top_k or 0, 0), TOP_K_MAX),
                    seed=_choice_seed(req.seed, j),
                    stop=req.stop_sequences(),
                    ignore_eos=req.ignore_eos,
                    presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                    logit_bias=bias,
                    min_tokens=req.min_tokens or 0,
                    logprobs=sampled_logprobs,
                    grammar=grammar,
                    prompt_logprobs=prompt_logprobs,
                )
                for j in range(per_prompt)
            ]
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        salt = tenants.salt_for(req.cache_salt)
        priority, tenant, weight = tenants.admission_for(req.priority)
        generations = [
            GenerationRequest(
                request_id=request_id if len(prompts) * per_prompt == 1 else f"{request_id}-{p}-{j}",
                prompt_token_ids=prompt,
                sampling=sampling[j],
                cache_salt=salt,
                priority=priority,
                tenant=tenant,
                tenant_weight=weight,
            )
            for p, prompt in enumerate(prompts)
            for j in range(per_prompt)
        ]
        include_usage = stream and req.include_usage
        fmt = format_cls(request_id, int(time.time()), self.model_name, include_usage, self.token_texts, logprobs)
        return PreparedRequest(request_id, generations, per_prompt, n, fmt, stream, include_usage, arrival)

    # -- vLLM's /tokenize and /detokenize ----------------------------------------------------

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """The token ids of a prompt or a conversation (as the completions would see them). Raises ApiError."""
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(
                400, "Send either 'prompt' (text) or 'messages' (a conversation), not both or neither", param="prompt"
            )
        if req.messages is not None:
            messages = [template_message(m, i) for i, m in enumerate(req.messages)]
            try:
                ids = await asyncio.to_thread(self.tokenizer.encode_chat, messages, req.add_generation_prompt)
            except ValueError as e:
                raise ApiError(400, f"The chat template cannot render these messages: {e}", param="messages") from None
        else:
            ids = (
                await asyncio.to_thread(self.tokenizer.encode, req.prompt, req.add_special_tokens) if req.prompt else []
            )
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
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    # -- generating -------------------------------------------------------------------------

    def _fanout(self, prepared: PreparedRequest) -> Fanout:
        return Fanout(self.backend, self.metrics, prepared.generations, prepared.per_prompt, prepared.arrival)

    async def complete(self, prepared: PreparedRequest) -> dict[str, Any]:
        """Generate every choice whole; the response body. Raises ApiError (the backend's errors included).

        Cancelling the awaiting task cancels the request in the backend.
        """
        fanout = self._fanout(prepared)
        pieces: list[list[str]] = [[] for _ in prepared.generations]
        logprobs: list[list[TokenLogprob]] = [[] for _ in prepared.generations]
        prompt_logprobs: list[list[TokenLogprob] | None] = [None] * len(prepared.generations)
        finish: list[str | None] = [None] * len(prepared.generations)
        try:
            while (item := await fanout.next()) is not None:
                i, chunk = item
                pieces[i].append(chunk.text)
                logprobs[i].extend(chunk.logprobs or ())
                prompt_logprobs[i] = chunk.prompt_logprobs or prompt_logprobs[i]
                finish[i] = chunk.finish_reason
        except BackendError as e:
            raise ApiError.from_backend(e) from None
        except RuntimeError:
            raise _unfinished(prepared) from None
        finally:
            await fanout.close()
        choices = []
        for p in range(len(prepared.generations) // prepared.per_prompt):
            group = range(p * prepared.per_prompt, (p + 1) * prepared.per_prompt)
            if prepared.per_prompt > prepared.n:  # best_of: the n likeliest, by their summed log-probabilities
                group = sorted(group, key=lambda i: -sum(lp.logprob for lp in logprobs[i]))[: prepared.n]
            for j, i in enumerate(group):
                text = "".join(pieces[i])
                result = ChoiceResult(p * prepared.n + j, text, finish[i] or "stop", logprobs[i])
                if prepared.echo is not None:
                    result.echo = self._echo(prepared, i, prompt_logprobs[i])
                if prepared.tools is not None:
                    content, calls = tools.parse(text, prepared.tools)
                    if calls:
                        result.text, result.tool_calls, result.finish_reason = content or "", calls, "tool_calls"
                choices.append(result)
        if prepared.format.top_logprobs is None:
            for c in choices:
                c.logprobs = []
        return prepared.format.response(choices, fanout.usage())

    async def open_stream(self, prepared: PreparedRequest) -> EventStream:
        """Start generating and wait for the first chunk; the SSE events from there on.

        Raises ApiError if the backend refuses the request before its first chunk (so a
        rejection is still a 429, not an event). The caller must ``aclose()`` the stream.
        """
        fanout = self._fanout(prepared)
        try:
            first = await fanout.next()
        except BackendError as e:
            await fanout.close()
            raise ApiError.from_backend(e) from None
        except BaseException:
            await fanout.close()
            raise
        predicted = first[1].predicted_ttft_s if first is not None else None
        return EventStream(self._events(prepared, fanout, first), fanout, prepared.request_id, predicted)

    async def _events(
        self, prepared: PreparedRequest, fanout: Fanout, first: tuple[int, GenerationChunk] | None
    ) -> AsyncGenerator[str, None]:
        fmt = prepared.format
        choices = len(prepared.generations)
        for i in range(choices):
            for event in fmt.opening(i):
                yield sse(event)
        echoed: set[int] = set()
        held = [_HeldToolText() if prepared.tools is not None else None for _ in range(choices)]
        item = first
        try:
            while item is not None:
                i, chunk = item
                if prepared.echo is not None and i not in echoed:  # before its first text, with its logprobs if asked
                    echoed.add(i)
                    if (event := fmt.echo(i, self._echo(prepared, i, chunk.prompt_logprobs))) is not None:
                        yield sse(event)
                text = held[i].push(chunk.text) if held[i] is not None else chunk.text
                event = fmt.text(i, text, chunk.logprobs)
                if event is not None:
                    yield sse(event)
                if chunk.finish_reason is not None:
                    reason = chunk.finish_reason
                    if held[i] is not None:
                        content, calls = tools.parse(held[i].flush(), prepared.tools)
                        if content and (event := fmt.text(i, content, None)) is not None:
                            yield sse(event)
                        for k, call in enumerate(calls):
                            yield sse(fmt.tool_call(i, k, call))
                        reason = "tool_calls" if calls else reason
                    yield sse(fmt.finish(i, reason))
                item = await fanout.next()
            if prepared.include_usage:
                yield sse(fmt.usage(fanout.usage()))
            yield DONE_EVENT
            return
        except BackendError as e:
            log.warning("request %s failed mid-stream: %s", prepared.request_id, e.message)
            error = ApiError.from_backend(e)
        except RuntimeError:
            error = _unfinished(prepared)
        except Exception:
            log.exception("request %s failed mid-stream", prepared.request_id)
            error = ApiError(500, "Internal error while generating", error_type="server_error")
        fanout.failed_status = error.status
        yield sse(error.body())
        yield DONE_EVENT

    def _echo(self, prepared: PreparedRequest, choice: int, prompt_logprobs: list[TokenLogprob] | None) -> Echo:
        generation = prepared.generations[choice]
        logprobs = prompt_logprobs or [] if generation.sampling.prompt_logprobs is not None else None
        return Echo(prepared.echo[choice // prepared.per_prompt], generation.prompt_token_ids[0], logprobs)


class _HeldToolText:
    """A streamed choice's text, held back from the point where it may be a tool call (tools.may_open_call)."""

    def __init__(self) -> None:
        self.held = ""

    def push(self, text: str) -> str:
        """What can be shown now of the new ``text``."""
        self.held += text
        if tools.may_open_call(self.held):
            return ""
        shown, self.held = self.held, ""
        return shown

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


async def _off_loop_if_long(chars: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a thread for a text of ``INLINE_CHARS`` or more, else here on the event loop.

    A short text tokenizes in well under a millisecond; handing it to a thread costs more
    than that under load (the event loop waits for the GIL back while other requests'
    threads run; a profile of a burst, benchmarks/overload_bench.py, showed the loop
    there). A long one would stall every other request on the loop, so it goes to a thread.
    """
    if chars < INLINE_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def _choice_seed(seed: int | None, choice: int) -> int | None:
    """Choice ``choice``'s seed: the request's plus its index (kept in range), so each choice has its own stream."""
    if seed is None:
        return None
    return seed + choice if seed + choice <= SEED_MAX else seed - choice


def _unfinished(prepared: PreparedRequest) -> ApiError:
    log.error("the backend ended request %s without a finish_reason", prepared.request_id)
    return ApiError(500, "The backend ended the request without finishing it", error_type="server_error")
