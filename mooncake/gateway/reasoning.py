"""Reasoning output: the model's ``<think>...</think>`` apart from its answer, as vLLM's ``reasoning_content``.

Two families, as vLLM's reasoning parsers name them:

- ``qwen3``: the model writes ``<think>reasoning</think>answer``; an output that does not
  open with ``<think>`` is all answer (Qwen3 with ``enable_thinking: false``, whose template
  closes an empty think block in the prompt).
- ``deepseek_r1``: the chat template opens ``<think>`` itself, so the output is
  ``reasoning</think>answer``; everything before ``</think>`` is reasoning (a leading
  ``<think>`` the model repeats is dropped).

Either way, a prompt whose text ends with ``<think>`` (the template opened it) starts the
output in reasoning. A reasoning without its ``</think>`` (cut by max_tokens) stays
reasoning. Newlines around the tags are dropped.

``ReasoningSplit`` is one choice's state, fed the text as it streams (``push``) and ended
with ``finish``; a non-streamed response feeds it the whole text at once, so both show the
same split. Pure: no I/O, no tokenizer.
"""

from __future__ import annotations

import enum

from mooncake.engine.tokenizer import Tokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningParser(str, enum.Enum):
    """The gateway's ``--reasoning-parser``: which family, or ``auto`` (from the model's tokenizer)."""

    AUTO = "auto"
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"
    NONE = "none"


def resolve(choice: ReasoningParser, tokenizer: Tokenizer) -> ReasoningParser:
    """The family to serve: ``choice``, or for ``auto`` the one the model's tokenizer and chat template show (NONE
    when it has no ``<think>`` tokens). Called once, when the app is built."""
    if choice != ReasoningParser.AUTO:
        return choice
    template = tokenizer.chat_template or ""
    has_tokens = tokenizer.token_to_id(THINK_OPEN) is not None and tokenizer.token_to_id(THINK_CLOSE) is not None
    if not has_tokens and THINK_CLOSE not in template:
        return ReasoningParser.NONE
    if "<｜Assistant｜>" in template:  # DeepSeek's template, which opens <think> in later releases
        return ReasoningParser.DEEPSEEK_R1
    return ReasoningParser.QWEN3


def opens_reasoning(parser: ReasoningParser, prompt_text: str) -> bool:
    """Whether the output starts inside the reasoning: the family's rule, or the prompt opened ``<think>``."""
    return parser == ReasoningParser.DEEPSEEK_R1 or prompt_text.rstrip().endswith(THINK_OPEN)


class _State(enum.Enum):
    START = "start"  # nothing decided: the output may open with <think>
    REASONING = "reasoning"
    CONTENT = "content"


def _held_tail(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag`` (kept back until the next text)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplit:
    """One choice's output split into reasoning and content as it streams. Not thread-safe: one consumer."""

    def __init__(self, in_reasoning: bool) -> None:
        """``in_reasoning``: the output starts inside the reasoning (``opens_reasoning``)."""
        self._default = _State.REASONING if in_reasoning else _State.CONTENT
        self._state = _State.START
        self._held = ""
        self._reasoning_shown = False  # leading newlines of the reasoning are dropped
        self._content_strip = False  # after </think>: leading newlines of the answer are dropped

    def push(self, text: str) -> tuple[str, str]:
        """Add the next text; the (reasoning, content) that can be shown now."""
        self._held += text
        reasoning = content = ""
        if self._state == _State.START:
            head = self._held.lstrip()
            if THINK_OPEN.startswith(head) and head != THINK_OPEN:
                return "", ""  # may still become <think>
            if head.startswith(THINK_OPEN):
                self._held, self._state = head[len(THINK_OPEN) :], _State.REASONING
            else:
                self._state = self._default
        if self._state == _State.REASONING:
            if not self._reasoning_shown:
                self._held = self._held.lstrip("\n")
            at = self._held.find(THINK_CLOSE)
            if at == -1:
                keep = _held_tail(self._held, THINK_CLOSE)
                shown = self._held[: len(self._held) - keep]
                shown = shown.rstrip()  # trailing whitespace waits: it may be the last before </think>
                reasoning, self._held = shown, self._held[len(shown) :]
                self._reasoning_shown |= bool(reasoning)
                return reasoning, ""
            reasoning = self._held[:at].rstrip()
            self._held, self._state, self._content_strip = self._held[at + len(THINK_CLOSE) :], _State.CONTENT, True
        if self._state == _State.CONTENT:
            if self._content_strip:
                self._held = self._held.lstrip()
                self._content_strip = not self._held
            content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The (reasoning, content) still held back, at the end of the output."""
        if self._state == _State.START:
            self._state = self._default
            if self._default == _State.REASONING:
                self._held = self._held.lstrip("\n")
        held, self._held = self._held, ""
        if self._state == _State.REASONING:
            return held.rstrip(), ""
        return "", held.lstrip() if self._content_strip else held


def split(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """A whole output's (reasoning or None when there is none, content)."""
    s = ReasoningSplit(in_reasoning)
    r1, c1 = s.push(text)
    r2, c2 = s.finish()
    reasoning = r1 + r2
    return (reasoning or None), c1 + c2
