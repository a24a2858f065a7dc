"""Structured output on vLLM workers: our grammars (mooncake.engine.grammar) as a vLLM v1 logits processor.

vLLM's own structured output starts a request's grammar at its first generated token.
On our workers a request's first tokens are often not vLLM's: the decode worker gets the
prefill worker's first token (and a resumed stream its earlier tokens) as part of the
prompt. This processor starts each request's matcher past those tokens
(``extra_args["mooncake_initial"]``), then advances it by every token vLLM generates, so
the constraint holds across the hand-off exactly as in our engine.

VllmEngine registers it (``logits_processors``) and sets ``extra_args`` for constrained
requests; an unconstrained request gets no per-request processor and costs nothing.
"""

from __future__ import annotations

import logging

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from mooncake.engine.grammar import Constraint, GrammarBook

log = logging.getLogger(__name__)

GRAMMAR_KEY = "mooncake_grammar"
INITIAL_KEY = "mooncake_initial"


class GrammarLogitsProcessor(AdapterLogitsProcessor):
    """Masks each constrained request's logits row with its grammar. Built by vLLM, one per engine."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self._model = vllm_config.model_config.model
        self._vocab_size = vllm_config.model_config.get_vocab_size()
        self._book: GrammarBook | None = None

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is likeliest

    def new_req_logits_processor(self, params):
        grammar = (params.extra_args or {}).get(GRAMMAR_KEY)
        if not grammar:
            return None
        if self._book is None:
            from mooncake.engine.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_dir(self._model)
            self._book = GrammarBook(tokenizer.backend.to_str(), self._vocab_size, tokenizer.eos_token_ids)
        try:
            return _Request(self._book.new(grammar, params.extra_args.get(INITIAL_KEY, ())))
        except ValueError:  # VllmEngine.add_request checked it; never raise inside vLLM's step
            log.exception("a request's grammar failed in vLLM; it runs unconstrained")
            return None


class _Request:
    """One request's constraint, called by vLLM with the tokens it generated so far and the row of logits."""

    def __init__(self, constraint: Constraint) -> None:
        self._constraint = constraint
        self._seen = 0  # of vLLM's output tokens, those the matcher consumed

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for token in output_ids[self._seen :]:
            self._constraint.accept(token)
        self._seen = len(output_ids)
        self._constraint.mask_(logits)
        return logits
