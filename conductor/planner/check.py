"""What a plan is made from, and how it is checked: the Conductor's state as the planner reads it, and the twin.

    snapshot(planner, conductor, now)       under the Conductor's lock: the window's requests, the learnt
                                            predictors, the pools' counts (conductor.planner.planner.Snapshot)
    twin_check(snapshot, rate, P, D)        outside it: the window's requests replayed at ``rate`` on P prefill
                                            and D decode instances of the twin (conductor.planner.twin), which
                                            runs the Conductor's own decisions on costs that are the Conductor's
                                            learnt predictors (``LearntCosts``), not a hardware model

The twin starts empty but for its pool nodes' caches: each request's prefix that its real placement found
in the pool is put in the twin's pool first (the prefixes of one root on one node, as cache-aware
placement keeps them), so the twin's prompts reuse what the real ones did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from conductor.core import Conductor
from conductor.planner.costs import ModelConfig
from conductor.planner.planner import Plan, Planner, Snapshot, TwinOutcome
from conductor.planner.sizing import StepModel
from conductor.planner.state import SimConfig, TraceRequest
from conductor.planner.twin import Cluster
from conductor.predictors import PredictorConfig
from conductor.types import InstanceState, KeyChain, Role

TWIN_REQUESTS = 800  # the most recent requests of the window the twin replays (a run of 800 takes about 0.3 s)


@dataclass(frozen=True)
class LearntCosts(ModelConfig):
    """The twin's costs: the Conductor's learnt predictors in the cost model's shapes (conductor.planner.costs)."""

    prefill_linear_s: float = 1 / 8000
    prefill_pair_s: float = 0.0
    step_base_s: float = 0.02
    step_per_token_s: float = 2e-8
    kv_tokens: int = 1 << 20

    @property
    def prefill_s_per_token(self) -> float:
        return self.prefill_linear_s

    @property
    def prefill_s_per_token_pair(self) -> float:
        return self.prefill_pair_s

    @property
    def decode_base_s(self) -> float:
        return self.step_base_s

    @property
    def decode_s_per_context_token(self) -> float:
        return self.step_per_token_s

    @property
    def decode_kv_tokens(self) -> int:
        return self.kv_tokens


def snapshot(planner: Planner, conductor: Conductor, now: float, kv_tokens: int = 0) -> Snapshot:
    """What the next plan is made from, read off the Conductor (call under its lock; a few milliseconds).
    ``kv_tokens``: a decode instance's KV in tokens (0: from the capacity the decode workers registered, where their
    running batch holds it)."""
    cfg = conductor.config
    slo = cfg.slo_classes.get("default") or next(iter(cfg.slo_classes.values()))
    alive = [i for i in conductor.instances.values() if i.state in (InstanceState.ALIVE, InstanceState.SUSPECT)]
    prefills = [i for i in alive if i.role is Role.PREFILL]
    decodes = [i for i in alive if i.role is Role.DECODE]
    steps = [i.load.step_s for i in decodes if i.load.step_s > 0]
    nodes = [i for i in alive if i.role is Role.KVSTORE]
    sized = [i.capacity for i in nodes if i.capacity > 0]
    kv = [i for i in decodes if i.kv_blocks > 0]
    kv_blocks = float(np.mean([i.kv_blocks for i in kv])) if kv else 0.0
    kv_shared = all(i.kv_shared for i in kv)
    if not kv_tokens and kv_shared:
        kv_tokens = int(kv_blocks * planner.block_tokens)
    p = conductor.predictors
    c0, c1, c2 = (float(x) for x in p.prefill.coef)
    d0, d1, d2 = (float(x) for x in p.decode.coef)
    return Snapshot(
        now=now,
        requests=planner.window(now),
        prefill=len(prefills),
        decode=len(decodes),
        prefill_coef=(c0, c1, c2),
        slowdown=float(np.mean([i.slowdown for i in prefills])) if prefills else 1.0,
        steps=StepModel(d0, d1, d2),
        step_s=float(np.mean(steps)) if steps else d0,
        ttft_slo_s=slo.ttft_s,
        tbt_slo_s=slo.tbt_s,
        tbt_headroom=cfg.tbt_headroom,
        block_tokens=planner.block_tokens,
        block_bytes=p.block_bytes,
        kv_tokens=kv_tokens,
        transfer=(p.transfer.latency_s, p.transfer.bytes_per_s),
        handoff_s=conductor.handoff_s,
        backlog_s=sum(i.load.queued_s for i in prefills),
        pool_nodes=len(nodes),
        node_blocks=float(np.mean(sized)) if sized else 0.0,
        reads=list(planner.reads),
        admission=cfg.admission,
        policy=cfg.policy,
        local_prefill=cfg.local_prefill,
        kv_blocks=kv_blocks,
        kv_shared=kv_shared,
        prefill_tp=max((i.tensor_parallel_size for i in prefills), default=1),
        decode_tp=max((i.tensor_parallel_size for i in decodes), default=1),
    )


def twin_requests(snap: Snapshot, rate: float, output_tokens: float) -> list[TraceRequest]:
    """The window's most recent requests, their arrivals pressed (or stretched) to ``rate`` a second."""
    reqs = snap.requests[-TWIN_REQUESTS:]
    if not reqs:
        return []
    span = max(reqs[-1].arrival_s - reqs[0].arrival_s, 1e-9)
    scale = (len(reqs) / span) / rate if rate > 0 and len(reqs) > 1 else 1.0
    out = []
    for i, s in enumerate(reqs):
        keys = KeyChain(s.keys)
        done = not math.isnan(s.finish) and not math.isnan(s.decode_start) and snap.step_s > 0
        tokens = s.output_tokens or ((s.finish - s.decode_start) / snap.step_s if done else output_tokens)
        out.append(
            TraceRequest(
                i, (s.arrival_s - reqs[0].arrival_s) * scale, s.prompt_tokens, max(1, round(tokens)), list(keys), keys
            )
        )
    return out


def twin_config(snap: Snapshot, prefill: int, decode: int) -> SimConfig:
    """The twin's configuration: the Conductor's SLOs and policies, costs and priors from its learnt predictors."""
    block_tokens = snap.block_tokens or 512
    c0, c1, c2 = snap.prefill_coef
    costs = LearntCosts(
        prefill_overhead_s=c0 * snap.slowdown,
        prefill_linear_s=c1 * snap.slowdown,
        prefill_pair_s=c2 * snap.slowdown,
        step_base_s=snap.steps.base_s,
        decode_per_request_s=snap.steps.per_request_s,
        step_per_token_s=snap.steps.per_token_s,
        kv_tokens=snap.kv_tokens or (1 << 40),
        kv_bytes_per_token=max(1, snap.block_bytes // block_tokens),
        block_tokens=block_tokens,
        net_latency_s=snap.transfer[0],
        net_bytes_per_s=snap.transfer[1],
    )
    priors = PredictorConfig(
        prefill_tokens_per_s=1.0 / max(costs.prefill_linear_s, 1e-12),
        prefill_attention_s_per_token2=costs.prefill_pair_s,
        prefill_overhead_s=costs.prefill_overhead_s,
        decode_base_s=costs.step_base_s,
        decode_s_per_request=costs.decode_per_request_s,
        decode_s_per_context_token=costs.step_per_token_s,
        transfer_bytes_per_s=costs.net_bytes_per_s,
        transfer_latency_s=costs.net_latency_s,
    )
    return SimConfig(
        prefill=prefill,
        decode=decode,
        policy=snap.policy,
        admission=snap.admission,
        local_prefill=snap.local_prefill,
        ttft_slo_s=snap.ttft_slo_s,
        tbt_slo_s=snap.tbt_slo_s,
        tbt_headroom=snap.tbt_headroom,
        calibrate=False,
        model=costs,
        predictors=priors,
    )


def twin_check(snap: Snapshot, plan: Plan, prefill: int, decode: int) -> TwinOutcome:
    """Replay the window at the plan's forecast rate on ``prefill`` + ``decode`` twin instances (its outputs as long as
    measured, the unfinished ones the mean): the share within both SLOs, and the tails."""
    requests = twin_requests(snap, plan.rate, plan.mean_output_tokens or 1.0)
    cluster = Cluster(twin_config(snap, prefill, decode), requests)
    block_tokens = cluster.model.block_tokens
    for r, s in zip(requests, snap.requests[-len(requests) :]):  # what the real pool held for it
        blocks = max(0, s.cached_tokens) // block_tokens
        if blocks and r.keys:
            root = int.from_bytes(r.keys[0][:8], "little")  # not hash(): a process's salt would move the twin's runs
            node = cluster.prefills[root % len(cluster.prefills)].cache
            node.put(r.keys[:blocks])
    records = cluster.run()
    good = 0
    ttft, tbt = [], []
    for rec in records:
        if rec.rejected is not None or math.isnan(rec.first_token):
            continue
        ttft.append(rec.ttft_s)
        tbt.append(0.0 if math.isnan(rec.tbt_s) else rec.tbt_s)
        good += rec.within_slos(snap.ttft_slo_s, snap.tbt_slo_s)
    return TwinOutcome(
        prefill,
        decode,
        good / max(1, len(records)),
        float(np.quantile(ttft, 0.99)) if ttft else math.inf,
        float(np.quantile(tbt, 0.99)) if tbt else math.inf,
    )
