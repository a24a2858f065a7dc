"""The Conductor's quotes, and how often they held: a calibration a client can trust.

Every request the Conductor places gets its predicted TTFT and TBT back (the gateway's
``x-mooncake-predicted-ttft`` and ``x-mooncake-predicted-tbt`` headers). What came out
reaches the Conductor in its decode worker's reports: the TTFT with the first token
(``Conductor.decode_started``), the mean time between tokens once the request leaves
(``Conductor.finished``). A quote *held* when it is within ``QUOTE_WITHIN`` (25%) of what
came out, replay.py's figure; the share of the last ``QUOTE_WINDOW`` that held, per part, is
``mooncake_conductor_quote_held_ratio{part}`` and a line of ``mooncake status``.

The TTFT measured is the decode worker's (from the request's arrival there), not the
client's (which adds the hop from the gateway and any wait the gateway was told to make);
benchmarks/replay.py measures the client's.
"""

from __future__ import annotations

from collections import OrderedDict, deque

QUOTE_WITHIN = 0.25
QUOTE_WINDOW = 1000  # quotes the held ratio is the share of
MAX_OPEN_QUOTES = 100_000  # TBT quotes awaiting their request's end (the oldest go first)
PARTS = ("ttft", "tbt")


class Quotes:
    """The TBT quotes of requests still running, and the last ``QUOTE_WINDOW`` outcomes of each part. Not thread-safe:
    the Conductor's owner calls it."""

    def __init__(self) -> None:
        self._tbt: OrderedDict[str, float] = OrderedDict()  # request id -> its quoted TBT, until it ends
        self._held = {part: deque(maxlen=QUOTE_WINDOW) for part in PARTS}

    def quoted(self, request_id: str, tbt_s: float) -> None:
        """``request_id`` was placed with this TBT quote (its TTFT quote comes back with its measured TTFT)."""
        self._tbt[request_id] = tbt_s
        if len(self._tbt) > MAX_OPEN_QUOTES:
            self._tbt.popitem(last=False)

    def ended(self, request_id: str, measured_tbt_s: float) -> None:
        """``request_id`` left its decode worker, its tokens ``measured_tbt_s`` apart on average (0: not measured, as
        for a request of one token)."""
        quoted = self._tbt.pop(request_id, None)
        if quoted is not None and quoted > 0 and measured_tbt_s > 0:
            self.came_out("tbt", quoted, measured_tbt_s)

    def came_out(self, part: str, quoted: float, measured: float) -> None:
        """One quote of ``part`` against what came out."""
        self._held[part].append(abs(quoted - measured) <= QUOTE_WITHIN * measured)

    def held(self, part: str) -> tuple[float, int]:
        """(the share of the last quotes of ``part`` that held, how many that is); (0.0, 0) before any."""
        outcomes = self._held[part]
        return (sum(outcomes) / len(outcomes), len(outcomes)) if outcomes else (0.0, 0)
