"""Admission: whether to serve a request, decided before any prefill work is spent on it.

    none              never reject (only when no instance exists)
    baseline          reject at schedule time only for the TTFT SLO; the decode side
                      rejects after prefill when its load is over 1 (prefill wasted)
    early             reject when max(prefill load, current decode load) > 1
    early_predictive  the same, with the decode load predicted for the moment this
                      request's prefill would finish (DESIGN §5)

Loads are fractions of the SLO: prefill load = predicted TTFT / TTFT SLO; decode load =
the mean over decode instances of predicted TBT / TBT SLO. The decode forecast comes in
two kinds:

    uniform   the paper's (arXiv §7): every decode lasts ``t_d`` (a moving average of
              measured decode durations); at time t an instance still runs what started
              after t - t_d, plus the requests whose prefill has finished by t
    survival  ours: the measured durations' distribution (the last ``window``), and each
              request counted by its chance to still run at t given how long it has run
              already, ``S(t - start) / S(now - start)``; a request not yet decoding counts
              ``S(t - start)`` from its predicted start. Output lengths are long-tailed, so
              a request that has run long is likely to run on, which ``t_d`` cannot say.
              Plus the requests not yet scheduled that will have joined by t, at the
              recent rate of decode starts (``joins``): a forecast far ahead otherwise
              sees every batch drain and admits long prompts that find it full.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from conductor.predictors import DecodePredictor
from conductor.types import Instance, RejectReason, ScheduleRequest


class AdmissionKind(str, enum.Enum):
    NONE = "none"
    BASELINE = "baseline"
    EARLY = "early"
    EARLY_PREDICTIVE = "early_predictive"


class ForecastKind(str, enum.Enum):
    UNIFORM = "uniform"
    SURVIVAL = "survival"


@dataclass(slots=True)
class _Flight:
    decode: str
    start: float  # when its decode starts (predicted until reported)
    context_tokens: int
    started: bool = False


@dataclass
class DecodeForecast:
    """The requests the Conductor has sent to each decode instance, and when they decode.

    ``t_d`` starts at ``default_decode_s`` and follows measured decode durations (EMA);
    ``kind`` picks how ``batch_at`` uses them (module docstring). The survival forecast
    uses the uniform one until ``min_samples`` durations are measured.
    """

    default_decode_s: float = 10.0
    alpha: float = 0.1
    kind: ForecastKind = ForecastKind.UNIFORM
    window: int = 1000
    min_samples: int = 20
    t_d: float = field(init=False)
    _flights: dict[str, _Flight] = field(default_factory=dict)  # request id -> flight
    _by_decode: dict[str, dict[str, _Flight]] = field(default_factory=dict)  # decode id -> its flights
    _recent: deque[float] = field(default_factory=deque)  # measured durations, oldest first
    _sorted: list[float] = field(default_factory=list)  # the same, sorted (for S(x))
    _starts: deque[tuple[float, int]] = field(default_factory=deque)  # (time, context tokens) of recent decode starts
    _start_tokens: int = 0  # their context tokens in all
    horizon_s: float = 0.0  # moving average of scheduled requests' time from schedule to decode
    _prefix: np.ndarray | None = None  # prefix sums of _sorted (None: to recompute)

    def __post_init__(self) -> None:
        self.t_d = self.default_decode_s
        self.kind = ForecastKind(self.kind)

    def scheduled(self, request_id: str, decode: str, prefill_done_at: float, context_tokens: int, now: float | None = None) -> None:
        """A request was sent to ``decode``; its prefill should end at ``prefill_done_at`` (scheduled at ``now``)."""
        if now is not None:
            self.horizon_s = (1 - self.alpha) * self.horizon_s + self.alpha * max(0.0, prefill_done_at - now)
        self._drop(request_id)
        flight = _Flight(decode, prefill_done_at, context_tokens)
        self._flights[request_id] = flight
        self._by_decode.setdefault(decode, {})[request_id] = flight

    def decode_started(self, request_id: str, now: float) -> None:
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.start, flight.started = now, True
            self._starts.append((now, flight.context_tokens))
            self._start_tokens += flight.context_tokens
            if len(self._starts) > self.window:
                self._start_tokens -= self._starts.popleft()[1]

    def finished(self, request_id: str, now: float) -> None:
        """The request left its decode instance (done, failed or cancelled)."""
        flight = self._drop(request_id)
        if flight is not None and flight.started and now > flight.start:
            duration = now - flight.start
            self.t_d = (1 - self.alpha) * self.t_d + self.alpha * duration
            self._recent.append(duration)
            bisect.insort(self._sorted, duration)
            if len(self._recent) > self.window:
                del self._sorted[bisect.bisect_left(self._sorted, self._recent.popleft())]
            self._prefix = None

    def _drop(self, request_id: str) -> _Flight | None:
        flight = self._flights.pop(request_id, None)
        if flight is not None:
            self._by_decode[flight.decode].pop(request_id, None)
        return flight

    def forget_instance(self, decode: str) -> None:
        for rid in list(self._by_decode.pop(decode, {})):
            self._flights.pop(rid, None)

    def expire(self, now: float) -> None:
        """Drop flights long past any end seen (a lost report must not inflate the load forever)."""
        longest = max(4 * self.t_d, 2 * self._sorted[-1] if self._sorted else 0.0)
        for rid in [r for r, f in self._flights.items() if now > f.start + longest]:
            self._drop(rid)

    def _survival(self, x: float) -> float:
        """Share of measured decode durations longer than ``x`` seconds."""
        return 1.0 - bisect.bisect_right(self._sorted, x) / len(self._sorted)

    def joins(self, t: float, now: float, instances: int) -> tuple[float, float]:
        """(requests, context tokens) expected on each of ``instances`` decode instances at ``t`` from requests
        not scheduled yet (survival forecast only; the uniform one says (0, 0)).

        Requests keep arriving at the recent rate of decode starts, spread evenly over the
        instances, and reach decode ``horizon_s`` (the usual time from schedule to decode)
        after they arrive; so before ``t`` only those arriving in the first
        ``t - now - horizon_s`` seconds join (the ones before them are already scheduled: the
        flights). One that starts at ``s`` still runs at ``t`` with chance ``S(t - s)``: in
        all ``rate * integral of S over [0, t - now - horizon_s]``, and the integral is the
        mean of ``min(duration, t - now - horizon_s)``. Without this term a forecast for a
        long prefill sees every batch drain and nothing replace it.
        """
        if self.kind is ForecastKind.UNIFORM or len(self._sorted) < self.min_samples or len(self._starts) < self.min_samples:
            return 0.0, 0.0
        first, last = self._starts[0][0], self._starts[-1][0]
        if last <= first:
            return 0.0, 0.0
        rate = (len(self._starts) - 1) / (last - first) / max(1, instances)  # starts per second per instance
        horizon = t - now - self.horizon_s
        if horizon <= 0:
            return 0.0, 0.0
        if self._prefix is None:
            self._prefix = np.concatenate([[0.0], np.cumsum(self._sorted)])
        k = bisect.bisect_left(self._sorted, horizon)
        n = rate * (self._prefix[k] + horizon * (len(self._sorted) - k)) / len(self._sorted)
        return n, n * self._start_tokens / len(self._starts)

    def batch_at(self, decode: str, t: float, now: float) -> tuple[float, float]:
        """(requests, context tokens) expected on ``decode`` at time ``t`` (>= ``now``) from the Conductor's own flights."""
        n = tokens = 0.0
        flights = self._by_decode.get(decode, {}).values()
        if self.kind is ForecastKind.UNIFORM or len(self._sorted) < self.min_samples:
            end = self.t_d
            for f in flights:
                start = f.start if f.started else max(f.start, now)  # late for its predicted start: not before now
                if start <= t < start + end:
                    n += 1
                    tokens += f.context_tokens
            return n, tokens
        for f in flights:
            start = f.start if f.started else max(f.start, now)
            if start > t:
                continue
            p = self._survival(t - start)
            if f.started and now > start:
                alive = self._survival(now - start)
                p = min(1.0, p / alive) if alive > 0 else 1.0  # older than every measured decode: no telling when it ends
            n += p
            tokens += p * f.context_tokens
        return n, tokens

    def pending(self, decode: str) -> tuple[int, int]:
        """(requests, context tokens) sent to ``decode`` whose decode has not started (in prefill or in transit)."""
        n = tokens = 0
        for f in self._by_decode.get(decode, {}).values():
            if not f.started:
                n += 1
                tokens += f.context_tokens
        return n, tokens

    def __len__(self) -> int:
        return len(self._flights)


Batch = tuple[float, float]  # (running requests, context tokens) of a decode instance; a forecast's are expected values


def reported_batch(inst: Instance) -> Batch:
    """The batch ``inst`` reported in its last heartbeat."""
    return inst.load.running_requests, inst.load.context_tokens


def decode_tbt(inst: Instance, predictor: DecodePredictor, extra_requests: int = 0, extra_tokens: int = 0) -> float:
    """Predicted TBT on ``inst`` from its reported batch plus ``extra`` requests."""
    return predictor.predict(inst.load.running_requests + extra_requests, inst.load.context_tokens + extra_tokens)


def join_tbt(inst: Instance, batch: Batch, context_tokens: int, predictor: DecodePredictor) -> float:
    """Predicted TBT on ``inst`` once a request of ``context_tokens`` joins ``batch`` (inf: no free slot)."""
    n, tokens = batch
    if inst.capacity and n + 1 > inst.capacity:
        return float("inf")  # full: it would queue the request
    return predictor.predict(n + 1, tokens + context_tokens)


def select_decode(req: ScheduleRequest, decodes: list[Instance], predictor: DecodePredictor,
                  batch_of: Callable[[Instance], Batch]) -> tuple[Instance, float]:  # fmt: skip
    """The decode instance with the lowest predicted TBT once ``req`` joins the batch ``batch_of`` says it will find."""
    context = req.prompt_tokens + req.expected_output_tokens // 2
    best = best_tbt = None
    for inst in decodes:
        tbt = join_tbt(inst, batch_of(inst), context, predictor)
        if best is None or (tbt, inst.id) < (best_tbt, best.id):
            best, best_tbt = inst, tbt
    return best, best_tbt


def decode_load(decodes: list[Instance], predictor: DecodePredictor, batch_of: Callable[[Instance], Batch], tbt_limit: float) -> float:
    """Mean over decode instances of the predicted TBT of the batch ``batch_of`` gives each, over ``tbt_limit``."""
    if not decodes:
        return float("inf")
    return sum(predictor.predict(*batch_of(i)) for i in decodes) / len(decodes) / tbt_limit
