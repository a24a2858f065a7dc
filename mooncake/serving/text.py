"""A request's output text: the one incremental detokenizer, for every engine and path (vLLM's OutputProcessor shape).

Engines emit token ids and decide what ends a request by its tokens (EOS, stop token ids, max_tokens: the scheduler's
``token_finish``). Text is made here, once per request, as its outputs arrive, whether our engine or vLLM computed
them, on a decode worker (handed over or computed there: the prefill's first token is one more output) or on one
engine behind the gateway (``--local``):

    text = OutputText(tokenizer, prompt_ids, params)
    piece = text.add(out)     -> Piece: the text safe to show now, and the end, if this output ends the request
    if piece.stop is not None: ...the engine still runs it: abort it there...

Stop strings are found here (never by an engine): a stop string completed at the text's end starts at most
``max(len(stop)) - 1`` characters before it, and one that started earlier would have been found already, so that many
characters are held back while the request runs, and what was shown is always a prefix of the final text. The final
text is cut before the stop string (after it with ``include_stop_str_in_output``); a request that ends otherwise shows
its whole output decoded once, except the token that ended it (EOS, a stop token id), which shows only with
``include_stop_str_in_output``, as vLLM does.

A resumed stream (another decode worker streamed ``output_ids`` and ``shown`` characters of their text before it died)
starts from there: only the text after them comes out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mooncake.engine.engine import RequestOutput
from mooncake.engine.request import FinishReason, SamplingParams
from mooncake.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True, slots=True)
class Piece:
    """What one output adds: ``text`` to show now; ``finish`` and ``stop_reason`` when the request ended with it;
    ``num_tokens``: how many of its new tokens count (all, unless a stop string ended it at an earlier one)."""

    text: str
    finish: FinishReason | None = None
    stop_reason: int | str | None = None
    num_tokens: int = 0

    @property
    def stop(self) -> str | None:
        """The stop string that ended the request here (its engine may still be running it), else None."""
        return self.stop_reason if isinstance(self.stop_reason, str) else None


def match_stop_string(text: str, previous_text: str, params: SamplingParams) -> tuple[str, str | None]:
    """Find the earliest of ``params.stop`` in ``text`` (all output decoded); return (text to show, the stop or None).

    The text is cut before the stop string (or after it, with ``include_stop_str_in_output``).
    Only the tail is searched: ``previous_text``, the text shown after the last token, held
    no match. ``OutputText`` calls this once per generated token of a request with stops.
    """
    window = max(len(s) for s in params.stop) + 16
    start = max(0, len(previous_text) - window)
    best = None
    for s in params.stop:
        at = text.find(s, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, s)
    if best is None:
        return text, None
    at, s = best
    return (text[: at + len(s)] if params.include_stop_str_in_output else text[:at]), s


class OutputText:
    """One request's text. Not thread-safe: one consumer."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        output_ids: Sequence[int] = (),
        shown: int = 0,
    ) -> None:
        self.params = params
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._text = ""  # everything decoded so far
        self._shown = 0  # characters of it already returned
        self.done = False
        # one id at a time, as the worker that streamed them pushed them: the detokenizer's pieces depend on how the ids
        # are split (a byte-fallback character cut across tokens), and ``shown`` counts the pieces' text
        for token in output_ids:
            self._text += self._detok.push([token])
        self._shown = min(shown, len(self._text))

    @property
    def text(self) -> str:
        """Everything decoded so far (shown or held back)."""
        return self._text

    def add(self, out: RequestOutput) -> Piece:
        """The text of ``out``'s new tokens (see the module docstring). Nothing more comes out once the request
        ended (a stop string found here ends it before its engine does)."""
        if self.done:
            return Piece("")
        new = list(out.new_token_ids)
        by_token = out.finished and isinstance(out.stop_reason, int)
        for n, token in enumerate(new, 1):
            previous = self._text
            if by_token and n == len(new) and not self.params.include_stop_str_in_output:
                break  # the ending token's text shows only with include_stop_str_in_output
            self._text += self._detok.push([token])
            if self.params.stop:
                cut, stop = match_stop_string(self._text, previous, self.params)
                if stop is not None:
                    return self._end(cut, FinishReason.STOP, stop, n)
        if out.finished:  # the whole output decoded once (a character the prompt's last bytes began is its own here)
            shown_ids = out.output_token_ids[:-1] if by_token and not self.params.include_stop_str_in_output else None
            final = self._tokenizer.decode(
                shown_ids if shown_ids is not None else out.output_token_ids, self.params.skip_special_tokens
            )
            return self._end(final, out.finish_reason, out.stop_reason, len(new))
        return Piece(self._reveal(len(self._text) - self._hold), num_tokens=len(new))

    def _end(self, final: str, finish: FinishReason | None, stop_reason, num_tokens: int) -> Piece:
        self.done = True
        return Piece(final[self._shown :], finish, stop_reason, num_tokens)

    def _reveal(self, safe: int) -> str:
        if safe <= self._shown:
            return ""
        piece = self._text[self._shown : safe]
        self._shown = safe
        return piece


def generate_text(engine, prompts: Iterable[Sequence[int]], params: SamplingParams, tokenizer: Tokenizer) -> list:
    """Run ``prompts`` to completion on ``engine`` (ours, offline), with stop strings: [(token ids, text, finish, stop
    reason)] in input order, as a server streams them."""
    texts, final = {}, {}
    for prompt in prompts:
        rid = engine.add_request(list(prompt), params)
        texts[rid] = (OutputText(tokenizer, prompt, params), [], [])
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in final:
                continue
            text, ids, shown = texts[out.request_id]
            piece = text.add(out)
            ids.extend(out.new_token_ids[: piece.num_tokens])
            shown.append(piece.text)
            if piece.finish is not None:
                final[out.request_id] = (ids, "".join(shown), piece.finish, piece.stop_reason)
                if piece.stop is not None:
                    engine.abort_request(out.request_id)
    return [final[rid] for rid in texts]
