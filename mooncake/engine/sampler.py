"""Token sampling: penalties and biases, then greedy, temperature, min-p, top-k, top-p, with per-request seeded
generators.

A request with a seed owns a ``torch.Generator`` seeded once, so its tokens depend only
on its own logits and seed, not on which other requests share the batch. Sampling uses
the exponential race (argmax of p / Exp(1)), which draws from p with one random vector.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mooncake.engine.request import SamplingParams, TokenLogprob


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus. logits: [V]."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top one always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens less likely than ``min_p`` times the likeliest one (vLLM's min-p). logits: [V],
    after temperature. The likeliest token always stays."""
    if min_p <= 0:
        return logits
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
    cut = logits.max() + math.log(min_p)
    return logits.masked_fill(logits < cut, float("-inf"))


@dataclass(frozen=True, slots=True)
class History:
    """What a request's logits processing reads: its prompt, what it generated so far, its end tokens."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class TokenCounts:
    """A request's tokens as its penalties read them, on the device: which its prompt and outputs hold, how often it
    generated each, and how many of its outputs are counted."""

    seen: torch.Tensor  # [V] bool
    generated: torch.Tensor  # [V] int32
    outputs: int = 0

    @classmethod
    def of(cls, history: History, vocab: int, device: torch.device | str = "cpu") -> TokenCounts:
        counts = cls(
            torch.zeros(vocab, dtype=torch.bool, device=device), torch.zeros(vocab, dtype=torch.int32, device=device)
        )
        counts.seen[_ids(history.prompt_token_ids, vocab, device)] = True
        return counts.add(history.output_token_ids)

    def add(self, outputs: Sequence[int]) -> TokenCounts:
        """Count the outputs past those counted already (usually one token a step)."""
        new = _ids(outputs[self.outputs :], self.seen.shape[0], self.seen.device)
        self.seen[new] = True
        self.generated.index_put_((new,), torch.ones_like(new, dtype=torch.int32), accumulate=True)
        self.outputs = len(outputs)
        return self


def _ids(tokens: Sequence[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    ids = torch.tensor(list(tokens), dtype=torch.long)
    return ids[(ids >= 0) & (ids < vocab)].to(device)


class PenaltyBook:
    """Each penalized request's TokenCounts, kept from step to step and grown by its new tokens only: a step's penalties
    are then a few tensor operations a row, where each row built a Python set of its whole prompt every step."""

    def __init__(self, vocab: int, device: torch.device | str = "cpu") -> None:
        self.vocab, self.device = vocab, device
        self._counts: dict[str, TokenCounts] = {}

    def counts(self, request_id: str, history: History) -> TokenCounts:
        c = self._counts.get(request_id)
        if c is None or len(history.output_token_ids) < c.outputs:  # new, or its outputs were taken back: afresh
            self._counts[request_id] = TokenCounts.of(history, self.vocab, self.device)
            return self._counts[request_id]
        return c.add(history.output_token_ids)

    def drop(self, request_id: str) -> None:
        self._counts.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._counts)


def shape_logits(
    logits: torch.Tensor, p: SamplingParams, history: History, counts: TokenCounts | None = None
) -> torch.Tensor:
    """Apply ``p``'s penalties, biases and ``min_tokens`` to one row of logits [V] (a new tensor), in vLLM's order:
    repetition penalty (prompt and output tokens), then frequency and presence (output tokens), then the biases,
    then the ban on ending before ``min_tokens``. ``counts``: the request's, kept by a PenaltyBook (else counted
    from ``history`` here)."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    if p.penalizes and counts is None:
        counts = TokenCounts.of(history, vocab, logits.device)
    if p.repetition_penalty != 1.0:
        logits = torch.where(
            counts.seen, torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty), logits
        )
    if p.frequency_penalty or p.presence_penalty:
        g = counts.generated.to(logits.dtype)
        logits -= p.frequency_penalty * g + p.presence_penalty * (counts.generated > 0).to(logits.dtype)
    for token, bias in p.logit_bias:
        if 0 <= token < vocab:
            logits[token] += bias
    if len(history.output_token_ids) < p.min_tokens:
        ends = [t for t in (*p.stop_token_ids, *(() if p.ignore_eos else history.eos_token_ids)) if 0 <= t < vocab]
        if ends:
            logits[torch.tensor(ends, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
    histories: Sequence[History] | None = None,
    counts: Sequence[TokenCounts | None] | None = None,
) -> list[int]:
    """Pick one token per row of ``logits`` [N, V] (float32). Called once per step.

    ``histories`` (one per row) are needed only when some request shapes its logits; ``counts`` (a PenaltyBook's, one
    per row or None) spare counting a penalized row's tokens again."""
    if any(p.shapes_logits for p in params):
        if histories is None:
            raise ValueError("penalties, biases and min_tokens need each request's history")
        counts = counts or [None] * len(params)
        logits = torch.stack(
            [
                shape_logits(row, p, h, c) if p.shapes_logits else row
                for row, p, h, c in zip(logits, params, histories, counts)
            ]
        )
    picked = logits.argmax(dim=-1)  # [N], on the device: greedy rows keep it
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    if drawn:
        choices = []
        for row in drawn:  # per row: each request's own generator draws one noise vector over the vocabulary
            p = params[row]
            x = apply_top_k_top_p(apply_min_p(logits[row] / p.temperature, p.min_p), p.top_k, p.top_p)
            probs = x.softmax(-1)
            noise = torch.empty_like(probs).exponential_(generator=generators[row] or default_generator)
            choices.append((probs / noise).argmax())
        picked = picked.index_put((torch.tensor(drawn, device=logits.device),), torch.stack(choices))
    return picked.tolist()  # the step's one wait on the device


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], tops: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """Each row's token's log-probability and its ``tops[row]`` likeliest, from the raw logits [N, V] (before
    penalties, temperature and grammar masks, as vLLM reports by default); None for rows whose ``tops`` is None."""
    out: list[TokenLogprob | None] = [None] * len(tops)
    rows = [i for i, k in enumerate(tops) if k is not None]
    if not rows:
        return out
    lp = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)].float().log_softmax(-1)
    k = max(tops[i] or 0 for i in rows)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    chosen = (
        lp.gather(1, torch.tensor([[tokens[i]] for i in rows], dtype=torch.long, device=lp.device)).squeeze(1).tolist()
    )
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(rows):
        n = tops[i] or 0
        out[i] = TokenLogprob(int(tokens[i]), chosen[j], tuple(zip(top_i[j][:n], top_v[j][:n])))
    return out
