"""The Conductor's registry of instances: registration, heartbeats, failures, drains and scaling plans.

    registry = Registry(config)
    registry.register(Instance("p0", Role.PREFILL, "10.0.0.1:7000", node="kv0"), now)
    inst = registry.heartbeat("p0", load, now)   # its load as reported (KeyError: register again)
    prefills, decodes = registry.pools(now)      # who may be sent work now (every Schedule asks)

A part of ``conductor.core.Conductor``. It owns ``instances`` (id -> Instance, with each
one's state and last load), ``retiring`` (drained instances to stop once idle) and
``last_sent`` (when a request was last placed on each), and reads only the timeouts of the
configuration it is given. What follows from an instance's coming and going elsewhere (the
index forgets a pool node's blocks, the forecast a decode instance's requests, a decode
worker's step time trains the predictors) the Conductor does with what these methods
return. Pure: time is passed in.
"""

from __future__ import annotations

from collections.abc import Callable

from conductor.config import ConductorConfig
from conductor.types import Instance, InstanceState, Load, Role


class Registry:
    """Who is registered, alive, suspect, draining or dead."""

    def __init__(self, config: ConductorConfig) -> None:
        self.config = config  # read only: suspect_hold_s, heartbeat_timeout_s
        self.instances: dict[str, Instance] = {}
        self.retiring: set[str] = set()  # drained instances to stop (through the pool provider) once idle
        self.last_sent: dict[str, float] = {}  # instance id -> when a request was last placed on it

    def register(self, inst: Instance, now: float) -> None:
        """Add or re-add an instance (a restarted worker re-registers under its id)."""
        if not inst.id or not inst.address:
            raise ValueError("an instance needs an id and an address")
        inst.state, inst.last_heartbeat, inst.queue_at = InstanceState.ALIVE, now, now
        self.instances[inst.id] = inst
        self.retiring.discard(inst.id)

    def heartbeat(
        self, instance_id: str, load: Load, now: float, price: Callable[[Instance, Load], None] | None = None
    ) -> Instance:
        """An instance's load (a prefill instance's queue as predicted, with what is on its way there): ``price`` (the
        Conductor's predictors, ``Learning.price_queue``) fills a prefill instance's queue fields from the prompts it
        reports. Returns the instance; raises KeyError for one not registered, or dead."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.state is InstanceState.DEAD:
            raise KeyError(f"instance {instance_id!r} is not registered (register again)")
        inst.load, inst.last_heartbeat, inst.queue_at = load, now, now
        if inst.role is Role.PREFILL:  # predicted seconds of prefill as they come out, and what is on its way there
            if price is not None:
                price(inst, load)
            load.queued_s = load.queued_s * inst.slowdown + inst.in_transit()
            requests, tokens = inst.in_transit_tokens()
            load.queued_requests += requests
            load.queued_tokens += tokens
        if inst.state is InstanceState.SUSPECT and now >= inst.suspect_until:
            inst.state = InstanceState.ALIVE
        return inst

    def suspect(self, instance_id: str, now: float) -> bool:
        """A caller saw ``instance_id`` fail (a reset stream, an unreachable address): send it nothing new
        until it heartbeats ``suspect_hold_s`` from now. Long before the heartbeat timeout notices a dead
        instance, the requests after this one go elsewhere. Returns whether it was alive until now."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.state is not InstanceState.ALIVE:
            return False
        inst.state, inst.suspect_until = InstanceState.SUSPECT, now + self.config.suspect_hold_s
        return True

    def drain(self, instance_id: str, remove: bool = False) -> list[str]:
        """Send ``instance_id`` nothing new; with ``remove``, stop it once it is idle (``idle_to_remove``). A pool node
        is drained with the prefill workers on it (with ``remove``: removed with them, its blocks moved to the nodes
        that stay before it stops, ``conductor.rehome``). Returns the instances drained."""
        inst = self.get(instance_id)
        drained = [inst]
        if inst.role is Role.KVSTORE:
            drained += [i for i in self.instances.values() if i.role is Role.PREFILL and i.node == inst.node]
        for i in drained:
            if i.state in (InstanceState.ALIVE, InstanceState.SUSPECT):
                i.state = InstanceState.DRAINING
            if remove and i.role is not Role.KVSTORE:
                self.retiring.add(i.id)
        return [i.id for i in drained]

    def retired(self, instance_id: str) -> None:
        """``instance_id`` was stopped: it is no longer to be stopped (it stays drained until it deregisters)."""
        self.retiring.discard(instance_id)

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

    def idle_to_remove(self, now: float, quiet_s: float, in_flight: Callable[[str], int]) -> list[Instance]:
        """Retiring instances with nothing left to do: reported idle, no request in flight to them (a decode
        instance's: ``in_flight``, by id), and nothing placed there for ``quiet_s`` (a request placed just before the
        drain may not have reached them yet)."""
        out = []
        for iid in list(self.retiring):
            inst = self.instances.get(iid)
            if inst is None or inst.state is not InstanceState.DRAINING:
                self.retiring.discard(iid)
                continue
            load = inst.load
            busy = load.queued_requests or load.running_requests
            if inst.role is Role.DECODE:
                busy = busy or in_flight(iid)
            if (
                not busy
                and now - self.last_sent.get(iid, -float("inf")) >= quiet_s
                and inst.last_heartbeat > self.last_sent.get(iid, -float("inf"))
            ):
                out.append(inst)
        return out

    def deregister(self, instance_id: str) -> Instance | None:
        """Forget ``instance_id``; returns it (None: it was not registered)."""
        self.retiring.discard(instance_id)
        self.last_sent.pop(instance_id, None)
        return self.instances.pop(instance_id, None)

    def expire(self, now: float) -> list[Instance]:
        """Mark instances silent for ``heartbeat_timeout_s`` dead; return them."""
        dead = []
        for inst in self.instances.values():
            if inst.state is not InstanceState.DEAD and now - inst.last_heartbeat > self.config.heartbeat_timeout_s:
                inst.state = InstanceState.DEAD
                dead.append(inst)
        return dead

    def placed(self, instance_ids: tuple[str, ...], now: float) -> None:
        """A request was placed on each of ``instance_ids`` at ``now`` (``idle_to_remove`` waits for it)."""
        for iid in instance_ids:
            self.last_sent[iid] = now

    def get(self, instance_id: str) -> Instance:
        """The instance registered as ``instance_id``; KeyError when none is."""
        inst = self.instances.get(instance_id)
        if inst is None:
            raise KeyError(f"no instance {instance_id!r}")
        return inst

    def alive(self, role: Role) -> list[Instance]:
        return [i for i in self.instances.values() if i.role is role and i.schedulable]

    def busy_prefills(self) -> int:
        """Prefill instances with predicted work queued (the audit's ``Placed.busy``)."""
        return sum(1 for i in self.instances.values() if i.role is Role.PREFILL and i.load.queued_s > 0.0)

    def pools(self, now: float) -> tuple[list[Instance], list[Instance]]:
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
