"""How fast the decode side gives places back: measured departures, and the Retry-After they give a refused request.

    departures = Departures()
    departures.left(decode_id, now)               # a request that was decoding left its decode instance
    retry = departures.retry_after(needed, now)   # seconds until ``needed`` more have left, at the measured rate
    retry = departures.retry_after(needed, now, decode_id)   # on one instance

A request refused because the decode side is over its TBT SLO (or its decode instance's batch is full) can be served
once enough running requests have left for it to fit. How many must leave is the caller's (the excess over the SLO);
how fast they leave is measured here: the requests that left each decode instance in the last ``window_s``, from the
workers' FINISHED reports. Too few measured (``MIN_DEPARTURES``): None, and the caller keeps its guess (half a mean
decode). Pure: time is passed in.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = (
    60.0  # departures this recent set the rate: long enough for a few on a slow CPU decode, short enough to follow load
)
MIN_DEPARTURES = 3  # fewer in the window: no rate (one departure says nothing about a rate)


class Departures:
    """When requests that were decoding left each decode instance, over the last ``window_s``."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._at: dict[str, deque[float]] = {}  # decode id -> departure times, oldest first
        self._since: dict[str, float] = {}  # decode id -> its first departure (a young instance's window is shorter)

    def left(self, decode: str, now: float) -> None:
        """A request that was decoding on ``decode`` left it (done, failed or cancelled)."""
        self._since.setdefault(decode, now)
        times = self._at.setdefault(decode, deque())
        times.append(now)
        self._trim(times, now)

    def forget(self, decode: str) -> None:
        """``decode`` died or left: its rate no longer drains anything."""
        self._at.pop(decode, None)
        self._since.pop(decode, None)

    def rate(self, now: float, decode: str | None = None) -> float | None:
        """Requests leaving a second, on ``decode`` or (None) on all decode instances together; None: too few
        measured. The window is ``window_s``, or since the first departure seen when that is shorter."""
        decodes = list(self._at) if decode is None else [decode] if decode in self._at else []
        rates = [r for d in decodes if (r := self._rate_of(d, now)) is not None]
        return sum(rates) if rates else None

    def _rate_of(self, decode: str, now: float) -> float | None:
        times = self._at[decode]
        self._trim(times, now)
        if len(times) < MIN_DEPARTURES:
            return None
        since = self._since[decode]
        span = min(self.window_s, now - since)
        # counted from the first departure seen, that one opens the span and is not in it
        n = len(times) - (since > now - self.window_s)
        return n / span if span > 0 and n > 0 else None

    def retry_after(self, needed: float, now: float, decode: str | None = None) -> float | None:
        """Seconds until ``needed`` more requests will have left (``decode``, or all of them), at the measured rate;
        None: no rate measured."""
        rate = self.rate(now, decode)
        if rate is None or rate <= 0:
            return None
        return max(needed, 1.0) / rate

    def _trim(self, times: deque[float], now: float) -> None:
        while times and times[0] < now - self.window_s:
            times.popleft()
