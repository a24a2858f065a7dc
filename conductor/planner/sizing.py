"""Sizing: how many prefill and decode instances keep the predicted TTFT and TBT within the SLOs at a given load.

Pure: a window's statistics and the Conductor's predictors in, instance counts (and why) out.
Called by the planner (conductor.planner.planner) once a plan, for each role.

Prefill. Every prompt's work is its *uncached* part: ``s = predictor(prompt, cached)``, cached as
the Conductor's plan for it found the prefix in the pool, times the prefill instances' learnt
slowdown. The Conductor places each prompt on the instance predicted to start it soonest, so the
pool behaves as N servers behind one queue (M/G/N):

    a = rate x E[s]                       offered load, in instances' worth (N > a to keep up)
    C = ErlangC(N, a)                     the chance a prompt waits at all
    P(wait > t) = C exp(-2 (N - a) t / (E[s] (1 + cs^2)))
                                          M/M/N's exponential tail, stretched by the service
                                          times' spread (cs^2, Allen-Cunneen)
    late(N) = mean over the window's prompts of P(wait > SLO - s_i)   (1 for s_i >= SLO)
    N = the least with a / N <= max_utilization and late(N) <= (1 - q) + the share no N can serve

With one instance ErlangC(1, a) = a, so a worked example fits on a line (tests/test_planner.py).

Decode. A step with B requests of mean context c costs ``base + (per_request + per_token x c) x B``
(the decode predictor's three terms); the TBT cap (the SLO x the headroom every decode worker keeps)
allows ``B* = (cap - base) / (per_request + per_token x c)`` requests, fewer if their KV does not fit.
A request stays for its output's steps, so each of N instances runs (Little's law)

    m = (rate / N) x E[out] x step(m)   ->   m = k x base / (1 - k x slope),  k = rate x E[out] / N

and N is the least with ``m + z sqrt(m) <= B*``: the batch, Poisson about m, passes B* for 1% of the
time at z = 2.33.

Decode KV. A request holds its blocks on its decode instance from its placement (the landing its
prefill writes) until it finishes: through its wait in the prefill queue, its prefill and hand-off,
and (where the batch shares the cache) its decode. So each instance holds, by Little's law,

    h = (rate / N) x residence    requests' blocks, ``blocks_per_request`` each

and N is also the least with ``h + z sqrt(h) <= kv_blocks / blocks_per_request``: a prefill queue
that grows (a step up the prefill pool has not caught up with) runs decode's KV out long before
its batch reaches the TBT cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

NORMAL_WAIT = 0.5  # a prefill queue whose wait is under this share of the TTFT SLO is the pool's usual one
Z_99 = 2.33  # the standard normal's 99th percentile


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """The prompts of a window, as their predicted prefill seconds on one instance (uncached tokens only)."""

    rate: float  # prompts a second (forecast)
    seconds: tuple[float, ...]  # each prompt's prefill

    @property
    def mean_s(self) -> float:
        return float(np.mean(self.seconds)) if self.seconds else 0.0

    @property
    def spread(self) -> float:
        """cs^2: the service times' squared coefficient of variation."""
        if not self.seconds or self.mean_s <= 0:
            return 0.0
        return float(np.var(self.seconds)) / self.mean_s**2


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """The requests of a window as a decode instance sees them."""

    rate: float  # requests a second (forecast)
    mean_output_tokens: float
    mean_context_tokens: float  # a running request's mean context: its prompt and half its output
    kv_tokens_per_request: float = 0.0  # prompt + output it reserves (0: KV not limiting)
    residence_s: float = 0.0  # decode KV: how long a request holds its blocks there (placement to finish, or to its
    # decode start where the batch does not share them)
    blocks_per_request: float = 0.0  # and how many (0: KV not counted)


@dataclass(frozen=True, slots=True)
class StepModel:
    """The decode predictor's step model: ``base + per_request x batch + per_token x context tokens`` seconds."""

    base_s: float
    per_request_s: float
    per_token_s: float

    def step_s(self, batch: float, context_per_request: float) -> float:
        return self.base_s + (self.per_request_s + self.per_token_s * context_per_request) * batch


@dataclass(frozen=True, slots=True)
class Sizing:
    """One role's count and the numbers behind it (the planner logs and exports these)."""

    instances: int
    utilization: float  # prefill: a / N; decode: m / B*, or the KV's share held when that is more
    predicted: float  # prefill: the share of prompts predicted late; decode: the step at the mean batch (s)
    limit: str  # what set the count: "slo", "utilization", "min", "max", "idle"


def erlang_c(n: int, a: float) -> float:
    """The chance an arrival waits in M/M/n with offered load ``a`` (< n): Erlang C, by the stable recurrence."""
    if a <= 0:
        return 0.0
    if a >= n:
        return 1.0
    b = 1.0  # Erlang B, built up one server at a time: B(k) = a B(k-1) / (k + a B(k-1))
    for k in range(1, n + 1):
        b = a * b / (k + a * b)
    return b / (1.0 - (a / n) * (1.0 - b))


def late_share(n: int, load: PrefillLoad, ttft_slo_s: float) -> float:
    """The predicted share of prompts whose TTFT passes ``ttft_slo_s`` with ``n`` instances: each prompt waits past
    its budget (the SLO less its own prefill) with M/G/n's chance, ``C exp(-2 (n - a) t / (E[s] (1 + cs^2)))``."""
    a = load.rate * load.mean_s
    if a >= n:
        return 1.0
    if a <= 0:
        return 0.0
    s = np.asarray(load.seconds)
    budget = ttft_slo_s - s
    decay = 2.0 * (n - a) / (load.mean_s * (1.0 + load.spread))
    late = np.where(budget <= 0, 1.0, erlang_c(n, a) * np.exp(-decay * np.maximum(budget, 0.0)))
    return float(late.mean())


def size_prefill(
    load: PrefillLoad,
    ttft_slo_s: float,
    q: float = 0.99,
    max_utilization: float = 0.9,
    bounds: tuple[int, int] = (1, 64),
) -> Sizing:
    """The fewest prefill instances (within ``bounds``) with at most ``1 - q`` of the prompts late, not counting the
    ones no count can serve (a prefill alone longer than the SLO), and at most ``max_utilization`` busy."""
    lo, hi = bounds
    a = load.rate * load.mean_s
    if a <= 0:
        return Sizing(lo, 0.0, 0.0, "idle")
    hopeless = float(np.mean(np.asarray(load.seconds) >= ttft_slo_s))
    n = max(lo, math.ceil(a / max_utilization))
    limit = "utilization" if n > lo else "min"
    while n <= hi and late_share(n, load, ttft_slo_s) > (1.0 - q) + hopeless:
        n, limit = n + 1, "slo"
    if n > hi:
        n, limit = hi, "max"
    return Sizing(n, a / n, late_share(n, load, ttft_slo_s), limit)


def drain_count(a: float, current: int, backlog_s: float, start_s: float, drain_s: float) -> int:
    """The prefill instances that clear a queue within ``drain_s`` once the new ones serve: the queue holds
    ``backlog_s`` of work now and grows by ``a - current`` a second until they do, ``start_s`` from now; N instances
    then take ``N - a`` off it a second. 0 while the queue is one the pool keeps at its load: a wait under
    ``NORMAL_WAIT`` of ``drain_s`` for each instance's share of it."""
    if current < 1 or backlog_s / current <= drain_s * NORMAL_WAIT:  # a queue the pool keeps, not one it fell behind
        return 0
    queued = backlog_s + max(0.0, a - current) * start_s
    return math.ceil(a + queued / drain_s)


def batch_at(rate_per_instance: float, load: DecodeLoad, steps: StepModel) -> float:
    """The mean batch of an instance taking ``rate_per_instance`` requests a second (inf if it cannot keep up)."""
    k = rate_per_instance * load.mean_output_tokens
    slope = steps.per_request_s + steps.per_token_s * load.mean_context_tokens
    if k * slope >= 1.0:
        return math.inf
    m = k * steps.base_s / (1.0 - k * slope)
    # a step carries one request at least: below one (a step model with little fixed cost), the batch is the share of
    # the time one request is running, at the step of one
    return m if m >= 1.0 else k * (steps.base_s + slope)


def max_batch(load: DecodeLoad, steps: StepModel, cap_s: float, kv_tokens: int = 0) -> float:
    """B*: the most requests a step may carry within ``cap_s`` (and within ``kv_tokens`` of KV, when given)."""
    slope = steps.per_request_s + steps.per_token_s * load.mean_context_tokens
    b = (cap_s - steps.base_s) / slope if slope > 0 else math.inf
    if kv_tokens and load.kv_tokens_per_request > 0:
        b = min(b, kv_tokens / load.kv_tokens_per_request)
    return max(b, 1.0)


def kv_fits(load: DecodeLoad, kv_blocks: float) -> float:
    """The requests whose blocks one decode instance's KV holds at once (inf: KV not counted)."""
    if kv_blocks <= 0 or load.blocks_per_request <= 0 or load.residence_s <= 0:
        return math.inf
    return kv_blocks / load.blocks_per_request


def size_decode(
    load: DecodeLoad,
    steps: StepModel,
    cap_s: float,
    kv_tokens: int = 0,
    z: float = Z_99,
    bounds: tuple[int, int] = (1, 64),
    kv_blocks: float = 0.0,
) -> Sizing:
    """The fewest decode instances (within ``bounds``) whose batch stays within B*, and whose KV (``kv_blocks`` each;
    0: not counted) holds the requests in flight there, both but for ``z`` deviations. ``limit`` says which set the
    count: "slo" (the batch at the TBT cap) or "kv"."""
    lo, hi = bounds
    if load.rate <= 0 or (load.mean_output_tokens <= 0 and load.residence_s <= 0):
        return Sizing(lo, 0.0, steps.base_s, "idle")
    cap_b, fits = max_batch(load, steps, cap_s, kv_tokens), kv_fits(load, kv_blocks)

    def over(n: int) -> str:
        m = batch_at(load.rate / n, load, steps)  # (0 with no output seen yet)
        if m + z * math.sqrt(m) > cap_b:
            return "slo"
        h = load.rate / n * load.residence_s
        return "kv" if h + z * math.sqrt(h) > fits else ""

    n, limit = lo, "min"
    while n <= hi and (why := over(n)):
        n, limit = n + 1, why
    if n > hi:
        n, limit = hi, "max"
    m = batch_at(load.rate / n, load, steps)
    held = load.rate / n * load.residence_s / fits if fits < math.inf else 0.0
    return Sizing(n, max(m / cap_b, held), steps.step_s(m, load.mean_context_tokens), limit)
