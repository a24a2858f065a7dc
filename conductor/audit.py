"""The prediction log (``--prediction-log``): one JSON line per admitted request whose TTFT came out, what the
Conductor predicted for it part by part beside what its workers measured, and what the instance held when it was
placed. Where the Prometheus histogram (``mooncake_conductor_prediction_ratio``) says how often a part is off, this
says which requests and under what load: what ``python -m benchmarks.prediction_parts FILE`` reads.

    {"at": 1764387000.1, "request": "r1", "instance": "prefill-0", "prompt_tokens": 345, "compute_tokens": 329,
     "ahead_tokens": 1024, "busy": 2, "slowdown": 1.31, "after_s": 3.41,
     "predicted": {"ttft": 3.1, "queue": 1.9, "prefill": 0.8, "transfer": 0.4},
     "measured": {"ttft": 3.4, "queue": 2.2, "prefill": 0.9, "transfer": 0.3}}

``measured`` queue and prefill are 0 where the decode worker did not measure them (a prompt computed on the decode
worker). The file rolls over at ``MAX_BYTES`` to one ``.1`` (the standard library's RotatingFileHandler), so a
long-running Conductor's log stays bounded.
"""

from __future__ import annotations

import json
import logging
import time
from logging.handlers import RotatingFileHandler
from pathlib import Path

from conductor.types import Measured, Placed

MAX_BYTES = 64 << 20  # a line is about 400 bytes: some 160,000 requests before it rolls over


class PredictionLog:
    """Appends one JSON line per scored prediction to ``path`` (made with its parent directory if missing)."""

    def __init__(self, path: str | Path, max_bytes: int = MAX_BYTES) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handler = RotatingFileHandler(path, maxBytes=max_bytes, backupCount=1, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))

    def __call__(self, request_id: str, placed: Placed, measured: Measured, now: float) -> None:
        p = placed.predicted
        line = {
            "at": round(time.time(), 3),
            "request": request_id,
            "instance": placed.instance,
            "prompt_tokens": placed.prompt_tokens,
            "compute_tokens": placed.compute_tokens,
            "ahead_tokens": placed.ahead_tokens,
            "busy": placed.busy,
            "slowdown": round(placed.slowdown, 4),
            "after_s": round(now - placed.at, 4),  # from its placement to this report
            "predicted": {k: round(v, 4) for k, v in _parts(p.ttft_s, p.queue_s, p.prefill_s, p.transfer_s)},
            "measured": {
                k: round(v, 4)
                for k, v in _parts(measured.ttft_s, measured.queue_s, measured.prefill_s, measured.transfer_s)
            },
        }
        self._handler.emit(logging.makeLogRecord({"msg": json.dumps(line, separators=(",", ":"))}))

    def close(self) -> None:
        self._handler.close()


def _parts(ttft: float, queue: float, prefill: float, transfer: float) -> tuple[tuple[str, float], ...]:
    return ("ttft", ttft), ("queue", queue), ("prefill", prefill), ("transfer", transfer)
