"""What the Conductor learns from what its workers measure: prefill and transfer samples, the hand-off, and each
prefill instance's slowdown from the TTFTs that come out against what was predicted for them.

A part of ``conductor.core.Conductor`` (which inherits it), apart by concept: it reads and moves the Conductor's
``predictors``, ``forecast``, ``handoff_s``, ``shares``, ``waiting``, ``instances`` (their ``slowdown``) and the
predictions awaiting their TTFT (``_ttfts``, which decisions fill). Pure: time is passed in.
"""

from __future__ import annotations

from collections.abc import Callable

from conductor.types import Instance, Measured, Placed, Prediction

HANDOFF_ALPHA = 0.1  # how far one measured hand-off moves the learnt one
SLOWDOWN_ALPHA = 0.1  # how far one measured TTFT (of a second's prediction or more) moves its instance's slowdown
SLOWDOWN_STEP = (0.5, 2.0)  # the most one measurement can say: a stalled or an instant request is mostly noise
SLOWDOWN_RANGE = (0.5, 8.0)


class Learning:
    """The measurements' side of the Conductor (mixed into Conductor)."""

    instances: dict[str, Instance]
    handoff_s: float
    _handoffs: int
    _ttfts: dict[str, Placed]  # request id -> its placement, awaiting its measured TTFT
    audit: Callable[[str, Placed, Measured, float], None] | None

    def prefill_sample(
        self, prompt_tokens: int, cached_tokens: int, seconds: float, instance: str | None = None
    ) -> None:
        """One measured prefill; ``instance`` (its id) says whose: a pipeline group's samples fit its own predictor."""
        inst = self.instances.get(instance) if instance is not None else None
        predictor = (
            self.predictors.prefill
            if inst is None
            else self.predictors.prefill_for(inst.pipeline_stages, inst.pipeline_chunk)
        )
        predictor.observe(prompt_tokens, cached_tokens, seconds)

    def transfer_sample(self, num_bytes: int, seconds: float) -> None:
        self.predictors.transfer.observe(num_bytes, seconds)

    def decode_started(
        self, request_id: str, now: float, measured_ttft_s: float = 0.0, queue_s: float = 0.0, prefill_s: float = 0.0
    ) -> Prediction | None:
        """``request_id`` joined its decode batch ``measured_ttft_s`` after its decode worker got it (0: not known), of
        which ``queue_s`` and ``prefill_s`` in its prefill worker's queue and prefill (0: not measured). Returns what
        was predicted for it when this measured TTFT is its first (``_measured``)."""
        self.forecast.decode_started(request_id, now)
        return self._measured(request_id, Measured(measured_ttft_s, queue_s, prefill_s), now)

    def finished(
        self, request_id: str, now: float, measured_ttft_s: float = 0.0, queue_s: float = 0.0, prefill_s: float = 0.0
    ) -> Prediction | None:
        """``request_id`` left its decode worker: done, failed, cancelled, or answered with its first token alone
        (``measured_ttft_s`` > 0: it got one, without joining a batch). Returns as ``decode_started`` does."""
        self.forecast.finished(request_id, now)
        self.shares.finished(request_id)
        self.waiting.release(request_id)
        return self._measured(request_id, Measured(measured_ttft_s, queue_s, prefill_s), now)

    def handoff_sample(self, seconds: float) -> None:
        """A decode worker measured one hand-off: its TTFT less the prefill worker's own queue and prefill. The first
        replaces the default; the later ones are averaged in."""
        if seconds < 0:
            raise ValueError(f"bad hand-off sample: {seconds} s")
        self.handoff_s = (
            seconds if not self._handoffs else (1 - HANDOFF_ALPHA) * self.handoff_s + HANDOFF_ALPHA * seconds
        )
        self._handoffs += 1

    def _measured(self, request_id: str, measured: Measured, now: float) -> Prediction | None:
        """A request's TTFT came out (first report only): its prefill instance's ``slowdown`` moves toward what it
        implies; its predicted prefill and queue times scale by it. A worker's predictor learns what a prompt's steps
        cost; what the client waits for also holds the time between steps, the hops, and cores shared with the other
        workers (on 2 cores, two prefill workers and a decode worker came out at twice their predictions as soon as all
        were busy). A prediction of well under a second weighs less: its fixed hops are most of it. No TTFT: it ended
        before its prefill (its decode worker turned it away), so it never reached the instance.

        Returns its prediction (None: no prediction is held for it, or no TTFT was measured)."""
        made = self._ttfts.pop(request_id, None)
        if made is None:
            return None
        predicted, slowdown = made.predicted, made.slowdown
        measured_ttft_s = measured.ttft_s
        inst = self.instances.get(made.instance)
        if measured_ttft_s <= 0.0:
            if inst is not None:
                inst.lose(request_id)
            return None
        if self.audit is not None:
            self.audit(request_id, made, measured, now)
        transfer = predicted.transfer_s
        work = predicted.ttft_s - transfer
        if inst is not None and work > 0.0:
            implied = slowdown * min(max((measured_ttft_s - transfer) / work, SLOWDOWN_STEP[0]), SLOWDOWN_STEP[1])
            weight = SLOWDOWN_ALPHA * min(1.0, work)
            inst.slowdown = min(
                max((1.0 - weight) * inst.slowdown + weight * implied, SLOWDOWN_RANGE[0]), SLOWDOWN_RANGE[1]
            )
        return predicted
