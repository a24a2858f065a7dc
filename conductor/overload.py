"""What the Conductor does when it cannot place a request now: early_wait's waits, tenants' fair shares under
pressure, and the shed verdict (when even the cheapest request would be refused).

    overload = Overload(config, judge, predictors, forecast)
    slo = overload.slo_of(req, slo, now)               # a sheddable request's SLO, cut while it is outranked
    later = overload.wait_for(req, choice, decodes, now, slo)   # (wait, prediction): placed then, it is admitted
    outcome = overload.hold(req, wait, now, slo, why)  # Wait, or the verdict refusing it
    shed_s = overload.shed_s(now, registry.pools, decode_due)   # how long every request will be refused

A part of ``conductor.core.Conductor``. It owns early_wait's queue (``waiting``), the
tenants' requests in flight (``shares``) and the last shed verdict; it asks the ``Judge``
it is given whether a request would be admitted at a later time, and reads the
predictors and the decode forecast it is given. It records no placement: its answers
are a wait, a verdict, or a time. Pure: time is passed in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from conductor.admission import AdmissionKind, select_decode
from conductor.config import ConductorConfig
from conductor.forecast import DecodeForecast
from conductor.index import PrefixMatch
from conductor.judge import Judge, Verdict, clamp_retry
from conductor.local import LocalPrefill
from conductor.policies import PrefillChoice, estimate
from conductor.predictors import Predictors
from conductor.types import Instance, Prediction, RejectReason, ScheduleRequest, Slo, Wait
from conductor.waiting import FAIR_SHARE_LOAD, SHEDDABLE_LOAD, FairShare, WaitQueue

SHED_S = 0.25  # how long a "refuse everything" verdict stands before it is asked again (Conductor.shed_s)
SHED_TIMES = 8  # when the cheapest request's prefill could end: points from its soonest to the SLO, checked
SHED_BUSY_S = 0.1  # the same when every decode worker is full: a batch frees sooner than a prefill queue drains
SHED_REUSE_S = 0.02  # a verdict this fresh is reused (a burst's rejections do not each recompute it)
MIN_WAIT_S = 0.05  # early_wait: the shortest wait tried (a gateway's sleep and a second Schedule cost about a ms); the
# next ones double, up to the longest its TTFT SLO allows
MAX_WAIT_S = 1.0  # the longest wait told at once: a waiter asks again at least this often (room may free sooner)
# early_wait: the refusals a wait may turn into a placement (the decode side: its batches empty as requests finish)
WAITABLE = frozenset({RejectReason.TTFT_SLO, RejectReason.TBT_SLO, RejectReason.OVERLOAD, RejectReason.DECODE_BUSY})

Pools = tuple[list[Instance], list[Instance]]  # (alive prefill instances, alive decode instances)


class Overload:
    """Waits, fair shares and shedding."""

    def __init__(self, config: ConductorConfig, judge: Judge, predictors: Predictors, forecast: DecodeForecast) -> None:
        self.config = config  # read only: the SLO classes the shed verdict takes the loosest of
        self.judge = judge
        self.predictors = predictors  # read only
        self.forecast = forecast  # read only
        self.waiting = WaitQueue(config.wait_queue)  # early_wait's order (conductor.waiting)
        self.shares = FairShare()  # requests in flight per priority and tenant
        self._shed: tuple[float, float] = (-float("inf"), 0.0)  # (when, verdict) of the last shed_s

    def slo_of(self, req: ScheduleRequest, slo: Slo, now: float) -> Slo:
        """``slo`` (its class's) as ``req`` is judged by it now: its own targets where tighter (a request may ask for
        less time, never more), less the time it has waited at its gateway (early_wait), and a sheddable one's
        (priority below 0) cut to ``SHEDDABLE_LOAD`` of it while a higher priority wants more, so that it is refused
        before those are (conductor.waiting)."""
        if req.ttft_slo_s or req.tbt_slo_s:
            slo = Slo(
                min(slo.ttft_s, req.ttft_slo_s or slo.ttft_s),
                min(slo.tbt_s, req.tbt_slo_s or slo.tbt_s),
            )
        scale = SHEDDABLE_LOAD if req.priority < 0 and self.shares.outranked(req.priority, now) else 1.0
        return Slo(slo.ttft_s * scale - req.waited_s, slo.tbt_s * scale)

    # -- who is in flight, who waits -------------------------------------------------------------

    def admitted(self, req: ScheduleRequest, now: float) -> None:
        self.shares.admitted(req, now)

    def pressed(self, req: ScheduleRequest, now: float) -> None:
        """``req`` was refused for capacity: its tenant wants more than it gets (fair shares, priorities)."""
        self.shares.pressed(req, now)

    def finished(self, request_id: str) -> None:
        self.shares.finished(request_id)
        self.waiting.release(request_id)

    def expire(self, now: float, max_age_s: float) -> None:
        self.shares.expire(now, max_age_s)

    def ahead_until(self, req: ScheduleRequest, now: float) -> float:
        """When the last waiter ``req`` may not overtake asks again (0: none waits ahead of it)."""
        return self.waiting.ahead_until(req, now)

    def release(self, request_id: str) -> None:
        self.waiting.release(request_id)

    # -- waits -------------------------------------------------------------------------------------

    def hold(
        self, req: ScheduleRequest, wait: float, now: float, slo: Slo, why: str, predicted: Prediction | None = None
    ) -> Wait | Verdict:
        """``req`` waits ``wait`` seconds at its gateway, or is refused (the verdict): when that would take it past its
        TTFT SLO, or its priority's queue is full."""
        if wait >= slo.ttft_s:
            self.waiting.release(req.request_id)
            return (
                RejectReason.TTFT_SLO,
                f"it would wait {wait:.2f} s ({why}), past the {slo.ttft_s:.2f} s left of its TTFT SLO",
                clamp_retry(wait),
            )
        if not self.waiting.hold(req, now + wait, now):
            return (
                RejectReason.QUEUE_FULL,
                f"{self.waiting.max_per_priority} requests of priority {req.priority} are waiting already ({why})",
                clamp_retry(wait),
            )
        return Wait(req.request_id, wait, f"waiting {wait:.2f} s: {why}", predicted)

    def hold_for_room(
        self,
        req: ScheduleRequest,
        decodes: list[Instance],
        blocks: int,
        now: float,
        slo: Slo,
        decode_due: float | None,
    ) -> Wait | Verdict | None:
        """With the planner acting (``decode_due``: when the next decode instance it started is predicted to serve), a
        request no decode worker has room for now waits at its gateway and asks again: room frees as requests finish,
        and the planner counts decode KV and adds a decode instance when it runs out (conductor.planner.sizing). It
        asks again within ``MAX_WAIT_S`` (a quarter of a mean decode, at least ``MIN_WAIT_S``); when even that would
        pass its TTFT SLO it is refused, with a Retry-After the planner's next decode instance is predicted to meet.
        None: refused as before (no planner acts, or a prompt larger than any worker's whole capacity, which no wait
        helps)."""
        if decode_due is None or blocks > max(i.kv_blocks or i.load.landing_blocks for i in decodes):
            return None
        why = self.judge.busy_message(decodes, blocks)
        wait = min(MAX_WAIT_S, max(MIN_WAIT_S, self.forecast.t_d / 4))
        if wait < slo.ttft_s:
            return Wait(req.request_id, wait, f"waiting {wait:.2f} s for decode room: {why}")
        due = decode_due - now if decode_due > now else self.forecast.t_d / 2
        return RejectReason.DECODE_BUSY, why, clamp_retry(due)

    def wait_for(
        self,
        req: ScheduleRequest,
        choice: PrefillChoice,
        decodes: list[Instance],
        now: float,
        slo: Slo,
        at_least: float = 0.0,
    ) -> tuple[float, Prediction] | None:
        """How long ``req`` should wait (at most MAX_WAIT_S, then it asks again), when it is predicted to be admitted
        after some wait within its TTFT SLO, and its prediction then; None: no wait helps. ``choice``: its prefill
        instance as placed now (with the hand-off), ``decodes``: the decode instances alive.

        The waits tried start at MIN_WAIT_S (or ``at_least``) and double up to the longest its SLO allows. While it
        waits, its prefill instance's queue drains (what is placed meanwhile aside), so placed
        after ``wait`` its TTFT from now is ``max(wait, queue) + transfer + prefill``; the decode
        side is judged by the batches forecast for when that prefill ends."""
        longest = slo.ttft_s - choice.transfer_s - choice.prefill_s  # the latest its prefill may start
        first = max(MIN_WAIT_S, at_least)
        if longest < max(first, choice.queue_s):
            return None  # its prefill queue alone takes it past the SLO: waiting cannot help
        waits = [first * 2**k for k in range(int(math.log2(longest / first)) + 1)] + [longest]
        for wait in waits:
            later = dataclasses.replace(choice, queue_s=max(wait, choice.queue_s))
            decode, tbt, batch_of = self.judge.pick_decode(req, decodes, now + later.ttft_s, now, len(decodes), slo)
            if self.judge.admit(req, later, decode, tbt, decodes, batch_of, slo, now) is None:
                return min(wait, MAX_WAIT_S), Prediction(
                    later.ttft_s, tbt, later.queue_s, later.transfer_s, later.prefill_s
                )
        return None

    # -- fair shares -------------------------------------------------------------------------------

    def over_share(
        self, req: ScheduleRequest, ttft_s: float, decodes: list[Instance], now: float, slo: Slo
    ) -> Verdict | None:
        """Refuse ``req`` when the cluster is under pressure (its predicted TTFT or the decode load at least
        ``FAIR_SHARE_LOAD`` of its SLO), another tenant of its priority wants more, and its tenant would go over its
        weighted share (conductor.waiting)."""
        if not req.tenant or self.judge.kind in (AdmissionKind.NONE, AdmissionKind.BASELINE):
            return None
        if not self.shares.contended(req, now):
            return None
        why = self.shares.over_share(req)
        if not why:
            return None
        pressure = max(ttft_s / slo.ttft_s, self.judge.decode_load(decodes, now + ttft_s, now, slo))
        if pressure < FAIR_SHARE_LOAD:
            return None
        return RejectReason.FAIR_SHARE, f"{why}, with the cluster at {pressure:.2f} of its SLO", clamp_retry(ttft_s)

    # -- shedding ----------------------------------------------------------------------------------

    def shed_s(self, now: float, pools: Callable[[float], Pools], decode_due: float | None) -> float:
        """How long every request will be refused: SHED_S if even the cheapest request would be now, else 0.

        The cheapest request is one prompt token on the prefill instance that would start
        it soonest, in the loosest SLO class. Everything a real request adds (tokens to
        compute, context in the decode batch) only makes its TTFT and TBT longer, so
        when this one is refused, so is every other, except through the decode forecast:
        a request whose prefill ends later meets the decode batch as it will be then. So
        under early_predictive the cheapest request must be refused at every one of
        SHED_TIMES moments its prefill could end, from its soonest to the TTFT SLO.
        Nothing is recorded. A gateway that hears a verdict refuses new requests itself
        for SHED_S and asks again (a probe) before that runs out. ``pools``: the instances
        alive at a time (asked only when the last verdict is stale); ``decode_due``: as
        ``hold_for_room`` takes it.
        """
        when, verdict = self._shed
        if now - when < SHED_REUSE_S:
            return max(0.0, verdict - (now - when)) if verdict else 0.0
        verdict = self._shed_verdict(now, pools, decode_due)
        self._shed = (now, verdict)
        return verdict

    def _shed_verdict(self, now: float, pools: Callable[[float], Pools], decode_due: float | None) -> float:
        judge = self.judge
        if judge.kind is AdmissionKind.NONE or not self.config.slo_classes:
            return 0.0
        prefills, decodes = pools(now)
        if not prefills or not decodes:
            return 0.0  # unavailable, not overloaded: the gateway holds such requests instead
        slo = Slo(
            ttft_s=max(s.ttft_s for s in self.config.slo_classes.values()),
            tbt_s=max(s.tbt_s for s in self.config.slo_classes.values()),
        )
        takers = judge.takers(decodes, 1)
        if not takers:
            if judge.kind is not AdmissionKind.EARLY_WAIT and decode_due is None:
                return SHED_BUSY_S  # (with the planner acting, requests wait for room: hold_for_room)
            takers = decodes  # full now; a request may wait for a place (the forecast's, below)
        probe = ScheduleRequest("shed-probe", (), 1, 1)
        choice = min(
            (estimate(i, probe, 0, None, 0, self.predictors) for i in prefills), key=lambda c: (c.ttft_s, c.instance.id)
        )
        if judge.local_prefill is not LocalPrefill.NEVER:  # or computed on a decode worker, which schedule would do
            match = PrefixMatch({}, {})  # the probe has no keys: no node holds any of them
            for decode in takers:
                local = judge.local(probe, choice, decode, match, now, len(decodes), slo)
                if local is not None:
                    _, tbt = select_decode(
                        probe,
                        [decode],
                        self.predictors.decode,
                        judge.batch_at(now + local.ttft_s, now, len(decodes), slo),
                    )
                    if judge.admit_local(probe, local, tbt, decodes, now, slo)[1] is None:
                        return 0.0
        times = [choice.ttft_s]
        if judge.kind.predictive and slo.ttft_s > choice.ttft_s:
            times = [choice.ttft_s + (slo.ttft_s - choice.ttft_s) * k / (SHED_TIMES - 1) for k in range(SHED_TIMES)]
        for t in times:
            decode, tbt, batch_of = judge.pick_decode(probe, takers, now + t, now, len(decodes), slo)
            if judge.admit(probe, choice, decode, tbt, decodes, batch_of, slo, now) is None:
                return 0.0
        return SHED_S
