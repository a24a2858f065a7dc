"""Prefill placement policies: pure functions of (request, instances, prefix match, predictors).

    random              any alive prefill instance
    round_robin         the next one in turn
    least_loaded        the shortest predicted queue (the paper's "load balancing")
    cache_aware_local   the lowest TTFT counting only the instance's own cached prefix
    kvcache_centric     Algorithm 1 (DESIGN §5): an instance may fetch the longest prefix
                        held anywhere when it is more than ``kvcache_balancing_threshold``
                        times its own; the fetched blocks stay there (hot blocks replicate)

Every policy reuses the chosen instance's own cached prefix. With ``tier_aware`` (our
addition, not in the paper), a prefix block on SSD is priced by its load time, and an
instance stops its prefix where loading the rest would cost more than recomputing it.

**The queue is packed** (``pack``), as the engine runs it: a prefill worker's engine
computes its prompts in steps of up to its step budget (``Instance.capacity``), chunk by
chunk, first come first served, several prompts sharing a step. So a request's first
token comes when the step holding its last token ends: the fixed cost of a step is paid
once a step, not once a prompt, and its first chunk rides on the step after the last
full one ahead of it. The queue's tokens come from the worker's heartbeat
(``Load.queued_tokens``) plus what was placed since. A worker that does not report them,
and a pipeline group, are predicted first come first served over whole prompts.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import random
from dataclasses import dataclass

from pydantic import BaseModel, Field

from conductor.index import PrefixMatch
from conductor.predictors import Predictors
from conductor.types import Instance, PrefixPlan, ScheduleRequest


class PolicyKind(str, enum.Enum):
    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    CACHE_AWARE_LOCAL = "cache_aware_local"
    KVCACHE_CENTRIC = "kvcache_centric"


class PolicyConfig(BaseModel):
    kvcache_balancing_threshold: float = Field(
        1.5, ge=1.0, description="fetch the best prefix when it is this many times the local one"
    )
    tier_aware: bool = Field(
        False, description="price SSD-resident prefix blocks by their load time (kvcache_centric, cache_aware_local)"
    )
    ssd_bytes_per_s: float = Field(2e9, gt=0, description="SSD read bandwidth, for tier_aware")
    seed: int = 0


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    instance: Instance
    plan: PrefixPlan
    queue_s: float  # until its first chunk's step starts
    transfer_s: float
    prefill_s: float  # from then to its first token
    work_s: float = -1.0  # what it adds to the instance's queue: its own prefill and prefix transfer (-1: those two)

    @property
    def own_s(self) -> float:
        """Its own prefill and prefix transfer, alone (what it adds to the instance's queue)."""
        return self.work_s if self.work_s >= 0 else self.prefill_s + self.transfer_s

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.transfer_s + self.prefill_s


def estimate(
    inst: Instance,
    req: ScheduleRequest,
    local_blocks: int,
    fetch_node: str | None,
    fetch_blocks: int,
    predictors: Predictors,
    load_s: float = 0.0,
) -> PrefillChoice:
    """The TTFT parts for ``inst`` reusing ``local_blocks`` and fetching ``fetch_blocks`` from ``fetch_node``.

    At least one token is always computed (the first output token needs the last prompt
    token's hidden state), so a fully cached prompt still costs one token of prefill.
    """
    reused = local_blocks + fetch_blocks
    cached = min(reused * req.block_tokens, req.prompt_tokens - 1)
    transfer_s = predictors.transfer.predict(fetch_blocks * predictors.block_bytes) + load_s
    prefill_s = (
        predictors.prefill_for(inst.pipeline_stages, inst.pipeline_chunk).predict(req.prompt_tokens, cached)
        * inst.slowdown
    )
    plan = PrefixPlan(local_blocks, fetch_node if fetch_blocks else None, fetch_blocks, req.prompt_tokens - cached)
    queue_s, packed_s = pack(inst, plan.compute_tokens, inst.load.queued_s, prefill_s, predictors)
    return PrefillChoice(inst, plan, queue_s, transfer_s, packed_s, prefill_s + transfer_s)


def pack(
    inst: Instance, new_tokens: int, queue_s: float, prefill_s: float, predictors: Predictors
) -> tuple[float, float]:
    """(queue, prefill) of a request of ``new_tokens`` placed behind ``inst``'s queue (``queue_s`` of predicted
    prefill, one prompt after the other; ``prefill_s`` its own, alone), in its engine's packed steps.

    With ``B`` the step budget, ``R`` the queue's tokens, ``k`` its prompts and ``c0`` a
    step's fixed cost (the prefill predictor's constant, at the instance's slowdown): the
    whole is ``queue_s + prefill_s`` less ``k + 1`` prompts' fixed costs plus one per step,
    ``ceil((R + new) / B)`` steps; the queue is the ``floor(R / B)`` steps before the one its
    first chunk rides on, each a fixed cost and ``B`` tokens at the whole's mean per token.
    """
    budget, ahead = inst.capacity, inst.load.queued_tokens
    if inst.pipeline_stages > 1 or budget <= 0 or ahead <= 0 or queue_s <= 0.0:
        return queue_s, prefill_s
    c0 = predictors.prefill.coef[0] * inst.slowdown
    steps = -(-(ahead + new_tokens) // budget)
    whole = max(queue_s + prefill_s - c0 * (max(inst.load.queued_requests, 1) + 1) + c0 * steps, c0 * steps)
    per_token = (whole - c0 * steps) / (ahead + new_tokens)
    queue = (ahead // budget) * (c0 + budget * per_token)
    return queue, whole - queue


def ahead_of_queue(instances: list[Instance]) -> list[Instance]:
    """``instances`` as a retry meets them (``Decision.ahead``: its prefill worker's engine takes it before the prompts
    waiting there): it waits for the prompt in progress only, counted as one prompt's share of the queue. Copies; the
    instances themselves are untouched."""
    seen = []
    for inst in instances:
        k = inst.load.queued_requests
        if k > 1:
            load = dataclasses.replace(
                inst.load,
                queued_s=inst.load.queued_s / k,
                queued_tokens=inst.load.queued_tokens // k,
                queued_requests=1,
            )
            inst = dataclasses.replace(inst, load=load)
        seen.append(inst)
    return seen


class PrefillPolicy(abc.ABC):
    kind: PolicyKind

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def choose(
        self, req: ScheduleRequest, candidates: list[Instance], match: PrefixMatch, predictors: Predictors
    ) -> PrefillChoice:
        """Pick one of ``candidates`` (non-empty, all alive prefill instances) and its prefix plan."""

    def _local(self, inst: Instance, req: ScheduleRequest, match: PrefixMatch, predictors: Predictors) -> PrefillChoice:
        """``inst`` reusing its own node's prefix (tier-aware: only as far as loading beats recomputing)."""
        blocks = match.blocks(inst.node)
        if not self.config.tier_aware:
            return estimate(inst, req, blocks, None, 0, predictors)
        leading_dram = min(match.dram_blocks(inst.node), blocks)
        options = [estimate(inst, req, leading_dram, None, 0, predictors)]  # stop where SSD starts
        on_ssd = blocks - match.dram_count(inst.node, 0, blocks)
        if blocks > leading_dram:  # or read the SSD blocks of the whole prefix
            options.append(estimate(inst, req, blocks, None, 0, predictors, load_s=self._ssd_s(on_ssd, predictors)))
        return min(options, key=lambda c: c.ttft_s)

    def _ssd_s(self, blocks: int, predictors: Predictors) -> float:
        return blocks * predictors.block_bytes / self.config.ssd_bytes_per_s


class RandomPolicy(PrefillPolicy):
    kind = PolicyKind.RANDOM

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._rng = random.Random(config.seed)

    def choose(self, req, candidates, match, predictors):
        return self._local(self._rng.choice(candidates), req, match, predictors)


class RoundRobinPolicy(PrefillPolicy):
    kind = PolicyKind.ROUND_ROBIN

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._turn = 0

    def choose(self, req, candidates, match, predictors):
        ordered = sorted(candidates, key=lambda i: i.id)
        inst = ordered[self._turn % len(ordered)]
        self._turn += 1
        return self._local(inst, req, match, predictors)


class LeastLoadedPolicy(PrefillPolicy):
    kind = PolicyKind.LEAST_LOADED

    def choose(self, req, candidates, match, predictors):
        inst = min(candidates, key=lambda i: (i.load.queued_s, i.load.queued_requests, i.id))
        return self._local(inst, req, match, predictors)


def _cheapest(candidates: list[Instance], key, cost, predictors: Predictors) -> PrefillChoice:
    """The candidate with the lowest TTFT, where ``cost(inst)`` is computed once per distinct ``key(inst)``.

    Instances that hold the same prefix differ only in their queues, and most of 64
    instances hold none of a given prompt, so a Schedule costs a few predictions, not 64.
    """
    parts: dict = {}
    best = best_part = None
    for inst in candidates:
        k = key(inst), inst.pipeline_stages, inst.pipeline_chunk  # a pipeline group predicts its own prefill
        c = parts.get(k)
        if c is None:
            c = parts[k] = cost(inst)
        own_s = (c.own_s - c.transfer_s) * inst.slowdown / c.instance.slowdown  # ``cost`` scaled it by its instance's
        queue_s, prefill_s = pack(inst, c.plan.compute_tokens, inst.load.queued_s, own_s, predictors)
        score = (queue_s + c.transfer_s + prefill_s, inst.id)
        if best is None or score < best:
            best, best_part = (
                score,
                dataclasses.replace(
                    c, instance=inst, queue_s=queue_s, prefill_s=prefill_s, work_s=own_s + c.transfer_s
                ),
            )
    return best_part


class CacheAwareLocalPolicy(PrefillPolicy):
    kind = PolicyKind.CACHE_AWARE_LOCAL

    def choose(self, req, candidates, match, predictors):
        if self.config.tier_aware:  # prices depend on where inside a prefix the SSD blocks are: one per instance
            key = lambda i: i.node
        else:
            key = lambda i: (match.blocks(i.node), match.dram_blocks(i.node))
        return _cheapest(candidates, key, lambda i: self._local(i, req, match, predictors), predictors)


class KVCacheCentricPolicy(PrefillPolicy):
    """Algorithm 1: min over instances of T_queue + T_transfer + T_prefill, fetching the best prefix when worth it."""

    kind = PolicyKind.KVCACHE_CENTRIC

    def choose(self, req, candidates, match, predictors):
        threshold = self.config.kvcache_balancing_threshold
        tier_aware = self.config.tier_aware
        top_node, top_len = match.best()
        runner_up = match.best(exclude=top_node) if tier_aware else (None, 0)

        def source(inst: Instance) -> tuple[str | None, int]:
            # Algorithm 1 fetches from the longest holder, which may be the instance's own node
            # (then nothing is fetched); tier-aware, from the longest *other* holder, since its
            # DRAM may beat reading this node's own SSD
            if tier_aware and inst.node == top_node:
                return runner_up
            return top_node, top_len

        def cost(inst: Instance) -> PrefillChoice:
            local = self._local(inst, req, match, predictors)
            if tier_aware:
                return self._tier_aware_cost(inst, req, match, predictors, local, *source(inst))
            own = local.plan.local_blocks
            fetch = (
                top_node is not None
                and top_node != inst.node
                and top_len > own
                and (own == 0 or top_len / own > threshold)
            )
            if not fetch:
                return local
            return estimate(inst, req, own, top_node, top_len - own, predictors)

        if tier_aware:  # prices depend on where inside a prefix the SSD blocks are: one per instance
            return _cheapest(candidates, lambda i: i.node, cost, predictors)
        held, dram = match.any_tier.get, match.dram.get  # plain dict lookups: this runs for every instance
        return _cheapest(candidates, lambda i: (held(i.node, 0), dram(i.node, 0), i.node == top_node), cost, predictors)

    def _tier_aware_cost(
        self, inst, req, match, predictors, local: PrefillChoice, src: str | None, src_len: int
    ) -> PrefillChoice:
        """The cheapest of: the local plan, or fetching from ``src`` whatever this node lacks, or also what it has only
        on SSD."""
        options = [local]
        if src is None or src == inst.node:
            return local
        blocks = match.blocks(inst.node)
        for start in {min(match.dram_blocks(inst.node), blocks), blocks}:
            if src_len <= start:
                continue
            own_ssd = start - match.dram_count(inst.node, 0, start)  # read from this node's SSD
            src_ssd = (src_len - start) - match.dram_count(src, start, src_len)  # read from the holder's SSD, then sent
            options.append(
                estimate(
                    inst,
                    req,
                    start,
                    src,
                    src_len - start,
                    predictors,
                    load_s=self._ssd_s(own_ssd + src_ssd, predictors),
                )
            )
        return min(options, key=lambda c: c.ttft_s)


POLICIES: dict[PolicyKind, type[PrefillPolicy]] = {
    p.kind: p for p in (RandomPolicy, RoundRobinPolicy, LeastLoadedPolicy, CacheAwareLocalPolicy, KVCacheCentricPolicy)
}


def make_policy(kind: PolicyKind | str, config: PolicyConfig | None = None) -> PrefillPolicy:
    try:
        kind = PolicyKind(kind)
    except ValueError:
        raise ValueError(f"unknown policy {kind!r}; choose from {', '.join(k.value for k in PolicyKind)}") from None
    return POLICIES[kind](config or PolicyConfig())
