"""Instances that come and go in the twin: started, registered when ready, drained, stopped when idle; their cost.

A part of ``conductor.planner.twin.Cluster`` (which inherits it), apart by concept, as a real cluster scales:

    scale_to(role, n)   more: new instances start now and register ``start_s`` later (a prefill instance
                        with a node of its own, empty, that calibrates as it registers, as a real worker)
                        fewer: the Conductor picks and drains them (``Conductor.scale_plan``, ``drain``);
                        each tick, the drained ones it finds idle (``idle_to_remove``, ``retire_quiet_s``
                        after the last placement there) stop and deregister, a prefill node's blocks with it
    autoscaler          asked every ``plan_interval_s`` for the counts it wants (None: as they are)
    instance_seconds    what the pools cost: every instance from the moment it was asked for (a starting
                        one is paid for) to the moment it stopped, or the run's end

Moving a leaving node's blocks to the nodes that stay (the service's hand-off, conductor.rehome) is not
modelled: they are gone with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from conductor.core import Conductor
from conductor.planner.costs import Jitter, ModelConfig
from conductor.planner.nodecache import NodeCache
from conductor.planner.state import DecodeInstance, PrefillInstance, SimConfig
from conductor.types import Decision, Instance, Rejection, Role, ScheduleRequest, Wait
from mooncake.serving import reports

# the twin's event kinds (conductor.planner.twin's loop; the last two are this module's)
_PREFILL_DONE, _DECODE_ARRIVE, _STEP_END, _TICK, _BEAT, _LOCAL_READY, _ASK_AGAIN, _READY, _PLAN = range(9)


class Observer(Protocol):
    """Hears what the Conductor hears of each request (the planner: conductor.planner.planner.Planner)."""

    def observe_schedule(self, now: float, req: ScheduleRequest, outcome: Decision | Rejection | Wait) -> None: ...

    def observe_decode_started(self, request_id: str, now: float) -> None: ...

    def observe_finished(self, request_id: str, now: float, output_tokens: int = 0) -> None: ...


Autoscaler = Callable[["Elastic"], "dict[Role, int] | None"]  # the cluster -> the counts wanted


class Elastic:
    """The pools' membership over time (mixed into Cluster)."""

    config: SimConfig
    model: ModelConfig
    conductor: Conductor
    now: float
    prefills: list[PrefillInstance]
    decodes: list[DecodeInstance]
    prefill_of: dict[str, PrefillInstance]
    decode_of: dict[str, DecodeInstance]
    caches: dict[str, NodeCache]

    def _init_elastic(self, autoscaler: Autoscaler | None) -> None:
        self.autoscaler = autoscaler
        self.started_at: dict[str, float] = {}  # instance id -> when it was asked for
        self.stopped_at: dict[str, float] = {}
        self.starting: dict[Role, int] = {Role.PREFILL: 0, Role.DECODE: 0}
        self.scalings: list[tuple[float, int, int]] = []  # (when, prefill, decode): each change of the counts asked
        self._numbers = {Role.PREFILL: 0, Role.DECODE: 0}
        self._periodic = 1  # the tick (and a prefill instance's beat each, the autoscaler's plan): always in the heap

    # -- members ----------------------------------------------------------------------------------

    def _new_prefill(self, stages: int, now: float) -> PrefillInstance:
        cfg, i = self.config, self._numbers[Role.PREFILL]
        self._numbers[Role.PREFILL] += 1
        blocks = None if cfg.cache_blocks is None else cfg.cache_blocks * stages
        node = f"kv{i}"
        inst = Instance(
            f"p{i}",
            Role.PREFILL,
            f"sim:p{i}",
            node=node,
            pipeline_stages=stages,
            pipeline_chunk=cfg.prefill_chunk if stages > 1 else 0,
        )
        # a pipeline group of X nodes is one prefill instance; each stage's node holds its layers' 1/X of every
        # block, so the group's cache is one of X times a node's blocks (and its SSD's)
        cache = NodeCache(node, blocks, cfg.ssd_blocks * stages, cfg.eviction, self._index_events)
        self.started_at[inst.id] = now
        return PrefillInstance(inst, cache, self.model.block_tokens)

    def _new_decode(self, now: float) -> DecodeInstance:
        i = self._numbers[Role.DECODE]
        self._numbers[Role.DECODE] += 1
        inst = Instance(f"d{i}", Role.DECODE, f"sim:d{i}", node=f"kvd{i}")
        self.started_at[inst.id] = now
        return DecodeInstance(inst, self.model.decode_kv_tokens)

    def _join(self, member: PrefillInstance | DecodeInstance, now: float) -> None:
        """``member`` is ready: it registers (a prefill instance with its node) and takes work."""
        c, inst = self.conductor, member.inst
        c.register(inst, now)
        if isinstance(member, DecodeInstance):
            self.decodes.append(member)
            self.decode_of[inst.id] = member
            return
        cache = member.cache
        c.register(Instance(inst.node, Role.KVSTORE, f"sim:{inst.node}", node=inst.node, capacity=0), now)
        self.caches[inst.node] = cache
        self.prefills.append(member)
        self.prefill_of[inst.id] = member

    def calibrate(self, p: PrefillInstance, jitter: Jitter) -> None:
        """A prefill instance's start, as prefill.worker's ``calibrate``: the compute time of made-up prompts of
        1/8, 1/2 and 1 step budget (a pipeline group's: its chunk, as a real group's is its step budget; a node
        alone's: ``step_budget``, 4,096 tokens by default, a GPU worker's) goes to the Conductor as prefill samples,
        so its predictors fit from the first request instead of predicting from their priors. (A real pipeline group
        does not calibrate yet; here it does.)"""
        m, chunk, x = self.model, self.config.prefill_chunk, p.inst.pipeline_stages
        budget = chunk if x > 1 else self.config.step_budget
        for n in reports.calibration_lengths(budget):
            seconds = m.pipelined_prefill_s(n, 0, x, chunk) * jitter()
            sample = reports.prefill_sample(n, 0, seconds)
            self.conductor.prefill_sample(sample.prompt_tokens, sample.cached_tokens, sample.seconds, p.inst.id)

    # -- scaling ------------------------------------------------------------------------------------

    def counts(self) -> dict[Role, int]:
        """Each pool's instances serving or starting (not the drained ones)."""
        return {role: len(self.conductor.alive(role)) + self.starting[role] for role in (Role.PREFILL, Role.DECODE)}

    def scale_to(self, role: Role, n: int) -> None:
        """Ask for ``n`` instances of ``role``: start the missing ones, or drain the Conductor's choice of extras."""
        now, have = self.now, self.counts()[role]
        if n > have:
            for _ in range(n - have):
                member = self._new_prefill(1, now) if role is Role.PREFILL else self._new_decode(now)
                self.starting[role] += 1
                self._push(now + self.config.start_s, _READY, member)
        elif n < have:
            _, drain = self.conductor.scale_plan(role, max(1, n - self.starting[role]))
            for iid in drain:
                self.conductor.drain(iid, remove=True)

    def _ready(self, member: PrefillInstance | DecodeInstance) -> None:
        role = member.inst.role
        self.starting[role] -= 1
        self._join(member, self.now)
        if isinstance(member, PrefillInstance):
            if self.config.calibrate:
                self.calibrate(member, Jitter(self.model.noise, (self.config.seed, 2, len(self.started_at))))
            if self.config.heartbeat_s:
                self._periodic += 1
                self._push(self.now + self.config.heartbeat_s, _BEAT, member)

    def _retire_idle(self) -> None:
        """Stop the drained instances the Conductor finds idle (a tick's work)."""
        c = self.conductor
        for inst in c.idle_to_remove(self.now, self.config.retire_quiet_s):
            c.deregister(inst.id)
            self.stopped_at[inst.id] = self.now
            if inst.role is Role.DECODE:
                self.decodes.remove(self.decode_of.pop(inst.id))
                continue
            p = self.prefill_of.pop(inst.id)
            p.gone = True
            self.prefills.remove(p)
            c.deregister(inst.node)  # its node goes with it (its blocks leave the index)
            self.caches.pop(inst.node, None)

    def _plan(self) -> None:
        """The autoscaler's turn (every ``plan_interval_s``)."""
        wanted = self.autoscaler(self) if self.autoscaler is not None else None
        if wanted:
            before = self.counts()
            for role, n in wanted.items():
                self.scale_to(role, n)
            after = {role: wanted.get(role, before[role]) for role in before}
            if after != before:
                self.scalings.append((self.now, after[Role.PREFILL], after[Role.DECODE]))
        self._push(self.now + self.config.plan_interval_s, _PLAN, None)

    def instance_seconds(self, end: float) -> dict[Role, float]:
        """Each pool's instance-seconds from the start to ``end``: every instance from when it was asked for."""
        out = {Role.PREFILL: 0.0, Role.DECODE: 0.0}
        for iid, start in self.started_at.items():
            role = Role.PREFILL if iid.startswith("p") else Role.DECODE
            out[role] += max(0.0, min(self.stopped_at.get(iid, end), end) - start)
        return out


_READY, _PLAN = (
    7,
    8,
)  # the twin's event kinds for a started instance and the autoscaler (after conductor.planner.twin's)
