"""Constrained decoding: a request's grammar masks its logits, so its output always parses.

We use llguidance (Microsoft's, the Rust engine behind guidance, also a vLLM and SGLang
backend): no Python dependencies, a JSON schema compiles lazily (a matcher for a small
schema was ready in under a millisecond on SmolLM2's tokenizer here; masking and accepting
cost 116 µs a token in benchmarks/structured_bench.py), and a grammar it cannot handle is
an error message we can hand back as a 400.

A grammar travels as text (llguidance's grammar JSON, made by :func:`grammar_for`), so
SamplingParams stays pure and the wire carries a string. Each engine holds one
:class:`GrammarBook`: a matcher per constrained request, advanced by every token the
request gets. A matcher's state is a function of the output tokens alone, so a decode
worker taking over after the prefill's first token, or a resumed stream, rebuilds it by
replaying the request's output tokens (``add(..., output_token_ids)``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the gateway reads this module (JSON_LAYOUT, checking grammars) and does not import torch
    import torch

# JSON as Python's json.dumps writes it (a schema's "x-guidance" may say otherwise): no free whitespace, so a
# sampled output cannot wander off into blank lines.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# The schema llguidance compiles for OpenAI's ``{"type": "json_object"}``: any JSON object.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def grammar_for(
    *, json_schema: dict[str, Any] | bool | None = None, regex: str | None = None, lark: str | None = None
) -> str:
    """The grammar text of one constraint; ValueError with llguidance's reason when it cannot be compiled.

    Called by the gateway once per constrained request (it checks, so a bad schema is a 400).
    """
    import llguidance

    given = [x for x in (json_schema, regex, lark) if x is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of json_schema, regex and lark")
    try:
        if json_schema is not None:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(json_schema), defaults=JSON_LAYOUT)
        elif regex is not None:
            grammar = llguidance.LLMatcher.grammar_from_regex(regex)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise ValueError(str(e)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return grammar


class GrammarBook:
    """The matchers of one engine's constrained requests. Engine thread only.

    ``tokenizer_json`` is the Hugging Face ``tokenizers`` JSON of the model's tokenizer;
    ``vocab_size`` the width of the logits (it may exceed the tokenizer's vocabulary);
    ``eos_token_ids`` end a grammar that is complete.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        import llguidance

        self._llg = llguidance
        eos = sorted(eos_token_ids)
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size = vocab_size
        self._matchers: dict[str, Any] = {}
        self._mask = np.empty((vocab_size + 31) // 32, dtype=np.int32)

    def new(self, grammar: str, output_token_ids: Sequence[int] = ()) -> Constraint:
        """A constraint following ``grammar``, as it stands after ``output_token_ids``.

        ValueError when the grammar does not compile or those tokens break it."""
        matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {matcher.get_error()}")
        if output_token_ids and not matcher.consume_tokens([int(t) for t in output_token_ids]):
            raise ValueError(f"the tokens generated so far do not follow the grammar: {matcher.get_error()}")
        return Constraint(matcher, self._mask)

    def add(self, request_id: str, grammar: str, output_token_ids: Sequence[int] = ()) -> None:
        """Start constraining ``request_id`` (see :meth:`new`)."""
        self._matchers[request_id] = self.new(grammar, output_token_ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def mask_(self, logits: torch.Tensor, request_id: str) -> None:
        """Set to -inf, in place, every entry of one row of logits [V] the request's grammar forbids next."""
        self._matchers[request_id].mask_(logits)

    def accept(self, request_id: str, token_id: int) -> None:
        """Advance the request's matcher past the token it was given (a no-op for unconstrained requests)."""
        constraint = self._matchers.get(request_id)
        if constraint is not None:
            constraint.accept(token_id)

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)


class Constraint:
    """One request's matcher (GrammarBook.new). ``mask_`` once per step, then ``accept`` of the sampled token."""

    def __init__(self, matcher, mask: np.ndarray) -> None:
        self._matcher = matcher
        self._mask = mask  # scratch, shared by the book's constraints (one engine thread)

    def mask_(self, logits: torch.Tensor) -> None:
        """Set to -inf, in place, every entry of one row of logits [V] the grammar forbids next."""
        self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: logits.shape[-1]]
        if not allowed.any():  # the matcher failed; leave the row alone rather than sample from nothing
            return
        import torch

        logits.masked_fill_(torch.from_numpy(allowed == 0).to(logits.device), float("-inf"))

    def accept(self, token_id: int) -> None:
        if not self._matcher.is_stopped():
            self._matcher.consume_token(int(token_id))
