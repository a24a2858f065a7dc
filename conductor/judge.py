"""The Conductor's judge: a placement against its SLOs, as the admission in force sees the decode side.

    judge = Judge(config, predictors, forecast, calibration)
    takers = judge.takers(decodes, blocks)               # the decode workers that would take the prompt's KV now
    decode, tbt, batch_of = judge.pick_decode(req, takers, t, now, len(decodes), slo)
    verdict = judge.admit(req, choice, decode, tbt, decodes, batch_of, slo, now)  # None: serve it

A part of ``conductor.core.Conductor``. It owns the admission in force (``kind``) and the
local-prefill mode (``local_prefill``), both set at run time through its own setters, and
reads the models it is given at construction: the step-time predictors (which
``conductor.learning.Learning`` trains), the decode forecast and the measured departures
(``conductor.drain``: a refusal's Retry-After), which the Conductor keeps as requests are
placed and reported. It records nothing: every method is a question,
asked on every Schedule, and the caller acts on the answer. Pure: time is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from conductor.admission import AdmissionKind, Batch, decode_load, join_tbt, reported_batch, select_decode, step_of
from conductor.config import ConductorConfig
from conductor.drain import Departures
from conductor.forecast import DecodeForecast
from conductor.index import PrefixMatch
from conductor.learning import Calibration
from conductor.local import LocalChoice, LocalPrefill, can_prefill, estimate_local, step_at_cap
from conductor.policies import PrefillChoice
from conductor.predictors import Predictors
from conductor.types import Instance, Prediction, Rejection, RejectReason, ScheduleRequest, Slo

MIN_RETRY_S, MAX_RETRY_S = 1.0, 60.0
# early_predictive counts a decode instance full while more than this share of its batch cap waits there for a place
# and the longest of them has waited past the TBT SLO (measured: its heartbeat's Load.waiting_requests and waiting_s),
# whatever its forecast. On the simulator (3,000 requests of the
# trace, 8P + 8D): at twice the trace's speed, slow decode profile, 40 ms TBT SLO, 68.7% of those served met both SLOs
# without it, 95.4% / 95.7% / 96.8% / 94.7% / 92.9% with shares 0 / 0.25 / 0.5 / 0.75 / 1; at 3x and 60 ms, 50.3% and
# 64.9% (0.5); tests/test_sim.py's decode-bound slice moved only at 0.5 and below (survival 297 -> 269 refused at 0.5)
BACKLOG_SHARE = 0.5

Verdict = tuple[RejectReason, str, float]  # why a request is turned away: reason, message, retry-after (s)


def clamp_retry(seconds: float) -> float:
    """A Retry-After within [MIN_RETRY_S, MAX_RETRY_S]."""
    return min(MAX_RETRY_S, max(MIN_RETRY_S, seconds))


class Judge:
    """Whether a placement meets its SLOs, and what the decode side looks like to the admission in force."""

    def __init__(
        self,
        config: ConductorConfig,
        predictors: Predictors,
        forecast: DecodeForecast,
        calibration: Calibration | None = None,
        departures: Departures | None = None,
    ) -> None:
        self.config = config
        self.predictors = predictors  # read only: conductor.learning trains them
        self.forecast = forecast  # read only: the Conductor keeps it
        self.calibration = calibration  # read only: conductor.learning moves its margin (None: 1)
        self.departures = departures  # read only: the Conductor records them (None: Retry-After from t_d alone)
        self.kind = AdmissionKind(config.admission)
        self.local_prefill = LocalPrefill(config.local_prefill)

    def set_kind(self, kind: AdmissionKind | str) -> None:
        try:
            self.kind = AdmissionKind(kind)
        except ValueError:
            raise ValueError(
                f"unknown admission {kind!r}; choose from {', '.join(k.value for k in AdmissionKind)}"
            ) from None

    def set_local_prefill(self, mode: LocalPrefill | str) -> None:
        try:
            self.local_prefill = LocalPrefill(mode)
        except ValueError:
            raise ValueError(
                f"unknown local prefill mode {mode!r}; choose from {', '.join(m.value for m in LocalPrefill)}"
            ) from None

    # -- the decode side ---------------------------------------------------------------------

    def batch_at(self, t: float, now: float, num_decodes: int, slo: Slo) -> Callable[[Instance], Batch]:
        """The batch a request joining a decode instance at ``t`` would find there, as this admission sees it.

        early_predictive: the decode forecast at ``t`` (DESIGN §5), but no room where the
        instance's last heartbeat measured more than ``BACKLOG_SHARE`` of its batch waiting for a
        place (``Load.waiting_requests``), the longest of them for longer than ``slo``'s TBT
        (``Load.waiting_s``: a gap between two of its tokens past the SLO): the closed loop believes
        the measurement over the forecast until the backlog drains (the forecast counts requests by
        their predicted starts and durations; a step model or a duration wrong by a factor fills an
        instance with requests that wait for a place). A backlog that waits less than the SLO allows
        (a short wait is no miss; a refusal is) leaves the forecast in force. The others: the
        reported batch plus what was sent there and has not started decoding (so requests
        scheduled between two heartbeats spread over the instances).
        """
        if self.kind.predictive:
            batches = self.forecast.batches_at(t, now)
            joins_n, joins_tokens = self.forecast.joins(t, now, num_decodes)

            def at_t(inst: Instance) -> Batch:
                n, tokens = batches.get(inst.id, (0.0, 0.0))
                n, tokens = n + joins_n, tokens + joins_tokens
                cap = inst.load.batch_cap or inst.capacity
                if inst.load.waiting_requests > BACKLOG_SHARE * cap and inst.load.waiting_s >= slo.tbt_s:
                    n = max(n, cap + inst.load.waiting_requests)
                return n, tokens

            return at_t

        pending = self.forecast.pending()

        def now_and_pending(inst: Instance) -> Batch:
            (n, tokens), (pn, ptokens) = reported_batch(inst), pending.get(inst.id, (0, 0))
            return n + pn, tokens + ptokens

        return now_and_pending

    def later(self, t: float, now: float, num_decodes: int, slo: Slo) -> Callable[[Instance], Batch] | None:
        """early_predictive: the batches one TBT budget after ``t``, forecast when first asked (join_tbt asks only
        about an instance at its cap at ``t``: would a place be free before the wait is longer than a step may be?)."""
        if not self.kind.predictive:
            return None
        forecast: list[Callable[[Instance], Batch]] = []

        def later_of(inst: Instance) -> Batch:
            if not forecast:
                forecast.append(self.batch_at(t + slo.tbt_s * self.config.tbt_headroom, now, num_decodes, slo))
            return forecast[0](inst)

        return later_of

    def pick_decode(
        self, req: ScheduleRequest, decodes: list[Instance], t: float, now: float, num_decodes: int, slo: Slo
    ) -> tuple[Instance, float, Callable[[Instance], Batch]]:
        """The decode instance of ``decodes`` for ``req`` joining at ``t`` (``select_decode``), its predicted TBT, and
        the batches it was judged by (``batch_at``; ``admit`` takes them)."""
        batch_of = self.batch_at(t, now, num_decodes, slo)
        decode, tbt = select_decode(
            req,
            decodes,
            self.predictors.decode,
            batch_of,
            lambda inst: self.forecast.count(inst.id),
            self.later(t, now, num_decodes, slo),
        )
        return decode, tbt, batch_of

    def decode_load(self, decodes: list[Instance], t: float, now: float, slo: Slo) -> float:
        """The decode load (a share of the TBT limit) a request joining at ``t`` meets (``admission.decode_load``)."""
        limit = slo.tbt_s * self.config.tbt_headroom
        return decode_load(decodes, self.predictors.decode, self.batch_at(t, now, len(decodes), slo), limit)

    def takers(self, decodes: list[Instance], blocks: int) -> list[Instance]:
        """The decode instances that would take one more request of ``blocks`` landing blocks now: those whose worker
        would not refuse it as ``decode.worker.DecodeWorker.generate`` does (its batch check only under the early
        admissions: the others leave it to the worker).

        A worker refuses when its KV has no room for the prompt's blocks (``kv_held``: the
        requests in prefill there hold theirs, and where the batch shares the cache, the
        running requests theirs), or when the requests running past its batch cap
        (``Load.batch_cap``: what its TBT SLO allows, in every heartbeat; they have landed and
        wait for a place) come to a whole batch. A request in prefill holds landing room, not
        a place in the batch: whether the batch has a place for it when it lands is the
        forecast's question (early_predictive's TBT check), asked at the time its prefill
        ends. Those requests come from the forecast's bookkeeping (scheduled here, their
        decode start and end reported by the worker), so a placement made between two
        heartbeats counts at once; what a worker does not report is not checked here.
        Refused here, such a request hears 429 in a fraction of a millisecond instead of
        after a round trip to a busy worker, and while every worker is full the gateway
        sheds; with the planner acting it waits for room instead (``Overload.hold_for_room``).
        """
        return [inst for inst in decodes if not self.refusal(inst, blocks)]

    def kv_held(self, inst: Instance) -> int:
        """The blocks of decode ``inst``'s KV capacity (``Instance.kv_blocks``) held now, as the Conductor counts them:
        the landings of the requests it placed there that are still in prefill and, where the running batch shares the
        cache, the batch's: its prompts' blocks and a block of output each. Where the worker's last heartbeat counted
        more of either (``Load.landing_held_blocks``, ``Load.running_blocks``: longer outputs, requests placed before a
        restart or whose report was lost), that. A request that started decoding since that heartbeat counts twice
        until the next one: the count errs on the side the worker does not refuse."""
        landing, batch = self.forecast.blocks_held(inst.id)
        landing = max(landing, inst.load.landing_held_blocks)
        return landing + max(batch, inst.load.running_blocks) if inst.kv_shared else landing

    def refusal(self, inst: Instance, blocks: int) -> str:
        """Why ``inst``'s worker would refuse a request of ``blocks`` landing blocks now ("": it would take it)."""
        _, decoding, landing = self.forecast.occupancy(inst.id)
        cap, room = inst.load.batch_cap, inst.load.landing_blocks
        batch_check = self.kind is AdmissionKind.EARLY or self.kind.predictive
        if batch_check and cap and decoding - cap >= cap:
            return f"{inst.id}: {decoding - cap} waiting for a place in a batch of {cap}"
        if inst.kv_blocks:
            held = self.kv_held(inst)
            if held + blocks > inst.kv_blocks:
                return f"{inst.id}: {held} of {inst.kv_blocks} KV blocks held, {blocks} more needed"
        elif room and landing + blocks > room:  # a worker that registered no capacity: its heartbeat's room
            return f"{inst.id}: {landing} of {room} landing blocks held, {blocks} more needed"
        return ""

    def busy_message(self, decodes: list[Instance], blocks: int) -> str:
        why = "; ".join(self.refusal(inst, blocks) for inst in decodes[:4])
        return f"every decode worker is full ({why}{'; ...' if len(decodes) > 4 else ''})"

    # -- prefill on the decode worker ----------------------------------------------------------

    def local(
        self,
        req: ScheduleRequest,
        choice: PrefillChoice,
        decode: Instance,
        match: PrefixMatch,
        now: float,
        num_decodes: int,
        slo: Slo,
    ) -> LocalChoice | None:
        """Where ``decode`` should compute ``req``'s prompt itself (conductor.local), its costs; None: a prefill worker.

        ``auto``: when its batch's step is at most ``local_max_load`` of the TBT limit, the prompt is predicted sooner
        there than the prefill worker's TTFT (with the hand-off), and the steps its chunks ride on stay within the TBT
        SLO with the batch grown to its cap; and while the steps it measured since its last heartbeat (``Load.step_s``,
        the chunks of the prompts it computed riding on them) kept within the TBT limit: a prompt computed there slows
        its running batch, and a worker whose measured steps are over the limit gets none until they are back under.
        ``schedule`` falls back to the prefill worker when admission refuses it."""
        if self.local_prefill is LocalPrefill.NEVER or not can_prefill(decode):
            return None
        batch = self.batch_at(now, now, num_decodes, slo)(decode)
        limit = slo.tbt_s * self.config.tbt_headroom
        if self.local_prefill is LocalPrefill.AUTO and (
            step_of(decode, self.predictors.decode, *batch) > limit * self.config.local_max_load
            or decode.load.step_s > limit
        ):
            return None  # a busy decode worker, as predicted or measured, has no time to spare for prompts
        chunk = decode.step_tokens or self.config.local_chunk_tokens  # what its engine takes a step, as it registered
        grown = step_at_cap(decode, batch, req, self.predictors, limit)
        local = estimate_local(req, decode, batch, match, self.predictors, chunk, grown, slo.tbt_s)
        if self.local_prefill is LocalPrefill.ALWAYS:
            return local
        if local.tbt_s <= slo.tbt_s and local.ttft_s < choice.ttft_s:
            return local
        return None

    def admit_local(
        self, req: ScheduleRequest, local: LocalChoice, tbt: float, decodes: list[Instance], now: float, slo: Slo
    ) -> tuple[Prediction, Verdict | None]:
        """``admit`` for a prompt its decode worker computes (``tbt``: that worker's with ``req`` in its batch), judged
        by the batch it meets when it would start decoding; its prediction and the verdict."""
        # a step a chunk rides on was held to the SLO itself (a gap, not the mean step the headroom is for)
        tbt = tbt if local.tbt_s <= slo.tbt_s else max(tbt, local.tbt_s)
        predicted = Prediction(local.ttft_s, tbt, local.queue_s, local.transfer_s, local.prefill_s)
        batch_of = self.batch_at(now + local.ttft_s, now, len(decodes), slo)
        return predicted, self.admit(req, local, local.decode, tbt, decodes, batch_of, slo, now)

    # -- verdicts --------------------------------------------------------------------------------

    def admit(
        self,
        req: ScheduleRequest,
        choice: PrefillChoice | LocalChoice,
        decode: Instance,
        tbt: float,
        decodes: list[Instance],
        batch_of: Callable[[Instance], Batch],
        slo: Slo,
        now: float | None = None,
    ) -> Verdict | None:
        """Why ``req`` must be turned away now (reason, message, retry-after), or None to serve it.

        ``tbt`` is the predicted TBT on ``decode`` with ``req`` in the batch ``batch_of``
        gives. Plain early judges decode by the current (reported) batches alone, as the
        paper's early rejection does; early_predictive by the batches forecast for when
        this prefill ends. Every early kind takes the predicted TTFT at the calibration's
        margin (``conductor.learning.Calibration``: what predictions near the SLO came out at);
        the baseline, the paper's, at its value. A refusal for the decode side comes back when
        enough running requests will have left for this one to fit, at the rate they were measured
        leaving (``decode_retry``; ``now`` None: half a mean decode).
        """
        kind = self.kind
        if kind is AdmissionKind.NONE:
            return None
        margin = 1.0 if kind is AdmissionKind.BASELINE or self.calibration is None else self.calibration.margin
        at_margin = f" ({margin:.2f}x: what predictions near the SLO came out at)" if margin > 1.0 else ""
        ttft_over = (
            RejectReason.TTFT_SLO,
            f"predicted TTFT {choice.ttft_s:.2f} s{at_margin} is over the {slo.ttft_s} s SLO",
            clamp_retry(choice.queue_s),
        )
        if kind is AdmissionKind.BASELINE:
            return ttft_over if choice.ttft_s > slo.ttft_s else None
        limit = slo.tbt_s * self.config.tbt_headroom
        context = req.prompt_tokens + req.expected_output_tokens // 2  # its KV halfway through its decode
        if kind is AdmissionKind.EARLY:
            batch_of = reported_batch
            tbt = join_tbt(decode, reported_batch(decode), context, self.predictors.decode)
        prefill_load = choice.ttft_s * margin / slo.ttft_s
        load = decode_load(decodes, self.predictors.decode, batch_of, limit)
        if prefill_load > 1.0 and prefill_load >= load:
            return ttft_over
        if load > 1.0:
            batches = ", ".join(
                f"{i.id}: {n:.1f} requests, {step_of(i, self.predictors.decode, n, tokens):.3f} s a step"
                for i in decodes[:4]
                for n, tokens in [batch_of(i)]
            ) + (", ..." if len(decodes) > 4 else "")
            return (
                RejectReason.OVERLOAD,
                f"decode load {load:.2f} of the TBT SLO {when_prefill_ends(kind, choice)} ({batches})",
                self.decode_retry(
                    now, sum(self.excess(i, batch_of, limit, context if i is decode else None) for i in decodes)
                ),
            )
        if tbt == float("inf"):
            cap = decode.load.batch_cap or decode.capacity
            return (
                RejectReason.TBT_SLO,
                f"decode {decode.id}'s batch of {cap} is full {when_prefill_ends(kind, choice)}",
                self.decode_retry(now, 1, decode.id),
            )
        if tbt > limit:
            return (
                RejectReason.TBT_SLO,
                f"predicted TBT {tbt:.3f} s is over the {slo.tbt_s} s SLO",
                self.decode_retry(now, self.excess(decode, batch_of, limit, context), decode.id),
            )
        return None

    def excess(self, inst: Instance, batch_of: Callable[[Instance], Batch], limit: float, joining: float | None) -> int:
        """How many requests must leave ``inst``'s batch (``batch_of``'s) for it to step within ``limit``, with a
        request of ``joining`` context tokens in it (None: none joins); each leaves with its share of the context.
        All of them when even that is not enough."""
        n, tokens = batch_of(inst)
        per = tokens / n if n > 0 else 0.0
        lo, hi = 0, math.ceil(n)
        while lo < hi:  # the fewest leaving: the step only grows with the batch
            mid = (lo + hi) // 2
            left = max(0.0, n - mid)
            size, context = (left, left * per) if joining is None else (left + 1, left * per + joining)
            if step_of(inst, self.predictors.decode, size, context) <= limit:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def decode_retry(self, now: float | None, needed: float, decode: str | None = None) -> float:
        """A Retry-After for a refusal the decode side made: the time ``needed`` running requests take to leave
        ``decode`` (None: any decode instance) at the measured rate (``conductor.drain``); none measured, or no
        ``now``: half a mean decode, the forecast's."""
        measured = None
        if self.departures is not None and now is not None:
            measured = self.departures.retry_after(needed, now, decode)
        return clamp_retry(self.forecast.t_d / 2 if measured is None else measured)

    def admit_at_decode(self, inst: Instance | None, context_tokens: int = 0) -> Rejection | None:
        """The baseline's late check, made when a prefill has finished: would decode instance ``inst`` (None: not
        registered), with this request (``context_tokens`` of KV) joining, run over ``tbt_headroom`` of its TBT SLO?

        Only the baseline rejects here (its prefill is then wasted). The other admissions
        decided before prefill; what they mispredicted waits on the decode side for room.
        """
        if self.kind is not AdmissionKind.BASELINE or inst is None:
            return None
        tbt_slo = min(s.tbt_s for s in self.config.slo_classes.values())
        tbt = join_tbt(inst, reported_batch(inst), context_tokens, self.predictors.decode)
        if tbt <= tbt_slo * self.config.tbt_headroom:
            return None
        return Rejection(
            "",
            RejectReason.TBT_SLO,
            f"decode {inst.id} would run at {tbt:.3f} s per token, over the {tbt_slo} s SLO",
            clamp_retry(self.forecast.t_d / 2),
        )


def when_prefill_ends(kind: AdmissionKind, choice: PrefillChoice | LocalChoice) -> str:
    """When the decode side is judged, for a message: now (plain early) or when the prefill would end."""
    return "now" if kind is AdmissionKind.EARLY else f"in {choice.ttft_s:.1f} s"
