"""The store's event stream: every block that enters or leaves a tier, in order, with a sequence number.

Subscribers (the Conductor's global index) read from a sequence number onwards and block
until there is something new. The log keeps the last ``StoreConfig.events_kept``; a subscriber
that fell further behind is told so (``reset``) and should take a snapshot instead. By default
that is as many events as the node holds blocks (4096 at least): replaying more would cost more
than the snapshot. A fixed 2**20 let a busy node's log grow by some 275 bytes an event (measured
with tracemalloc) for hours, to about 290 MB: in the hour-long soak each node's private memory grew
about 6 MiB an hour (benchmarks/results/2026-11-29-soak.md).
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from dataclasses import dataclass


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


class Tier(enum.Enum):
    DRAM = "dram"
    SSD = "ssd"


@dataclass(frozen=True, slots=True)
class BlockEvent:
    seq: int
    kind: EventKind
    key: bytes
    tier: Tier
    time: float
    parent: bytes | None = None  # the block before it in its chain (b"": the chain's first block; None: not known)


class EventLog:
    """A bounded, thread-safe, append-only log with blocking reads."""

    def __init__(self, max_events: int) -> None:
        self._events: deque[BlockEvent] = deque(maxlen=max_events)
        self._next_seq = 1
        self._cond = threading.Condition()

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def append(self, kind: EventKind, key: bytes, tier: Tier, parent: bytes | None = None) -> None:
        with self._cond:
            self._events.append(BlockEvent(self._next_seq, kind, key, tier, time.time(), parent))
            self._next_seq += 1
            self._cond.notify_all()

    def read(self, from_seq: int, timeout: float, limit: int = 4096) -> tuple[list[BlockEvent], bool]:
        """Return events with ``seq >= from_seq`` (waiting up to ``timeout`` s for one) and whether some were lost."""
        with self._cond:
            if from_seq >= self._next_seq:
                self._cond.wait_for(lambda: from_seq < self._next_seq, timeout)
            if not self._events or from_seq >= self._next_seq:
                return [], False
            first = self._events[0].seq
            lost = from_seq < first
            start = max(from_seq, first) - first
            end = min(len(self._events), start + limit)
            return [self._events[i] for i in range(start, end)], lost

    def wake(self) -> None:
        """Wake blocked readers (shutdown)."""
        with self._cond:
            self._cond.notify_all()
