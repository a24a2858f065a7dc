"""The Conductor's state and its decisions, with no I/O: the gRPC service and the simulator both drive it.

    conductor = Conductor(ConductorConfig())
    conductor.register(Instance("p0", Role.PREFILL, "10.0.0.1:7000", node="kv0"), now)
    conductor.stored("kv0", key, Tier.DRAM, parent)         # from kvstore event streams
    outcome = conductor.schedule(ScheduleRequest(...), now)  # Decision or Rejection

Time is always passed in (``now``, seconds on any monotonic clock), so the simulator can
run it on simulated time. Not thread-safe: the service serialises calls with a lock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from conductor.admission import AdmissionKind, Batch, decode_load, join_tbt, reported_batch, select_decode
from conductor.config import ConductorConfig
from conductor.forecast import DecodeForecast
from conductor.index import KVIndex, PrefixMatch
from conductor.learning import Learning
from conductor.local import LocalChoice, LocalPrefill, can_prefill, estimate_local, step_at_cap
from conductor.overload import MAX_WAIT_S, MIN_RETRY_S, MIN_WAIT_S, WAITABLE, Overload, clamp_retry
from conductor.policies import PolicyKind, PrefillChoice, ahead_of_queue, make_policy
from conductor.predictors import Predictors
from conductor.registry import Registry
from conductor.types import (
    Decision,
    Instance,
    Measured,
    Placed,
    Prediction,
    PrefixPlan,
    Rejection,
    RejectReason,
    Role,
    ScheduleRequest,
    Slo,
    Wait,
)
from conductor.waiting import SHEDDABLE_LOAD, WAIT_GAP_S, FairShare, WaitQueue
from kvstore.events import Tier

MAX_PENDING_TTFTS = 100_000  # predictions awaiting their measured TTFT (a worker that never reports cannot grow it)


@dataclass
class Served:
    """What one prefill instance was given so far (the admin API's per-instance cache figures)."""

    decisions: int = 0
    prompt_blocks: int = 0
    reused_blocks: int = 0  # of those, local or fetched instead of computed
    fetched_blocks: int = 0


@dataclass
class Counters:
    """Decisions so far (what /metrics and the admin API report)."""

    scheduled: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    reused_blocks: int = 0
    fetched_blocks: int = 0
    computed_tokens: int = 0
    local: int = 0  # of the scheduled, computed on their decode worker (conductor.local)


class Conductor(Registry, Learning, Overload):
    def __init__(self, config: ConductorConfig | None = None) -> None:
        self.config = config or ConductorConfig()
        self.instances: dict[str, Instance] = {}
        self.index = KVIndex()
        self.predictors = Predictors.from_config(self.config.predictors, self.config.block_bytes)
        self.forecast = DecodeForecast(self.config.default_decode_s, kind=self.config.decode_forecast)
        self.policy = make_policy(self.config.policy, self.config.policy_config)
        self.admission = self.config.admission
        self.local_prefill = self.config.local_prefill
        self.handoff_s = self.config.default_handoff_s  # learnt from decode workers' reports (handoff_sample)
        self._handoffs = 0
        self.counters = Counters()
        self.served: dict[str, Served] = {}  # prefill instance id -> what it was given
        self.last_sent: dict[str, float] = {}  # instance id -> when a request was last placed on it
        self.retiring: set[str] = set()  # drained instances to stop (through the pool provider) once idle
        self._shed: tuple[float, float] = (-float("inf"), 0.0)  # (when, verdict) of the last shed_s
        self._ttfts: dict[str, Placed] = {}  # request id -> its placement: _measured learns from it
        # called with each placement and what came out (the service's --prediction-log); None: nothing is called
        self.audit: Callable[[str, Placed, Measured, float], None] | None = None
        self.waiting = WaitQueue(self.config.wait_queue)  # early_wait's order (conductor.waiting)
        self.shares = FairShare()  # requests in flight per priority and tenant
        # The planner acting (conductor.planning sets it): when the next decode instance it started is predicted to
        # serve (inf: none is starting; one may come with its next plan). None: no planner adds decode instances, so a
        # prompt no decode worker has room for is refused (decode_busy) instead of held at its gateway (_hold_for_room)
        self.decode_due: float | None = None

    # -- configuration at run time -------------------------------------------------------

    def set_policy(self, kind: PolicyKind | str) -> None:
        self.policy = make_policy(kind, self.config.policy_config)

    def set_local_prefill(self, mode: LocalPrefill | str) -> None:
        try:
            self.local_prefill = LocalPrefill(mode)
        except ValueError:
            raise ValueError(
                f"unknown local prefill mode {mode!r}; choose from {', '.join(m.value for m in LocalPrefill)}"
            ) from None

    def set_admission(self, kind: AdmissionKind | str) -> None:
        try:
            self.admission = AdmissionKind(kind)
        except ValueError:
            raise ValueError(
                f"unknown admission {kind!r}; choose from {', '.join(k.value for k in AdmissionKind)}"
            ) from None

    # -- the index -------------------------------------------------------------------------

    def stored(self, node: str, key: bytes, tier: Tier, parent: bytes | None) -> None:
        self.index.stored(node, key, tier, parent)

    def removed(self, node: str, key: bytes, tier: Tier) -> None:
        self.index.removed(node, key, tier)

    def snapshot(self, node: str, blocks: list[tuple[bytes, Tier, bytes | None]]) -> None:
        self.index.reset_node(node, blocks)

    # -- decisions -------------------------------------------------------------------------

    def slo(self, slo_class: str) -> Slo:
        slo = self.config.slo_classes.get(slo_class)
        if slo is None:
            raise ValueError(
                f"unknown SLO class {slo_class!r}; configured: {', '.join(sorted(self.config.slo_classes))}"
            )
        return slo

    def slo_of(self, req: ScheduleRequest, now: float) -> Slo:
        """The SLO ``req`` is judged by now: its class's, less the time it has waited at its gateway (early_wait), and
        a sheddable one's (priority below 0) cut to ``SHEDDABLE_LOAD`` of it while a higher priority wants more, so
        that it is refused before those are (conductor.waiting)."""
        slo = self.slo(req.slo_class)
        scale = SHEDDABLE_LOAD if req.priority < 0 and self.shares.outranked(req.priority, now) else 1.0
        return Slo(slo.ttft_s * scale - req.waited_s, slo.tbt_s * scale)

    def schedule(self, req: ScheduleRequest, now: float) -> Decision | Rejection | Wait:
        """Pick the prefill and decode instances and the prefix plan for ``req``, or reject it, or (early_wait) tell
        it to wait.

        Raises ValueError for a malformed request. A Decision is recorded: the prefill
        instance's queue grows by the predicted prefill time until its next heartbeat,
        and the request joins the decode forecast. Under early_wait a request that would be
        refused now, but is predicted to meet its SLOs if placed a little later, waits at
        its gateway (``Wait``) and asks again; so does one behind a waiter it may not
        overtake (conductor.waiting). One no wait within its TTFT SLO helps is refused now.
        """
        req.validate()
        outcome = self._schedule(req, now)
        if isinstance(outcome, Rejection) and outcome.reason in WAITABLE:
            self.shares.pressed(req, now)  # its tenant wants more than it gets (fair shares, priorities)
        return outcome

    def _schedule(self, req: ScheduleRequest, now: float) -> Decision | Rejection | Wait:
        if self.admission is not AdmissionKind.EARLY_WAIT:
            return self._place(req, now)
        slo = self.slo_of(req, now)
        ahead = self.waiting.ahead_until(req, now)
        if ahead:  # it goes after them, if waiting helps at all: it asks again just after the last of them has
            behind = ahead + WAIT_GAP_S - now
            later = self._wait_for(req, now, slo, at_least=behind)
            if later is not None:
                why = "behind requests of a higher priority"
                return self._hold(req, max(behind, later[0]), now, slo, why, later[1])
        outcome = self._place(req, now)
        if isinstance(outcome, Rejection) and outcome.reason in WAITABLE:
            later = self._wait_for(req, now, slo)
            if later is not None:
                self._uncount(outcome)  # not a refusal after all
                wait, predicted = later
                return self._hold(req, wait, now, slo, outcome.message, predicted)
        self.waiting.release(req.request_id)
        return outcome

    def _place(self, req: ScheduleRequest, now: float) -> Decision | Rejection:
        """``schedule`` without waiting: a placement (recorded) or a rejection."""
        slo = self.slo_of(req, now)
        for instance_id in req.failed:
            self.suspect(instance_id, now)
        prefills, decodes = self._alive_pools(now)
        if not prefills:
            return self._reject(req, RejectReason.NO_PREFILL, "no prefill instance is alive", MIN_RETRY_S)
        if not decodes:
            return self._reject(req, RejectReason.NO_DECODE, "no decode instance is alive", MIN_RETRY_S)
        if slo.ttft_s <= 0:
            return self._reject(
                req, RejectReason.TTFT_SLO, f"it waited {req.waited_s:.2f} s, its whole TTFT SLO", MIN_RETRY_S
            )
        blocks = -(
            -req.prompt_tokens // req.block_tokens
        )  # what its prompt's KV takes of a decode worker's landing slots
        takers = self._takers(decodes, blocks)
        if not takers:
            held = self._hold_for_room(req, decodes, blocks, now, slo)
            if held is not None:
                return held
            return dataclasses.replace(
                self._reject(req, RejectReason.DECODE_BUSY, self._busy_message(decodes, blocks), MIN_RETRY_S),
                shed_s=self.shed_s(now),
            )
        match = self.index.match(req.keys)
        if req.retry:  # it goes ahead of each queue (Placement.ahead): the policy sees the queues as it will meet them
            choice = self.policy.choose(req, ahead_of_queue(prefills), match, self.predictors)
            choice = dataclasses.replace(choice, instance=self.instances[choice.instance.id])
        else:
            choice = self.policy.choose(req, prefills, match, self.predictors)
        if self.handoff_s:  # the KV's way to the decode worker: a fixed cost, like the prefix's transfer
            choice = dataclasses.replace(choice, transfer_s=choice.transfer_s + self.handoff_s)
        batch_of = self._batch_at(now + choice.ttft_s, now, len(decodes))
        later_of = self._later(now + choice.ttft_s, now, len(decodes), slo)
        decode, tbt = select_decode(
            req, takers, self.predictors.decode, batch_of, lambda inst: self.forecast.count(inst.id), later_of
        )
        local = self._local(req, choice, decode, match, now, len(decodes), slo)
        if local is not None:  # its decode worker computes it
            predicted, verdict = self._admit_local(req, local, tbt, decodes, now, slo)
            verdict = verdict or self._over_share(req, predicted.ttft_s, decodes, now, slo)
            if verdict is None:
                self._record_local(req, local, now)
                # its new blocks go to the node holding its prefix,
                # or (none) to the node of the prefill worker it passed by
                return Decision(
                    req.request_id,
                    "",
                    decode.id,
                    local.plan,
                    predicted,
                    self.policy.kind.value,
                    local.plan.fetch_node or choice.instance.node,
                    local=True,
                    chunk_tokens=local.chunk_tokens,
                )
        if (
            local is None or self.local_prefill is not LocalPrefill.ALWAYS
        ):  # auto: refused there, a prefill worker may do
            predicted = Prediction(choice.ttft_s, tbt, choice.queue_s, choice.transfer_s, choice.prefill_s)
            verdict = self._admit(req, choice, decode, tbt, decodes, batch_of, slo)
            verdict = verdict or self._over_share(req, choice.ttft_s, decodes, now, slo)
        if verdict is not None:
            reason, message, retry = verdict
            return dataclasses.replace(self._reject(req, reason, message, retry, predicted), shed_s=self.shed_s(now))
        self._record(req, choice, decode, now, blocks)
        return Decision(
            req.request_id,
            choice.instance.id,
            decode.id,
            choice.plan,
            predicted,
            self.policy.kind.value,
            admit_at_decode=self.admission is AdmissionKind.BASELINE,
            ahead=req.retry,
        )

    def _local(
        self,
        req: ScheduleRequest,
        choice: PrefillChoice,
        decode: Instance,
        match: PrefixMatch,
        now: float,
        num_decodes: int,
        slo: Slo,
    ) -> LocalChoice | None:
        """Where ``decode`` should compute ``req``'s prompt itself (conductor.local), its costs; None: a prefill worker.

        ``auto``: when its batch's step is at most ``local_max_load`` of the TBT limit, the prompt is predicted sooner
        there than the prefill worker's TTFT (with the hand-off), and the steps its chunks ride on stay within the TBT
        SLO with the batch grown to its cap. ``schedule`` falls back to the prefill worker when admission refuses it."""
        if self.local_prefill is LocalPrefill.NEVER or not can_prefill(decode):
            return None
        batch = self._batch_at(now, now, num_decodes)(decode)
        limit = slo.tbt_s * self.config.tbt_headroom
        if (
            self.local_prefill is LocalPrefill.AUTO
            and self.predictors.decode.predict(*batch) > limit * self.config.local_max_load
        ):
            return None  # a busy decode worker has no time to spare for prompts (conductor.local)
        chunk = decode.step_tokens or self.config.local_chunk_tokens  # what its engine takes a step, as it registered
        grown = step_at_cap(decode, batch, req, self.predictors, limit)
        local = estimate_local(req, decode, batch, match, self.predictors, chunk, grown, slo.tbt_s)
        if self.local_prefill is LocalPrefill.ALWAYS:
            return local
        if local.tbt_s <= slo.tbt_s and local.ttft_s < choice.ttft_s:
            return local
        return None

    def _admit_local(
        self, req: ScheduleRequest, local: LocalChoice, tbt: float, decodes: list[Instance], now: float, slo: Slo
    ) -> tuple[Prediction, tuple[RejectReason, str, float] | None]:
        """``_admit`` for a prompt its decode worker computes (``tbt``: that worker's with ``req`` in its batch), judged
        by the batch it meets when it would start decoding; its prediction and the verdict."""
        # a step a chunk rides on was held to the SLO itself (a gap, not the mean step the headroom is for)
        tbt = tbt if local.tbt_s <= slo.tbt_s else max(tbt, local.tbt_s)
        predicted = Prediction(local.ttft_s, tbt, local.queue_s, local.transfer_s, local.prefill_s)
        return predicted, self._admit(
            req, local, local.decode, tbt, decodes, self._batch_at(now + local.ttft_s, now, len(decodes)), slo
        )

    def _takers(self, decodes: list[Instance], blocks: int) -> list[Instance]:
        """The decode instances that would take one more request of ``blocks`` landing blocks now: those whose worker
        would not refuse it as ``decode.worker.DecodeWorker.generate`` does (its batch check only under the early
        admissions: the others leave it to the worker).

        A worker refuses when its KV has no room for the prompt's blocks (``kv_held``: the
        requests in prefill there hold theirs, and where the batch shares the cache, the
        running requests theirs), or when the requests running past its batch cap
        (``Load.batch_cap``: what its TBT SLO allows, in every heartbeat; they have landed and
        wait for a place) come to a whole batch. A request in prefill holds landing room, not
        a place in the batch: whether the batch has a place for it when it lands is the
        forecast's question (early_predictive's TBT check), asked at the time its prefill
        ends. Those requests come from the forecast's bookkeeping (scheduled here, their
        decode start and end reported by the worker), so a placement made between two
        heartbeats counts at once; what a worker does not report is not checked here.
        Refused here, such a request hears 429 in a fraction of a millisecond instead of
        after a round trip to a busy worker, and while every worker is full the gateway
        sheds; with the planner acting it waits for room instead (``_hold_for_room``).
        """
        return [inst for inst in decodes if not self._refusal(inst, blocks)]

    def kv_held(self, inst: Instance) -> int:
        """The blocks of decode ``inst``'s KV capacity (``Instance.kv_blocks``) held now, as the Conductor counts them:
        the landings of the requests it placed there that are still in prefill and, where the running batch shares the
        cache, the batch's: its prompts' blocks and a block of output each. Where the worker's last heartbeat counted
        more of either (``Load.landing_held_blocks``, ``Load.running_blocks``: longer outputs, requests placed before a
        restart or whose report was lost), that. A request that started decoding since that heartbeat counts twice
        until the next one: the count errs on the side the worker does not refuse."""
        landing, batch = self.forecast.blocks_held(inst.id)
        landing = max(landing, inst.load.landing_held_blocks)
        return landing + max(batch, inst.load.running_blocks) if inst.kv_shared else landing

    def _refusal(self, inst: Instance, blocks: int) -> str:
        """Why ``inst``'s worker would refuse a request of ``blocks`` landing blocks now ("": it would take it)."""
        _, decoding, landing = self.forecast.occupancy(inst.id)
        cap, room = inst.load.batch_cap, inst.load.landing_blocks
        batch_check = self.admission is AdmissionKind.EARLY or self.admission.predictive
        if batch_check and cap and decoding - cap >= cap:
            return f"{inst.id}: {decoding - cap} waiting for a place in a batch of {cap}"
        if inst.kv_blocks:
            held = self.kv_held(inst)
            if held + blocks > inst.kv_blocks:
                return f"{inst.id}: {held} of {inst.kv_blocks} KV blocks held, {blocks} more needed"
        elif room and landing + blocks > room:  # a worker that registered no capacity: its heartbeat's room
            return f"{inst.id}: {landing} of {room} landing blocks held, {blocks} more needed"
        return ""

    def _hold_for_room(
        self, req: ScheduleRequest, decodes: list[Instance], blocks: int, now: float, slo: Slo
    ) -> Wait | Rejection | None:
        """With the planner acting (``decode_due`` set), a request no decode worker has room for now waits at its
        gateway and asks again: room frees as requests finish, and the planner counts decode KV and adds a decode
        instance when it runs out (conductor.planner.sizing). It asks again within ``MAX_WAIT_S`` (a quarter of a
        mean decode, at least ``MIN_WAIT_S``); when even that would pass its TTFT SLO it is refused, with a
        Retry-After the planner's next decode instance is predicted to meet. None: refused as before (no planner
        acts, or a prompt larger than any worker's whole capacity, which no wait helps)."""
        if self.decode_due is None or blocks > max(i.kv_blocks or i.load.landing_blocks for i in decodes):
            return None
        why = self._busy_message(decodes, blocks)
        wait = min(MAX_WAIT_S, max(MIN_WAIT_S, self.forecast.t_d / 4))
        if wait < slo.ttft_s:
            return Wait(req.request_id, wait, f"waiting {wait:.2f} s for decode room: {why}")
        due = self.decode_due - now if self.decode_due > now else self.forecast.t_d / 2
        return self._reject(req, RejectReason.DECODE_BUSY, why, clamp_retry(due))

    def _busy_message(self, decodes: list[Instance], blocks: int) -> str:
        why = "; ".join(self._refusal(inst, blocks) for inst in decodes[:4])
        return f"every decode worker is full ({why}{'; ...' if len(decodes) > 4 else ''})"

    def admit_at_decode(self, decode_id: str, now: float, context_tokens: int = 0) -> Rejection | None:
        """The baseline's late check, made when a prefill has finished: would the decode instance, with this
        request (``context_tokens`` of KV) joining, run over ``tbt_headroom`` of its TBT SLO?

        Only the baseline rejects here (its prefill is then wasted). The other admissions
        decided before prefill; what they mispredicted waits on the decode side for room.
        """
        inst = self.instances.get(decode_id)
        if self.admission is not AdmissionKind.BASELINE or inst is None:
            return None
        tbt_slo = min(s.tbt_s for s in self.config.slo_classes.values())
        tbt = join_tbt(inst, reported_batch(inst), context_tokens, self.predictors.decode)
        if tbt <= tbt_slo * self.config.tbt_headroom:
            return None
        return Rejection(
            "",
            RejectReason.TBT_SLO,
            f"decode {decode_id} would run at {tbt:.3f} s per token, over the {tbt_slo} s SLO",
            clamp_retry(self.forecast.t_d / 2),
        )

    def _batch_at(self, t: float, now: float, num_decodes: int) -> Callable[[Instance], Batch]:
        """The batch a request joining a decode instance at ``t`` would find there, as this admission sees it.

        early_predictive: the decode forecast at ``t`` (DESIGN §5). The others: the
        reported batch plus what was sent there and has not started decoding (so requests
        scheduled between two heartbeats spread over the instances).
        """
        if self.admission.predictive:
            batches = self.forecast.batches_at(t, now)
            joins_n, joins_tokens = self.forecast.joins(t, now, num_decodes)

            def at_t(inst: Instance) -> Batch:
                n, tokens = batches.get(inst.id, (0.0, 0.0))
                return n + joins_n, tokens + joins_tokens

            return at_t

        pending = self.forecast.pending()

        def now_and_pending(inst: Instance) -> Batch:
            (n, tokens), (pn, ptokens) = reported_batch(inst), pending.get(inst.id, (0, 0))
            return n + pn, tokens + ptokens

        return now_and_pending

    def _later(self, t: float, now: float, num_decodes: int, slo: Slo) -> Callable[[Instance], Batch] | None:
        """early_predictive: the batches one TBT budget after ``t``, forecast when first asked (join_tbt asks only
        about an instance at its cap at ``t``: would a place be free before the wait is longer than a step may be?)."""
        if not self.admission.predictive:
            return None
        forecast: list[Callable[[Instance], Batch]] = []

        def later_of(inst: Instance) -> Batch:
            if not forecast:
                forecast.append(self._batch_at(t + slo.tbt_s * self.config.tbt_headroom, now, num_decodes))
            return forecast[0](inst)

        return later_of

    def _admit(
        self,
        req: ScheduleRequest,
        choice: PrefillChoice,
        decode: Instance,
        tbt: float,
        decodes: list[Instance],
        batch_of: Callable[[Instance], Batch],
        slo: Slo,
    ) -> tuple[RejectReason, str, float] | None:
        """Why ``req`` must be turned away now (reason, message, retry-after), or None to serve it.

        ``tbt`` is the predicted TBT on ``decode`` with ``req`` in the batch ``batch_of``
        gives. Plain early judges decode by the current (reported) batches alone, as the
        paper's early rejection does; early_predictive by the batches forecast for when
        this prefill ends.
        """
        kind = self.admission
        if kind is AdmissionKind.NONE:
            return None
        ttft_over = (
            RejectReason.TTFT_SLO,
            f"predicted TTFT {choice.ttft_s:.2f} s is over the {slo.ttft_s} s SLO",
            clamp_retry(choice.queue_s),
        )
        if kind is AdmissionKind.BASELINE:
            return ttft_over if choice.ttft_s > slo.ttft_s else None
        limit = slo.tbt_s * self.config.tbt_headroom
        if kind is AdmissionKind.EARLY:
            batch_of = reported_batch
            tbt = join_tbt(
                decode,
                reported_batch(decode),
                req.prompt_tokens + req.expected_output_tokens // 2,
                self.predictors.decode,
            )
        prefill_load = choice.ttft_s / slo.ttft_s
        load = decode_load(decodes, self.predictors.decode, batch_of, limit)
        if prefill_load > 1.0 and prefill_load >= load:
            return ttft_over
        retry_decode = clamp_retry(self.forecast.t_d / 2)
        if load > 1.0:
            batches = ", ".join(
                f"{i.id}: {n:.1f} requests, {self.predictors.decode.predict(n, tokens):.3f} s a step"
                for i in decodes[:4]
                for n, tokens in [batch_of(i)]
            ) + (", ..." if len(decodes) > 4 else "")
            return (
                RejectReason.OVERLOAD,
                f"decode load {load:.2f} of the TBT SLO {when_prefill_ends(kind, choice)} ({batches})",
                retry_decode,
            )
        if tbt == float("inf"):
            cap = decode.load.batch_cap or decode.capacity
            return (
                RejectReason.TBT_SLO,
                f"decode {decode.id}'s batch of {cap} is full {when_prefill_ends(kind, choice)}",
                retry_decode,
            )
        if tbt > limit:
            return RejectReason.TBT_SLO, f"predicted TBT {tbt:.3f} s is over the {slo.tbt_s} s SLO", retry_decode
        return None

    def _record(
        self, req: ScheduleRequest, choice: PrefillChoice, decode: Instance, now: float, landing_blocks: int
    ) -> None:
        load = choice.instance.load
        if len(self._ttfts) < MAX_PENDING_TTFTS:
            self._ttfts[req.request_id] = Placed(
                choice.instance.id,
                Prediction(choice.ttft_s, 0.0, choice.queue_s, choice.transfer_s, choice.prefill_s),
                choice.instance.slowdown,
                now,
                req.prompt_tokens,
                choice.plan.compute_tokens,
                load.queued_tokens,
                self._busy_prefill() if self.audit is not None else 0,  # only the log reads it: not on every Schedule
            )
        # its own part (not the hand-off), as the instance reports its queue: one prompt after the other
        own = choice.work_s if choice.work_s >= 0 else choice.prefill_s + choice.transfer_s - self.handoff_s
        choice.instance.place(req.request_id, own, choice.plan.compute_tokens)
        load.queued_requests += 1
        self.forecast.scheduled(
            req.request_id,
            decode.id,
            now + choice.ttft_s,
            req.prompt_tokens + req.expected_output_tokens // 2,
            now,
            landing_blocks,
        )
        self.last_sent[choice.instance.id] = self.last_sent[decode.id] = now
        self.shares.admitted(req, now)
        self._count(choice.instance.id, req, choice.plan)

    def _record_local(self, req: ScheduleRequest, local: LocalChoice, now: float) -> None:
        d = local.decode
        if len(self._ttfts) < MAX_PENDING_TTFTS:
            self._ttfts[req.request_id] = Placed(
                d.id,
                Prediction(local.ttft_s, 0.0, local.queue_s, local.transfer_s, local.prefill_s),
                d.slowdown,
                now,
                req.prompt_tokens,
                local.plan.compute_tokens,
                busy=self._busy_prefill() if self.audit is not None else 0,
            )
        d.local_queue_s += local.transfer_s + local.prefill_s
        self.forecast.scheduled(
            req.request_id, d.id, now + local.ttft_s, req.prompt_tokens + req.expected_output_tokens // 2, now
        )
        self.last_sent[d.id] = now
        self.shares.admitted(req, now)
        self._count(d.id, req, local.plan)  # a decode instance's figures: the prompts it computed itself
        self.counters.local += 1

    def _busy_prefill(self) -> int:
        """Prefill instances with predicted work queued (the audit's ``Placed.busy``)."""
        return sum(1 for i in self.instances.values() if i.role is Role.PREFILL and i.load.queued_s > 0.0)

    def _count(self, instance_id: str, req: ScheduleRequest, plan: PrefixPlan) -> None:
        """A placement into the counters and ``instance_id``'s figures (the instance that computes the prompt)."""
        served = self.served.setdefault(instance_id, Served())
        served.decisions += 1
        served.prompt_blocks += len(req.keys)
        served.reused_blocks += plan.reused_blocks
        served.fetched_blocks += plan.fetch_blocks
        c = self.counters
        c.scheduled += 1
        c.reused_blocks += plan.reused_blocks
        c.fetched_blocks += plan.fetch_blocks
        c.computed_tokens += plan.compute_tokens

    def _uncount(self, rejection: Rejection) -> None:
        reason = rejection.reason.value
        self.counters.rejected[reason] -= 1
        if not self.counters.rejected[reason]:
            del self.counters.rejected[reason]

    def _reject(
        self,
        req: ScheduleRequest,
        reason: RejectReason,
        message: str,
        retry: float,
        predicted: Prediction | None = None,
    ) -> Rejection:
        self.counters.rejected[reason.value] = self.counters.rejected.get(reason.value, 0) + 1
        return Rejection(req.request_id, reason, message, retry, predicted)


def when_prefill_ends(kind: AdmissionKind, choice: PrefillChoice) -> str:
    """When the decode side is judged, for a message: now (plain early) or when the prefill would end."""
    return "now" if kind is AdmissionKind.EARLY else f"in {choice.ttft_s:.1f} s"
