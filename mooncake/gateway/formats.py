"""Response bodies and stream events of one request, in OpenAI's shapes (chat and legacy completions).

A request has one or more choices (``n``, a batch of prompts); each event names its
choice's ``index``. Log-probabilities come from the engine as ``TokenLogprob`` (token
ids) and are shown here as text: chat's ``logprobs.content`` entries (token, logprob,
bytes, top_logprobs), completions' parallel lists (tokens, token_logprobs, top_logprobs,
text_offset). A token's text is its own decoding; its ``bytes`` are that text's UTF-8 (a
token that is part of a multi-byte character shows U+FFFD, as in vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mooncake.engine.request import TokenLogprob
from mooncake.engine.tokenizer import Tokenizer
from mooncake.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    TokenLogprobEntry,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)


@dataclass(slots=True)
class ChoiceResult:
    """One finished choice of a non-streaming request."""

    index: int
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[ToolCall] | None = None
    echo: Echo | None = None  # completions' echo: the prompt shown first
    reasoning: str | None = None  # chat's reasoning_content (reasoning.py)


@dataclass(slots=True)
class Echo:
    """A prompt echoed before its completion, with its tokens' logprobs when they were asked for."""

    text: str
    first_token: int  # has no logprob (nothing precedes it)
    logprobs: list[TokenLogprob] | None  # prompt tokens 1..


class TokenTexts:
    """Each token id's text and bytes, decoded once (shared by a gateway's requests)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            hit = self._cache[token_id] = (text, list(text.encode("utf-8")))
        return hit


class _Format:
    """The fields every response and event of one request repeats."""

    id_prefix = ""

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        include_usage: bool,
        texts: TokenTexts,
        top_logprobs: int | None,
    ) -> None:
        self._head = dict(id=request_id, created=created, model=model)
        self._exclude = None if include_usage else {"usage"}  # events carry "usage": null only if asked
        self._texts = texts
        self.top_logprobs = top_logprobs  # None: the request asked for no logprobs


class ChatFormat(_Format):
    """Chat completion responses and stream events of one request."""

    id_prefix = "chatcmpl-"

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> ChoiceLogprobs | None:
        if self.top_logprobs is None or logprobs is None:
            return None
        entries = []
        for lp in logprobs:
            text, raw = self._texts(lp.token_id)
            top = [
                TopLogprob(token=t, logprob=v, bytes=b)
                for t, b, v in ((*self._texts(tid), v) for tid, v in lp.top[: self.top_logprobs])
            ]
            entries.append(TokenLogprobEntry(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=top))
        return ChoiceLogprobs(content=entries)

    def response(self, choices: list[ChoiceResult], usage: Usage) -> dict[str, Any]:
        out = [
            ChatChoice(
                index=c.index,
                message=AssistantMessage(  # with calls, content is the text before them (as vLLM's)
                    content=(c.text or None) if c.tool_calls else c.text,
                    tool_calls=c.tool_calls,
                    reasoning_content=c.reasoning,
                ),
                logprobs=self._logprobs(c.logprobs),
                finish_reason=c.finish_reason,
            )
            for c in choices
        ]
        return ChatCompletionResponse(**self._head, choices=out, usage=usage).model_dump()

    def _chunk(
        self, index: int, delta: Delta, finish_reason: str | None = None, logprobs: ChoiceLogprobs | None = None
    ) -> dict[str, Any]:
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return ChatCompletionChunk(**self._head, choices=[choice]).model_dump(exclude=self._exclude)

    def opening(self, index: int) -> list[dict[str, Any]]:
        return [self._chunk(index, Delta(role="assistant", content=""))]

    def text(
        self, index: int, text: str, logprobs: list[TokenLogprob] | None, reasoning: str = ""
    ) -> dict[str, Any] | None:
        """A delta of the content (and of the reasoning_content, when there is some); None when nothing changed."""
        shown = self._logprobs(logprobs)
        if not text and not reasoning and shown is None:
            return None
        if reasoning:
            return self._chunk(index, Delta(reasoning_content=reasoning, content=text or None), logprobs=shown)
        return self._chunk(index, Delta(content=text), logprobs=shown)

    def tool_call(self, index: int, call_index: int, call: ToolCall) -> dict[str, Any]:
        """One tool call, whole, as the deltas of its first (id, name) and its arguments."""
        delta = ToolCallDelta(
            index=call_index,
            id=call.id,
            type="function",
            function={"name": call.function.name, "arguments": call.function.arguments},
        )
        return self._chunk(index, Delta(tool_calls=[delta]))

    def finish(self, index: int, finish_reason: str) -> dict[str, Any]:
        return self._chunk(index, Delta(), finish_reason)

    def usage(self, usage: Usage) -> dict[str, Any]:
        return ChatCompletionChunk(**self._head, choices=[], usage=usage).model_dump()


class CompletionFormat(_Format):
    """Text completion responses and stream events of one request (no role event: OpenAI sends none)."""

    id_prefix = "cmpl-"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, int] = {}  # choice index -> length of its text so far (text_offset)

    def _logprobs(
        self, index: int, logprobs: list[TokenLogprob] | None, echo: Echo | None = None
    ) -> CompletionLogprobs | None:
        if self.top_logprobs is None or logprobs is None:
            return None
        tokens, values, tops, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        if echo is not None and echo.logprobs is not None:  # the prompt's first token has no logprob
            first, _ = self._texts(echo.first_token)
            tokens.append(first)
            values.append(None)
            tops.append(None)
            offsets.append(offset)
            offset += len(first)
            logprobs = [*echo.logprobs, *logprobs]
        for lp in logprobs:
            text, _ = self._texts(lp.token_id)
            tokens.append(text)
            values.append(lp.logprob)
            tops.append(self._top_by_text(lp) if self.top_logprobs else None)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)

    def _top_by_text(self, lp: TokenLogprob) -> dict[str, float]:
        """The likeliest tokens keyed by their text; tokens of the same text (U+FFFD pieces) keep the likeliest's."""
        top: dict[str, float] = {}
        for token_id, value in lp.top[: self.top_logprobs]:
            top.setdefault(self._texts(token_id)[0], value)
        return top

    def response(self, choices: list[ChoiceResult], usage: Usage) -> dict[str, Any]:
        out = []
        for c in choices:
            if c.echo is not None and c.echo.logprobs is None:
                self._offsets[c.index] = len(c.echo.text)  # offsets count in the text shown, the prompt's included
            text = c.text if c.echo is None else c.echo.text + c.text
            out.append(
                CompletionChoice(
                    index=c.index,
                    text=text,
                    logprobs=self._logprobs(c.index, c.logprobs, c.echo),
                    finish_reason=c.finish_reason,
                )
            )
        return CompletionResponse(**self._head, choices=out, usage=usage).model_dump()

    def echo(self, index: int, echo: Echo) -> dict[str, Any] | None:
        """The stream event showing the prompt (and its logprobs) before choice ``index``'s first text."""
        if echo.logprobs is None:
            self._offsets[index] = len(echo.text)
            return self._chunk(index, echo.text) if echo.text else None
        return self._chunk(index, echo.text, logprobs=self._logprobs(index, [], echo))

    def _chunk(
        self, index: int, text: str, finish_reason: str | None = None, logprobs: CompletionLogprobs | None = None
    ) -> dict[str, Any]:
        choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=logprobs)
        return CompletionResponse(**self._head, choices=[choice]).model_dump(exclude=self._exclude)

    def opening(self, index: int) -> list[dict[str, Any]]:
        return []

    def text(
        self, index: int, text: str, logprobs: list[TokenLogprob] | None, reasoning: str = ""
    ) -> dict[str, Any] | None:
        shown = self._logprobs(index, logprobs)  # completions have no reasoning to show
        if not text and shown is None:
            return None
        return self._chunk(index, text, logprobs=shown)

    def finish(self, index: int, finish_reason: str) -> dict[str, Any]:
        return self._chunk(index, "", finish_reason)

    def usage(self, usage: Usage) -> dict[str, Any]:
        return CompletionResponse(**self._head, choices=[], usage=usage).model_dump()
