"""The Conductor as a service: the pure :class:`~conductor.core.Conductor` behind a lock, fed by I/O threads.

ConductorService  owns the Conductor, persistence (Redis or nothing), Prometheus
                  metrics, one event watcher per kvstore node (its Subscribe stream
                  applied to the index; a resync snapshot on every (re)connect),
                  and the expiry thread that marks silent instances dead
The gRPC adapter is conductor/servicer.py; the gateway's fast path to ``schedule`` is
conductor/fastpath.py.
"""

from __future__ import annotations

import logging
import threading
import time

from conductor.audit import PredictionLog
from conductor.config import ConductorConfig
from conductor.core import Conductor
from conductor.index import chains_of
from conductor.metrics import Metrics
from conductor.persistence import MemoryStore
from conductor.planner.planner import PlannerConfig
from conductor.planning import PlannerLoop
from conductor.pool import NoProvider, PoolProvider
from conductor.quotes import PARTS
from conductor.rehome import rehome, wait_leases_ended
from conductor.types import (
    Decision,
    Instance,
    InstanceState,
    Load,
    Measured,
    Role,
    ScheduleRequest,
    Wait,
)
from kvstore.client import KVStoreClient, KVStoreUnavailable
from kvstore.events import Tier
from protos import conductor_pb2 as pb
from protos import kvstore_pb2 as kv_pb

log = logging.getLogger(__name__)

KV_TIER = {kv_pb.DRAM: Tier.DRAM, kv_pb.SSD: Tier.SSD}
HEARTBEAT_INTERVAL_FRACTION = 0.25  # workers are told to beat 4 times per timeout
RESUBSCRIBE_S = 1.0


class _Watcher:
    """Follows one kvstore node's event stream into the index until stopped."""

    def __init__(self, service: "ConductorService", inst: Instance) -> None:
        self.service, self.inst = service, inst
        self._stop = threading.Event()
        self._client: KVStoreClient | None = None
        self._thread = threading.Thread(target=self._run, name=f"conductor-events-{inst.node}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._client = KVStoreClient(self.inst.address, control="grpc", timeout_s=5)
                for batch in self._client.subscribe(snapshot=True):  # a fresh snapshot on every connect
                    if self._stop.is_set():
                        break
                    self.service.apply_events(self.inst.node, batch, self._stop)
            except (KVStoreUnavailable, ValueError, RuntimeError) as e:
                log.debug("events of %s: %s", self.inst.node, e)
            finally:
                if self._client is not None:
                    self._client.close()
            self._stop.wait(RESUBSCRIBE_S)

    def stop(self) -> None:
        self._stop.set()
        if self._client is not None:
            self._client.close()  # cancels the stream


class ConductorService:
    """The Conductor, its persistence, metrics and background threads. Thread-safe."""

    def __init__(
        self,
        config: ConductorConfig,
        store: MemoryStore | None = None,
        expire_every_s: float = 0.5,
        provider: PoolProvider | None = None,
        retire_quiet_s: float = 3.0,
        standby: bool = False,
        prediction_log: PredictionLog | None = None,
        planner: PlannerConfig | None = None,
        planner_acts: bool = False,
    ) -> None:
        """``standby``: start without serving (another Conductor leads); ``take_over`` makes it the leader.
        ``prediction_log``: where each scored prediction goes (conductor.audit; None: nowhere). ``planner``: plan
        every interval (conductor.planning; None: only when asked, ``plan_now``), and with ``planner_acts`` scale
        the pools to the plans."""
        self.config = config
        self.prediction_log = prediction_log
        self.conductor = Conductor(config)
        self.provider = provider or NoProvider()
        self.retire_quiet_s = retire_quiet_s
        self._removing: set[str] = set()  # instances the provider is stopping now
        self.store = store or MemoryStore()
        self.metrics = Metrics()
        self.metrics.transfer_rate.set(self.conductor.predictors.transfer.bytes_per_s)  # its default until learnt
        self._priorities: set[int] = set()  # the priorities seen waiting (their gauges go back to 0)
        self._lock = threading.Lock()
        self._watchers: dict[str, _Watcher] = {}
        self._stop = threading.Event()
        self.leading = threading.Event()
        self.control_port = (
            0  # where Schedule's fast path listens (conductor/fastpath.py; 0: nowhere), for ListInstances
        )
        if not standby:
            self.take_over()
        self.planning = PlannerLoop(self, planner or PlannerConfig(), acting=planner_acts)
        if planner is not None:
            self.planning.start()
        self._expirer = threading.Thread(
            target=self._expire_loop, args=(expire_every_s,), name="conductor-expire", daemon=True
        )
        self._expirer.start()

    # -- leadership (conductor/leader.py) -------------------------------------------------

    def take_over(self) -> None:
        """Start serving: rebuild the registry and settings from the store (Redis: what the previous leader wrote;
        every instance gets a fresh heartbeat deadline) and the index from the pool nodes' snapshots."""
        with self._lock:
            due = self.conductor.decode_due  # the planner's, which outlives a takeover (conductor.planning)
            self.conductor = Conductor(self.config)
            self.conductor.audit = self.prediction_log
            self.conductor.decode_due = due
            self._recover()
        self.leading.set()

    def step_down(self) -> None:
        """Stop serving (the lease went to another Conductor): calls are answered UNAVAILABLE from now on."""
        self.leading.clear()
        for instance_id in list(self._watchers):
            self._unwatch(instance_id)

    def on_leadership(self, leading: bool) -> None:
        (self.take_over if leading else self.step_down)()

    # -- recovery and persistence ---------------------------------------------------------

    def _recover(self) -> None:
        instances, settings = self.store.load()
        if settings.get("policy"):
            self.conductor.set_policy(settings["policy"])
        if settings.get("admission"):
            self.conductor.set_admission(settings["admission"])
        now = time.monotonic()
        for inst in instances:
            state = inst.state
            self.conductor.register(inst, now)  # a fresh heartbeat deadline
            if state is InstanceState.DRAINING:
                self.conductor.drain(inst.id)
            if inst.role is Role.KVSTORE and state is not InstanceState.DEAD:
                self._watch(inst)
        if instances:
            log.info(
                "recovered %d instances (policy %s, admission %s)",
                len(instances),
                self.conductor.policy.kind.value,
                self.conductor.admission.value,
            )

    def _watch(self, inst: Instance) -> None:
        old = self._watchers.pop(inst.id, None)
        if old is not None:
            old.stop()
        self._watchers[inst.id] = _Watcher(self, inst)

    def _unwatch(self, instance_id: str) -> None:
        watcher = self._watchers.pop(instance_id, None)
        if watcher is not None:
            watcher.stop()

    # -- calls (each under the lock) ------------------------------------------------------

    def register(self, inst: Instance) -> None:
        """Add (or re-add) an instance. Raises Mismatch for a worker whose KV the cluster's workers cannot use."""
        with self._lock:
            self._check_compatible(inst)
            self.conductor.register(inst, time.monotonic())
            if inst.role is Role.KVSTORE:
                self.conductor.index.reset_node(inst.node)  # the watcher's snapshot refills it
            self.store.save_instance(inst)
        if inst.role is Role.KVSTORE:
            self._watch(inst)

    def _check_compatible(self, inst: Instance) -> None:
        """Prefill and decode workers exchange KV and share pool blocks: one fingerprint (model, dtype, engine) for
        all, and one block size in bytes, as each worker's engine laid the model out and the pool nodes hold it."""
        if inst.role is Role.KVSTORE:
            return
        other = inst.block_bytes and self._live_other(
            inst, lambda o: o.block_bytes and o.block_bytes != inst.block_bytes
        )
        if other:
            raise Mismatch(
                f"{inst.id} ({inst.engine or 'unknown'} engine, model {inst.model}) cannot join: its engine's "
                f"KV blocks are {inst.block_bytes} bytes, {other.id}'s are {other.block_bytes}. A cluster's "
                "workers and pool nodes hold blocks of one layout (model, dtype, engine, block size)."
            )
        other = inst.fingerprint and self._live_other(
            inst, lambda o: o.role is not Role.KVSTORE and o.fingerprint and o.fingerprint != inst.fingerprint
        )
        if other:
            raise Mismatch(
                f"{inst.id} ({inst.engine or 'unknown'} engine, model {inst.model}) cannot join: {other.id} runs "
                f"the {other.engine or 'unknown'} engine on {other.model}, and their KV caches differ (block-key "
                f"fingerprints {inst.fingerprint.hex()[:12]} and {other.fingerprint.hex()[:12]}). A cluster's "
                "prefill and decode workers run one engine on one model and dtype."
            )

    def _live_other(self, inst: Instance, differs) -> Instance | None:
        """Another registered instance, not dead, for which ``differs`` holds; None if there is none."""
        return next(
            (
                o
                for o in self.conductor.instances.values()
                if o.id != inst.id and o.state is not InstanceState.DEAD and differs(o)
            ),
            None,
        )

    def heartbeat(self, instance_id: str, load: Load) -> tuple[bool, int]:
        """(whether ``instance_id`` is known, the batch cap a decode worker is to apply: ``Conductor.decode_cap``)."""
        with self._lock:
            try:
                return True, self.conductor.heartbeat(instance_id, load, time.monotonic())
            except KeyError:
                return False, 0

    def deregister(self, instance_id: str) -> None:
        with self._lock:
            self.conductor.deregister(instance_id)
            self.store.delete_instance(instance_id)
        self._unwatch(instance_id)

    def drain(self, instance_id: str, remove: bool = False) -> InstanceState:
        if remove and isinstance(self.provider, NoProvider):
            raise ValueError(
                "this Conductor has no pool provider to stop the instance: drain without --remove, "
                "or start the Conductor with --pool-provider local or kubernetes"
            )
        with self._lock:
            for iid in self.conductor.drain(instance_id, remove):
                self.store.save_instance(self.conductor.instances[iid])
            return self.conductor.instances[instance_id].state

    def scale(self, role: Role, replicas: int) -> tuple[int, list[str], list[str]]:
        """Bring ``role``'s pool to ``replicas`` (see Conductor.scale_plan); return (alive before, started,
        draining)."""
        with self._lock:
            alive = len(self.conductor.alive(role))
            add, drain = self.conductor.scale_plan(role, replicas)
            if drain and isinstance(self.provider, NoProvider):
                raise ValueError(
                    "this Conductor has no pool provider: start it with --pool-provider local or kubernetes"
                )
            for iid in drain:
                self.conductor.drain(iid, remove=True)
                self.store.save_instance(self.conductor.instances[iid])
        started = self.provider.add(role, add) if add else []
        if add or drain:
            log.info("scaling %s from %d to %d: started %s, draining %s", role.value, alive, replicas, started, drain)
        return alive, started, drain

    def set_policy(self, policy: str, admission: str) -> tuple[str, str]:
        with self._lock:
            if policy:
                self.conductor.set_policy(policy)
            if admission:
                self.conductor.set_admission(admission)
            settings = {"policy": self.conductor.policy.kind.value, "admission": self.conductor.admission.value}
            self.store.save_settings(settings)
            return settings["policy"], settings["admission"]

    def schedule(self, req: ScheduleRequest):
        started = time.perf_counter()
        with self._lock:
            now = time.monotonic()
            outcome = self.conductor.schedule(req, now)
            self.planning.planner.observe_schedule(now, req, outcome)
            policy = self.conductor.policy.kind.value
            if isinstance(outcome, Decision):
                addresses = {i.id: i.address for i in self.conductor.instances.values()}
                nodes = {i.node: i.address for i in self.conductor.instances.values() if i.role is Role.KVSTORE}
                # local: no prefill worker; the decode worker writes the prompt's blocks to the node it reads the prefix
                # from (its chain continues there), else to the node of the prefill worker the policy would have used
                prefill_node = (outcome.node or "") if outcome.local else self.conductor.instances[outcome.prefill].node
                outcome_info = (
                    addresses.get(outcome.prefill, ""),
                    addresses[outcome.decode],
                    nodes.get(outcome.plan.fetch_node or "", ""),
                    prefill_node,
                    nodes.get(prefill_node, ""),
                )
            else:
                outcome_info = None
            self.metrics.index_blocks.set(self.conductor.index.num_blocks)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        if isinstance(outcome, Decision):
            kind = "scheduled"
            self.metrics.placements.labels("decode_worker" if outcome.local else "prefill_worker").inc()
            self.metrics.match_blocks.observe(outcome.plan.reused_blocks)
            if outcome.narrow:
                self.metrics.narrow_handoffs.inc()
        else:
            kind = "wait" if isinstance(outcome, Wait) else outcome.reason.value
        self.metrics.decisions.labels(policy, kind).inc()
        self.metrics.admitted(req.tenant, req.priority, kind)
        return outcome, outcome_info

    def shed_s(self) -> float:
        """How long every request will be refused from now (Conductor.shed_s): what a shedding gateway's probe asks."""
        with self._lock:
            return self.conductor.shed_s(time.monotonic())

    def admit_at_decode(self, decode_id: str, context_tokens: int = 0):
        with self._lock:
            return self.conductor.admit_at_decode(decode_id, time.monotonic(), context_tokens)

    def report(self, request: pb.ReportRequest) -> None:
        now = time.monotonic()
        with self._lock:
            for s in request.prefill:
                self.conductor.prefill_sample(s.prompt_tokens, s.cached_tokens, s.seconds, request.id or None)
            for s in request.transfer:
                self.conductor.transfer_sample(s.bytes, s.seconds)
            if request.transfer:
                self.metrics.transfer_rate.set(self.conductor.predictors.transfer.bytes_per_s)
            for e in request.requests:
                if e.handoff_s > 0:
                    self.conductor.handoff_sample(e.handoff_s)
                    self.metrics.handoff.set(self.conductor.handoff_s)
                parts = e.measured_ttft_s, e.queue_s, e.prefill_s
                planner = self.planning.planner
                if e.kind == pb.RequestEvent.DECODE_STARTED:
                    predicted = self.conductor.decode_started(e.request_id, now, *parts)
                    planner.observe_decode_started(e.request_id, now)
                elif e.kind == pb.RequestEvent.FINISHED:
                    predicted = self.conductor.finished(e.request_id, now, *parts, e.measured_tbt_s)
                    planner.observe_finished(e.request_id, now, e.output_tokens)
                else:
                    raise ValueError(f"request event of unknown kind {e.kind} for {e.request_id!r}")
                if predicted is not None:  # its first measured TTFT
                    self.metrics.score(predicted, Measured(*parts))
            for part in PARTS:
                self.metrics.quote_held.labels(part).set(self.conductor.quotes.held(part)[0])
            self.metrics.ttft_margin.set(self.conductor.learning.calibration.margin)
            waiting = self.conductor.waiting.by_priority()
            self._priorities.update(waiting)
            for priority in self._priorities:
                self.metrics.waiting.labels(str(priority)).set(waiting.get(priority, 0))

    def apply_events(self, node: str, batch, stopped: threading.Event | None = None) -> None:
        """One batch of a kvstore node's event stream (``reset``: a snapshot replaces what the index had); not once
        ``stopped`` is set (the node left the index while the batch was on its way)."""
        with self._lock:
            if stopped is not None and stopped.is_set():
                return
            if batch.reset:
                self.conductor.snapshot(node, [(bytes(e.key), KV_TIER[e.tier], _parent(e)) for e in batch.events])
            else:
                for e in batch.events:
                    if e.kind == kv_pb.Event.STORED:
                        self.conductor.stored(node, bytes(e.key), KV_TIER[e.tier], _parent(e))
                    else:
                        self.conductor.removed(node, bytes(e.key), KV_TIER[e.tier])
            self.metrics.index_blocks.set(self.conductor.index.num_blocks)

    def snapshot_instances(
        self, role: Role | None = None
    ) -> list[tuple[Instance, float, int, int, object, bool, tuple]]:
        """(instance, seconds since its heartbeat, blocks the index has on its node, of those in DRAM, what it was
        served (prefill), retiring, what the forecast counts there (decode: requests in prefill, decoding, landing
        blocks held, KV blocks held)) for the admin API."""
        now = time.monotonic()
        c = self.conductor
        with self._lock:
            return [
                (
                    i,
                    now - i.last_heartbeat,
                    c.index.node_blocks(i.node),
                    c.index.node_dram_blocks(i.node),
                    c.served.get(i.id),
                    i.id in c.retiring,
                    (*c.forecast.occupancy(i.id), c.kv_held(i) if i.role is Role.DECODE else 0),
                )
                for i in c.instances.values()
                if role is None or i.role is role
            ]

    # -- background ---------------------------------------------------------------------------

    def _expire_loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            if not self.leading.is_set():
                continue
            try:
                with self._lock:
                    dead = self.conductor.expire(time.monotonic())
                    counts: dict[tuple[str, str], int] = {}
                    for i in self.conductor.instances.values():
                        counts[(i.role.value, i.state.value)] = counts.get((i.role.value, i.state.value), 0) + 1
                for role in Role:
                    for state in InstanceState:
                        self.metrics.instances.labels(role.value, state.value).set(
                            counts.get((role.value, state.value), 0)
                        )
                for instance_id in dead:
                    log.warning("instance %s missed its heartbeats: marked dead", instance_id)
                    self._unwatch(instance_id)
                self._retire_idle()
            except Exception:  # keep expiring; a bug here must not silently stop it
                log.exception("expiry failed")

    def _retire_idle(self) -> None:
        """Hand drained instances that finished their work to the provider (each on a thread: stopping takes a
        while)."""
        with self._lock:
            idle = [
                i
                for i in self.conductor.idle_to_remove(time.monotonic(), self.retire_quiet_s)
                if i.id not in self._removing
            ]
            self._removing.update(i.id for i in idle)
        for inst in idle:
            threading.Thread(target=self._remove, args=(inst,), name=f"conductor-remove-{inst.id}", daemon=True).start()

    def _remove(self, inst: Instance) -> None:
        log.info("%s is drained and idle: stopping it (%s provider)", inst.id, self.provider.kind)
        if inst.role is Role.PREFILL:
            self.hand_off(inst.node)
        try:
            self.provider.remove(inst)
        except (RuntimeError, ValueError) as e:
            log.warning("could not stop %s (%s); trying again", inst.id, e)
            with self._lock:
                self._removing.discard(inst.id)
            return
        with self._lock:  # it deregisters itself as it stops; until then it stays drained
            self.conductor.retired(inst.id)
            self._removing.discard(inst.id)

    def hand_off(self, node: str, timeout_s: float = float("inf"), stopping: bool = False) -> None:
        """Pool node ``node`` leaves: move its blocks to the nodes that stay, take it out of the index, and wait for the
        reads in flight on it (``conductor.rehome``), all within ``timeout_s``. Called when the last prefill worker on
        it is removed (the provider stops the node with it; nothing happens while another prefill worker stays on it),
        and by the node itself as it stops (``stopping``: Deregister with ``hand_off``)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            instances, retiring = self.conductor.instances.values(), self.conductor.retiring
            staying = {i.node for i in instances if i.role is Role.PREFILL and i.id not in retiring}
            if node in staying and not stopping:
                return  # another prefill worker keeps using it
            leaving = next((i for i in instances if i.role is Role.KVSTORE and i.node == node), None)
            if leaving is None or leaving.state is InstanceState.DEAD:
                return
            gone = {i.node for i in instances if i.role is Role.PREFILL and i.id in retiring} - staying
            targets = {  # not a node whose prefill workers all leave too
                i.node: i.address
                for i in instances
                if i.role is Role.KVSTORE and i.schedulable and i.node != node and i.node not in gone
            }
            tree = self.conductor.index.node_tree(node)
            if leaving.state is not InstanceState.DRAINING:
                self.conductor.drain(leaving.id)
                self.store.save_instance(leaving)
        chains = chains_of(*tree)  # not under the lock: a walk over every block the node holds
        moved = rehome(chains, leaving.address, targets, deadline)
        log.info(
            "pool node %s leaves: %d of its %d chains copied to %s (%d blocks, %d there already, %d chains left: "
            "no room or a failed copy) in %.1f s",
            node,
            moved.chains,
            len(chains),
            ", ".join(sorted(targets)) or "no other node",
            moved.blocks,
            moved.already,
            moved.left,
            moved.seconds,
        )
        self._unwatch(leaving.id)
        with self._lock:
            self.conductor.index.reset_node(node)  # no plan reads from it any more
            self.metrics.index_blocks.set(self.conductor.index.num_blocks)
        wait_leases_ended(leaving.address, self.retire_quiet_s, deadline)

    def close(self) -> None:
        self._stop.set()
        self.planning.stop()
        for instance_id in list(self._watchers):
            self._unwatch(instance_id)


def _parent(event: kv_pb.Event) -> bytes | None:
    """A STORED event's parent as the index takes it: the key, ROOT (b"") for a chain's first block, None if unknown."""
    return bytes(event.parent) if event.parent_known else None


class Mismatch(Exception):
    """A worker that cannot join this cluster (FAILED_PRECONDITION)."""
