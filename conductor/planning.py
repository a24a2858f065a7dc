"""The planner in the running Conductor: what it hears, its thread, what it exports, and how it acts.

    the service, under its lock:  every Schedule outcome, DECODE_STARTED and FINISHED -> Planner.observe_*
    every interval (PlannerConfig.interval_s, 30 s), on the planner's thread:
      1. snapshot       under the service's lock (milliseconds): the window, the learnt predictors, the pools
      2. decide         outside it: forecast, sizing, the twin's runs (a second or two), hysteresis
      3. export         mooncake_planner_desired_instances{role}, _desired_devices{role} (x their TP size),
                        mooncake_planner_forecast_* (KEDA or an HPA can scale on these instead: ``--planner-advise``)
      4. act            with ``--planner``: service.scale(role, count) for a role whose count differs; the pool
                        provider starts instances, or the Conductor drains the least busy and stops them once idle
                        (no request placed there fails: it finishes where it is)

``mooncake plan`` asks for a plan made now (``plan_now``): the same steps on a copy of the planner, so asking
changes nothing.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from typing import Protocol

from conductor.core import Conductor
from conductor.metrics import Metrics
from conductor.planner.check import snapshot, twin_check
from conductor.planner.planner import Plan, Planner, PlannerConfig
from conductor.types import Role

log = logging.getLogger(__name__)


class Service(Protocol):
    """What the planner uses of the Conductor's service (conductor.service.ConductorService)."""

    conductor: Conductor
    metrics: Metrics
    leading: threading.Event
    _lock: threading.Lock

    def scale(self, role: Role, replicas: int) -> tuple[int, list[str], list[str]]: ...


class PlannerLoop:
    """The planner of one Conductor service: always observing; planning on its thread when started."""

    def __init__(self, service: Service, config: PlannerConfig, acting: bool = False) -> None:
        self.service = service
        self.config = config
        self.acting = acting
        self.planner = Planner(config, started=time.monotonic())
        self.last: Plan | None = None
        self._asked: dict[Role, tuple[int, float]] = {}  # role -> (the count last asked for, when)
        self._started = time.monotonic()
        self._seen: set[Role] = set()  # roles with an instance alive at some plan
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Plan every ``interval_s`` from now on (the thread logs a failed plan and goes on). Acting, it tells the
        Conductor that decode instances may come (``Conductor.decode_due``): a prompt no decode worker has room for
        then waits for room at its gateway instead of being refused."""
        if self.acting:
            with self.service._lock:
                self.service.conductor.decode_due = math.inf
        self._thread = threading.Thread(target=self._run, name="conductor-planner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            if not self.service.leading.is_set():
                continue
            try:
                self.plan_once()
            except Exception:  # a bug in a plan must not stop the next ones
                log.exception("the planner failed to plan")

    def _snapshot(self, planner: Planner):
        with self.service._lock:
            return snapshot(planner, self.service.conductor, time.monotonic())

    def plan_once(self) -> Plan:
        """Plan, export, and (acting) scale. Returns the plan."""
        plan = self.planner.decide(self._snapshot(self.planner), twin_check)
        self.last = plan
        self._export(plan)
        log.info("plan: %s", plan.describe().replace("\n", "; "))
        if self.acting:
            self._act(plan)
        return plan

    def plan_now(self) -> Plan:
        """A plan made now on a copy of the planner (its window, forecast and hysteresis untouched)."""
        with self.service._lock:
            planner = copy.deepcopy(self.planner)
            snap = snapshot(planner, self.service.conductor, time.monotonic())
        return planner.decide(snap, twin_check)

    def _export(self, plan: Plan) -> None:
        m = self.service.metrics
        m.planner_desired.labels(Role.PREFILL.value).set(plan.prefill)
        m.planner_desired.labels(Role.DECODE.value).set(plan.decode)
        for role in (Role.PREFILL, Role.DECODE):
            m.planner_devices.labels(role.value).set(plan.devices(role))
        f = m.planner_forecast
        f["rate"].set(plan.rate)
        f["prompt_tokens"].set(plan.mean_prompt_tokens)
        f["uncached_tokens"].set(plan.mean_uncached_tokens)
        f["output_tokens"].set(plan.mean_output_tokens)
        chosen = next((t for t in plan.twin if (t.prefill, t.decode) == (plan.prefill, plan.decode)), None)
        if chosen is not None:
            m.planner_twin_attainment.set(chosen.attainment)

    def _act(self, plan: Plan) -> None:
        """Scale each role whose count differs from the plan's: start what is missing beyond the instances still
        starting (asked for within ``2 x start_s`` and not registered yet), or drain down to the plan. A pool with no
        instance yet within ``2 x start_s`` of the planner's start is left alone: the cluster is still coming up (its
        deployment's or launcher's instances would otherwise be doubled). A refusal is logged; the next plan tries
        again."""
        now = time.monotonic()
        with self.service._lock:
            alive = {role: len(self.service.conductor.alive(role)) for role in (Role.PREFILL, Role.DECODE)}
        self._seen.update(role for role, n in alive.items() if n)
        for role, want in ((Role.PREFILL, plan.prefill), (Role.DECODE, plan.decode)):
            if role not in self._seen and now - self._started < 2 * max(self.config.start_s, 10.0):
                continue  # the pool's first instances are still starting (the cluster is coming up): not to fill
            asked, at = self._asked.get(role, (0, -float("inf")))
            starting = max(0, asked - alive[role]) if now - at < 2 * max(self.config.start_s, 10.0) else 0
            if want > alive[role] + starting:
                replicas = want - starting  # the provider starts replicas - alive more
            elif want < alive[role]:
                replicas = want
            else:
                continue
            try:
                self.service.scale(role, replicas)
            except (RuntimeError, ValueError) as e:
                log.warning("the planner could not scale %s to %d: %s", role.value, want, e)
                self.planner.settle(role, alive[role])
                continue
            self._asked[role] = (want, now)
            if role is Role.DECODE and want > alive[role]:
                with self.service._lock:  # a prompt waiting for decode room hears when this one is predicted to serve
                    self.service.conductor.decode_due = now + self.config.start_s
