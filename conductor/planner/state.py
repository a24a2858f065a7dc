"""The twin's state: its configuration, the requests it replays, what happened to each, and its instances.

The twin (conductor.planner.twin) moves these; the planner (conductor.planner.planner) builds a
``SimConfig`` for each plan it checks, and benchmarks.sim one for each run.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from conductor.admission import AdmissionKind
from conductor.config import ConductorConfig
from conductor.forecast import ForecastKind
from conductor.local import LocalPrefill
from conductor.planner.costs import ModelConfig
from conductor.planner.nodecache import NodeCache
from conductor.policies import PolicyKind
from conductor.predictors import PredictorConfig
from conductor.types import Decision, Instance, KeyChain, Load
from mooncake.budgets import CUDA_BATCHED_TOKENS
from mooncake.serving import reports
from mooncake.serving.reports import PREFILL_BUSY_BEAT_S

REJECTED_AT_DECODE = "decode_after_prefill"  # the baseline's late rejection: the prefill was wasted
HEARTBEAT_S = 2.5  # a real worker's heartbeat period: ConductorConfig.heartbeat_timeout_s (10 s) x conductor.service's
# HEARTBEAT_INTERVAL_FRACTION (0.25), which the Conductor hands each worker as it registers
STEP_BUDGET_TOKENS = CUDA_BATCHED_TOKENS  # a worker's step budget on a GPU


@dataclass(slots=True)
class TraceRequest:
    """One request of the trace, with its arrival already scaled by the replay speed."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    keys: list[bytes]  # the 16-byte keys of its full 512-token blocks, in chain order
    chain: KeyChain  # the same keys as one byte string (what the Conductor is sent)


@dataclass
class SimConfig:
    prefill: int = 8  # prefill nodes
    decode: int = 8
    group_size: int = 1  # prefill nodes per chunked-pipeline group (one prefill instance each; 1: every node alone)
    pipeline_groups: int | None = None  # how many groups (the other nodes serve alone); None: every node in one
    prefill_chunk: int = 2048  # *free*: a pipeline group's chunk of a prompt (tokens)
    policy: PolicyKind = PolicyKind.KVCACHE_CENTRIC
    admission: AdmissionKind = AdmissionKind.NONE
    cache_blocks: int | None = None  # DRAM blocks per prefill node (None: unbounded)
    ssd_blocks: int = 0  # SSD blocks per prefill node (0: no SSD tier)
    eviction: str = "lru"
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    tbt_headroom: float = (
        0.9  # the Conductor's and each decode instance's: mean step held under this share of the TBT SLO
    )
    decode_forecast: ForecastKind = ForecastKind.SURVIVAL
    local_prefill: LocalPrefill = LocalPrefill.NEVER  # where prompts are computed (conductor.local)
    local_chunk: int = STEP_BUDGET_TOKENS  # a decode instance's step budget: the chunk of a prompt it computes itself
    local_max_load: float = ConductorConfig.model_fields[
        "local_max_load"
    ].default  # auto: a decode instance computes prompts
    # while its step is at most this share of the TBT limit
    threshold: float = 1.5  # kvcache_balancing_threshold
    tier_aware: bool = False
    seed: int = 0
    tick_s: float = 0.5
    heartbeat_s: float = (
        HEARTBEAT_S  # a prefill instance's heartbeat period (0: on every change of its queue, and every tick)
    )
    # its period while it holds prompts, with a beat as each prefill ends (heartbeat_s > 0; the shorter wins);
    # 0: neither, only the periodic beats (workers before PREFILL_BUSY_BEAT_S)
    busy_beat_s: float = PREFILL_BUSY_BEAT_S
    calibrate: bool = (
        True  # each prefill instance sends calibration samples before the first request (prefill.worker's)
    )
    step_budget: int = (
        STEP_BUDGET_TOKENS  # a node alone's step budget: only its calibration prompts follow it (1/8, 1/2, 1)
    )
    start_s: float = 60.0  # an instance the autoscaler asks for serves this long after (conductor.planner.elastic)
    plan_interval_s: float = 30.0  # the autoscaler's period
    retire_quiet_s: float = 3.0  # a drained instance stops once idle and nothing was placed there for this long
    model: ModelConfig = field(default_factory=ModelConfig)
    predictors: PredictorConfig = field(default_factory=PredictorConfig)  # the Conductor's priors (its defaults)

    def validate(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"need at least one prefill and one decode instance, got {self.prefill} and {self.decode}")
        grouped = self.prefill if self.pipeline_groups is None else self.pipeline_groups * self.group_size
        if self.group_size < 1 or grouped % self.group_size or not 0 <= grouped <= self.prefill:
            raise ValueError(
                f"{self.prefill} prefill nodes do not hold {self.pipeline_groups} groups of {self.group_size}"
            )
        if self.ttft_slo_s <= 0 or self.tbt_slo_s <= 0:
            raise ValueError("SLOs must be positive")
        if not 0 < self.tbt_headroom <= 1:
            raise ValueError(f"tbt_headroom must be in (0, 1], got {self.tbt_headroom}")
        if self.step_budget < 16:
            raise ValueError(f"step_budget must be at least 16 tokens, got {self.step_budget}")
        timeout = ConductorConfig().heartbeat_timeout_s
        if not 0 <= self.heartbeat_s < timeout:
            raise ValueError(
                f"heartbeat_s must be in [0, {timeout}) (the Conductor's heartbeat timeout), got {self.heartbeat_s}"
            )

    def prefill_shapes(self) -> list[int]:
        """Each prefill instance's nodes: the groups first, then the nodes alone."""
        groups = self.prefill // self.group_size if self.pipeline_groups is None else self.pipeline_groups
        return [self.group_size] * groups + [1] * (self.prefill - groups * self.group_size)


@dataclass(slots=True)
class Record:
    """What happened to one request."""

    req: TraceRequest
    rid: str
    decision: Decision | None = None
    rejected: str | None = None  # a RejectReason value, or REJECTED_AT_DECODE
    predicted_ttft_s: float = 0.0
    predicted_s: float = 0.0  # the Conductor's predicted transfer + prefill time (what it queued)
    waits: int = 0  # times early_wait told it to wait and ask again
    tenant: str = ""  # who sent it, its tenant's weight and its priority (benchmarks.sim.tenants; "": no tenants)
    weight: float = 1.0
    priority: int = 0
    prefill_start: float = math.nan
    prefill_end: float = math.nan
    local_blocks: int = 0
    fetched_blocks: int = 0
    ssd_blocks: int = 0
    cached_tokens: int = 0
    load_s: float = 0.0  # SSD reads and the fetch
    compute_s: float = 0.0
    join_step: int = -1
    first_token: float = math.nan
    finish: float = math.nan
    tbt_s: float = math.nan

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.req.arrival_s

    def within_slos(self, ttft_slo_s: float, tbt_slo_s: float) -> bool:
        """Served, its first token within the TTFT SLO and its gaps within the TBT SLO (a one-token answer has none)."""
        return (
            self.rejected is None
            and not math.isnan(self.first_token)
            and self.ttft_s <= ttft_slo_s
            and (math.isnan(self.tbt_s) or self.tbt_s <= tbt_slo_s)
        )


class PrefillInstance:
    def __init__(self, inst: Instance, cache: NodeCache, block_tokens: int) -> None:
        self.inst, self.cache, self.block_tokens = inst, cache, block_tokens
        self.queue: deque[Record] = deque()
        self.running: Record | None = None
        self.busy_s = 0.0
        self.received = 0  # requests placed here (they arrive at once: none is ever on its way)
        self.gone = False  # stopped (conductor.planner.elastic): its beats end

    def load(self, now: float) -> Load:
        """The heartbeat, as a real worker's (prefill.worker's ``in_flight``): every prompt it holds with what it has
        computed so far, which the Conductor prices with its own predictor. A queued one has its plan's prefix; the
        running one the whole blocks computed by now (its prefix read, then its compute at an even pace), or, in a
        pipelined group, none until it ends (a real group's stages report no progress)."""
        bs, prompts = self.block_tokens, []
        if (rec := self.running) is not None:
            prompt, issued = rec.req.prompt_tokens, 0
            if self.inst.pipeline_stages == 1 and rec.compute_s > 0:
                share = min(max((now - rec.prefill_start - rec.load_s) / rec.compute_s, 0.0), 1.0)
                issued = int((rec.cached_tokens + share * (prompt - rec.cached_tokens)) // bs)
            prompts.append(reports.InFlight(prompt, reports.computed_tokens(prompt, rec.cached_tokens, issued, bs)))
        for rec in self.queue:
            plan, prompt = rec.decision.plan, rec.req.prompt_tokens
            prompts.append(
                reports.InFlight(prompt, reports.cached_tokens(plan.local_blocks + plan.fetch_blocks, bs, prompt))
            )
        return Load(
            queued_requests=len(prompts),
            received_requests=self.received,
            prompts=tuple(prompts),
        )


class DecodeInstance:
    """A decode instance's batch, advanced a *run* of steps at a time.

    Between a join and a leave nothing changes but the context (each step adds one token
    per running request), so the steps up to the next leave are computed at once (numpy)
    and one event ends them; a request that arrives meanwhile cuts the run short at the
    first step boundary after it, where it joins. ``durations[i]`` is step i's time,
    ``batches[i]``, ``contexts[i]`` and ``new_tokens[i]`` its requests, their context and the
    tokens it computed: a heartbeat reports the mean decode step since the last one
    (``step_report``), by the rule a real worker's heartbeat follows.
    """

    def __init__(self, inst: Instance, kv_tokens: int) -> None:
        self.inst = inst
        self.kv_tokens = kv_tokens
        self.kv_used = 0  # tokens reserved: prompt + output of every running request
        self.waiting: deque[Record] = deque()
        self.batch = 0
        self.context = 0  # at the start of the current run
        self.finishing: list[tuple[int, int, Record]] = []  # (step count after which it is done, seq, record)
        self.steps = 0  # completed steps (at the start of the current run)
        self.durations = np.zeros(1 << 14)
        self.batches = np.zeros(1 << 14)
        self.contexts = np.zeros(1 << 14)
        self.new_tokens = np.zeros(1 << 14)
        self.reported = 0  # steps before this one are in a heartbeat already
        self.busy = False
        self.run_start = 0.0
        self.run_ends = np.zeros(0)  # offsets from run_start at which the run's steps end
        self.run_steps = 0  # steps of the current run that will happen (cut short by a join)
        self.version = 0  # the live run's number: an end event of an older one is ignored
        self.peak_batch = 0
        self.last_heartbeat = -math.inf
        self.locals: deque[Record] = deque()  # prompts it computes itself (conductor.local), first come first served
        self.local: Record | None = None  # the one computing: its chunks ride on steps [local_from, local_end)
        self.local_from = self.local_end = 0
        self.local_chunk_s = 0.0  # what each of its chunks adds to a step (its first also carries its prefix's load)
        self.local_chunk = 0  # and the tokens of each

    def reserve(self, n: int) -> None:
        while self.steps + n > len(self.durations):
            self.durations, self.batches, self.contexts, self.new_tokens = (
                np.concatenate([a, np.zeros_like(a)])
                for a in (self.durations, self.batches, self.contexts, self.new_tokens)
            )

    def step_report(self, upto: int) -> reports.StepMean | None:
        """The mean decode step of the steps from the last report to ``upto`` (None: no decode step among them), as a
        real decode worker's heartbeat reports it; they are reported."""
        a, self.reported = self.reported, max(self.reported, upto)
        return reports.mean_step(
            self.batches[a:upto], self.contexts[a:upto], self.durations[a:upto], self.new_tokens[a:upto]
        )

    def progress(self, now: float) -> int:
        """Steps of the current run completed by ``now``."""
        if not self.busy:
            return 0
        return min(self.run_steps, int(np.searchsorted(self.run_ends, now - self.run_start, side="right")))

    def waiting_s(self, now: float) -> float:
        """How long the longest waiting request has waited for a place in the batch (0: none waits): first come first
        served, so the head of the queue, or the one behind a prompt computed here (it goes first)."""
        return max((now - rec.prefill_end for rec in itertools.islice(self.waiting, 2)), default=0.0)

    def load(self, now: float) -> Load:
        """The heartbeat: batch and context now, and the mean decode step since the last one (``step_report``)."""
        done = self.progress(now)
        return step_load(
            Load(
                queued_requests=len(self.waiting),
                running_requests=self.batch,
                waiting_requests=len(self.waiting),
                waiting_s=self.waiting_s(now),
                context_tokens=self.context + done * self.batch,
                free_kv_blocks=(self.kv_tokens - self.kv_used) // 512,
            ),
            self.step_report(self.steps + done),
        )


def step_load(load: Load, step: reports.StepMean | None) -> Load:
    """``load`` with the mean step of a decode heartbeat (none: its step fields stay 0)."""
    if step is not None:
        load.step_s, load.step_batch, load.step_context_tokens = step.seconds, step.batch, step.context_tokens
    return load


def tbt_of(gaps: np.ndarray) -> float:
    """The paper's TBT: the mean of the longest 10% of a request's token gaps (0 with no gaps)."""
    if not len(gaps):
        return 0.0
    k = max(1, math.ceil(0.1 * len(gaps)))
    return float(np.partition(gaps, len(gaps) - k)[len(gaps) - k :].mean())
