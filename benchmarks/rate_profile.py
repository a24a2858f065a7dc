"""A rate that moves: a trace's arrivals re-timed so its request rate follows a profile over the run.

    flat          the trace's own times
    step:1,3,1    equal spans of wall time at 1x, 3x, then 1x the trace's rate (any number of levels)
    day:1,4       one day over the run: the rate follows lo + (hi - lo) (1 - cos(2 pi t / T)) / 2, from
                  lo at the start (night) to hi at the middle (noon) and back; its mean is (lo + hi) / 2

The requests and their order stay as the trace has them; only their times move. A profile r(t) of the
wall time t multiplies the trace's rate, so a request the trace sends at u (after its speed) is sent at
the t where the integral of r from 0 to t reaches u. The run's wall time is then the trace's span over
the profile's mean level (a 1x..4x day runs for the span over 2.5).

Used by benchmarks.replay, benchmarks.compare and the simulator (``--rate-profile``); the planner's
experiments (benchmarks.sim.planning) judge plans under ``day`` and ``step``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GRID = 20_000  # points of the profile's integral the inverse is read from


@dataclass(frozen=True, slots=True)
class RateProfile:
    """One profile: ``kind`` (flat, step, day) and its levels (multipliers of the trace's rate)."""

    kind: str = "flat"
    levels: tuple[float, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> RateProfile:
        """``flat``, ``step:A,B,...`` or ``day:LO,HI``. Raises ValueError for anything else."""
        if not text or text == "flat":
            return cls()
        kind, _, rest = text.partition(":")
        try:
            levels = tuple(float(x) for x in rest.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"rate profile {text!r}: levels must be numbers, as in step:1,3,1 or day:1,4") from None
        if kind not in ("step", "day"):
            raise ValueError(f"unknown rate profile {text!r}; choose flat, step:A,B,... or day:LO,HI")
        if kind == "day" and len(levels) != 2:
            raise ValueError(f"rate profile {text!r}: a day has two levels, its low and its high (day:1,4)")
        if kind == "step" and not levels:
            raise ValueError(f"rate profile {text!r}: a step needs its levels (step:1,3,1)")
        if any(x <= 0 for x in levels):
            raise ValueError(f"rate profile {text!r}: levels must be positive")
        return cls(kind, levels)

    @property
    def mean(self) -> float:
        if self.kind == "step":
            return sum(self.levels) / len(self.levels)
        if self.kind == "day":
            return sum(self.levels) / 2
        return 1.0

    @property
    def peak(self) -> float:
        return max(self.levels) if self.levels else 1.0

    def rate_at(self, t: float, wall_s: float) -> float:
        """The multiplier at wall time ``t`` of a run lasting ``wall_s``."""
        if self.kind == "step":
            i = min(len(self.levels) - 1, max(0, int(t / wall_s * len(self.levels))))
            return self.levels[i]
        if self.kind == "day":
            lo, hi = self.levels
            return lo + (hi - lo) * (1 - math.cos(2 * math.pi * t / wall_s)) / 2
        return 1.0

    def phases(self, arrivals: np.ndarray | list[float]) -> list[tuple[float, float, float]] | None:
        """A step's phases for these arrivals (before ``retime``): (level, start, end) in the re-timed run's seconds
        from its first arrival; None for other profiles."""
        u = np.asarray(arrivals, dtype=np.float64)
        if self.kind != "step" or len(u) < 2 or u[-1] <= u[0]:
            return None
        wall = float(u[-1] - u[0]) / self.mean
        k = len(self.levels)
        return [(level, wall * i / k, wall * (i + 1) / k) for i, level in enumerate(self.levels)]

    def retime(self, arrivals: np.ndarray | list[float]) -> np.ndarray:
        """The arrivals (seconds, ascending, from the first) re-timed to follow the profile."""
        u = np.asarray(arrivals, dtype=np.float64)
        if self.kind == "flat" or not len(u):
            return u.copy()
        start = u[0]
        span = float(u[-1] - start)
        if span <= 0:
            return u.copy()
        wall = span / self.mean
        t = np.linspace(0.0, wall, GRID)
        r = np.array([self.rate_at(x, wall) for x in t])
        cum = np.concatenate([[0.0], np.cumsum((r[1:] + r[:-1]) / 2 * np.diff(t))])
        cum *= span / cum[-1]  # the grid's small error, spread
        return start + np.interp(u - start, cum, t)

    def describe(self) -> str:
        if self.kind == "step":
            return "rate steps " + " -> ".join(f"{x:g}x" for x in self.levels)
        if self.kind == "day":
            return f"a day from {self.levels[0]:g}x to {self.levels[1]:g}x and back"
        return "the trace's own rate"
