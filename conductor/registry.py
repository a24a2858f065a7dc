"""The Conductor's registry of instances: registration, heartbeats, failures, drains and scaling plans.

A part of ``conductor.core.Conductor`` (which inherits it), apart by concept: it keeps
``instances``, ``retiring`` and ``last_sent``, and reads the Conductor's ``config``,
``predictors`` (a decode worker's heartbeat is a step-time sample; a pool node's
registration says its block size), ``forecast``, ``index`` and ``shares``. Pure: time is
passed in.
"""

from __future__ import annotations

from conductor.types import Instance, InstanceState, Load, Role


class Registry:
    """Who is registered, alive, suspect, draining or dead (mixed into Conductor)."""

    instances: dict[str, Instance]
    retiring: set[str]  # drained instances to stop (through the pool provider) once idle
    last_sent: dict[str, float]  # instance id -> when a request was last placed on it

    def register(self, inst: Instance, now: float) -> None:
        """Add or re-add an instance (a restarted worker re-registers under its id)."""
        if not inst.id or not inst.address:
            raise ValueError("an instance needs an id and an address")
        inst.state, inst.last_heartbeat, inst.queue_at = InstanceState.ALIVE, now, now
        self.instances[inst.id] = inst
        if inst.role is Role.KVSTORE and inst.block_bytes:  # the pool's own figure, not a configured guess
            self.predictors.block_bytes = inst.block_bytes
        self.retiring.discard(inst.id)

    def heartbeat(self, instance_id: str, load: Load, now: float) -> int:
        """An instance's load. Returns a decode instance's batch cap (``decode_cap``; 0 for the others, or none known
        yet): the worker applies it to its engine, so the step model and its headroom have one owner, here."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.state is InstanceState.DEAD:
            raise KeyError(f"instance {instance_id!r} is not registered (register again)")
        inst.load, inst.last_heartbeat, inst.queue_at = load, now, now
        if inst.role is Role.PREFILL:  # predicted seconds of prefill as they come out, and what is on its way there
            load.queued_s = load.queued_s * inst.slowdown + inst.in_transit()
            requests, tokens = inst.in_transit_tokens()
            load.queued_requests += requests
            load.queued_tokens += tokens
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
        if inst.role is not Role.DECODE:
            return 0
        cap = self.decode_cap(inst)
        if cap:
            load.batch_cap = cap
        return cap

    def decode_cap(self, inst: Instance) -> int:
        """The most running requests ``inst`` may hold with its predicted step within ``tbt_headroom`` of the
        strictest TBT SLO, at its batch's mean context per request (its registered capacity at most; 0: the step model
        has no samples yet)."""
        if not self.predictors.decode.fitted or not self.config.slo_classes:
            return 0
        limit = min(s.tbt_s for s in self.config.slo_classes.values()) * self.config.tbt_headroom
        load = inst.load
        running = load.running_requests or load.step_batch
        per_request = (load.context_tokens or load.step_context_tokens) / running if running else 0.0
        c0, c1, c2 = self.predictors.decode.coef  # step = c0 + n * (c1 + c2 * context per request)
        slope = c1 + c2 * per_request
        if slope <= 0:
            return inst.capacity
        cap = max(1, int((limit - c0) / slope))
        return min(cap, inst.capacity) if inst.capacity else cap

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
        inst = self._get(instance_id)
        drained = [inst]
        if inst.role is Role.KVSTORE:
            drained += [i for i in self.instances.values() if i.role is Role.PREFILL and i.node == inst.node]
        for i in drained:
            if i.state in (InstanceState.ALIVE, InstanceState.SUSPECT):
                i.state = InstanceState.DRAINING
            if remove and i.role is not Role.KVSTORE:
                self.retiring.add(i.id)
        return [i.id for i in drained]

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
        ttft_s = max(s.ttft_s for s in self.config.slo_classes.values())
        self.forecast.expire(now, ttft_s)
        self.shares.expire(now, 4 * self.forecast.t_d + ttft_s)
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
