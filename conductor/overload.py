"""What the Conductor does when it cannot place a request now: early_wait's waits, tenants' fair shares under
pressure, and the shed verdict (when even the cheapest request would be refused).

A part of ``conductor.core.Conductor`` (which inherits it), apart by concept; it uses the
Conductor's decision code (``_admit``, ``_batch_at``, ``_later``, ``_takers``, ``_local``)
and its state. Pure: time is passed in.
"""

from __future__ import annotations

import dataclasses
import math

from conductor.admission import AdmissionKind, decode_load, select_decode
from conductor.local import LocalPrefill
from conductor.policies import estimate
from conductor.types import Instance, Prediction, Rejection, RejectReason, ScheduleRequest, Slo, Wait
from conductor.waiting import FAIR_SHARE_LOAD

MIN_RETRY_S, MAX_RETRY_S = 1.0, 60.0
SHED_S = 0.25  # how long a "refuse everything" verdict stands before it is asked again (Conductor.shed_s)
SHED_TIMES = 8  # when the cheapest request's prefill could end: points from its soonest to the SLO, checked
SHED_BUSY_S = 0.1  # the same when every decode worker is full: a batch frees sooner than a prefill queue drains
SHED_REUSE_S = 0.02  # a verdict this fresh is reused (a burst's rejections do not each recompute it)
MIN_WAIT_S = 0.05  # early_wait: the shortest wait tried (a gateway's sleep and a second Schedule cost about a ms); the
# next ones double, up to the longest its TTFT SLO allows
MAX_WAIT_S = 1.0  # the longest wait told at once: a waiter asks again at least this often (room may free sooner)
# early_wait: the refusals a wait may turn into a placement (the decode side: its batches empty as requests finish)
WAITABLE = frozenset({RejectReason.TTFT_SLO, RejectReason.TBT_SLO, RejectReason.OVERLOAD, RejectReason.DECODE_BUSY})


def clamp_retry(seconds: float) -> float:
    """A Retry-After within [MIN_RETRY_S, MAX_RETRY_S]."""
    return min(MAX_RETRY_S, max(MIN_RETRY_S, seconds))


class Overload:
    """Waits, fair shares and shedding (mixed into Conductor)."""

    def _hold(
        self, req: ScheduleRequest, wait: float, now: float, slo: Slo, why: str, predicted: Prediction | None = None
    ) -> Wait | Rejection:
        """``req`` waits ``wait`` seconds at its gateway, or is refused: when that would take it past its TTFT SLO, or
        its priority's queue is full."""
        if wait >= slo.ttft_s:
            self.waiting.release(req.request_id)
            return self._reject(
                req,
                RejectReason.TTFT_SLO,
                f"it would wait {wait:.2f} s ({why}), past the {slo.ttft_s:.2f} s left of its TTFT SLO",
                clamp_retry(wait),
            )
        if not self.waiting.hold(req, now + wait, now):
            return self._reject(
                req,
                RejectReason.QUEUE_FULL,
                f"{self.waiting.max_per_priority} requests of priority {req.priority} are waiting already ({why})",
                clamp_retry(wait),
            )
        return Wait(req.request_id, wait, f"waiting {wait:.2f} s: {why}", predicted)

    def _wait_for(
        self, req: ScheduleRequest, now: float, slo: Slo, at_least: float = 0.0
    ) -> tuple[float, Prediction] | None:
        """How long ``req`` should wait (at most MAX_WAIT_S, then it asks again), when it is predicted to be admitted
        after some wait within its TTFT SLO, and its prediction then; None: no wait helps.

        The waits tried start at MIN_WAIT_S (or ``at_least``) and double up to the longest its SLO allows. While it
        waits, its prefill instance's queue drains (what is placed meanwhile aside), so placed
        after ``wait`` its TTFT from now is ``max(wait, queue) + transfer + prefill``; the decode
        side is judged by the batches forecast for when that prefill ends."""
        prefills, decodes = self._alive_pools(now)
        if not prefills or not decodes:
            return None
        choice = self.policy.choose(req, prefills, self.index.match(req.keys), self.predictors)
        if self.handoff_s:
            choice = dataclasses.replace(choice, transfer_s=choice.transfer_s + self.handoff_s)
        longest = slo.ttft_s - choice.transfer_s - choice.prefill_s  # the latest its prefill may start
        first = max(MIN_WAIT_S, at_least)
        if longest < max(first, choice.queue_s):
            return None  # its prefill queue alone takes it past the SLO: waiting cannot help
        waits = [first * 2**k for k in range(int(math.log2(longest / first)) + 1)] + [longest]
        for wait in waits:
            later = dataclasses.replace(choice, queue_s=max(wait, choice.queue_s))
            t = now + later.ttft_s
            batch_of = self._batch_at(t, now, len(decodes))
            decode, tbt = select_decode(
                req,
                decodes,
                self.predictors.decode,
                batch_of,
                lambda inst: self.forecast.count(inst.id),
                self._later(t, now, len(decodes), slo),
            )
            if self._admit(req, later, decode, tbt, decodes, batch_of, slo) is None:
                return min(wait, MAX_WAIT_S), Prediction(
                    later.ttft_s, tbt, later.queue_s, later.transfer_s, later.prefill_s
                )
        return None

    def _over_share(
        self, req: ScheduleRequest, ttft_s: float, decodes: list[Instance], now: float, slo: Slo
    ) -> tuple[RejectReason, str, float] | None:
        """Refuse ``req`` when the cluster is under pressure (its predicted TTFT or the decode load at least
        ``FAIR_SHARE_LOAD`` of its SLO), another tenant of its priority wants more, and its tenant would go over its
        weighted share (conductor.waiting)."""
        if not req.tenant or self.admission in (AdmissionKind.NONE, AdmissionKind.BASELINE):
            return None
        if not self.shares.contended(req, now):
            return None
        why = self.shares.over_share(req)
        if not why:
            return None
        limit = slo.tbt_s * self.config.tbt_headroom
        pressure = max(
            ttft_s / slo.ttft_s,
            decode_load(decodes, self.predictors.decode, self._batch_at(now + ttft_s, now, len(decodes)), limit),
        )
        if pressure < FAIR_SHARE_LOAD:
            return None
        return RejectReason.FAIR_SHARE, f"{why}, with the cluster at {pressure:.2f} of its SLO", clamp_retry(ttft_s)

    def shed_s(self, now: float) -> float:
        """How long every request will be refused: SHED_S if even the cheapest request would be now, else 0.

        The cheapest request is one prompt token on the prefill instance that would start
        it soonest, in the loosest SLO class. Everything a real request adds (tokens to
        compute, context in the decode batch) only makes its TTFT and TBT longer, so
        when this one is refused, so is every other, except through the decode forecast:
        a request whose prefill ends later meets the decode batch as it will be then. So
        under early_predictive the cheapest request must be refused at every one of
        SHED_TIMES moments its prefill could end, from its soonest to the TTFT SLO.
        Nothing is recorded. A gateway that hears a verdict refuses new requests itself
        for SHED_S and asks again (a probe) before that runs out.
        """
        when, verdict = self._shed
        if now - when < SHED_REUSE_S:
            return max(0.0, verdict - (now - when)) if verdict else 0.0
        verdict = self._shed_verdict(now)
        self._shed = (now, verdict)
        return verdict

    def _shed_verdict(self, now: float) -> float:
        if self.admission is AdmissionKind.NONE or not self.config.slo_classes:
            return 0.0
        prefills, decodes = self._alive_pools(now)
        if not prefills or not decodes:
            return 0.0  # unavailable, not overloaded: the gateway holds such requests instead
        slo = Slo(
            ttft_s=max(s.ttft_s for s in self.config.slo_classes.values()),
            tbt_s=max(s.tbt_s for s in self.config.slo_classes.values()),
        )
        takers = self._takers(decodes, 1)
        if not takers:
            if self.admission is not AdmissionKind.EARLY_WAIT and self.decode_due is None:
                return SHED_BUSY_S  # (with the planner acting, requests wait for room: Conductor._hold_for_room)
            takers = decodes  # full now; a request may wait for a place (the forecast's, below)
        probe = ScheduleRequest("shed-probe", (), 1, 1)
        choice = min(
            (estimate(i, probe, 0, None, 0, self.predictors) for i in prefills), key=lambda c: (c.ttft_s, c.instance.id)
        )
        if self.local_prefill is not LocalPrefill.NEVER:  # or computed on a decode worker, which schedule would do
            match = self.index.match(())
            for decode in takers:
                local = self._local(probe, choice, decode, match, now, len(decodes), slo)
                if local is not None:
                    _, tbt = select_decode(
                        probe, [decode], self.predictors.decode, self._batch_at(now + local.ttft_s, now, len(decodes))
                    )
                    if self._admit_local(probe, local, tbt, decodes, now, slo)[1] is None:
                        return 0.0
        times = [choice.ttft_s]
        if self.admission.predictive and slo.ttft_s > choice.ttft_s:
            times = [choice.ttft_s + (slo.ttft_s - choice.ttft_s) * k / (SHED_TIMES - 1) for k in range(SHED_TIMES)]
        for t in times:
            batch_of = self._batch_at(now + t, now, len(decodes))
            later_of = self._later(now + t, now, len(decodes), slo)
            decode, tbt = select_decode(
                probe, takers, self.predictors.decode, batch_of, lambda inst: self.forecast.count(inst.id), later_of
            )
            if self._admit(probe, choice, decode, tbt, decodes, batch_of, slo) is None:
                return 0.0
        return SHED_S
