"""A prepared request's response: the whole body (``complete``) or its SSE events (``open_stream``).

Owns everything after serving.py has checked and tokenized a request: the
``PreparedRequest`` it hands over, and turning the backend's chunks (one generation per
choice, merged by a runs.Fanout) into OpenAI's output, choice by choice:

1. a reasoning model's text is split into reasoning and content (reasoning.py);
2. a request with tools has its text parsed for tool calls (tool_parsers.py); a stream
   holds text back from where a call may start (``_HeldToolText``) until the choice ends;
3. ``best_of`` keeps the ``n`` likeliest choices (by summed log-probabilities); ``echo``
   shows the prompt (and its log-probabilities if asked) before a choice's text;
4. formats.py shapes the result as a chat or completions body, or as stream events.

A BackendError before the first chunk is an ApiError (an HTTP status); after the first
SSE event it is one ``data: {"error": ...}`` event and ``[DONE]``. Closing the stream
(``EventStream.aclose``) closes the Fanout, which cancels the backend's requests.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from mooncake.engine.request import TokenLogprob
from mooncake.gateway import reasoning, tool_parsers
from mooncake.gateway.errors import ApiError
from mooncake.gateway.formats import ChatFormat, ChoiceResult, CompletionFormat, Echo
from mooncake.gateway.reasoning import ReasoningSplit
from mooncake.gateway.runs import Fanout
from mooncake.gateway.tool_parsers import ToolCallParser
from mooncake.gateway.tools import ToolPlan
from mooncake.serving.types import BackendError, GenerationChunk, GenerationRequest, Quote

log = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"


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
    tool_parser: ToolCallParser = ToolCallParser.HERMES  # the format tool calls are read in (tool_parsers.effective)
    reasoning: bool | None = None  # chat with a reasoning model: whether the output starts inside the reasoning
    include_reasoning: bool = True

    def reasoning_split(self) -> ReasoningSplit | None:
        """A new choice's reasoning state (None when the output has no reasoning to split)."""
        return ReasoningSplit(self.reasoning) if self.reasoning is not None else None

    @property
    def generation(self) -> GenerationRequest:
        return self.generations[0]


class EventStream:
    """A streaming response's SSE events (``async for``), and :meth:`aclose`, which ends it.

    ``aclose`` must always be called (app.py does it when the response ends, however it
    ends); it closes the backend's streams, which cancels requests still running.
    """

    def __init__(self, events: AsyncGenerator[str, None], fanout: Fanout, request_id: str) -> None:
        self._events = events
        self._fanout = fanout
        self.request_id = request_id

    @property
    def quote(self) -> Quote | None:
        """The Conductor's prediction for the first choice (a cluster backend's; None elsewhere)."""
        return self._fanout.quote

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


async def complete(prepared: PreparedRequest, fanout: Fanout) -> dict[str, Any]:
    """Generate every choice whole from ``fanout``; the response body. Raises ApiError (the backend's errors
    included).

    Cancelling the awaiting task cancels the request in the backend.
    """
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
            thought = None
            if prepared.reasoning is not None:
                thought, text = reasoning.split(text, prepared.reasoning)
            result = ChoiceResult(p * prepared.n + j, text, finish[i] or "stop", logprobs[i])
            result.reasoning = thought if prepared.include_reasoning else None
            if prepared.echo is not None:
                result.echo = _echo(prepared, i, prompt_logprobs[i])
            if prepared.tools is not None:
                content, calls = tool_parsers.parse(text, prepared.tools, prepared.tool_parser)
                if calls:
                    result.text, result.tool_calls, result.finish_reason = content or "", calls, "tool_calls"
            choices.append(result)
    if prepared.format.top_logprobs is None:
        for c in choices:
            c.logprobs = []
    return prepared.format.response(choices, fanout.usage())


async def open_stream(prepared: PreparedRequest, fanout: Fanout) -> EventStream:
    """Start ``fanout`` generating and wait for the first chunk; the SSE events from there on.

    Raises ApiError if the backend refuses the request before its first chunk (so a
    rejection is still a 429, not an event). The caller must ``aclose()`` the stream.
    """
    try:
        first = await fanout.next()
    except BackendError as e:
        await fanout.close()
        raise ApiError.from_backend(e) from None
    except BaseException:
        await fanout.close()
        raise
    return EventStream(_events(prepared, fanout, first), fanout, prepared.request_id)


async def _events(
    prepared: PreparedRequest, fanout: Fanout, first: tuple[int, GenerationChunk] | None
) -> AsyncGenerator[str, None]:
    fmt = prepared.format
    choices = len(prepared.generations)
    for i in range(choices):
        for event in fmt.opening(i):
            yield sse(event)
    echoed: set[int] = set()
    held = [_HeldToolText(prepared.tool_parser) if prepared.tools is not None else None for _ in range(choices)]
    splits = [prepared.reasoning_split() for _ in range(choices)]
    item = first
    try:
        while item is not None:
            i, chunk = item
            if prepared.echo is not None and i not in echoed:  # before its first text, with its logprobs if asked
                echoed.add(i)
                if (event := fmt.echo(i, _echo(prepared, i, chunk.prompt_logprobs))) is not None:
                    yield sse(event)
            text, thought = chunk.text, ""
            if splits[i] is not None:  # reasoning until </think>, then content
                thought, text = splits[i].push(text)
                if chunk.finish_reason is not None:
                    rest = splits[i].finish()
                    thought, text = thought + rest[0], text + rest[1]
                thought = thought if prepared.include_reasoning else ""
            text = held[i].push(text) if held[i] is not None else text
            event = fmt.text(i, text, chunk.logprobs, thought)
            if event is not None:
                yield sse(event)
            if chunk.finish_reason is not None:
                reason = chunk.finish_reason
                if held[i] is not None:
                    content, calls = tool_parsers.parse(held[i].flush(), prepared.tools, prepared.tool_parser)
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


def _echo(prepared: PreparedRequest, choice: int, prompt_logprobs: list[TokenLogprob] | None) -> Echo:
    generation = prepared.generations[choice]
    logprobs = prompt_logprobs or [] if generation.sampling.prompt_logprobs is not None else None
    return Echo(prepared.echo[choice // prepared.per_prompt], generation.prompt_token_ids[0], logprobs)


class _HeldToolText:
    """A streamed choice's text, held back from the point where it may be a tool call (tool_parsers.may_open_call)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.held = ""
        self.parser = parser
        self.started = False  # formats whose call is the whole output (llama3_json, pythonic) decide at its start

    def push(self, text: str) -> str:
        """What can be shown now of the new ``text``."""
        self.held += text
        whole = self.parser in (ToolCallParser.LLAMA3_JSON, ToolCallParser.PYTHONIC)
        if whole and self.started:
            shown, self.held = self.held, ""
            return shown
        if tool_parsers.may_open_call(self.held, self.parser):
            return ""
        self.started = self.started or bool(self.held.strip())
        shown, self.held = self.held, ""
        return shown

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def _unfinished(prepared: PreparedRequest) -> ApiError:
    log.error("the backend ended request %s without a finish_reason", prepared.request_id)
    return ApiError(500, "The backend ended the request without finishing it", error_type="server_error")
