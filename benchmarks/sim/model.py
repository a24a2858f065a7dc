"""The simulator's trace: a Mooncake trace's requests, read as the twin (conductor.planner.twin) replays them.

The cost models (``ModelConfig``) are in conductor/planner/costs.py and a pool node's cache
(``NodeCache``) in conductor/planner/nodecache.py: the Conductor's planner runs the same
cluster model on what it saw (its twin); this module only reads a trace file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from benchmarks.rate_profile import RateProfile
from benchmarks.trace import TRACE_BLOCK_TOKENS, open_trace
from conductor.planner.state import TraceRequest
from conductor.types import KeyChain


def block_key(hash_id: int) -> bytes:
    """The 16-byte block key of a trace hash id (an id already names its whole prefix, so no chaining)."""
    return hashlib.blake2b(hash_id.to_bytes(8, "little"), digest_size=16).digest()


def load_trace(
    path: Path, speed: float = 1.0, limit: int | None = None, profile: RateProfile | None = None
) -> list[TraceRequest]:
    """Read a Mooncake trace (JSON lines); arrival = timestamp / speed, re-timed by ``profile``
    (benchmarks.rate_profile) when given. Only full blocks get keys."""
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    keys_of: dict[int, bytes] = {}
    out: list[TraceRequest] = []
    with open_trace(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            prompt = int(rec["input_length"])
            ids = rec["hash_ids"][: min(prompt // TRACE_BLOCK_TOKENS, len(rec["hash_ids"]))]
            keys = []
            for h in ids:
                k = keys_of.get(h)
                if k is None:
                    k = keys_of[h] = block_key(h)
                keys.append(k)
            out.append(
                TraceRequest(
                    len(out),
                    rec["timestamp"] / 1000.0 / speed,
                    prompt,
                    max(1, int(rec["output_length"])),
                    keys,
                    KeyChain(b"".join(keys)),
                )
            )
    if profile is not None and profile.kind != "flat":
        for r, t in zip(out, profile.retime([r.arrival_s for r in out])):
            r.arrival_s = float(t)
    return out
