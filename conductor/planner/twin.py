"""The discrete-event cluster: prefill and decode instances driven by the Conductor's own code.

    requests (trace) --schedule--> Conductor (conductor.core, the real one)
        Decision -> prefill instance queue (FIFO, one prefill at a time)
                      fetch plan.fetch_blocks from plan.fetch_node, read SSD blocks, compute
                      store every block of the prompt in the node's cache (events -> Conductor)
                 -> decode instance (continuous batching: one token per running request a step)
        Rejection -> counted by reason
        Wait (early_wait) -> asks again wait_s later, with the time it waited

What the Conductor hears, and when (all on simulated time). What a report holds is decided by
the workers' own rules (mooncake.serving.reports), which the twin calls as the workers do:
- before the first request, unless ``calibrate`` is off, a ``prefill_sample`` of each
  calibration prompt of each prefill instance (``Elastic.calibrate``: ``calibration_lengths``,
  as prefill.worker's ``calibrate``);
- ``stored`` / ``removed`` for every block entering or leaving a tier of a node (exact index);
- a prefill instance's heartbeat every ``heartbeat_s`` (2.5 s, a real worker's period: the
  service's heartbeat timeout of 10 s x its HEARTBEAT_INTERVAL_FRACTION of 0.25), every
  ``busy_beat_s`` (``PREFILL_BUSY_BEAT_S``) instead while it holds prompts, and one as each of
  its prefills ends (``beat_interval``); the instances' phases spread evenly over the period.
  It holds every prompt queued or running with what it has computed so far (``InFlight``:
  ``PrefillInstance.load``); the Conductor prices them with its own predictor, as it does a
  real worker's. Between two, the Conductor takes a second of predicted prefill off the
  queue each second (``Instance.drain``). ``heartbeat_s = 0``: a heartbeat whenever the queue
  changes, and every tick (fresher than a real worker's: the drain then has little to correct);
- a decode instance's heartbeat when requests join it, when one leaves, and when it goes
  idle, with the mean decode step since its last heartbeat (``mean_step``: the Conductor's
  decode predictor learns from these);
- ``prefill_sample`` after each prefill (its compute seconds only: ``prefill_sample``),
  ``transfer_sample`` after each fetch, ``decode_started`` / ``finished`` for the decode forecast;
- every ``tick_s`` (0.5 s, the service's expiry period) every decode instance and pool node
  heartbeats (prefill instances too when ``heartbeat_s`` is 0) and ``expire`` runs, as the
  gRPC service would.

Decode heartbeats stay as fresh as they were (on every join and leave, and every tick):
the TTFT a decision predicts reads no decode load, and the Conductor has no drain for a
decode instance's load; what changes between a real decode worker's heartbeats is carried
by the decode forecast (``decode_started`` / ``finished``, which a real worker sends at once).

Decode steps are simulated a run at a time (DecodeInstance): the result is the same as
stepping one by one, at a cost per join and leave instead of per step.

A prompt the Conductor places on its decode instance (``Decision.local``, conductor.local) is
computed there, one at a time in the order their prefixes are in: its prefix is read from the
plan's node first (the network and SSD time, while the batch's steps go on, as a decode worker
reads it before the prompt enters its engine), then its uncached tokens ride in chunks of the
decision's ``chunk_tokens`` on the instance's steps (each step longer by a chunk's share of the
prompt's prefill time; with no batch, the chunks run alone). The step of its last chunk gives
its first token; its blocks go to the decision's node (a decode worker writes them behind), and
it joins the batch like a handed-over request, its first gap a step later (a wait for a place
in the batch is not counted among its gaps). Steps with chunks in them are not decode steps (``mean_step``).

A prefill instance follows its plan as made: it reuses its own blocks ``[0, local_blocks)``
(fewer if some were evicted since), fetches ``[local_blocks, local_blocks + fetch_blocks)``
from ``fetch_node`` while that node still holds them, and computes the rest; blocks that
arrived on its node after the decision are not used (the Conductor did not plan with them).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from conductor.config import ConductorConfig
from conductor.core import Conductor
from conductor.planner.costs import Jitter
from conductor.planner.elastic import (
    _ASK_AGAIN,
    _BEAT,
    _DECODE_ARRIVE,
    _LOCAL_READY,
    _PLAN,
    _PREFILL_DONE,
    _READY,
    _STEP_END,
    _TICK,
    Autoscaler,
    Elastic,
    Observer,
)
from conductor.planner.nodecache import NodeCache
from conductor.planner.state import (
    REJECTED_AT_DECODE,
    DecodeInstance,
    PrefillInstance,
    Record,
    SimConfig,
    TraceRequest,
    step_load,
    tbt_of,
)
from conductor.policies import PolicyConfig
from conductor.types import Load, Rejection, ScheduleRequest, Slo, Wait
from kvstore.events import Tier
from mooncake.serving import reports


class Cluster(Elastic):
    """One simulation: build with a config and the trace's requests, then ``run()``.

    ``autoscaler`` (conductor.planner.elastic) changes the pools as it runs; ``observer`` (the planner's
    ``observe_schedule``, ``observe_decode_started``, ``observe_finished``) hears what the Conductor hears."""

    def __init__(
        self,
        config: SimConfig,
        requests: list[TraceRequest],
        autoscaler: Autoscaler | None = None,
        observer: Observer | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.model = m = config.model
        self.requests = requests
        self.conductor = Conductor(
            ConductorConfig(
                policy=config.policy,
                admission=config.admission,
                slo_classes={"default": Slo(ttft_s=config.ttft_slo_s, tbt_s=config.tbt_slo_s)},
                tbt_headroom=config.tbt_headroom,
                decode_forecast=config.decode_forecast,
                local_prefill=config.local_prefill,
                local_chunk_tokens=config.local_chunk,
                local_max_load=config.local_max_load,
                block_bytes=m.block_bytes,
                predictors=config.predictors,
                policy_config=PolicyConfig(
                    kvcache_balancing_threshold=config.threshold,
                    tier_aware=config.tier_aware,
                    ssd_bytes_per_s=m.ssd_bytes_per_s,
                    seed=config.seed,
                ),
            )
        )
        self._init_elastic(autoscaler)
        self.observer = observer
        self.prefills: list[PrefillInstance] = []
        self.caches: dict[str, NodeCache] = {}
        self.prefill_of: dict[str, PrefillInstance] = {}
        self.decodes: list[DecodeInstance] = []
        self.decode_of: dict[str, DecodeInstance] = {}
        for x in config.prefill_shapes():
            self._join(self._new_prefill(x, 0.0), 0.0)
        for _ in range(config.decode):
            self._join(self._new_decode(0.0), 0.0)
        self.records = [Record(r, f"r{r.index}") for r in requests]
        self.jitter = Jitter(m.noise, config.seed)
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.now = 0.0
        self.events = 0
        if config.calibrate:
            self._calibrate()

    def _calibrate(self) -> None:
        """Each prefill instance calibrates before the first request (``Elastic.calibrate``). The noise is drawn from
        its own stream, so the requests' draws are the same with and without it."""
        jitter = Jitter(self.model.noise, (self.config.seed, 1))
        for p in self.prefills:
            self.calibrate(p, jitter)

    def _index_events(self, node: str, events: list[tuple[bool, bytes, Tier, bytes | None]]) -> None:
        """A node's block events, in order, to the Conductor's index.

        A run of stored events of one tier goes in as one ``index.stored_many`` (what the
        Conductor's snapshot path uses; the same result as ``stored`` key by key, which costs
        tens of microseconds a key); removals go one by one through ``Conductor.removed``.
        """
        c = self.conductor
        run: list[bytes] = []
        parents: list[bytes | None] = []
        run_tier = None
        for stored, key, tier, parent in events:
            if stored and (tier is run_tier or not run):
                run.append(key)
                parents.append(parent)
                run_tier = tier
                continue
            if run:
                c.index.stored_many(node, run, run_tier, parents)
                run, parents = [], []
            if stored:
                run.append(key)
                parents.append(parent)
                run_tier = tier
            else:
                c.removed(node, key, tier)
        if run:
            c.index.stored_many(node, run, run_tier, parents)

    # -- the event loop --------------------------------------------------------------------

    def _push(self, t: float, kind: int, what: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, what))

    def run(self, progress: Callable[[int], None] | None = None) -> list[Record]:
        """Replay every request; return their records. ``progress(n)`` hears of every 100 arrivals."""
        heap, records = self._heap, self.records
        nxt = 0
        self._push(self.config.tick_s, _TICK, None)
        beat_s = self.config.heartbeat_s
        if beat_s:
            for i, p in enumerate(self.prefills):  # the workers started at different moments: phases spread evenly
                self._push((i + 1) * beat_s / len(self.prefills), _BEAT, p)
            self._periodic += len(self.prefills)
        if self.autoscaler is not None:
            self._periodic += 1
            self._push(self.config.plan_interval_s, _PLAN, None)
        while nxt < len(records) or len(heap) > self._periodic:
            if nxt < len(records) and (not heap or records[nxt].req.arrival_s <= heap[0][0]):
                rec = records[nxt]
                nxt += 1
                self.now = rec.req.arrival_s
                self._arrive(rec)
                if progress is not None and nxt % 100 == 0:
                    progress(nxt)
                continue
            t, _, kind, what = heapq.heappop(heap)
            self.now = t
            self.events += 1
            if kind == _STEP_END:
                self._step_end(*what)
            elif kind == _PREFILL_DONE:
                self._prefill_done(what)
            elif kind == _DECODE_ARRIVE:
                self._decode_arrive(*what)
            elif kind == _BEAT:
                self._beat(what)
            elif kind == _LOCAL_READY:
                self._local_ready(*what)
            elif kind == _ASK_AGAIN:
                self._arrive(what)
            elif kind == _READY:
                self._ready(what)
            elif kind == _PLAN:
                self._plan()
            else:
                self._tick()
        if progress is not None:
            progress(len(records))
        return records

    def _tick(self) -> None:
        c, now = self.conductor, self.now
        for p in self.prefills:
            if not self.config.heartbeat_s:
                c.heartbeat(p.inst.id, p.load(now), now)
            c.heartbeat(p.inst.node, Load(), now)
        for d in self.decodes:
            c.heartbeat(d.inst.id, d.load(now), now)
        c.expire(now)
        if c.retiring:
            self._retire_idle()
        self._push(now + self.config.tick_s, _TICK, None)

    def _beat(self, p: PrefillInstance) -> None:
        """A prefill instance's periodic heartbeat (``heartbeat_s`` > 0), and the next one: ``busy_beat_s`` later while
        it holds prompts, as a real worker's (ConductorLink's busy interval). A stopped one beats no more."""
        if p.gone:
            self._periodic -= 1
            return
        self.conductor.heartbeat(p.inst.id, p.load(self.now), self.now)
        holding = p.running is not None or bool(p.queue)
        self._push(
            self.now + reports.beat_interval(self.config.heartbeat_s, self.config.busy_beat_s, holding), _BEAT, p
        )

    def _queue_changed(self, p: PrefillInstance) -> None:
        """With ``heartbeat_s`` = 0 the Conductor hears of every change of a prefill queue at once; otherwise at the
        instance's next beat, as from a real worker."""
        if not self.config.heartbeat_s:
            self.conductor.heartbeat(p.inst.id, p.load(self.now), self.now)

    # -- arrival and prefill ------------------------------------------------------------------

    def _arrive(self, rec: Record) -> None:
        """A request arrives (or, told to wait by early_wait, asks again)."""
        r = rec.req
        waited = self.now - r.arrival_s
        req = ScheduleRequest(
            rec.rid,
            r.chain,
            r.prompt_tokens,
            self.model.block_tokens,
            priority=rec.priority,
            tenant=rec.tenant,
            tenant_weight=rec.weight,
            waited_s=waited,
        )
        out = self.conductor.schedule(req, self.now)
        if self.observer is not None:
            self.observer.observe_schedule(self.now, req, out)
        if isinstance(out, Wait):
            rec.waits += 1
            self._push(self.now + out.wait_s, _ASK_AGAIN, rec)
            return
        if isinstance(out, Rejection):
            rec.rejected = out.reason.value
            return
        rec.decision = out
        rec.predicted_ttft_s = waited + out.predicted.ttft_s
        rec.predicted_s = out.predicted.transfer_s + out.predicted.prefill_s
        if out.local:  # its decode instance reads its prefix (off its steps), then computes the rest on them
            self._read_local_prefix(rec)
            self._push(self.now + rec.load_s, _LOCAL_READY, (self.decode_of[out.decode], rec))
            return
        p = self.prefill_of[out.prefill]
        p.queue.append(rec)
        p.received += 1
        if p.running is None:
            self._start_prefill(p)
        else:
            self._queue_changed(p)

    def _start_prefill(self, p: PrefillInstance) -> None:
        rec = p.queue.popleft()
        m, now, keys, plan = self.model, self.now, rec.req.keys, rec.decision.plan
        local = p.cache.leading(keys, 0, plan.local_blocks)
        fetched = 0
        src = self.caches.get(plan.fetch_node) if plan.fetch_blocks else None  # (None: its node has stopped since)
        if src is not None and local == plan.local_blocks:
            fetched = src.leading(keys, local, local + plan.fetch_blocks)
        p.cache.leased = set(keys[: local + fetched])  # before the reads: a promotion may evict, never these
        ssd = p.cache.read(keys[:local])
        net_s = 0.0
        if fetched:
            ssd += self.caches[plan.fetch_node].read(keys[local : local + fetched])
            net_s = m.transfer_s(fetched * m.block_bytes)
        prompt = rec.req.prompt_tokens
        cached = reports.cached_tokens(local + fetched, m.block_tokens, prompt)
        rec.local_blocks, rec.fetched_blocks, rec.ssd_blocks, rec.cached_tokens = local, fetched, ssd, cached
        x = p.inst.pipeline_stages
        rec.load_s = (m.ssd_s(ssd) + net_s) / x  # a group's stages read their layers in parallel
        rec.compute_s = m.pipelined_prefill_s(prompt, cached, x, self.config.prefill_chunk) * self.jitter()
        rec.prefill_start = now
        p.running = rec
        self._push(now + rec.load_s + rec.compute_s, _PREFILL_DONE, p)
        if fetched:
            self.conductor.transfer_sample(fetched * m.block_bytes, net_s)
        self._queue_changed(p)

    def _prefill_done(self, p: PrefillInstance) -> None:
        c, now, rec = self.conductor, self.now, p.running
        rec.prefill_end = now
        p.busy_s += rec.load_s + rec.compute_s
        # one prefill at a time: its own share of the steps is all of its compute (its reads are not in it)
        sample = reports.prefill_sample(rec.req.prompt_tokens, rec.cached_tokens, rec.compute_s)
        c.prefill_sample(sample.prompt_tokens, sample.cached_tokens, sample.seconds, p.inst.id)
        p.cache.put(rec.req.keys)  # the whole prompt, fetched blocks included (keep_fetched)
        p.cache.leased = set()
        p.running = None
        late = c.admit_at_decode(rec.decision.decode, now, rec.req.prompt_tokens)
        if late is not None:
            rec.rejected = REJECTED_AT_DECODE
            c.finished(
                rec.rid, now, now - rec.req.arrival_s
            )  # its prefill answered: a TTFT, as a decode worker reports it
        else:
            push_s = self.model.transfer_s(
                rec.req.prompt_tokens * self.model.kv_bytes_per_token * self.model.decode_push_fraction
            )
            self._push(now + push_s, _DECODE_ARRIVE, (self.decode_of[rec.decision.decode], rec))
        if p.queue:
            self._start_prefill(p)
        else:
            self._queue_changed(p)
        if self.config.heartbeat_s and self.config.busy_beat_s:  # a real worker beats as a prompt ends (beat_soon)
            c.heartbeat(p.inst.id, p.load(now), now)

    # -- decode ------------------------------------------------------------------------------------

    def _decode_arrive(self, d: DecodeInstance, rec: Record) -> None:
        d.waiting.append(rec)
        if not d.busy:
            self._start_run(d)
            return
        self._cut_run(d)

    def _cut_run(self, d: DecodeInstance) -> None:
        """Something arrived at a busy instance: its run ends at the first step boundary from now."""
        cut = (
            int(np.searchsorted(d.run_ends, self.now - d.run_start, side="left")) + 1
        )  # it joins after this many steps
        if cut < d.run_steps:
            d.run_steps = cut
            d.version += 1
            self._push(d.run_start + float(d.run_ends[cut - 1]), _STEP_END, (d, d.version))

    def _start_run(self, d: DecodeInstance) -> None:
        now, m = self.now, self.model
        joined = []
        cap_s = self.config.tbt_slo_s * self.config.tbt_headroom
        while d.waiting:  # join at a step boundary, first come first served, while the KV fits (a request
            rec = d.waiting[0]  # reserves prompt + output) and the step stays under the TBT cap
            need = rec.req.prompt_tokens + rec.req.output_tokens
            if d.batch and (
                d.kv_used + need > d.kv_tokens
                or m.decode_step_s(d.batch + 1, d.context + rec.req.prompt_tokens) > cap_s
            ):
                break
            d.waiting.popleft()
            d.kv_used += need
            d.batch += 1
            d.context += rec.req.prompt_tokens
            # one computed here has its first token out already (its last chunk's step): the next comes a step from now
            # (a wait for a place in the batch is not counted among its gaps)
            rec.join_step = d.steps - 1 if rec.decision.local else d.steps
            self._seq += 1
            heapq.heappush(d.finishing, (rec.join_step + rec.req.output_tokens, self._seq, rec))
            joined.append(rec)
            self.conductor.decode_started(
                rec.rid, now, rec.prefill_end - rec.req.arrival_s
            )  # as a decode worker: its prefill answered
            if self.observer is not None:
                self.observer.observe_decode_started(rec.rid, now)
        if d.local is None and d.locals:
            self._start_local(d)
        if not d.batch and d.local is None:
            d.busy = False
            self.conductor.heartbeat(d.inst.id, d.load(now), now)
            return
        d.busy = True
        d.peak_batch = max(d.peak_batch, d.batch)
        n = d.finishing[0][0] - d.steps if d.batch else d.local_end - d.steps  # steps until the next request leaves
        if d.local is not None:  # or the prompt computed here is done
            n = min(n, d.local_end - d.steps)
        context = d.context + d.batch * np.arange(n)
        step_s = (
            m.decode_base_s + m.decode_per_request_s * d.batch + m.decode_s_per_context_token * context
        ) * self.jitter.many(n)
        if not d.batch:
            step_s[:] = 0.0
        if d.local is not None:  # a chunk of it rides on every step of this run
            step_s += d.local_chunk_s
        d.reserve(n)
        d.durations[d.steps : d.steps + n] = step_s
        d.batches[d.steps : d.steps + n] = d.batch
        d.contexts[d.steps : d.steps + n] = context
        d.new_tokens[d.steps : d.steps + n] = d.batch + (d.local_chunk if d.local is not None else 0)
        d.run_ends = np.cumsum(step_s)
        d.run_start, d.run_steps = now, n
        d.version += 1
        for rec in joined:  # a run always completes its first step: a join only cuts it after that
            if not rec.decision.local:  # (one computed here had its first token from its last chunk's step)
                rec.first_token = now + float(d.run_ends[0])
        self._push(now + float(d.run_ends[-1]), _STEP_END, (d, d.version))
        if joined:
            self.conductor.heartbeat(d.inst.id, d.load(now), now)

    def _read_local_prefix(self, rec: Record) -> None:
        """A prompt placed on its decode instance: its prefix read from the node the plan names, as the decode worker
        reads it before the prompt enters its engine (the batch's steps go on meanwhile)."""
        m, keys, plan = self.model, rec.req.keys, rec.decision.plan
        src = self.caches.get(plan.fetch_node) if plan.fetch_blocks else None
        fetched = src.leading(keys, 0, plan.fetch_blocks) if src is not None else 0
        ssd = src.read(keys[:fetched]) if fetched else 0
        rec.fetched_blocks, rec.ssd_blocks = fetched, ssd
        rec.cached_tokens = reports.cached_tokens(fetched, m.block_tokens, rec.req.prompt_tokens)
        net_s = m.transfer_s(fetched * m.block_bytes) if fetched else 0.0
        rec.load_s = m.ssd_s(ssd) + net_s
        rec.prefill_start = self.now
        if fetched:
            self.conductor.transfer_sample(fetched * m.block_bytes, net_s)

    def _local_ready(self, d: DecodeInstance, rec: Record) -> None:
        """Its prefix is in: it waits for the instance's prompts before it, then rides on the steps."""
        d.locals.append(rec)
        if d.busy:
            self._cut_run(d)
        else:
            self._start_run(d)

    def _start_local(self, d: DecodeInstance) -> None:
        """The next prompt ``d`` computes itself: its uncached tokens in chunks of the decision's size, one on each of
        its steps (conductor.local)."""
        rec = d.locals.popleft()
        m, prompt = self.model, rec.req.prompt_tokens
        # its chunks ride on steps that pay the launches already: no prefill's own overhead
        rec.compute_s = (m.prefill_s(prompt, rec.cached_tokens) - m.prefill_overhead_s) * self.jitter()
        chunks = -(-(prompt - rec.cached_tokens) // (rec.decision.chunk_tokens or self.config.local_chunk))
        d.local, d.local_from, d.local_end = rec, d.steps, d.steps + chunks
        d.local_chunk_s = rec.compute_s / chunks
        d.local_chunk = -(-(prompt - rec.cached_tokens) // chunks)

    def _local_done(self, d: DecodeInstance) -> None:
        """Its last chunk's step gave the first token: the prompt's blocks go to the pool node the Conductor named (the
        decode worker writes them behind), and it joins the batch."""
        rec, d.local = d.local, None
        rec.prefill_end = rec.first_token = self.now
        if rec.decision.node in self.caches:
            self.caches[rec.decision.node].put(rec.req.keys)
        if rec.req.output_tokens <= 1:  # a one-token answer: done
            rec.finish, rec.tbt_s = self.now, 0.0
            self.conductor.finished(rec.rid, self.now, rec.prefill_end - rec.req.arrival_s)
            return
        d.waiting.appendleft(rec)

    def _step_end(self, d: DecodeInstance, version: int) -> None:
        if version != d.version:
            return  # a run that a join cut short
        now, c = self.now, self.conductor
        n = d.run_steps
        # the decode predictor's sample: the mean decode step since the last heartbeat, as a decode worker reports it
        load = step_load(
            Load(
                queued_requests=len(d.waiting),
                running_requests=d.batch,
                context_tokens=d.context + (n - 1) * d.batch,
                waiting_requests=len(d.waiting),
                waiting_s=d.waiting_s(now),
            ),
            d.step_report(d.steps + n),
        )
        d.steps += n
        d.context += n * d.batch
        if d.local is not None and d.steps >= d.local_end:
            self._local_done(d)
        while d.finishing and d.finishing[0][0] <= d.steps:
            _, _, rec = heapq.heappop(d.finishing)
            rec.finish = now
            start = rec.join_step + 1  # token i+1 comes one step after token i: the gaps are those steps
            rec.tbt_s = tbt_of(d.durations[start : rec.join_step + rec.req.output_tokens])
            d.batch -= 1
            d.context -= rec.req.prompt_tokens + rec.req.output_tokens
            d.kv_used -= rec.req.prompt_tokens + rec.req.output_tokens
            c.finished(rec.rid, now)
            if self.observer is not None:
                self.observer.observe_finished(rec.rid, now, rec.req.output_tokens)
        d.busy = False
        c.heartbeat(d.inst.id, load, now)
        self._start_run(d)
