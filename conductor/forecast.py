"""The decode forecast: what the Conductor sent to each decode instance, and what will still run there at time t.

Every scheduled request is a *flight*: its decode instance, when its decode starts
(predicted at schedule time, measured once the decode worker reports it), and its context
tokens. early_predictive asks, for the moment a new request's prefill would end, how many
requests (and how much context) each decode instance will be running. Two kinds:

    uniform   the paper's (arXiv §7): every decode lasts ``t_d`` (a moving average of
              measured decode durations); at time t an instance still runs what started
              after t - t_d, plus the requests whose prefill has finished by t
    survival  ours: the measured durations' distribution (the last ``window``), and each
              request counted by its chance to still run at t given how long it has run
              already, ``S(t - start) / S(now - start)``; a request not yet decoding counts
              ``S(t - start)`` from its predicted start. Output lengths are long-tailed, so
              a request that has run long is likely to run on, which ``t_d`` cannot say.
              Plus the requests not yet scheduled that will have joined by t (``joins``):
              a forecast far ahead otherwise sees every batch drain and admits long
              prompts that then find it full.

A request late for its predicted start has not started: it is forecast from now.

``t_d`` starts at ``default_decode_s`` and the first measured duration replaces it (a guess,
not a sample: it is not averaged in). On a fresh cluster serving 20-token answers in 6 s, a
10 s default that only an average moved counted every request as running for 10 s, and the
Conductor refused requests for a decode load that never came.

Storage: one row per flight in numpy columns (rows of finished flights are reused), so the
forecast for every instance at once is a few vector operations; a Schedule costs tens of
microseconds here with hundreds of requests in flight.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque

import numpy as np

# a flight not decoding yet is kept this long past its predicted start at most (its worker's report lost): it may wait
# in its prefill, or for a place in the batch, for minutes under load
UNSTARTED_KEEP_S = 600.0


class ForecastKind(str, enum.Enum):
    UNIFORM = "uniform"
    SURVIVAL = "survival"


class DecodeForecast:
    """The flights, the measured decode durations, and the forecasts made from them. Pure: time is passed in.

    ``t_d`` starts at ``default_decode_s``, is set by the first measured duration, and follows the later ones (EMA).
    The survival forecast uses the uniform one until ``min_samples`` durations are measured.
    """

    def __init__(
        self,
        default_decode_s: float = 10.0,
        kind: ForecastKind | str = ForecastKind.UNIFORM,
        alpha: float = 0.1,
        window: int = 1000,
        min_samples: int = 20,
    ) -> None:
        self.kind = ForecastKind(kind)
        self.t_d = default_decode_s
        self.alpha, self.window, self.min_samples = alpha, window, min_samples
        self.horizon_s = 0.0  # moving average of the time from schedule to decode start (predicted)
        # flights, one row each
        self._row: dict[str, int] = {}  # request id -> row
        self._ids: list[str | None] = []  # row -> request id (None: free)
        self._free: list[int] = []
        self._decode_number: dict[str, int] = {}  # decode id -> its number in the ``_decode`` column
        self._decode_ids: list[str] = []
        self._pending: list[int] = []  # by decode number: live flights not yet decoding
        self._decoding: list[int] = []  # and decoding
        self._landing: list[int] = []  # the landing blocks the ones not yet decoding hold
        self._batch_blocks: list[int] = []  # and the prompt blocks the decoding ones still hold
        # flights ``expire`` dropped from the forecast while still in prefill (late for their predicted start): the
        # worker holds their blocks until they finish, so they stay counted (``blocks_held``) until then, or until a
        # TTFT SLO and a longest decode later (a report lost): request id -> [decode number, blocks, until, decoding]
        self._late: dict[str, list] = {}
        self._late_landing: list[int] = []  # by decode number: their blocks, still landing
        self._late_batch: list[int] = []  # and decoding (with a block of output each)
        self._decode = np.zeros(0, np.int64)
        self._start = np.zeros(0)  # when its decode starts (predicted until reported)
        self._context = np.zeros(0)
        self._blocks = np.zeros(0, np.int64)  # landing blocks it holds until its decode starts
        self._started = np.zeros(0, np.bool_)
        self._live = np.zeros(0, np.bool_)
        # measurements
        self._recent: deque[float] = deque()  # measured durations, oldest first
        self._sorted: list[float] = []  # the same, sorted (for S(x))
        self._sorted_array: np.ndarray | None = None  # _sorted as an array, and its prefix sums (None: to recompute)
        self._prefix: np.ndarray | None = None
        self._starts: deque[tuple[float, int]] = deque()  # (time, context tokens) of recent decode starts
        self._start_tokens = 0  # their context tokens in all

    # -- what happens to requests ------------------------------------------------------------

    def scheduled(
        self,
        request_id: str,
        decode: str,
        prefill_done_at: float,
        context_tokens: int,
        now: float | None = None,
        landing_blocks: int = 0,
    ) -> None:
        """A request was sent to ``decode``; its prefill should end at ``prefill_done_at`` (scheduled at ``now``), and
        its prompt's KV takes ``landing_blocks`` of the decode worker's landing segment until its decode starts."""
        if now is not None:
            self.horizon_s = (1 - self.alpha) * self.horizon_s + self.alpha * max(0.0, prefill_done_at - now)
        self._drop(request_id)
        number = self._decode_number.get(decode)
        if number is None:
            number = self._decode_number[decode] = len(self._decode_ids)
            self._decode_ids.append(decode)
            self._pending.append(0)
            self._decoding.append(0)
            self._landing.append(0)
            self._batch_blocks.append(0)
            self._late_landing.append(0)
            self._late_batch.append(0)
        self._forget_late(request_id)
        row = self._free.pop() if self._free else self._grow()
        self._pending[number] += 1
        self._landing[number] += landing_blocks
        self._blocks[row] = landing_blocks
        self._row[request_id], self._ids[row] = row, request_id
        self._decode[row], self._start[row], self._context[row] = number, prefill_done_at, context_tokens
        self._started[row], self._live[row] = False, True

    def decode_started(self, request_id: str, now: float) -> None:
        late = self._late.get(request_id)
        if late is not None and not late[3]:  # its blocks now hold its running request
            number, blocks = late[0], late[1]
            self._late_landing[number] -= blocks
            self._late_batch[number] += blocks + 1
            late[3] = True
        row = self._row.get(request_id)
        if row is None:
            return
        if not self._started[row]:
            number = int(self._decode[row])
            self._pending[number] -= 1
            self._decoding[number] += 1
            self._landing[number] -= int(self._blocks[row])
            self._batch_blocks[number] += int(self._blocks[row])
        self._start[row], self._started[row] = now, True
        context = int(self._context[row])
        self._starts.append((now, context))
        self._start_tokens += context
        if len(self._starts) > self.window:
            self._start_tokens -= self._starts.popleft()[1]

    def finished(self, request_id: str, now: float) -> str | None:
        """The request left its decode instance (done, failed or cancelled). Returns that instance when the request
        was decoding there (it gave a place in the batch back), else None."""
        late = self._late.get(request_id)
        left = self._decode_ids[late[0]] if late is not None and late[3] else None
        self._forget_late(request_id)
        row = self._row.get(request_id)
        if row is None:
            return left
        started, start = bool(self._started[row]), float(self._start[row])
        left = self._decode_ids[int(self._decode[row])] if started else None
        self._drop(request_id)
        if started and now > start:
            duration = now - start
            self.t_d = (1 - self.alpha) * self.t_d + self.alpha * duration if self._recent else duration
            self._recent.append(duration)
            bisect.insort(self._sorted, duration)
            if len(self._recent) > self.window:
                del self._sorted[bisect.bisect_left(self._sorted, self._recent.popleft())]
            self._sorted_array = self._prefix = None
        return left

    def forget_instance(self, decode: str) -> None:
        """Drop every flight to ``decode`` (it died or left)."""
        number = self._decode_number.get(decode)
        if number is not None:
            self._drop_rows(np.flatnonzero(self._live & (self._decode == number)))
            for request_id in [r for r, late in self._late.items() if late[0] == number]:
                self._forget_late(request_id)

    def expire(self, now: float, pending_s: float = 0.0) -> None:
        """Drop flights long past any end seen (a lost report must not inflate the load forever): one decoding after
        the longest decode seen; one not decoding yet (in its prefill, or landed and waiting for a place in the batch)
        only ``UNSTARTED_KEEP_S`` later, since its worker reports when it starts or ends. It was dropped as soon as a
        decoding one, and a decode instance whose requests waited minutes for a place, on short decodes, was forecast
        empty: early_predictive admitted into the backlog (the simulator at twice the trace's speed, slow decode
        profile, 40 ms TBT SLO: 4% of those served within both SLOs; 69% since). One dropped before its decode
        started keeps its blocks counted (``blocks_held``) until it finishes, as its worker holds them, or
        ``pending_s`` and twice the longest decode later (its report lost)."""
        longest = max(4 * self.t_d, 2 * self._sorted[-1] if self._sorted else 0.0)
        keep = np.where(self._started, longest, longest + UNSTARTED_KEEP_S)
        rows = np.flatnonzero(self._live & (now > self._start + keep))
        for row in rows[~self._started[rows] & (self._blocks[rows] > 0)].tolist():
            number, blocks = int(self._decode[row]), int(self._blocks[row])
            self._late[self._ids[row]] = [number, blocks, float(self._start[row]) + 2 * longest + pending_s, False]
            self._late_landing[number] += blocks
        self._drop_rows(rows)
        for request_id in [r for r, late in self._late.items() if now > late[2]]:
            self._forget_late(request_id)

    def _forget_late(self, request_id: str) -> None:
        late = self._late.pop(request_id, None)
        if late is not None and late[3]:
            self._late_batch[late[0]] -= late[1] + 1
        elif late is not None:
            self._late_landing[late[0]] -= late[1]

    def __len__(self) -> int:
        return len(self._row)

    def count(self, decode: str) -> int:
        """Requests sent to ``decode`` that have not finished."""
        pending, decoding, _ = self.occupancy(decode)
        return pending + decoding

    def occupancy(self, decode: str) -> tuple[int, int, int]:
        """(requests sent to ``decode`` and not decoding yet, requests decoding there, landing blocks the first hold),
        as reported so far."""
        number = self._decode_number.get(decode)
        if number is None:
            return 0, 0, 0
        return self._pending[number], self._decoding[number], self._landing[number]

    def blocks_held(self, decode: str) -> tuple[int, int]:
        """(landing blocks held by the requests sent to ``decode`` and not decoding yet, blocks held by those decoding
        there: their prompts' and a block of output each), as reported so far, those ``expire`` dropped as late
        included: a request's blocks are its until it finishes."""
        number = self._decode_number.get(decode)
        if number is None:
            return 0, 0
        batch = self._batch_blocks[number] + self._decoding[number] + self._late_batch[number]
        return self._landing[number] + self._late_landing[number], batch

    def _grow(self) -> int:
        """A fresh row (the columns double when full)."""
        row = len(self._ids)
        if row == len(self._live):
            size = max(64, 2 * row)
            for name in ("_decode", "_start", "_context", "_blocks", "_started", "_live"):
                old = getattr(self, name)
                new = np.zeros(size, old.dtype)
                new[:row] = old
                setattr(self, name, new)
        self._ids.append(None)
        return row

    def _drop(self, request_id: str) -> None:
        row = self._row.pop(request_id, None)
        if row is not None:
            number = int(self._decode[row])
            if self._started[row]:
                self._decoding[number] -= 1
                self._batch_blocks[number] -= int(self._blocks[row])
            else:
                self._pending[number] -= 1
                self._landing[number] -= int(self._blocks[row])
            self._live[row], self._ids[row] = False, None
            self._free.append(row)

    def _drop_rows(self, rows: np.ndarray) -> None:
        for row in rows.tolist():
            self._drop(self._ids[row])

    # -- forecasts -----------------------------------------------------------------------------

    def _durations(self) -> np.ndarray:
        if self._sorted_array is None:
            self._sorted_array = np.array(self._sorted)
            self._prefix = np.concatenate([[0.0], np.cumsum(self._sorted_array)])
        return self._sorted_array

    def batches_at(self, t: float, now: float) -> dict[str, tuple[float, float]]:
        """For every decode instance ever sent a request: (requests, context tokens) expected there
        at ``t`` (>= ``now``).

        Called once per Schedule under early_predictive.
        """
        live = np.flatnonzero(self._live[: len(self._ids)])
        if not len(live):
            return {}
        started = self._started[live]
        start = np.where(started, self._start[live], np.maximum(self._start[live], now))  # late: not before now
        if self.kind is ForecastKind.UNIFORM or len(self._sorted) < self.min_samples:
            p = ((start <= t) & (t < start + self.t_d)).astype(np.float64)
        else:
            durations = self._durations()
            p = np.where(start <= t, 1.0 - np.searchsorted(durations, t - start, side="right") / len(durations), 0.0)
            running = started & (now > start)
            alive = 1.0 - np.searchsorted(durations, now - start[running], side="right") / len(durations)
            # S(t - start) / S(now - start); older than every measured decode: no telling when it ends
            p[running] = np.where(alive > 0, np.minimum(1.0, p[running] / np.where(alive > 0, alive, 1.0)), 1.0)
        decode = self._decode[live]
        count = np.bincount(decode, weights=p, minlength=len(self._decode_ids))
        tokens = np.bincount(decode, weights=p * self._context[live], minlength=len(self._decode_ids))
        return dict(zip(self._decode_ids, zip(count.tolist(), tokens.tolist())))

    def batch_at(self, decode: str, t: float, now: float) -> tuple[float, float]:
        """(requests, context tokens) expected on ``decode`` at time ``t`` (>= ``now``) from the Conductor's own
        flights."""
        return self.batches_at(t, now).get(decode, (0.0, 0.0))

    def pending(self) -> dict[str, tuple[int, int]]:
        """For every decode instance ever sent a request: (requests, context tokens) sent there, not yet decoding."""
        rows = np.flatnonzero(self._live[: len(self._ids)] & ~self._started[: len(self._ids)])
        decode = self._decode[rows]
        count = np.bincount(decode, minlength=len(self._decode_ids))
        tokens = np.bincount(decode, weights=self._context[rows], minlength=len(self._decode_ids))
        return dict(zip(self._decode_ids, zip(count.tolist(), tokens.astype(np.int64).tolist())))

    def joins(self, t: float, now: float, instances: int) -> tuple[float, float]:
        """(requests, context tokens) expected on each of ``instances`` decode instances at ``t`` from requests
        not scheduled yet (survival forecast only; the uniform one says (0, 0)).

        Requests keep arriving at the recent rate of decode starts, spread evenly over the
        instances, and reach decode ``horizon_s`` (the usual time from schedule to decode)
        after they arrive; so before ``t`` only those arriving in the first
        ``t - now - horizon_s`` seconds join (the ones before them are already scheduled: the
        flights). One that starts at ``s`` still runs at ``t`` with chance ``S(t - s)``: in
        all ``rate * integral of S over [0, t - now - horizon_s]``, and the integral is the
        mean of ``min(duration, t - now - horizon_s)``.
        """
        if (
            self.kind is ForecastKind.UNIFORM
            or len(self._sorted) < self.min_samples
            or len(self._starts) < self.min_samples
        ):
            return 0.0, 0.0
        first, last = self._starts[0][0], self._starts[-1][0]
        horizon = t - now - self.horizon_s
        if last <= first or horizon <= 0:
            return 0.0, 0.0
        rate = (len(self._starts) - 1) / (last - first) / max(1, instances)  # starts per second per instance
        durations = self._durations()
        k = int(np.searchsorted(durations, horizon, side="left"))
        n = rate * (float(self._prefix[k]) + horizon * (len(durations) - k)) / len(durations)
        return n, n * self._start_tokens / len(self._starts)
