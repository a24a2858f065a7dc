"""Token sampling: penalties and biases, then greedy, temperature, top-k, top-p, with per-request seeded generators.

A request with a seed owns a ``torch.Generator`` seeded once, so its tokens depend only
on its own logits and seed, not on which other requests share the batch. Sampling uses
the exponential race (argmax of p / Exp(1)), which draws from p with one random vector.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class History:
    """What a request's logits processing reads: its prompt, what it generated so far, its end tokens."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int] = frozenset()


def shape_logits(logits: torch.Tensor, p: SamplingParams, history: History) -> torch.Tensor:
    """Apply ``p``'s penalties, biases and ``min_tokens`` to one row of logits [V] (a new tensor), in vLLM's order:
    repetition penalty (prompt and output tokens), then frequency and presence (output tokens), then the biases,
    then the ban on ending before ``min_tokens``."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted({t for t in (*history.prompt_token_ids, *history.output_token_ids) if t < vocab}), dtype=torch.long
        )
        if len(seen):
            x = logits[seen]
            logits[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and history.output_token_ids:
        outputs = torch.tensor(list(history.output_token_ids), dtype=torch.long, device=logits.device)
        counts = torch.bincount(outputs, minlength=vocab)[:vocab]
        logits -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty * (counts > 0).to(logits.dtype)
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
) -> list[int]:
    """Pick one token per row of ``logits`` [N, V] (float32). Called once per step.

    ``histories`` (one per row) are needed only when some request shapes its logits."""
    if any(p.shapes_logits for p in params):
        if histories is None:
            raise ValueError("penalties, biases and min_tokens need each request's history")
        logits = torch.stack(
            [shape_logits(row, p, h) if p.shapes_logits else row for row, p, h in zip(logits, params, histories)]
        )
    picked = logits.argmax(dim=-1)  # [N], on the device: greedy rows keep it
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    if drawn:
        choices = []
        for row in drawn:  # per row: each request's own generator draws one noise vector over the vocabulary
            p = params[row]
            x = apply_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
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
