"""Prefill on the decode worker: when the hand-off to a decode worker costs more than it saves (issue 35).

A request's prompt can be computed in two places:

    remote   a prefill worker (the policy's choice) computes it and hands the KV over: its queue, the prefix
             transfer, its prefill, and the hand-off (the hops, the reservation, the join), which a long prompt
             hides and a short one does not
    local    the decode worker itself loads the reusable prefix from the pool node holding the longest one
             and computes the rest in its own engine, in chunks between its decode steps: no hand-off, but
             each of those steps is longer by a chunk, for every request in its batch

``estimate_local`` prices the local one on a decode instance; ``Conductor.schedule`` takes the lower
predicted TTFT of the two whose TBT stays within the SLO (``LocalPrefill.AUTO``), or one of them always.
Under ``auto`` a decode instance computes prompts only while its batch's predicted step is at most
``local_max_load`` of the TBT limit: the decode pool is what a decode-bound cluster lacks, and every chunk
lengthens every running request's step (in the simulator, with no such bound, the chunks' steps took the
decode pool's time and the requests within both SLOs fell below ``never``'s; benchmarks/README.md).

Local prefill costs, on decode instance ``d`` with batch ``(n, context)`` when it starts, whose steps may grow
to ``grown`` while the chunks ride (``step_at_cap``: its batch at the cap its own TBT budget sets; the
Conductor keeps sending it requests until then):

    chunk       the most tokens of the prompt one step computes: as many as keep a step of the grown batch with
                the costliest chunk in it (the last: it attends to the most context) within the TBT SLO (it is
                a gap between two tokens, not the mean step the headroom is for), at most the decode worker's
                step budget; the decode worker's engine holds the prompt to it. A chunk costs its tokens at
                the prefill predictor's rate without a prefill's fixed cost (the step pays its launches)
    queue_s     the local prefills already placed on ``d`` (they share its steps; drained a second a second)
    transfer_s  the prefix blocks read from the pool node (the transfer predictor)
    prefill_s   the uncached tokens at the prefill predictor's rate (scaled by ``d``'s slowdown), plus one
                decode step per chunk: the first of the batch as it is, the others of the grown batch
    tbt_s       a step of the grown batch with the costliest chunk (over the SLO only when a chunk of one token is)

Pure: no I/O, time passed in.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from conductor.admission import Batch, step_of
from conductor.index import PrefixMatch
from conductor.predictors import Predictors
from conductor.types import Instance, PrefixPlan, ScheduleRequest


class LocalPrefill(str, enum.Enum):
    AUTO = "auto"  # the lower predicted TTFT of the two, within the TBT SLO
    NEVER = "never"  # always a prefill worker (the paper's disaggregation)
    ALWAYS = "always"  # always the decode worker (where it runs our engine)


@dataclass(frozen=True, slots=True)
class LocalChoice:
    decode: Instance
    # fetch_blocks from fetch_node (the node holding the longest prefix); compute_tokens in the decode engine
    plan: PrefixPlan
    chunk_tokens: int  # the most of them one step computes
    queue_s: float
    transfer_s: float
    prefill_s: float
    tbt_s: float  # a step of the decode batch while the prompt's chunks ride on it

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.transfer_s + self.prefill_s


def can_prefill(inst: Instance) -> bool:
    """Whether a decode instance can compute a prompt itself: our engine (stock vLLM's decode workers cannot load a
    pool prefix into their own cache)."""
    return inst.engine in ("", "native")


def estimate_local(
    req: ScheduleRequest,
    decode: Instance,
    batch: Batch,
    match: PrefixMatch,
    predictors: Predictors,
    chunk_tokens: int,
    grown_step_s: float,
    tbt_slo_s: float,
) -> LocalChoice:
    """The predicted costs of computing ``req``'s prompt on ``decode`` (see the module docstring); ``batch`` is the
    decode batch it will ride on, ``chunk_tokens`` the decode engine's token budget per step, ``grown_step_s`` the step
    that batch may grow to while the chunks ride (``step_at_cap``), ``tbt_slo_s`` what a step with a chunk in it may
    take (it is a gap between two tokens of every request in the batch)."""
    node, blocks = match.best()
    blocks = min(blocks, req.prompt_tokens // req.block_tokens)
    cached = min(blocks * req.block_tokens, req.prompt_tokens - 1)  # the last prompt token is always computed
    new = req.prompt_tokens - cached
    n, context = batch
    step_s = step_of(decode, predictors.decode, n, context)  # 0 for an empty batch
    grown_s = max(step_s, grown_step_s)
    prefill = predictors.prefill
    fixed_s = float(prefill.coef[0])  # a prefill's own launches: a chunk rides on a step that pays them already

    def step_with(chunk: int) -> float:  # a step of the grown batch with the prompt's last chunk of ``chunk`` tokens
        return grown_s + (prefill.predict(req.prompt_tokens, req.prompt_tokens - chunk) - fixed_s) * decode.slowdown

    low, high = 1, max(1, min(chunk_tokens, new))  # the largest chunk within the SLO (1 when none is)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if step_with(mid) <= tbt_slo_s else (low, mid - 1)
    chunk = low
    chunks = math.ceil(new / chunk)
    # the first chunk rides on the batch as it is; the others on a batch that may have grown
    prefill_s = prefill.predict(req.prompt_tokens, cached) * decode.slowdown + step_s + (chunks - 1) * grown_s
    transfer_s = predictors.transfer.predict(blocks * predictors.block_bytes)
    plan = PrefixPlan(0, node if blocks else None, blocks, new, keep_fetched=False)
    return LocalChoice(decode, plan, chunk, decode.local_queue_s, transfer_s, prefill_s, step_with(chunk))


def step_at_cap(decode: Instance, batch: Batch, req: ScheduleRequest, predictors: Predictors, limit_s: float) -> float:
    """The step ``decode``'s batch may grow to: at its batch cap (the one it last reported, which its own TBT budget
    sets, else its registered capacity) with requests the size of those running (``req``'s, in an empty batch),
    at most ``limit_s`` (the Conductor admits no more than that)."""
    cap = decode.load.batch_cap or decode.capacity
    if not cap:
        return limit_s
    n, context = batch
    per_request = context / n if n >= 1 else req.prompt_tokens + req.expected_output_tokens // 2
    return min(limit_s, step_of(decode, predictors.decode, cap, cap * per_request))
