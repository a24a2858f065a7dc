"""LinkMeter: the network's bandwidth, as the batches a process wrote across it measured it.

A batch's time runs from its start to its last byte acknowledged; batches queued behind each other on one link overlap,
and gaps between them (a prefill worker waiting for its next layer's compute) are the link idle. So the meter counts
the union of the batches' times, each moment once, against the bytes they moved across the network (tcp or rdma; a
copy on this host through shared memory is not the link's). Only a busy period counts: batches that overlapped (each
queued behind another), or one of ``min_bytes`` or more. A smaller batch that found the link idle measured its latency
and whatever burst the network lets through at once, not its rate (a prefill worker's narrow per-layer pushes at a
light load, on a 100 Mbit/s link shaped with a 256 KB burst, came out at 41 MB/s). ``take`` hands on what it
gathered once it holds ``min_bytes``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

MIN_SAMPLE_BYTES = 1 << 20


class LinkMeter:
    def __init__(self, transfer, min_bytes: int = MIN_SAMPLE_BYTES) -> None:
        self.transfer = transfer  # the TransferEngine the batches went through (which backend reaches a segment)
        self.min_bytes = min_bytes
        self._lock = threading.Lock()  # settled on the engine's thread, taken on a request's
        self._bytes = 0
        self._seconds = 0.0
        self._end = 0.0  # where the time counted so far ends (monotonic seconds)

    def settled(self, batches: Sequence[tuple[object, Sequence]]) -> None:
        """Count ``batches``, each (a settled TransferBatch, its slices): one that failed, or sent nothing across the
        network, counts nothing."""
        spans = []
        networked: dict[str, bool] = {}
        for batch, slices in batches:
            if batch.error is not None or batch.finished_at is None:
                continue
            moved = 0
            for s in slices:
                if s.segment not in networked:
                    try:
                        networked[s.segment] = self.transfer.networked(s.segment)
                    except Exception:  # noqa: BLE001 - a segment gone since (its owner left): not counted
                        networked[s.segment] = False
                moved += s.length if networked[s.segment] else 0
            if moved:
                spans.append((batch.started_at, batch.finished_at, moved))
        with self._lock:
            period: list | None = None  # the busy period under way: [seconds, bytes, batches, its end]
            for started, finished, moved in sorted(spans):
                if period is not None and started > period[3]:
                    self._close(period)
                    period = None
                if period is None:
                    period = [0.0, 0, 0, finished]
                period[0] += max(0.0, finished - max(started, self._end))
                period[1] += moved
                period[2] += 1
                period[3] = max(period[3], finished)
                self._end = max(self._end, finished)
            if period is not None:
                self._close(period)

    def _close(self, period: list) -> None:
        seconds, moved, batches, _ = period
        if batches >= 2 or moved >= self.min_bytes:
            self._seconds += seconds
            self._bytes += moved

    def take(self) -> tuple[int, float] | None:
        """(bytes, seconds) gathered since the last take, once they hold ``min_bytes``; None before."""
        with self._lock:
            if self._bytes < self.min_bytes or self._seconds <= 0:
                return None
            sample, self._bytes, self._seconds = (self._bytes, self._seconds), 0, 0.0
            return sample
