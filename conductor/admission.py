"""Admission: whether to serve a request, decided before any prefill work is spent on it.

    none              never reject (only when no instance exists)
    baseline          reject at schedule time only for the TTFT SLO; the decode side
                      rejects after prefill when its load is over 1 (prefill wasted)
    early             reject when max(prefill load, current decode load) > 1
    early_predictive  the same, with the decode load predicted for the moment this
                      request's prefill would finish (DESIGN §5)

Loads are fractions of the SLO: prefill load = predicted TTFT / TTFT SLO; decode load =
the mean over decode instances of predicted TBT / TBT SLO. The prediction (arXiv §7)
assumes every decode lasts a uniform ``t_d`` (a moving average of measured decode
durations): at time t an instance still runs what started after t - t_d, plus the
requests whose prefill has finished by t.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conductor.predictors import DecodePredictor
from conductor.types import Instance, RejectReason, ScheduleRequest


class AdmissionKind(str, enum.Enum):
    NONE = "none"
    BASELINE = "baseline"
    EARLY = "early"
    EARLY_PREDICTIVE = "early_predictive"


@dataclass(slots=True)
class _Flight:
    decode: str
    start: float  # when its decode starts (predicted until reported)
    context_tokens: int
    started: bool = False


@dataclass
class DecodeForecast:
    """The requests the Conductor has sent to each decode instance, and when they decode.

    ``t_d`` starts at ``default_decode_s`` and follows measured decode durations (EMA).
    """

    default_decode_s: float = 10.0
    alpha: float = 0.1
    t_d: float = field(init=False)
    _flights: dict[str, _Flight] = field(default_factory=dict)  # request id -> flight
    _by_decode: dict[str, dict[str, _Flight]] = field(default_factory=dict)  # decode id -> its flights

    def __post_init__(self) -> None:
        self.t_d = self.default_decode_s

    def scheduled(self, request_id: str, decode: str, prefill_done_at: float, context_tokens: int) -> None:
        self._drop(request_id)
        flight = _Flight(decode, prefill_done_at, context_tokens)
        self._flights[request_id] = flight
        self._by_decode.setdefault(decode, {})[request_id] = flight

    def decode_started(self, request_id: str, now: float) -> None:
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.start, flight.started = now, True

    def finished(self, request_id: str, now: float) -> None:
        """The request left its decode instance (done, failed or cancelled)."""
        flight = self._drop(request_id)
        if flight is not None and flight.started and now > flight.start:
            self.t_d = (1 - self.alpha) * self.t_d + self.alpha * (now - flight.start)

    def _drop(self, request_id: str) -> _Flight | None:
        flight = self._flights.pop(request_id, None)
        if flight is not None:
            self._by_decode[flight.decode].pop(request_id, None)
        return flight

    def forget_instance(self, decode: str) -> None:
        for rid in list(self._by_decode.pop(decode, {})):
            self._flights.pop(rid, None)

    def expire(self, now: float) -> None:
        """Drop flights long past their predicted end (a lost report must not inflate the load forever)."""
        for rid in [r for r, f in self._flights.items() if now > f.start + 4 * self.t_d]:
            self._drop(rid)

    def batch_at(self, decode: str, t: float) -> tuple[int, int]:
        """(requests, context tokens) predicted on ``decode`` at time ``t`` from the Conductor's own flights."""
        n = tokens = 0
        end = self.t_d
        for f in self._by_decode.get(decode, {}).values():
            if f.start <= t < f.start + end:
                n += 1
                tokens += f.context_tokens
        return n, tokens

    def in_flight(self, decode: str) -> int:
        return len(self._by_decode.get(decode, ()))

    def __len__(self) -> int:
        return len(self._flights)


def decode_tbt(inst: Instance, predictor: DecodePredictor, extra_requests: int = 0, extra_tokens: int = 0) -> float:
    """Predicted TBT on ``inst`` from its reported batch plus ``extra`` requests."""
    return predictor.predict(inst.load.running_requests + extra_requests, inst.load.context_tokens + extra_tokens)


def select_decode(req: ScheduleRequest, decodes: list[Instance], predictor: DecodePredictor, forecast: DecodeForecast) -> tuple[Instance, float]:
    """The decode instance with the lowest predicted TBT once this request (and those already sent its way) join."""
    context = req.prompt_tokens + req.expected_output_tokens // 2

    def tbt(inst: Instance) -> float:
        pending = max(0, forecast.in_flight(inst.id) - inst.load.running_requests)  # sent, not yet in its heartbeat
        if inst.capacity and inst.load.running_requests + pending + 1 > inst.capacity:
            return float("inf")  # full: it would queue the request
        return decode_tbt(inst, predictor, pending + 1, context * (pending + 1))

    best = min(decodes, key=lambda i: (tbt(i), i.id))
    return best, tbt(best)


def decode_load_now(decodes: list[Instance], predictor: DecodePredictor, tbt_slo: float) -> float:
    """Mean over decode instances of the current predicted TBT / SLO."""
    if not decodes:
        return float("inf")
    return sum(decode_tbt(i, predictor) for i in decodes) / len(decodes) / tbt_slo


def decode_load_at(decodes: list[Instance], predictor: DecodePredictor, forecast: DecodeForecast, t: float, tbt_slo: float) -> float:
    """Mean over decode instances of predicted TBT / SLO at time ``t``, from the Conductor's flights."""
    if not decodes:
        return float("inf")
    total = 0.0
    for inst in decodes:
        n, tokens = forecast.batch_at(inst.id, t)
        total += predictor.predict(n, tokens)
    return total / len(decodes) / tbt_slo


@dataclass(frozen=True, slots=True)
class Verdict:
    reason: RejectReason
    message: str
    retry_after_s: float
