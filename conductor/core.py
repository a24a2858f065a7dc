"""The Conductor's state and its decisions, with no I/O: the gRPC service and the simulator both drive it.

    conductor = Conductor(ConductorConfig())
    conductor.register(Instance("p0", Role.PREFILL, "10.0.0.1:7000", node="kv0"), now)
    conductor.stored("kv0", key, Tier.DRAM, parent)         # from kvstore event streams
    outcome = conductor.schedule(ScheduleRequest(...), now)  # Decision or Rejection

Time is always passed in (``now``, seconds on any monotonic clock), so the simulator can
run it on simulated time. Not thread-safe: the service serialises calls with a lock.

The Conductor is composed of parts, each owning its state behind a small interface; the
Conductor builds them, holds them, and hands each what it needs:

    registry  Registry (conductor.registry): the instances, their states and loads, who retires
    learning  Learning (conductor.learning): the predictors, the hand-off, predictions awaiting their TTFT
    judge     Judge (conductor.judge): the admission and local-prefill modes; the decode side and the verdicts
    overload  Overload (conductor.overload): early_wait's queue, tenants' shares, the shed verdict
    index     KVIndex (conductor.index): which pool node holds which blocks
    forecast  DecodeForecast (conductor.forecast): the requests placed on each decode instance, until they end

The Conductor itself keeps the policy, the counters, and what the service and the planner
set on it (``audit``, ``decode_due``); a Schedule passes through it in three hops: the
registry's pools, the policy's and the judge's choices, and the record of the placement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from conductor.admission import AdmissionKind
from conductor.config import ConductorConfig
from conductor.drain import Departures
from conductor.forecast import DecodeForecast
from conductor.index import KVIndex, PromptWrites
from conductor.judge import MIN_RETRY_S, Judge
from conductor.learning import Learning
from conductor.local import LocalChoice, LocalPrefill
from conductor.overload import WAITABLE, Overload
from conductor.policies import PolicyKind, PrefillChoice, ahead_of_queue, make_policy
from conductor.predictors import Predictors
from conductor.quotes import Quotes
from conductor.registry import Registry
from conductor.types import (
    Decision,
    Instance,
    Load,
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
from conductor.waiting import WAIT_GAP_S, FairShare, WaitQueue
from kvstore.events import Tier

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}  # the KV dtypes workers register, by name

# a prompt's new blocks are written to its node after its first token: one that ``follows`` it may count on them until
# that predicted time and this long after (the write takes milliseconds; a longer wait means something went wrong)
WRITE_GRACE_S = 5.0


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


class Conductor:
    """The global scheduler: it builds its parts (the module docstring), and every call passes through it to them."""

    def __init__(self, config: ConductorConfig | None = None) -> None:
        self.config = config or ConductorConfig()
        self.index = KVIndex()
        self.quotes = Quotes()  # what each placement predicted, and how often that held (conductor.quotes)
        self.writes = PromptWrites()  # where placed prompts' new blocks are being written (a ``follows`` request's)
        self.forecast = DecodeForecast(self.config.default_decode_s, kind=self.config.decode_forecast)
        self.registry = Registry(self.config)
        self.learning = Learning(self.config)
        self.departures = Departures()  # when requests left each decode instance (a refusal's Retry-After)
        self.judge = Judge(
            self.config, self.learning.predictors, self.forecast, self.learning.calibration, self.departures
        )
        self.overload = Overload(self.config, self.judge, self.learning.predictors, self.forecast)
        self.policy = make_policy(self.config.policy, self.config.policy_config)
        self.counters = Counters()
        self.served: dict[str, Served] = {}  # prefill instance id -> what it was given
        # called with each placement and what came out (the service's --prediction-log); None: nothing is called
        self.audit: Callable[[str, Placed, Measured, float], None] | None = None
        # The planner acting (conductor.planning sets it): when the next decode instance it started is predicted to
        # serve (inf: none is starting; one may come with its next plan). None: no planner adds decode instances, so a
        # prompt no decode worker has room for is refused (decode_busy) instead of held at its gateway
        # (Overload.hold_for_room)
        self.decode_due: float | None = None

    # -- what the service, the planner and the tests read (each part owns it) ------------------

    @property
    def instances(self) -> dict[str, Instance]:
        return self.registry.instances

    @property
    def retiring(self) -> set[str]:
        return self.registry.retiring

    @property
    def predictors(self) -> Predictors:
        return self.learning.predictors

    @property
    def handoff_s(self) -> float:
        return self.learning.handoff_s

    @property
    def admission(self) -> AdmissionKind:
        return self.judge.kind

    @property
    def local_prefill(self) -> LocalPrefill:
        return self.judge.local_prefill

    @property
    def waiting(self) -> WaitQueue:
        return self.overload.waiting

    @property
    def shares(self) -> FairShare:
        return self.overload.shares

    # -- configuration at run time -------------------------------------------------------

    def set_policy(self, kind: PolicyKind | str) -> None:
        self.policy = make_policy(kind, self.config.policy_config)

    def set_local_prefill(self, mode: LocalPrefill | str) -> None:
        self.judge.set_local_prefill(mode)

    def set_admission(self, kind: AdmissionKind | str) -> None:
        self.judge.set_kind(kind)

    # -- the index -------------------------------------------------------------------------

    def stored(self, node: str, key: bytes, tier: Tier, parent: bytes | None) -> None:
        self.index.stored(node, key, tier, parent)

    def removed(self, node: str, key: bytes, tier: Tier) -> None:
        self.index.removed(node, key, tier)

    def snapshot(self, node: str, blocks: list[tuple[bytes, Tier, bytes | None]]) -> None:
        self.index.reset_node(node, blocks)

    # -- instances (conductor.registry) ------------------------------------------------------

    def register(self, inst: Instance, now: float) -> None:
        """Add or re-add an instance (a restarted worker re-registers under its id)."""
        self.registry.register(inst, now)
        if inst.role is Role.KVSTORE and inst.block_bytes:
            self.learning.pool_block_bytes(inst.block_bytes)

    def heartbeat(self, instance_id: str, load: Load, now: float) -> int:
        """An instance's load (a prefill instance's prompts priced by this Conductor's predictor). Returns a decode
        instance's batch cap (``decode_cap``; 0 for the others, or none known
        yet): the worker applies it to its engine, so the step model and its headroom have one owner, here."""
        inst = self.registry.heartbeat(instance_id, load, now, self.learning.price_queue)
        if inst.role is not Role.DECODE:
            return 0
        self.learning.step_sample(inst, load)
        cap = self.learning.decode_cap(inst)
        if cap:
            load.batch_cap = cap
        return cap

    def decode_cap(self, inst: Instance) -> int:
        return self.learning.decode_cap(inst)

    def suspect(self, instance_id: str, now: float) -> bool:
        return self.registry.suspect(instance_id, now)

    def drain(self, instance_id: str, remove: bool = False) -> list[str]:
        return self.registry.drain(instance_id, remove)

    def retired(self, instance_id: str) -> None:
        self.registry.retired(instance_id)

    def scale_plan(self, role: Role | str, replicas: int) -> tuple[int, list[str]]:
        return self.registry.scale_plan(role, replicas)

    def idle_to_remove(self, now: float, quiet_s: float) -> list[Instance]:
        return self.registry.idle_to_remove(now, quiet_s, self.forecast.count)

    def alive(self, role: Role) -> list[Instance]:
        return self.registry.alive(role)

    def deregister(self, instance_id: str) -> None:
        inst = self.registry.deregister(instance_id)
        if inst is not None:
            self._forget(inst)

    def expire(self, now: float) -> list[str]:
        """Mark instances silent for ``heartbeat_timeout_s`` dead and forget what they held; return their ids."""
        dead = self.registry.expire(now)
        for inst in dead:
            self._forget(inst)
        ttft_s = max(s.ttft_s for s in self.config.slo_classes.values())
        self.forecast.expire(now, ttft_s)
        self.overload.expire(now, 4 * self.forecast.t_d + ttft_s)
        return [inst.id for inst in dead]

    def _forget(self, inst: Instance) -> None:
        if inst.role is Role.KVSTORE:
            self.index.reset_node(inst.node)  # its blocks are gone from scheduling
        elif inst.role is Role.DECODE:
            self.forecast.forget_instance(inst.id)
            self.departures.forget(inst.id)

    # -- measurements (conductor.learning) ---------------------------------------------------

    def prefill_sample(
        self, prompt_tokens: int, cached_tokens: int, seconds: float, instance: str | None = None
    ) -> None:
        """One measured prefill; ``instance`` (its id) says whose: a pipeline group's samples fit its own predictor."""
        inst = self.registry.instances.get(instance) if instance is not None else None
        self.learning.prefill_sample(inst, prompt_tokens, cached_tokens, seconds)

    def transfer_sample(self, num_bytes: int, seconds: float) -> None:
        self.learning.transfer_sample(num_bytes, seconds)

    def handoff_sample(self, seconds: float) -> None:
        self.learning.handoff_sample(seconds)

    def decode_started(
        self, request_id: str, now: float, measured_ttft_s: float = 0.0, queue_s: float = 0.0, prefill_s: float = 0.0
    ) -> Prediction | None:
        """``request_id`` joined its decode batch ``measured_ttft_s`` after its decode worker got it (0: not known), of
        which ``queue_s`` and ``prefill_s`` in its prefill worker's queue and prefill (0: not measured). Returns what
        was predicted for it when this measured TTFT is its first (``Learning.measured``)."""
        self.forecast.decode_started(request_id, now)
        return self._measured(request_id, Measured(measured_ttft_s, queue_s, prefill_s), now)

    def finished(
        self,
        request_id: str,
        now: float,
        measured_ttft_s: float = 0.0,
        queue_s: float = 0.0,
        prefill_s: float = 0.0,
        measured_tbt_s: float = 0.0,
    ) -> Prediction | None:
        """``request_id`` left its decode worker: done, failed, cancelled, or answered with its first token alone
        (``measured_ttft_s`` > 0: it got one, without joining a batch), its tokens ``measured_tbt_s`` apart on average
        (0: not measured). Returns as ``decode_started`` does."""
        left = self.forecast.finished(request_id, now)
        if left is not None:
            self.departures.left(left, now)
        self.overload.finished(request_id)
        self.quotes.ended(request_id, measured_tbt_s)
        return self._measured(request_id, Measured(measured_ttft_s, queue_s, prefill_s), now)

    def _measured(self, request_id: str, measured: Measured, now: float) -> Prediction | None:
        made = self.learning.measured(request_id, measured, self.registry.instances)
        if made is None:
            return None
        if measured.ttft_s > 0:
            self.quotes.came_out("ttft", made.predicted.ttft_s, measured.ttft_s)
        if self.audit is not None:
            self.audit(request_id, made, measured, now)
        return made.predicted

    # -- decisions -------------------------------------------------------------------------

    def slo(self, slo_class: str) -> Slo:
        slo = self.config.slo_classes.get(slo_class)
        if slo is None:
            raise ValueError(
                f"unknown SLO class {slo_class!r}; configured: {', '.join(sorted(self.config.slo_classes))}"
            )
        return slo

    def slo_of(self, req: ScheduleRequest, now: float) -> Slo:
        """The SLO ``req`` is judged by now (``Overload.slo_of``: less its wait, a sheddable one's cut)."""
        return self.overload.slo_of(req, self.slo(req.slo_class), now)

    def kv_held(self, inst: Instance) -> int:
        """The blocks of decode ``inst``'s KV capacity held now, as the Conductor counts them (``Judge.kv_held``)."""
        return self.judge.kv_held(inst)

    def admit_at_decode(self, decode_id: str, now: float, context_tokens: int = 0) -> Rejection | None:
        """The baseline's late check, made when a prefill has finished (``Judge.admit_at_decode``)."""
        return self.judge.admit_at_decode(self.registry.instances.get(decode_id), context_tokens)

    def shed_s(self, now: float) -> float:
        """How long every request will be refused: ``overload.SHED_S`` if even the cheapest request would be now, else
        0 (``Overload.shed_s``)."""
        return self.overload.shed_s(now, self.registry.pools, self.decode_due)

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
            self.overload.pressed(req, now)  # its tenant wants more than it gets (fair shares, priorities)
        return outcome

    def _schedule(self, req: ScheduleRequest, now: float) -> Decision | Rejection | Wait:
        if self.judge.kind is not AdmissionKind.EARLY_WAIT:
            return self._place(req, now)
        slo = self.slo_of(req, now)
        ahead = self.overload.ahead_until(req, now)
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
        self.overload.release(req.request_id)
        return outcome

    def _wait_for(
        self, req: ScheduleRequest, now: float, slo: Slo, at_least: float = 0.0
    ) -> tuple[float, Prediction] | None:
        """``Overload.wait_for`` for ``req`` on the instances alive now, from the prefill instance the policy picks."""
        prefills, decodes = self.registry.pools(now)
        if not prefills or not decodes:
            return None
        choice = self._with_handoff(self.policy.choose(req, prefills, self.index.match(req.keys), self.predictors))
        return self.overload.wait_for(req, choice, decodes, now, slo, at_least)

    def _hold(
        self, req: ScheduleRequest, wait: float, now: float, slo: Slo, why: str, predicted: Prediction | None = None
    ) -> Wait | Rejection:
        held = self.overload.hold(req, wait, now, slo, why, predicted)
        return held if isinstance(held, Wait) else self._reject(req, *held)

    def _with_handoff(self, choice: PrefillChoice) -> PrefillChoice:
        """``choice`` with the KV's way to the decode worker (the learnt hand-off): a fixed cost, like the prefix's
        transfer."""
        handoff_s = self.learning.handoff_s
        return dataclasses.replace(choice, transfer_s=choice.transfer_s + handoff_s) if handoff_s else choice

    def _place(self, req: ScheduleRequest, now: float) -> Decision | Rejection | Wait:
        """``schedule`` without waiting: a placement (recorded) or a rejection (or, with the planner acting, a wait for
        decode room: ``Overload.hold_for_room``)."""
        slo = self.slo_of(req, now)
        for instance_id in req.failed:
            self.registry.suspect(instance_id, now)
        prefills, decodes = self.registry.pools(now)
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
        takers = self.judge.takers(decodes, blocks)
        if not takers:
            held = self.overload.hold_for_room(req, decodes, blocks, now, slo, self.decode_due)
            if isinstance(held, Wait):
                return held
            if held is not None:
                return self._reject(req, *held)
            return dataclasses.replace(
                self._reject(req, RejectReason.DECODE_BUSY, self.judge.busy_message(decodes, blocks), MIN_RETRY_S),
                shed_s=self.shed_s(now),
            )
        match = self.index.match(req.keys)
        if req.follows:
            match = self.writes.follow(req.follows, req.keys, match, now)
        if req.retry:  # it goes ahead of each queue (Placement.ahead): the policy sees the queues as it will meet them
            choice = self.policy.choose(req, ahead_of_queue(prefills), match, self.predictors)
            choice = dataclasses.replace(choice, instance=self.registry.instances[choice.instance.id])
        else:
            choice = self.policy.choose(req, prefills, match, self.predictors)
        choice = self._with_handoff(choice)
        decode, tbt, batch_of = self.judge.pick_decode(req, takers, now + choice.ttft_s, now, len(decodes), slo)
        local = self.judge.local(req, choice, decode, match, now, len(decodes), slo)
        if local is not None:  # its decode worker computes it
            predicted, verdict = self.judge.admit_local(req, local, tbt, decodes, now, slo)
            verdict = verdict or self.overload.over_share(req, predicted.ttft_s, decodes, now, slo)
            if verdict is None:
                self._record_local(req, local, now)
                self.quotes.quoted(req.request_id, predicted.tbt_s)
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
            local is None or self.judge.local_prefill is not LocalPrefill.ALWAYS
        ):  # auto: refused there, a prefill worker may do
            predicted = Prediction(choice.ttft_s, tbt, choice.queue_s, choice.transfer_s, choice.prefill_s)
            verdict = self.judge.admit(req, choice, decode, tbt, decodes, batch_of, slo, now)
            verdict = verdict or self.overload.over_share(req, choice.ttft_s, decodes, now, slo)
        if verdict is not None:
            reason, message, retry = verdict
            return dataclasses.replace(self._reject(req, reason, message, retry, predicted), shed_s=self.shed_s(now))
        self._record(req, choice, decode, now, blocks)
        self.quotes.quoted(req.request_id, predicted.tbt_s)
        self.writes.placed(req.request_id, choice.instance.node, req.keys, now + choice.ttft_s + WRITE_GRACE_S)
        return Decision(
            req.request_id,
            choice.instance.id,
            decode.id,
            choice.plan,
            predicted,
            self.policy.kind.value,
            admit_at_decode=self.judge.kind is AdmissionKind.BASELINE,
            ahead=req.retry,
            narrow=self._narrow(choice.instance, decode, blocks),
        )

    def _narrow(self, prefill: Instance, decode: Instance, blocks: int) -> bool:
        """Whether a prompt of ``blocks`` blocks moves to ``decode`` in the pool's narrower dtype (``narrow_handoff``):
        never where the pool is not narrower; under auto only between hosts (on one host the decode engine's cache is
        written in place) and where the narrower bytes plus converting them both ways are predicted to arrive sooner
        than the cache's bytes, at the pool bandwidth learnt from prefix fetches (the same network)."""
        mode = self.config.narrow_handoff
        narrow = ITEMSIZE.get(decode.pool_kv_dtype, 0)
        if mode == "never" or not narrow or not ITEMSIZE.get(decode.kv_dtype):
            return False
        if mode == "always":
            return True
        if prefill.address.rpartition(":")[0] == decode.address.rpartition(":")[0]:
            return False
        pool_bytes = blocks * self.predictors.block_bytes  # the pool's block bytes (its nodes registered them)
        full_bytes = pool_bytes * ITEMSIZE[decode.kv_dtype] // narrow
        t = self.predictors.transfer
        return t.predict(pool_bytes) + full_bytes / self.config.narrow_convert_bytes_per_s < t.predict(full_bytes)

    def _record(
        self, req: ScheduleRequest, choice: PrefillChoice, decode: Instance, now: float, landing_blocks: int
    ) -> None:
        load = choice.instance.load
        self.learning.expect(
            req.request_id,
            Placed(
                choice.instance.id,
                Prediction(choice.ttft_s, 0.0, choice.queue_s, choice.transfer_s, choice.prefill_s),
                choice.instance.slowdown,
                now,
                req.prompt_tokens,
                choice.plan.compute_tokens,
                load.queued_tokens,
                # only the log reads it: not counted on every Schedule
                self.registry.busy_prefills() if self.audit is not None else 0,
            ),
        )
        # its own part (not the hand-off), as the instance reports its queue: one prompt after the other
        own = choice.work_s if choice.work_s >= 0 else choice.prefill_s + choice.transfer_s - self.learning.handoff_s
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
        self.registry.placed((choice.instance.id, decode.id), now)
        self.overload.admitted(req, now)
        self._count(choice.instance.id, req, choice.plan)

    def _record_local(self, req: ScheduleRequest, local: LocalChoice, now: float) -> None:
        d = local.decode
        self.learning.expect(
            req.request_id,
            Placed(
                d.id,
                Prediction(local.ttft_s, 0.0, local.queue_s, local.transfer_s, local.prefill_s),
                d.slowdown,
                now,
                req.prompt_tokens,
                local.plan.compute_tokens,
                busy=self.registry.busy_prefills() if self.audit is not None else 0,
            ),
        )
        d.local_queue_s += local.transfer_s + local.prefill_s
        self.forecast.scheduled(
            req.request_id, d.id, now + local.ttft_s, req.prompt_tokens + req.expected_output_tokens // 2, now
        )
        self.registry.placed((d.id,), now)
        self.overload.admitted(req, now)
        self._count(d.id, req, local.plan)  # a decode instance's figures: the prompts it computed itself
        self.counters.local += 1

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
        return Rejection(req.request_id, reason, message, retry, predicted, offer_slo_class=self._offer(req, predicted))

    def _offer(self, req: ScheduleRequest, predicted: Prediction | None) -> str:
        """The strictest other SLO class (by TTFT, then TBT) whose targets ``predicted`` meets: what a refused request
        could have at once instead of a later start ("": none, or nothing predicted)."""
        if predicted is None or predicted.ttft_s <= 0:
            return ""
        fits = [
            (slo.ttft_s, slo.tbt_s, name)
            for name, slo in self.config.slo_classes.items()
            if name != req.slo_class and predicted.ttft_s <= slo.ttft_s and 0 < predicted.tbt_s <= slo.tbt_s
        ]
        return min(fits)[2] if fits else ""
