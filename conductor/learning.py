"""What the Conductor learns from what its workers measure: prefill, transfer and decode-step samples, the hand-off,
and each prefill instance's slowdown from the TTFTs that come out against what was predicted for them.

    learning = Learning(config)
    learning.prefill_sample(inst, prompt_tokens, cached_tokens, seconds)   # the predictors' samples
    learning.price_queue(inst, load)                # a prefill worker's prompts in flight, priced: its queue
    learning.expect(request_id, placed)             # a placement's prediction, kept until its TTFT comes out
    made = learning.measured(request_id, measured, instances)   # it came out: slowdown moves; the placement
    learning.calibration.margin                     # admission's TTFT margin: what predictions came out at

A part of ``conductor.core.Conductor``. It owns the step-time predictors (``predictors``,
built from the configuration; the decisions read them), the learnt hand-off (``handoff_s``)
and the predictions awaiting their measured TTFT. The instances whose ``slowdown`` it moves
are handed to it with each measurement. Pure: time is passed in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import numpy as np

from conductor.admission import step_scale
from conductor.config import ConductorConfig
from conductor.predictors import Predictors
from conductor.types import Instance, Load, Measured, Placed
from mooncake.serving import reports

HANDOFF_ALPHA = 0.1  # how far one measured hand-off moves the learnt one
SLOWDOWN_ALPHA = 0.1  # how far one measured TTFT (of a second's prediction or more) moves its instance's slowdown
SLOWDOWN_STEP = (0.5, 2.0)  # the most one measurement can say: a stalled or an instant request is mostly noise
SLOWDOWN_RANGE = (0.5, 8.0)
# a decode instance's step ratio (Instance.step_ratio): how far one heartbeat's measured mean step over the step model's
# prediction moves it, the most one may say, and its range. The step model is one fit of every decode worker's
# steps; the ratio is what sets one worker apart (another kind of GPU, a noisy neighbour, the prompts it computes)
STEP_RATIO_ALPHA = 0.2
STEP_RATIO_STEP = (0.5, 2.0)
STEP_RATIO_RANGE = (0.25, 8.0)
MAX_PENDING_TTFTS = 100_000  # predictions awaiting their measured TTFT (a worker that never reports cannot grow it)
# Admission's TTFT margin (Calibration): measured / predicted TTFT of the last MARGIN_WINDOW predictions near the SLO
# (of at least MARGIN_NEAR_SLO of the tightest TTFT SLO: a short one's fixed hops are most of it, and it is far from
# any SLO), its MARGIN_QUANTILE, within MARGIN_RANGE; 1 until MARGIN_MIN_SAMPLES came out. With aiperf at 4x the
# conversation trace's rate on this machine (benchmarks/aiperf_compare.py), predictions of 5 s and more came out at
# 1.05x (p50), 1.13x (p80), 1.23x (p90) their predicted TTFT; the 10 of 79 admitted that missed the 10 s TTFT SLO were
# all predicted at 8.7 to 9.8 s
MARGIN_QUANTILE = 0.8
MARGIN_WINDOW = 200
MARGIN_MIN_SAMPLES = 20
MARGIN_RANGE = (1.0, 1.5)
MARGIN_NEAR_SLO = 0.5


class Calibration:
    """How far admission trusts a TTFT prediction: ``margin``, the factor its predicted TTFT is taken at against the
    SLO (``conductor.judge``): the MARGIN_QUANTILE of what predictions near the SLO came out at, measured over
    predicted. A prediction is a mean; the client meets the spread around it, and a request admitted at 95% of its
    TTFT SLO misses it about half the time. The per-instance ``slowdown`` corrects the mean, this the spread."""

    def __init__(self, near_s: float) -> None:
        self.near_s = near_s  # predictions shorter than this are not counted
        self._ratios: deque[float] = deque(maxlen=MARGIN_WINDOW)
        self.margin = 1.0

    def came_out(self, predicted_s: float, measured_s: float) -> None:
        if predicted_s < self.near_s or measured_s <= 0.0:
            return
        self._ratios.append(measured_s / predicted_s)
        if len(self._ratios) >= MARGIN_MIN_SAMPLES:
            q = float(np.quantile(np.fromiter(self._ratios, float), MARGIN_QUANTILE))
            self.margin = min(max(q, MARGIN_RANGE[0]), MARGIN_RANGE[1])


class Learning:
    """The measurements' side of the Conductor: its models, and what moves them."""

    def __init__(self, config: ConductorConfig) -> None:
        self.config = config  # read only: the SLOs a decode worker's batch cap keeps to
        self.predictors = Predictors.from_config(config.predictors, config.block_bytes)
        self.handoff_s = config.default_handoff_s  # learnt from decode workers' reports (handoff_sample)
        self._handoffs = 0
        self._ttfts: dict[str, Placed] = {}  # request id -> its placement, awaiting its measured TTFT
        tightest = min(s.ttft_s for s in config.slo_classes.values())
        self.calibration = Calibration(MARGIN_NEAR_SLO * tightest)

    def prefill_sample(self, inst: Instance | None, prompt_tokens: int, cached_tokens: int, seconds: float) -> None:
        """One measured prefill on ``inst`` (None: not known): a pipeline group's samples fit its own predictor."""
        predictor = (
            self.predictors.prefill
            if inst is None
            else self.predictors.prefill_for(inst.pipeline_stages, inst.pipeline_chunk)
        )
        predictor.observe(prompt_tokens, cached_tokens, seconds)

    def price_queue(self, inst: Instance, load: Load) -> None:
        """A prefill instance's heartbeat: the prompts it holds (``load.prompts``, each from what it has computed so
        far) priced with its predictor into ``load.queued_s`` and ``load.queued_tokens``, the rules of
        mooncake.serving.reports. A worker that reports no prompts keeps its own figures (an older worker's, or an idle
        one's zeros)."""
        if not load.prompts:
            return
        predictor = self.predictors.prefill_for(inst.pipeline_stages, inst.pipeline_chunk)
        load.queued_s = reports.queued_seconds(load.prompts, predictor.predict)
        load.queued_tokens = reports.queued_tokens(load.prompts)

    def transfer_sample(self, num_bytes: int, seconds: float) -> None:
        self.predictors.transfer.observe(num_bytes, seconds)

    def pool_block_bytes(self, block_bytes: int) -> None:
        """A pool node registered its block size: the pool's own figure, not a configured guess, prices transfers."""
        self.predictors.block_bytes = block_bytes

    def step_sample(self, inst: Instance, load: Load) -> None:
        """A decode worker's heartbeat: its mean step as a sample of the step model (the steps' own batch where
        reported: the running one may differ), and against the model's prediction for that batch, a move of the
        instance's ``step_ratio`` (its predicted steps are scaled by it past a dead band: ``admission.step_scale``)."""
        if load.step_s <= 0:
            return
        batch, context = (
            (load.step_batch, load.step_context_tokens)
            if load.step_batch > 0
            else (load.running_requests, load.context_tokens)
        )
        if batch <= 0:
            return
        model = self.predictors.decode
        predicted = model.predict(batch, context) if model.fitted else 0.0
        if predicted > 0:
            implied = min(max(load.step_s / predicted, STEP_RATIO_STEP[0]), STEP_RATIO_STEP[1])
            ratio = (1.0 - STEP_RATIO_ALPHA) * inst.step_ratio + STEP_RATIO_ALPHA * implied
            inst.step_ratio = min(max(ratio, STEP_RATIO_RANGE[0]), STEP_RATIO_RANGE[1])
        model.observe(batch, context, load.step_s)

    def decode_cap(self, inst: Instance) -> int:
        """The most running requests ``inst`` may hold with its predicted step (the step model's at its
        ``step_scale``) within ``tbt_headroom`` of the strictest TBT SLO, at its batch's mean context per request (its
        registered capacity at most; 0: the step model has no samples yet)."""
        if not self.predictors.decode.fitted or not self.config.slo_classes:
            return 0
        limit = min(s.tbt_s for s in self.config.slo_classes.values()) * self.config.tbt_headroom / step_scale(inst)
        load = inst.load
        running = load.running_requests or load.step_batch
        per_request = (load.context_tokens or load.step_context_tokens) / running if running else 0.0
        c0, c1, c2 = self.predictors.decode.coef  # step = c0 + n * (c1 + c2 * context per request)
        slope = c1 + c2 * per_request
        if slope <= 0:
            return inst.capacity
        cap = max(1, int((limit - c0) / slope))
        return min(cap, inst.capacity) if inst.capacity else cap

    def handoff_sample(self, seconds: float) -> None:
        """A decode worker measured one hand-off: its TTFT less the prefill worker's own queue and prefill. The first
        replaces the default; the later ones are averaged in."""
        if seconds < 0:
            raise ValueError(f"bad hand-off sample: {seconds} s")
        self.handoff_s = (
            seconds if not self._handoffs else (1 - HANDOFF_ALPHA) * self.handoff_s + HANDOFF_ALPHA * seconds
        )
        self._handoffs += 1

    def expect(self, request_id: str, placed: Placed) -> None:
        """Keep ``placed`` (a placement's prediction) until ``request_id``'s TTFT comes out (``measured``); at most
        ``MAX_PENDING_TTFTS`` are kept."""
        if len(self._ttfts) < MAX_PENDING_TTFTS:
            self._ttfts[request_id] = placed

    def measured(self, request_id: str, measured: Measured, instances: Mapping[str, Instance]) -> Placed | None:
        """A request's TTFT came out (first report only): its prefill instance's ``slowdown`` moves toward what it
        implies; its predicted prefill and queue times scale by it. A worker's predictor learns what a prompt's steps
        cost; what the client waits for also holds the time between steps, the hops, and cores shared with the other
        workers (on 2 cores, two prefill workers and a decode worker came out at twice their predictions as soon as all
        were busy). A prediction of well under a second weighs less: its fixed hops are most of it. No TTFT: it ended
        before its prefill (its decode worker turned it away), so it never reached the instance (in ``instances``, by
        id), which forgets it.

        Returns its placement (None: no prediction is held for it, or no TTFT was measured)."""
        made = self._ttfts.pop(request_id, None)
        if made is None:
            return None
        predicted, slowdown = made.predicted, made.slowdown
        measured_ttft_s = measured.ttft_s
        inst = instances.get(made.instance)
        if measured_ttft_s <= 0.0:
            if inst is not None:
                inst.lose(request_id)
            return None
        self.calibration.came_out(predicted.ttft_s, measured_ttft_s)
        transfer = predicted.transfer_s
        work = predicted.ttft_s - transfer
        if inst is not None and work > 0.0:
            implied = slowdown * min(max((measured_ttft_s - transfer) / work, SLOWDOWN_STEP[0]), SLOWDOWN_STEP[1])
            weight = SLOWDOWN_ALPHA * min(1.0, work)
            inst.slowdown = min(
                max((1.0 - weight) * inst.slowdown + weight * implied, SLOWDOWN_RANGE[0]), SLOWDOWN_RANGE[1]
            )
        return made
