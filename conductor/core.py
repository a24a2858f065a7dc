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

from pydantic import BaseModel, Field

from conductor.admission import AdmissionKind, Batch, decode_load, join_tbt, reported_batch, select_decode
from conductor.forecast import DecodeForecast, ForecastKind
from conductor.index import KVIndex, PrefixMatch
from conductor.local import LocalChoice, LocalPrefill, can_prefill, estimate_local, step_at_cap
from conductor.policies import PolicyConfig, PolicyKind, PrefillChoice, estimate, make_policy
from conductor.predictors import PredictorConfig, Predictors
from conductor.types import (
    DEFAULT_SLO,
    Decision,
    Instance,
    InstanceState,
    Load,
    Prediction,
    PrefixPlan,
    Rejection,
    RejectReason,
    Role,
    ScheduleRequest,
    Slo,
)
from kvstore.events import Tier

MIN_RETRY_S, MAX_RETRY_S = 1.0, 60.0
HANDOFF_ALPHA = 0.1  # how far one measured hand-off moves the learnt one
SLOWDOWN_ALPHA = 0.1  # how far one measured TTFT (of a second's prediction or more) moves its instance's slowdown
SLOWDOWN_STEP = (0.5, 2.0)  # the most one measurement can say: a stalled or an instant request is mostly noise
SLOWDOWN_RANGE = (0.5, 8.0)
MAX_PENDING_TTFTS = 100_000  # predictions awaiting their measured TTFT (a worker that never reports cannot grow it)
SHED_S = 0.25  # how long a "refuse everything" verdict stands before it is asked again (Conductor.shed_s)
SHED_TIMES = 8  # when the cheapest request's prefill could end: points from its soonest to the SLO, checked
SHED_BUSY_S = 0.1  # the same when every decode worker is full: a batch frees sooner than a prefill queue drains
SHED_REUSE_S = 0.02  # a verdict this fresh is reused (a burst's rejections do not each recompute it)


class ConductorConfig(BaseModel):
    policy: PolicyKind = Field(
        PolicyKind.KVCACHE_CENTRIC, description="prefill placement policy (a value persisted in Redis wins)"
    )
    admission: AdmissionKind = Field(
        AdmissionKind.EARLY_PREDICTIVE,
        description="admission (early rejection) policy (a value persisted in Redis wins)",
    )
    slo_classes: dict[str, Slo] = Field(default_factory=lambda: {"default": DEFAULT_SLO})
    block_bytes: int = Field(320 * 1024 * 16, gt=0, description="bytes of one KV block (for transfer estimates)")
    heartbeat_timeout_s: float = Field(10.0, gt=0, description="seconds of silence before an instance is dead")
    suspect_hold_s: float = Field(
        1.0,
        ge=0,
        description="an instance reported failing gets nothing new until a heartbeat "
        "sent this long after the report (a dead one sends none, and is dead after heartbeat_timeout_s)",
    )
    default_decode_s: float = Field(10.0, gt=0, description="t_d before any decode has finished")
    decode_forecast: ForecastKind = Field(
        ForecastKind.SURVIVAL,
        description="early_predictive's decode forecast: survival (measured decode durations, each request weighed "
        "by how long it has run, plus the joins to come at the recent rate) or uniform (the paper's: every decode "
        "lasts t_d)",
    )
    local_prefill: LocalPrefill = Field(
        LocalPrefill.AUTO,
        description="where prompts are computed: auto (a prefill worker or the decode worker itself, whichever is "
        "predicted to reach the first token sooner with its steps within the TBT SLO, the decode worker only "
        "while it has time to spare (--local-max-load): a short prompt, or a short new part of a prompt whose "
        "prefix is in the pool, skips the hand-off; conductor.local), never (a prefill worker; the paper's "
        "disaggregation) or always (the decode worker, where it runs our engine)",
    )
    local_max_load: float = Field(
        0.5,
        gt=0,
        le=1.0,
        description="auto: a decode worker computes prompts only while its batch's predicted step is at most this "
        "share of the TBT limit (0 < x <= 1; a busier one has no time to spare: every chunk lengthens every running "
        "request's step)",
    )
    local_chunk_tokens: int = Field(
        512,
        ge=1,
        description="a decode worker's token budget per step where it does not register its own (ours do: their "
        "--max-num-batched-tokens): the most of a prompt it computes itself that one step takes",
    )
    default_handoff_s: float = Field(
        0.0,
        ge=0,
        description="what handing a prompt's KV from a prefill worker to a decode "
        "worker costs before any is measured (decode workers report each; the first replaces this)",
    )
    tbt_headroom: float = Field(
        1.0,
        gt=0,
        le=1.0,
        description="admit while the predicted mean decode step stays under this share of the TBT SLO (0 < x <= 1; "
        "the SLO is on a request's slowest gaps, not its mean)",
    )
    predictors: PredictorConfig = Field(default_factory=PredictorConfig)
    policy_config: PolicyConfig = Field(default_factory=PolicyConfig)

    model_config = {"arbitrary_types_allowed": True}


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
        # request id -> (prefill instance id, predicted TTFT, of which transfer, its slowdown then): _measured learns
        self._ttfts: dict[str, tuple[str, float, float, float]] = {}

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

    # -- registry --------------------------------------------------------------------------

    def register(self, inst: Instance, now: float) -> None:
        """Add or re-add an instance (a restarted worker re-registers under its id)."""
        if not inst.id or not inst.address:
            raise ValueError("an instance needs an id and an address")
        inst.state, inst.last_heartbeat, inst.queue_at = InstanceState.ALIVE, now, now
        self.instances[inst.id] = inst
        self.retiring.discard(inst.id)

    def heartbeat(self, instance_id: str, load: Load, now: float) -> None:
        inst = self.instances.get(instance_id)
        if inst is None or inst.state is InstanceState.DEAD:
            raise KeyError(f"instance {instance_id!r} is not registered (register again)")
        inst.load, inst.last_heartbeat, inst.queue_at = load, now, now
        if inst.role is Role.PREFILL:  # predicted seconds of prefill as they come out, and what is on its way there
            load.queued_s = load.queued_s * inst.slowdown + inst.in_transit()
        if inst.state is InstanceState.SUSPECT and now >= inst.suspect_until:
            inst.state = InstanceState.ALIVE
        if (
            inst.role is Role.DECODE and load.step_s > 0
        ):  # the steps' own batch where reported (the running one may differ)
            batch, context = (
                (load.step_batch, load.step_context_tokens)
                if load.step_batch > 0
                else (load.running_requests, load.context_tokens)
            )
            if batch > 0:
                self.predictors.decode.observe(batch, context, load.step_s)

    def suspect(self, instance_id: str, now: float) -> bool:
        """A caller saw ``instance_id`` fail (a reset stream, an unreachable address): send it nothing new
        until it heartbeats ``suspect_hold_s`` from now. Long before the heartbeat timeout notices a dead
        instance, the requests after this one go elsewhere. Returns whether it was alive until now."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.state is not InstanceState.ALIVE:
            return False
        inst.state, inst.suspect_until = InstanceState.SUSPECT, now + self.config.suspect_hold_s
        return True

    def drain(self, instance_id: str, remove: bool = False) -> None:
        """Send ``instance_id`` nothing new; with ``remove``, stop it once it is idle (``idle_to_remove``)."""
        inst = self._get(instance_id)
        if inst.state in (InstanceState.ALIVE, InstanceState.SUSPECT):
            inst.state = InstanceState.DRAINING
        if remove and inst.role is not Role.KVSTORE:
            self.retiring.add(instance_id)

    def scale_plan(self, role: Role | str, replicas: int) -> tuple[int, list[str]]:
        """How to reach ``replicas`` schedulable instances of ``role``: (how many to add, which to drain and remove).

        Scaling down picks the least busy instances (ties: the last by id, so the first
        ones stay). Raises ValueError for the pool role or fewer than one replica.
        """
        role = Role(role)
        if role is Role.KVSTORE:
            raise ValueError("pool nodes scale with their prefill workers; scale prefill or decode")
        if replicas < 1:
            raise ValueError(f"a pool needs at least one instance (every request would be rejected); got {replicas}")
        alive = self.alive(role)
        if replicas >= len(alive):
            return replicas - len(alive), []

        def busy(i: Instance) -> tuple:
            return (i.load.queued_requests + i.load.running_requests, i.load.queued_s, [-ord(ch) for ch in i.id])

        return 0, [i.id for i in sorted(alive, key=busy)[: len(alive) - replicas]]

    def idle_to_remove(self, now: float, quiet_s: float) -> list[Instance]:
        """Retiring instances with nothing left to do: reported idle, no request in flight to them, and nothing
        placed there for ``quiet_s`` (a request placed just before the drain may not have reached them yet)."""
        out = []
        for iid in list(self.retiring):
            inst = self.instances.get(iid)
            if inst is None or inst.state is not InstanceState.DRAINING:
                self.retiring.discard(iid)
                continue
            load = inst.load
            busy = load.queued_requests or load.running_requests
            if inst.role is Role.DECODE:
                busy = busy or self.forecast.count(iid)
            if (
                not busy
                and now - self.last_sent.get(iid, -float("inf")) >= quiet_s
                and inst.last_heartbeat > self.last_sent.get(iid, -float("inf"))
            ):
                out.append(inst)
        return out

    def deregister(self, instance_id: str) -> None:
        inst = self.instances.pop(instance_id, None)
        self.retiring.discard(instance_id)
        self.last_sent.pop(instance_id, None)
        if inst is not None:
            self._forget(inst)

    def expire(self, now: float) -> list[str]:
        """Mark instances silent for ``heartbeat_timeout_s`` dead; return their ids."""
        dead = []
        for inst in self.instances.values():
            if inst.state is not InstanceState.DEAD and now - inst.last_heartbeat > self.config.heartbeat_timeout_s:
                inst.state = InstanceState.DEAD
                self._forget(inst)
                dead.append(inst.id)
        self.forecast.expire(now)
        return dead

    def _forget(self, inst: Instance) -> None:
        if inst.role is Role.KVSTORE:
            self.index.reset_node(inst.node)  # its blocks are gone from scheduling
        elif inst.role is Role.DECODE:
            self.forecast.forget_instance(inst.id)

    def _get(self, instance_id: str) -> Instance:
        inst = self.instances.get(instance_id)
        if inst is None:
            raise KeyError(f"no instance {instance_id!r}")
        return inst

    def alive(self, role: Role) -> list[Instance]:
        return [i for i in self.instances.values() if i.role is role and i.schedulable]

    def _alive_pools(self, now: float) -> tuple[list[Instance], list[Instance]]:
        """(alive prefill instances, alive decode instances), in one pass (every Schedule asks); each prefill
        instance's queue as it stands at ``now`` (``Instance.drain``)."""
        prefills, decodes = [], []
        for i in self.instances.values():
            if i.role is Role.PREFILL:
                if i.schedulable:
                    i.drain(now)
                    prefills.append(i)
            elif i.role is Role.DECODE and i.schedulable:
                i.drain_local(now)
                decodes.append(i)
        return prefills, decodes

    # -- the index -------------------------------------------------------------------------

    def stored(self, node: str, key: bytes, tier: Tier, parent: bytes | None) -> None:
        self.index.stored(node, key, tier, parent)

    def removed(self, node: str, key: bytes, tier: Tier) -> None:
        self.index.removed(node, key, tier)

    def snapshot(self, node: str, blocks: list[tuple[bytes, Tier, bytes | None]]) -> None:
        self.index.reset_node(node, blocks)

    # -- measurements ----------------------------------------------------------------------

    def prefill_sample(
        self, prompt_tokens: int, cached_tokens: int, seconds: float, instance: str | None = None
    ) -> None:
        """One measured prefill; ``instance`` (its id) says whose: a pipeline group's samples fit its own predictor."""
        inst = self.instances.get(instance) if instance is not None else None
        predictor = (
            self.predictors.prefill
            if inst is None
            else self.predictors.prefill_for(inst.pipeline_stages, inst.pipeline_chunk)
        )
        predictor.observe(prompt_tokens, cached_tokens, seconds)

    def transfer_sample(self, num_bytes: int, seconds: float) -> None:
        self.predictors.transfer.observe(num_bytes, seconds)

    def decode_started(self, request_id: str, now: float, measured_ttft_s: float = 0.0) -> float | None:
        """``request_id`` joined its decode batch ``measured_ttft_s`` after its decode worker got it (0: not known).
        Returns the TTFT predicted for it when this measured one is its first (``_measured``)."""
        self.forecast.decode_started(request_id, now)
        return self._measured(request_id, measured_ttft_s)

    def finished(self, request_id: str, now: float, measured_ttft_s: float = 0.0) -> float | None:
        """``request_id`` left its decode worker: done, failed, cancelled, or answered with its first token alone
        (``measured_ttft_s`` > 0: it got one, without joining a batch). Returns as ``decode_started`` does."""
        self.forecast.finished(request_id, now)
        return self._measured(request_id, measured_ttft_s)

    def handoff_sample(self, seconds: float) -> None:
        """A decode worker measured one hand-off: its TTFT less the prefill worker's own queue and prefill. The first
        replaces the default; the later ones are averaged in."""
        if seconds < 0:
            raise ValueError(f"bad hand-off sample: {seconds} s")
        self.handoff_s = (
            seconds if not self._handoffs else (1 - HANDOFF_ALPHA) * self.handoff_s + HANDOFF_ALPHA * seconds
        )
        self._handoffs += 1

    def _measured(self, request_id: str, measured_ttft_s: float) -> float | None:
        """A request's TTFT came out (first report only): its prefill instance's ``slowdown`` moves toward what it
        implies; its predicted prefill and queue times scale by it. A worker's predictor learns what a prompt's steps
        cost; what the client waits for also holds the time between steps, the hops, and cores shared with the other
        workers (on 2 cores, two prefill workers and a decode worker came out at twice their predictions as soon as all
        were busy). A prediction of well under a second weighs less: its fixed hops are most of it. No TTFT: it ended
        before its prefill (its decode worker turned it away), so it never reached the instance.

        Returns the TTFT predicted for it (None: no prediction is held for it, or no TTFT was measured)."""
        made = self._ttfts.pop(request_id, None)
        if made is None:
            return None
        instance_id, predicted, transfer, slowdown = made
        inst = self.instances.get(instance_id)
        if measured_ttft_s <= 0.0:
            if inst is not None:
                inst.lose(request_id)
            return None
        work = predicted - transfer
        if inst is not None and work > 0.0:
            implied = slowdown * min(max((measured_ttft_s - transfer) / work, SLOWDOWN_STEP[0]), SLOWDOWN_STEP[1])
            weight = SLOWDOWN_ALPHA * min(1.0, work)
            inst.slowdown = min(
                max((1.0 - weight) * inst.slowdown + weight * implied, SLOWDOWN_RANGE[0]), SLOWDOWN_RANGE[1]
            )
        return predicted

    # -- decisions -------------------------------------------------------------------------

    def slo(self, slo_class: str) -> Slo:
        slo = self.config.slo_classes.get(slo_class)
        if slo is None:
            raise ValueError(
                f"unknown SLO class {slo_class!r}; configured: {', '.join(sorted(self.config.slo_classes))}"
            )
        return slo

    def schedule(self, req: ScheduleRequest, now: float) -> Decision | Rejection:
        """Pick the prefill and decode instances and the prefix plan for ``req``, or reject it.

        Raises ValueError for a malformed request. A Decision is recorded: the prefill
        instance's queue grows by the predicted prefill time until its next heartbeat,
        and the request joins the decode forecast.
        """
        req.validate()
        slo = self.slo(req.slo_class)
        for instance_id in req.failed:
            self.suspect(instance_id, now)
        prefills, decodes = self._alive_pools(now)
        if not prefills:
            return self._reject(req, RejectReason.NO_PREFILL, "no prefill instance is alive", MIN_RETRY_S)
        if not decodes:
            return self._reject(req, RejectReason.NO_DECODE, "no decode instance is alive", MIN_RETRY_S)
        blocks = -(
            -req.prompt_tokens // req.block_tokens
        )  # what its prompt's KV takes of a decode worker's landing slots
        takers = self._takers(decodes, blocks)
        if not takers:
            return dataclasses.replace(
                self._reject(req, RejectReason.DECODE_BUSY, self._busy_message(decodes, blocks), MIN_RETRY_S),
                shed_s=self.shed_s(now),
            )
        match = self.index.match(req.keys)
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
        if verdict is not None:
            reason, message, retry = verdict
            return dataclasses.replace(self._reject(req, reason, message, retry, predicted), shed_s=self.shed_s(now))
        self._record(req, choice, decode, now, blocks)
        return Decision(req.request_id, choice.instance.id, decode.id, choice.plan, predicted, self.policy.kind.value)

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
            return SHED_BUSY_S
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
        if self.admission is AdmissionKind.EARLY_PREDICTIVE and slo.ttft_s > choice.ttft_s:
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

    def _takers(self, decodes: list[Instance], blocks: int) -> list[Instance]:
        """The decode instances that would take one more request of ``blocks`` landing blocks now; under the early
        admissions, those whose worker would not refuse it as ``decode.worker.DecodeWorker.generate`` does.

        A worker refuses when the requests running past its batch cap (``Load.batch_cap``: what
        its TBT SLO allows, in every heartbeat; they have landed and wait for a place) come to a
        whole batch, or when its landing room (``Load.landing_blocks``) has no room for the
        prompt's KV beside that of the requests in prefill there. A request in prefill holds
        landing room, not a place in the batch: whether the batch has a place for it when it
        lands is the forecast's question (early_predictive's TBT check), asked at the time its
        prefill ends. Those requests come from the forecast's bookkeeping
        (scheduled here, their decode start and end reported by the worker), as fresh as the
        last report; what a worker does not report is not checked here. Refused here, such a
        request hears 429 in a fraction of a millisecond instead of after a round trip to a
        busy worker, and while every worker is full the gateway sheds.
        """
        if self.admission not in (AdmissionKind.EARLY, AdmissionKind.EARLY_PREDICTIVE):
            return decodes
        return [inst for inst in decodes if not self._refusal(inst, blocks)]

    def _refusal(self, inst: Instance, blocks: int) -> str:
        """Why ``inst``'s worker would refuse a request of ``blocks`` landing blocks now ("": it would take it)."""
        _, decoding, landing = self.forecast.occupancy(inst.id)
        cap, room = inst.load.batch_cap, inst.load.landing_blocks
        if cap and decoding - cap >= cap:
            return f"{inst.id}: {decoding - cap} waiting for a place in a batch of {cap}"
        if room and landing + blocks > room:
            return f"{inst.id}: {landing} of {room} landing blocks held, {blocks} more needed"
        return ""

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
            _clamp(self.forecast.t_d / 2),
        )

    def _batch_at(self, t: float, now: float, num_decodes: int) -> Callable[[Instance], Batch]:
        """The batch a request joining a decode instance at ``t`` would find there, as this admission sees it.

        early_predictive: the decode forecast at ``t`` (DESIGN §5). The others: the
        reported batch plus what was sent there and has not started decoding (so requests
        scheduled between two heartbeats spread over the instances).
        """
        if self.admission is AdmissionKind.EARLY_PREDICTIVE:
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
        if self.admission is not AdmissionKind.EARLY_PREDICTIVE:
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
            _clamp(choice.queue_s),
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
        retry_decode = _clamp(self.forecast.t_d / 2)
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
            self._ttfts[req.request_id] = (
                choice.instance.id,
                choice.ttft_s,
                choice.transfer_s,
                choice.instance.slowdown,
            )
        choice.instance.place(
            req.request_id, choice.prefill_s + choice.transfer_s - self.handoff_s
        )  # its part: not the hand-off
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
        self._count(choice.instance.id, req, choice.plan)

    def _record_local(self, req: ScheduleRequest, local: LocalChoice, now: float) -> None:
        d = local.decode
        if len(self._ttfts) < MAX_PENDING_TTFTS:
            self._ttfts[req.request_id] = (d.id, local.ttft_s, local.transfer_s, d.slowdown)
        d.local_queue_s += local.transfer_s + local.prefill_s
        self.forecast.scheduled(
            req.request_id, d.id, now + local.ttft_s, req.prompt_tokens + req.expected_output_tokens // 2, now
        )
        self.last_sent[d.id] = now
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


def _clamp(seconds: float) -> float:
    return min(MAX_RETRY_S, max(MIN_RETRY_S, seconds))
