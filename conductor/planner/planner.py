"""The planner: how many prefill and decode instances the next window needs, from what the Conductor saw and predicts.

    every request placed, waited or refused  ->  observe_schedule      (arrival, prompt, uncached tokens)
    a request's decode starts, ends          ->  observe_decode_started / observe_finished  (its output's length)
    every interval (30 s):
      1. snapshot(conductor, now)    under the Conductor's lock: the window's requests, the learnt predictors, the pools
      2. decide(snapshot, check)     outside it:
           forecast   the next window's arrival rate (Holt: level and trend of the intervals' rates, looking ahead
                      an instance's start time), its prompts' uncached prefill seconds and its outputs' lengths
           size       prefill and decode counts at that rate (conductor.planner.sizing)
           check      the twin replays the window at the forecast rate with the sized counts and the ones around them
                      (conductor.planner.check); the cheapest that meets the SLOs there wins
           hold       more instances: at once; fewer: only after ``down_after`` plans in a row want fewer and
                      ``cooldown_s`` after the last change (a load that swings between two plans does not make
                      instances come and go), never outside [min, max]
      3. the service scales each role to the plan's count through its pool provider (drain first on the way down)

Pure: time is passed in, and nothing here does I/O; the twin check is a function passed to ``decide``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, Field

from conductor.admission import AdmissionKind
from conductor.local import LocalPrefill
from conductor.planner.poolsize import READS_KEPT, PoolAdvice, advise_pool
from conductor.planner.sizing import (
    DecodeLoad,
    PrefillLoad,
    Sizing,
    StepModel,
    drain_count,
    late_share,
    size_decode,
    size_prefill,
)
from conductor.policies import PolicyKind
from conductor.types import Decision, Rejection, Role, ScheduleRequest, Wait


class PlannerConfig(BaseModel):
    """The planner's knobs (``mooncake up --planner``, the Conductor's ``--planner``)."""

    interval_s: float = Field(30.0, gt=0, description="seconds between two plans")
    window_s: float = Field(120.0, gt=0, description="the plan's statistics (lengths, cache hits) cover this long")
    start_s: float = Field(60.0, ge=0, description="how long a new instance takes to serve: forecasts look ahead so")
    cooldown_s: float | None = Field(
        None, ge=0, description="no scale-down within this long of the role's last change [default: 3 intervals]"
    )
    down_after: int = Field(2, ge=1, description="plans in a row that want fewer instances before there are fewer")
    min_prefill: int = Field(1, ge=1)
    max_prefill: int = Field(16, ge=1)
    min_decode: int = Field(1, ge=1)
    max_decode: int = Field(16, ge=1)
    ttft_quantile: float = Field(0.99, gt=0.5, lt=1.0, description="the share of prompts sized to start in time")
    max_utilization: float = Field(0.95, gt=0, le=1.0, description="the busiest a prefill pool is sized to be")
    batch_z: float = Field(2.33, ge=0, description="decode: deviations of the batch kept under the TBT cap")
    trend_alpha: float = Field(0.5, gt=0, le=1.0, description="Holt smoothing of the rate's level")
    trend_beta: float = Field(0.3, ge=0, le=1.0, description="Holt smoothing of the rate's trend")
    twin: bool = Field(True, description="check each plan on the twin before acting (conductor.planner.check)")
    twin_target: float = Field(0.99, gt=0, le=1.0, description="the twin's share within both SLOs a plan must reach")
    pool_gain: float = Field(
        0.5,
        gt=0,
        description="a pool node (with its prefill worker) is planned when the prefill seconds its extra cache hits "
        "save are at least this share of an instance's time (conductor.planner.poolsize)",
    )
    act: bool = Field(True, description="scale the pools (off: only export the desired counts, for KEDA or an HPA)")

    @property
    def cooldown(self) -> float:
        return 3 * self.interval_s if self.cooldown_s is None else self.cooldown_s

    def bounds(self, role: Role) -> tuple[int, int]:
        return (self.min_prefill, self.max_prefill) if role is Role.PREFILL else (self.min_decode, self.max_decode)


@dataclass(slots=True)
class Seen:
    """One request as the planner saw it."""

    arrival_s: float
    prompt_tokens: int
    keys: bytes  # its block keys (a KeyChain's blob): the twin replays them against its caches
    cached_tokens: int = -1  # what its placement reused (-1: not placed, so not known)
    decode_start: float = math.nan
    finish: float = math.nan
    output_tokens: int = 0  # as its decode worker reported it (0: not reported)


@dataclass(slots=True)
class Snapshot:
    """What one plan is made from (taken under the Conductor's lock; ``decide`` runs outside it)."""

    now: float
    requests: list[Seen]  # the window's, oldest first
    prefill: int  # schedulable instances of each role now (starting ones not counted: see ``Planner.pending``)
    decode: int
    prefill_coef: tuple[float, float, float]  # the prefill predictor: c0 + c1 new + c2 new (prompt + cached) / 2
    slowdown: float  # the prefill instances' mean learnt slowdown
    steps: StepModel
    step_s: float  # the decode instances' mean reported step (for output lengths: decode seconds / step)
    ttft_slo_s: float
    tbt_slo_s: float
    tbt_headroom: float
    block_tokens: int
    block_bytes: int
    kv_tokens: int  # a decode instance's KV in tokens (0: not known)
    transfer: tuple[float, float]  # (latency s, bytes/s)
    handoff_s: float
    backlog_s: float = 0.0  # the prefill instances' queued work (predicted seconds, their heartbeats')
    pool_nodes: int = 0  # the pool nodes registered, and a node's mean DRAM blocks (0: not known)
    node_blocks: float = 0.0
    reads: list[bytes] = field(default_factory=list)  # the arrivals' key chains (Planner.reads), oldest first
    admission: AdmissionKind = AdmissionKind.EARLY_PREDICTIVE  # the Conductor's, for the twin's
    policy: PolicyKind = PolicyKind.KVCACHE_CENTRIC
    local_prefill: LocalPrefill = LocalPrefill.NEVER
    kv_blocks: float = 0.0  # a decode instance's KV capacity in blocks, as registered (the mean; 0: not known)
    kv_shared: bool = True  # its running batch holds blocks of it too (else only prompts in prefill do)
    prefill_tp: int = 1  # an instance's devices (its tensor-parallel size; a role's instances share theirs)
    decode_tp: int = 1

    def prefill_s(self, prompt: int, cached: int) -> float:
        new = prompt - cached
        c0, c1, c2 = self.prefill_coef
        return (c0 + c1 * new + c2 * new * (prompt + cached) / 2.0) * self.slowdown


@dataclass(slots=True)
class TwinOutcome:
    """A plan's run on the twin: the share of the window's requests within both SLOs, and their tails."""

    prefill: int
    decode: int
    attainment: float
    ttft_p99_s: float
    tbt_p99_s: float


@dataclass(slots=True)
class Plan:
    """One plan: the counts to reach and why."""

    at: float
    prefill: int
    decode: int
    rate: float  # the forecast rate (requests/s) the plan is sized for
    observed_rate: float  # the last interval's
    mean_prompt_tokens: float
    mean_uncached_tokens: float
    mean_output_tokens: float
    prefill_sizing: Sizing
    decode_sizing: Sizing
    twin: list[TwinOutcome] = field(default_factory=list)  # every candidate the twin ran, in order
    pool: PoolAdvice | None = None  # what more pool nodes would do (None: no reads or no capacity known)
    held: str = ""  # why the counts are not the sized ones ("" : they are)
    prefill_tp: int = 1  # the devices an instance of each role takes (its tensor-parallel size)
    decode_tp: int = 1

    def devices(self, role: Role) -> int:
        """The devices the plan's instances of ``role`` take: instances x their tensor-parallel size."""
        return self.prefill * self.prefill_tp if role is Role.PREFILL else self.decode * self.decode_tp

    def describe(self) -> str:
        p, d = self.prefill_sizing, self.decode_sizing
        lines = [
            f"forecast {self.rate:.2f} req/s (last interval {self.observed_rate:.2f}); prompts "
            f"{self.mean_prompt_tokens:.0f} tokens, {self.mean_uncached_tokens:.0f} uncached; outputs "
            f"{self.mean_output_tokens:.0f} tokens",
            f"prefill: {p.instances} sized ({p.limit}: utilization {p.utilization:.0%}, {p.predicted:.2%} of prompts "
            "predicted late)",
            f"decode: {d.instances} sized ({d.limit}: batch or KV {d.utilization:.0%} of what one holds, step "
            f"{d.predicted * 1000:.1f} ms)",
        ]
        if self.pool is not None:
            lines.append(self.pool.describe())
        lines += [
            f"twin {t.prefill}P {t.decode}D: {t.attainment:.1%} within both SLOs, TTFT p99 {t.ttft_p99_s:.2f} s, "
            f"TBT p99 {t.tbt_p99_s * 1000:.1f} ms"
            for t in self.twin
        ]
        sized = ""
        if self.prefill_tp > 1 or self.decode_tp > 1:
            total = self.devices(Role.PREFILL) + self.devices(Role.DECODE)
            sized = f", {total} devices (prefill at TP {self.prefill_tp}, decode at TP {self.decode_tp})"
        lines.append(
            f"plan: {self.prefill} prefill, {self.decode} decode{sized}" + (f" ({self.held})" if self.held else "")
        )
        return "\n".join(lines)


def kv_residence(snap: Snapshot, prefills: int, seconds: list[float], prompt: float, out: float) -> tuple[float, float]:
    """(seconds a request holds its decode KV, blocks it holds) for the decode sizing's KV term (0, 0: KV not known).

    It holds its prompt's blocks from its placement: through the wait for its prefill (the queue there now, spread
    over the instances the plan will have, which a backlog a step up left behind makes long), its prefill and the
    hand-off; where the batch shares the cache, on through its decode (its output's steps) with its output's blocks.
    """
    if snap.kv_blocks <= 0 or not snap.block_tokens or prompt <= 0:
        return 0.0, 0.0
    wait = snap.backlog_s / max(1, prefills, snap.prefill)
    residence = wait + (float(np.mean(seconds)) if seconds else 0.0) + snap.handoff_s
    tokens = prompt
    if snap.kv_shared:
        residence += out * max(snap.step_s, snap.steps.step_s(1.0, prompt + out / 2))
        tokens += out
    return residence, math.ceil(tokens / snap.block_tokens)


MAX_AHEAD = 2.0  # the most intervals the forecast follows the rate's trend ahead
MAX_UP = 4  # a plan adds at most this many instances of a role, or doubles it if that is more
TWIN_STEPS = 3  # the most instances a twin search moves a role from its sized count
Check = Callable[[Snapshot, "Plan", int, int], TwinOutcome]  # (snapshot, plan, prefill, decode) -> the twin's outcome


class Planner:
    """The observations, the forecast's state and the hysteresis between plans. Pure: time is passed in."""

    def __init__(self, config: PlannerConfig | None = None, started: float | None = None) -> None:
        """``started``: when it began to observe (the first rate counts from then; None: from the first arrival, so
        a lone request just before the first plan reads as a rate of one per the time between the two)."""
        self.config = config or PlannerConfig()
        self._seen: dict[str, Seen] = {}  # request id -> what was seen of it (the window's, and those still running)
        self._order: deque[tuple[float, str]] = deque()  # (arrival, id) oldest first
        self._durations: deque[tuple[float, float]] = deque()  # (finish, decode seconds) of the window's finishes
        self._outputs: deque[tuple[float, int]] = deque()  # (finish, output tokens) of those that reported them
        self._since = started  # when the arrivals counted now began (the last plan, its start, or the first arrival)
        self._arrivals = 0
        self.rates: deque[float] = deque(maxlen=64)  # each plan's observed arrival rate since the one before
        self._level: float | None = None
        self._trend = 0.0
        self._below: dict[Role, list[int]] = {Role.PREFILL: [], Role.DECODE: []}  # recent plans wanting fewer
        self.last_change: dict[Role, float] = {Role.PREFILL: -math.inf, Role.DECODE: -math.inf}
        self.target: dict[Role, int] = {}  # the counts last acted on (a starting instance is not registered yet)
        self.last: Plan | None = None
        self.block_tokens = 0  # the requests' block size (their ScheduleRequest's)
        # the arrivals' key chains, in order (pool sizing): a chain each, split into keys only on the planner's thread
        # (a Schedule of a 100k-token prompt does not pay for 6,000 slices), about READS_KEPT keys in all
        self.reads: deque[bytes] = deque()
        self._read_keys = 0

    # -- observations (called under the Conductor's lock, once per event) ---------------------------

    def observe_schedule(self, now: float, req: ScheduleRequest, outcome: Decision | Rejection | Wait) -> None:
        """A request asked to be placed. A retry, or the same request asking again after a wait, is not a new
        arrival; a refused one is (it is demand the pools did not meet)."""
        seen = self._seen.get(req.request_id)
        if seen is None and not req.retry:
            if self._since is None:
                self._since = now
            self._arrivals += 1
            self.block_tokens = req.block_tokens
            keys = req.keys.blob if hasattr(req.keys, "blob") else b"".join(req.keys)
            seen = self._seen[req.request_id] = Seen(now, req.prompt_tokens, keys)
            self.reads.append(keys)
            self._read_keys += len(keys) // 16
            while self._read_keys - len(self.reads[0]) // 16 >= READS_KEPT:
                self._read_keys -= len(self.reads.popleft()) // 16
            self._order.append((now, req.request_id))
            self._trim(now)
        if seen is not None and isinstance(outcome, Decision) and seen.cached_tokens < 0:
            seen.cached_tokens = req.prompt_tokens - outcome.plan.compute_tokens

    def observe_decode_started(self, request_id: str, now: float) -> None:
        seen = self._seen.get(request_id)
        if seen is not None and math.isnan(seen.decode_start):
            seen.decode_start = now

    def observe_finished(self, request_id: str, now: float, output_tokens: int = 0) -> None:
        """``request_id`` left its decode instance having made ``output_tokens`` tokens (0: not reported; its length
        is then its decode seconds over the mean step)."""
        seen = self._seen.get(request_id)
        if seen is None or not math.isnan(seen.finish):
            return
        seen.finish, seen.output_tokens = now, output_tokens
        if output_tokens > 0:
            self._outputs.append((now, output_tokens))
        elif not math.isnan(seen.decode_start):
            self._durations.append((now, now - seen.decode_start))

    def _trim(self, now: float) -> None:
        """Forget what is older than the window; a request still decoding stays (its finish gives its output's
        length) until two windows have passed."""
        horizon, oldest = now - self.config.window_s, now - 2 * self.config.window_s
        order = self._order
        while order and order[0][0] < horizon:
            arrival, rid = order.popleft()
            seen = self._seen.get(rid)
            if seen is not None and (arrival < oldest or not math.isnan(seen.finish) or seen.cached_tokens < 0):
                del self._seen[rid]
        if len(self._seen) > 4 * len(order) + 1000:  # the running ones that never finished (lost): sweep them
            keep = {rid for _, rid in order}
            self._seen = {r: s for r, s in self._seen.items() if r in keep or s.arrival_s >= oldest}
        for done in (self._durations, self._outputs):
            while done and done[0][0] < horizon:
                done.popleft()

    def forecast_rate(self, now: float) -> float:
        """Arrivals a second over the next interval, looking ``start_s`` ahead but at most ``MAX_AHEAD`` intervals
        (Holt: the level and trend of the rates seen between plans), never below the last observed rate."""
        c = self.config
        if self._level is None:
            return self.rates[-1] if self.rates else 0.0
        # the trend of rates a few seconds apart is mostly noise: it is followed two intervals ahead at most
        ahead = min(max(c.start_s, c.interval_s) / c.interval_s, MAX_AHEAD)
        return max(0.0, self._level + self._trend * ahead, self.rates[-1])

    def _observe_rate(self, now: float) -> None:
        """The arrival rate since the last plan, into the Holt forecast; none from a span under a quarter of an
        interval (``mooncake plan`` asked just after a plan: its few arrivals, often none, say nothing of the rate)."""
        if self._since is None or now - self._since < 0.25 * self.config.interval_s:
            return
        rate = self._arrivals / (now - self._since)
        self._since, self._arrivals = now, 0
        c = self.config
        self.rates.append(rate)
        if self._level is None:
            self._level = rate
            return
        level = c.trend_alpha * rate + (1 - c.trend_alpha) * (self._level + self._trend)
        self._trend = c.trend_beta * (level - self._level) + (1 - c.trend_beta) * self._trend
        self._level = level

    # -- a plan ----------------------------------------------------------------------------------

    def window(self, now: float) -> list[Seen]:
        """The window's requests, oldest first (a snapshot's ``requests``)."""
        self._trim(now)
        horizon = now - self.config.window_s
        return sorted((s for s in self._seen.values() if s.arrival_s >= horizon), key=lambda s: s.arrival_s)

    def decide(self, snap: Snapshot, check: Check | None = None) -> Plan:
        """The counts for the next interval (see the module's docstring). Updates the hysteresis's state."""
        c, now = self.config, snap.now
        self._observe_rate(now)
        rate = self.forecast_rate(now)
        observed = self.rates[-1] if self.rates else rate
        reqs = snap.requests
        placed = [s for s in reqs if s.cached_tokens >= 0]
        hit = sum(s.cached_tokens for s in placed) / max(1, sum(s.prompt_tokens for s in placed)) if placed else 0.0
        seconds = [
            snap.prefill_s(s.prompt_tokens, s.cached_tokens if s.cached_tokens >= 0 else int(hit * s.prompt_tokens))
            for s in reqs
        ]
        uncached = [s.prompt_tokens - max(0, s.cached_tokens) for s in placed]
        pre = size_prefill(
            PrefillLoad(rate, tuple(seconds)),
            max(snap.ttft_slo_s - snap.handoff_s, 1e-3),
            c.ttft_quantile,
            c.max_utilization,
            c.bounds(Role.PREFILL),
        )
        a = pre.utilization * pre.instances
        drain = drain_count(a, snap.prefill, snap.backlog_s, c.start_s, snap.ttft_slo_s)
        if drain > pre.instances:  # a queue built up (a step up outran the pool): clear it within the TTFT SLO
            n = min(drain, c.max_prefill)
            pre = Sizing(n, a / n, late_share(n, PrefillLoad(rate, tuple(seconds)), snap.ttft_slo_s), "backlog")
        out = self.output_tokens(snap.step_s)
        prompt = float(np.mean([s.prompt_tokens for s in reqs])) if reqs else 0.0
        residence, blocks = kv_residence(snap, pre.instances, seconds, prompt, out)
        load = DecodeLoad(rate, out, prompt + out / 2, prompt + out, residence, blocks)
        dec = size_decode(
            load,
            snap.steps,
            snap.tbt_slo_s * snap.tbt_headroom,
            snap.kv_tokens,
            c.batch_z,
            c.bounds(Role.DECODE),
            snap.kv_blocks,
        )
        plan = Plan(
            now,
            pre.instances,
            dec.instances,
            rate,
            observed,
            prompt,
            float(np.mean(uncached)) if uncached else prompt * (1 - hit),
            out,
            pre,
            dec,
            prefill_tp=snap.prefill_tp,
            decode_tp=snap.decode_tp,
        )
        self._pool(plan, snap)
        if check is not None and c.twin and reqs and rate > 0:
            self._check(plan, snap, check)
        self._hold(plan, snap)
        self.last = plan
        return plan

    def _pool(self, plan: Plan, snap: Snapshot) -> None:
        """The pool's advice (conductor.planner.poolsize); nodes come with prefill workers, so the prefill count is at
        least the nodes it recommends."""
        if not snap.reads or snap.pool_nodes < 1 or snap.node_blocks <= 0 or not snap.requests:
            return
        keys_per_request = sum(len(s.keys) // 16 for s in snap.requests) / len(snap.requests)
        c0, c1, c2 = snap.prefill_coef
        block = snap.block_tokens or 1
        reads = [chain[i : i + 16] for chain in snap.reads for i in range(0, len(chain), 16)][-READS_KEPT:]
        plan.pool = advise_pool(
            reads,
            snap.pool_nodes,
            snap.node_blocks,
            plan.rate * keys_per_request,
            c1 * block * snap.slowdown,
            self.config.pool_gain,
        )
        if plan.pool.recommended > max(plan.pool.nodes, plan.prefill):  # more nodes pay for themselves
            plan.prefill = min(plan.pool.recommended, self.config.max_prefill)

    def _check(self, plan: Plan, snap: Snapshot, check: Check) -> None:
        """Keep the cheapest counts that meet the SLOs on the twin, from the sized ones: while they miss there, one
        more of the role whose SLO the twin saw broken (at most ``TWIN_STEPS``); when the sized ones meet them, one
        fewer of each role if the twin meets them with it too and the pool still keeps up with the forecast (its
        utilization within ``max_utilization``, the decode batch within the TBT cap's): the twin replays a window
        from an idle start, so it cannot judge a pool that falls behind more slowly than that."""
        target = self.config.twin_target
        lo_p, hi_p = self.config.bounds(Role.PREFILL)
        hi_d = self.config.bounds(Role.DECODE)[1]

        def run(p: int, d: int) -> TwinOutcome:
            outcome = check(snap, plan, p, d)
            plan.twin.append(outcome)
            return outcome

        p, d = plan.prefill, plan.decode
        if plan.pool is not None and plan.pool.recommended > plan.pool.nodes:  # nor below the pool nodes worth adding
            lo_p = max(lo_p, plan.pool.recommended)
        best = run(p, d)
        for _ in range(TWIN_STEPS):  # short: add where the SLO broke
            if best.attainment >= target:
                break
            if best.ttft_p99_s > snap.ttft_slo_s and p < hi_p:
                p += 1
            elif best.tbt_p99_s > snap.tbt_slo_s and d < hi_d:
                d += 1
            elif p < hi_p:
                p += 1
            else:
                break
            best = run(p, d)
        if best.attainment >= target and p == plan.prefill:  # enough as sized: one fewer, if the pool keeps up
            a = plan.prefill_sizing.utilization * plan.prefill_sizing.instances
            if p > lo_p and a / (p - 1) <= self.config.max_utilization and run(p - 1, d).attainment >= target:
                p -= 1
        plan.prefill, plan.decode = p, d

    def _hold(self, plan: Plan, snap: Snapshot) -> None:
        """Up at once; down after ``down_after`` plans in a row below and ``cooldown_s`` after the last change."""
        c, now = self.config, plan.at
        held = []
        for role, current in ((Role.PREFILL, snap.prefill), (Role.DECODE, snap.decode)):
            current = max(current, self.target.get(role, 0))
            want = plan.prefill if role is Role.PREFILL else plan.decode
            lo, hi = c.bounds(role)
            want = min(max(want, lo), hi)
            below = self._below[role]
            if want >= current:
                below.clear()
                new = min(want, max(2 * current, current + MAX_UP))  # as an HPA's default: a surge is not a flood
            else:
                below.append(want)
                del below[: -c.down_after]
                if len(below) < c.down_after:
                    new = current
                    held.append(f"{role.value} waits for {c.down_after - len(below)} more plan(s) below {current}")
                elif now - self.last_change[role] < (cooldown := c.cooldown):
                    new = current
                    held.append(f"{role.value} cools down for {cooldown - (now - self.last_change[role]):.0f} s")
                else:
                    new = max(below)
                    below.clear()
            if new != current:
                self.last_change[role] = now
            self.target[role] = new
            if role is Role.PREFILL:
                plan.prefill = new
            else:
                plan.decode = new
        plan.held = "; ".join(held)

    def output_tokens(self, step_s: float) -> float:
        """The window's mean output length: as reported by the requests that finished in it, or else their decode
        seconds over the mean step (0: none finished yet)."""
        if self._outputs:
            return float(np.mean([n for _, n in self._outputs]))
        if not self._durations or step_s <= 0:
            return 0.0
        return float(np.mean([d for _, d in self._durations])) / step_s

    def settle(self, role: Role, count: int) -> None:
        """The pool's count is known to be ``count`` (a scale that failed, or a count set by hand)."""
        self.target[role] = count
