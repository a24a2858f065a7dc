"""Admission: whether to serve a request, decided before any prefill work is spent on it.

    none              never reject (only when no instance exists)
    baseline          reject at schedule time only for the TTFT SLO; the decode side
                      rejects after prefill when its load is over 1 (prefill wasted)
    early             reject when max(prefill load, current decode load) > 1
    early_predictive  the same, with the decode load predicted for the moment this
                      request's prefill would finish (DESIGN §5)
    early_wait        early_predictive's judgement; a request it would refuse now but
                      predicts to meet its SLOs if placed a little later (the decode
                      batches it would meet have room by then) waits at its gateway
                      instead, in a short queue per priority (conductor.waiting), and is
                      refused at once when no wait within its TTFT SLO helps

Loads are fractions of the SLO: prefill load = predicted TTFT / TTFT SLO; decode load =
the mean over decode instances of predicted TBT / TBT SLO. early_predictive takes the
decode batches from the decode forecast (conductor.forecast: the paper's uniform ``t_d``,
or our survival forecast).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from conductor.predictors import DecodePredictor
from conductor.types import Instance, ScheduleRequest


class AdmissionKind(str, enum.Enum):
    NONE = "none"
    BASELINE = "baseline"
    EARLY = "early"
    EARLY_PREDICTIVE = "early_predictive"
    EARLY_WAIT = "early_wait"

    @property
    def predictive(self) -> bool:
        """It judges the decode side by the forecast at the moment the prefill would end."""
        return self in (AdmissionKind.EARLY_PREDICTIVE, AdmissionKind.EARLY_WAIT)


Batch = tuple[float, float]  # (running requests, context tokens) of a decode instance; a forecast's are expected values


def reported_batch(inst: Instance) -> Batch:
    """The batch ``inst`` reported in its last heartbeat."""
    return inst.load.running_requests, inst.load.context_tokens


# a decode instance's step ratio within this of 1 is the step model's own error, and scales nothing: in the simulator
# (the slow decode profile, 2 + 2 instances of one kind) measured steps came out within 0.97x to 1.03x of the fit (p10,
# p90) and ratios within 1%, and scaling by them moved the served-within-SLOs count by chance alone (a constant 0.2%
# moved it by up to 4%: tests/test_sim.py's decode-bound slice is that sensitive)
STEP_RATIO_DEADBAND = 0.1


def step_scale(inst: Instance) -> float:
    """What ``inst``'s predicted steps are scaled by: its measured ratio to the step model (``Instance.step_ratio``),
    1 within ``STEP_RATIO_DEADBAND`` of it."""
    return inst.step_ratio if abs(inst.step_ratio - 1.0) > STEP_RATIO_DEADBAND else 1.0


def step_of(inst: Instance, predictor: DecodePredictor, n: float, context_tokens: float) -> float:
    """``inst``'s predicted step with ``n`` requests holding ``context_tokens``: the step model's (one fit of every
    decode worker's steps) at what ``inst`` measured against it (``step_scale``)."""
    return predictor.predict(n, context_tokens) * step_scale(inst)


def join_tbt(
    inst: Instance,
    batch: Batch,
    context_tokens: int,
    predictor: DecodePredictor,
    later: Callable[[], Batch] | None = None,
) -> float:
    """Predicted TBT on ``inst`` once a request of ``context_tokens`` joins ``batch`` (inf: no free slot).

    A slot is free below the batch cap the instance last reported (what its TBT SLO allows
    now, ``Load.batch_cap``), else below its registered capacity (max_num_seqs). Past it the
    request waits for a place after its first token: one long gap. ``later``, when given, is
    the batch one TBT budget on: a place free by then makes the wait no longer than a step
    may be, and the request is judged by the batch it joins.
    """
    n, tokens = batch
    cap = inst.load.batch_cap or inst.capacity
    if cap and n + 1 > cap and (later is None or later()[0] + 1 > cap):
        return float("inf")  # full: it would wait too long for a place
    return step_of(inst, predictor, min(n + 1, cap) if cap else n + 1, tokens + context_tokens)


def select_decode(
    req: ScheduleRequest,
    decodes: list[Instance],
    predictor: DecodePredictor,
    batch_of: Callable[[Instance], Batch],
    assigned: Callable[[Instance], int] | None = None,
    later_of: Callable[[Instance], Batch] | None = None,
) -> tuple[Instance, float]:
    """The decode instance with the lowest predicted TBT once ``req`` joins the batch ``batch_of`` says it will find
    (``later_of``: the batch one TBT budget after that, for an instance then at its cap; see join_tbt).

    Ties (a predictor that has learnt that batch size costs nothing, as on a small model,
    or a forecast that sees every batch drained by then) go to the smaller batch, then to
    the instance with fewer requests ``assigned`` now, then by id, so requests spread.
    """
    context = req.prompt_tokens + req.expected_output_tokens // 2
    best = best_key = None
    for inst in decodes:
        batch = batch_of(inst)
        tbt = join_tbt(inst, batch, context, predictor, (lambda inst=inst: later_of(inst)) if later_of else None)
        key = (round(tbt, 9), round(batch[0], 6), assigned(inst) if assigned else 0, inst.id)
        if best is None or key < best_key:
            best, best_key = inst, key
    return best, best_key[0]


def decode_load(
    decodes: list[Instance], predictor: DecodePredictor, batch_of: Callable[[Instance], Batch], tbt_limit: float
) -> float:
    """Mean over decode instances of the predicted TBT of the batch ``batch_of`` gives each, over ``tbt_limit``."""
    if not decodes:
        return float("inf")
    return sum(step_of(i, predictor, *batch_of(i)) for i in decodes) / len(decodes) / tbt_limit
