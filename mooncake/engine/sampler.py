"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

A request with a seed owns a ``torch.Generator`` seeded once, so its tokens depend only
on its own logits and seed, not on which other requests share the batch. Sampling uses
the exponential race (argmax of p / Exp(1)), which draws from p with one random vector.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mooncake.engine.request import SamplingParams


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


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> list[int]:
    """Pick one token per row of ``logits`` [N, V] (float32). Called once per step."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    out: list[int] = []
    greedy = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            out.append(greedy[row])
            continue
        x = apply_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = x.softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=gen or default_generator)
        out.append(int((probs / noise).argmax()))
    return out
