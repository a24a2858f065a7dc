"""Who sizes the simulated pools: the Conductor's planner, or a reactive baseline as an HPA would run it.

planner   conductor.planner: the Conductor's forecast, its sizing from its learnt predictors, each plan checked
          on the twin (a simulation inside the simulation, of the window it saw), hysteresis and cool-down
queue     the Kubernetes HPA's rule on queue length: desired = ceil(current x metric / target), left alone
          within 10% of the target, scaling down to the highest desire of the last 5 minutes (the HPA's
          stabilization window). Metrics: prompts waiting or running per prefill instance (target
          ``prefill_queue``), requests waiting to join a batch per decode instance (target ``decode_queue``)
          plus a share of their batch's room used (``decode_batch``: running requests over the batch the
          TBT cap allows, measured as the HPA would see a utilization metric)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from conductor.planner.check import snapshot, twin_check
from conductor.planner.planner import Planner, PlannerConfig
from conductor.planner.twin import Cluster
from conductor.types import Role

HPA_TOLERANCE = 0.1
HPA_DOWN_WINDOW_S = 300.0


class PlannerScaler:
    """The Conductor's planner as the simulated cluster's autoscaler (and the observer it learns the load from)."""

    def __init__(self, config: PlannerConfig) -> None:
        self.planner = Planner(config, started=0.0)
        self.plans = []

    def __call__(self, cluster: Cluster) -> dict[Role, int]:
        snap = snapshot(self.planner, cluster.conductor, cluster.now, cluster.model.decode_kv_tokens)
        plan = self.planner.decide(snap, twin_check)
        self.plans.append(plan)
        return {Role.PREFILL: plan.prefill, Role.DECODE: plan.decode}


@dataclass
class QueueScaler:
    """The HPA's rule on the pools' queue lengths (see the module's docstring)."""

    prefill_queue: float = 2.0
    decode_batch: float = 0.7
    bounds: tuple[int, int] = (1, 64)
    _desired: dict[Role, deque] = field(default_factory=lambda: {Role.PREFILL: deque(), Role.DECODE: deque()})

    def __call__(self, cluster: Cluster) -> dict[Role, int]:
        c, now = cluster.conductor, cluster.now
        counts = cluster.counts()
        out = {}
        cap = c.config.tbt_headroom * min(s.tbt_s for s in c.config.slo_classes.values())
        for role in (Role.PREFILL, Role.DECODE):
            alive = c.alive(role)
            current = counts[role]
            if not alive:
                out[role] = current
                continue
            if role is Role.PREFILL:
                ratio = sum(i.load.queued_requests for i in alive) / len(alive) / self.prefill_queue
            else:  # the batch against the most a step may carry within the TBT cap (the decode predictor's)
                coef = c.predictors.decode.coef
                used = []
                for i in alive:
                    b = i.load.running_requests + i.load.queued_requests
                    per = (i.load.context_tokens / i.load.running_requests) if i.load.running_requests else 0.0
                    room = (cap - coef[0]) / max(coef[1] + coef[2] * per, 1e-12)
                    used.append(b / max(room, 1.0))
                ratio = sum(used) / len(used) / self.decode_batch
            desired = current if abs(ratio - 1.0) <= HPA_TOLERANCE else math.ceil(len(alive) * ratio)
            desired = min(max(desired, self.bounds[0]), self.bounds[1])
            window = self._desired[role]
            window.append((now, desired))
            while window and window[0][0] < now - HPA_DOWN_WINDOW_S:
                window.popleft()
            out[role] = desired if desired >= current else max(d for _, d in window)
        return out


AUTOSCALERS = ("none", "planner", "queue")


def make_scaler(kind: str, bounds: tuple[int, int] = (1, 64)) -> PlannerScaler | QueueScaler | None:
    """The autoscaler called ``kind`` (``AUTOSCALERS``); None for none."""
    if kind == "none":
        return None
    if kind == "planner":
        return PlannerScaler(PlannerConfig(min_prefill=bounds[0], max_prefill=bounds[1], max_decode=bounds[1]))
    if kind == "queue":
        return QueueScaler(bounds=bounds)
    raise ValueError(f"unknown autoscaler {kind!r}; choose from {', '.join(AUTOSCALERS)}")
