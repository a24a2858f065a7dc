"""Streaming a request's text as its tokens arrive, without ever showing a stop string.

The engine finds stop strings (engine.py cuts ``output_text`` before the first one and
finishes the request); while the request runs, text that could be the start of a stop
string is held back, so what was streamed is always a prefix of the final text:

    stream = TextStream(tokenizer, prompt_ids, stop=("\\n\\n",))
    stream.push(new_ids)          -> text safe to show now ("" while held back)
    stream.finish(final_text)     -> the rest of the final text

A stop string completed at the text's end starts at most ``max(len(stop)) - 1``
characters before it, and one that started earlier would have been found already, so
holding back that many characters is enough.
"""

from __future__ import annotations

from collections.abc import Sequence

from mooncake.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """One request's streamed text. Not thread-safe: one consumer."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        output_ids: Sequence[int] = (),
        shown: int = 0,
        skip_special_tokens: bool = True,
    ) -> None:
        """``output_ids`` and ``shown``: a resumed stream, whose tokens so far and ``shown`` characters of
        their text were already returned (by another worker); only the text after that comes out.
        ``skip_special_tokens``: the request's (SamplingParams), whether special tokens' text is left out."""
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""  # everything decoded so far
        self._shown = 0  # characters of it already returned
        if output_ids:
            # one id at a time, as the worker that streamed them pushed them: the detokenizer's pieces depend on how
            # the ids are split (a byte-fallback character cut across tokens), and ``shown`` counts the pieces' text
            for token in output_ids:
                self.add([token])
            self._shown = min(shown, len(self._text))

    @classmethod
    def of_request(
        cls, tokenizer: Tokenizer, prompt_ids: Sequence[int], params, output_ids: Sequence[int], shown: int
    ) -> "TextStream":
        """The stream of a request sampled with ``params`` (SamplingParams: its stop strings and
        skip_special_tokens), resumed after ``output_ids`` and ``shown`` characters (see ``__init__``)."""
        return cls(tokenizer, prompt_ids, params.stop, output_ids, shown, params.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the new text that can be shown."""
        self.add(token_ids)
        return self.reveal()

    def add(self, token_ids: Sequence[int]) -> None:
        """Decode generated ids without showing anything yet (``text`` then holds them: check it for stops)."""
        self._text += self._detok.push(token_ids)

    def reveal(self) -> str:
        """The text that can be shown now and was not yet."""
        safe = len(self._text) - self._hold
        if safe <= self._shown:
            return ""
        piece = self._text[self._shown : safe]
        self._shown = safe
        return piece

    def finish(self, final_text: str | None = None) -> str:
        """The rest: of ``final_text`` (the engine's, cut at a stop string) or of everything decoded."""
        if final_text is None:
            self._text += self._detok.flush()
            final_text = self._text
        piece = final_text[self._shown :]
        self._shown = len(final_text)
        return piece

    @property
    def text(self) -> str:
        """Everything decoded so far (shown or held back)."""
        return self._text

    @property
    def shown(self) -> int:
        return self._shown
