"""Segment metadata: who exposes which memory, and how to reach it.

``SegmentRegistry`` is the interface; :class:`MemoryRegistry` keeps segments in this
process (the embedded default, and what tests use for single-process set-ups), and
:class:`RedisRegistry` shares them across processes and hosts through Redis (one hash,
``<prefix>segments``, field = segment name, value = JSON). Lookups are per transfer
batch at most, and engines cache what they resolved, so Redis is off the data path.
"""

from __future__ import annotations

import json
import threading
from typing import Protocol

from transfer.types import Segment


class SegmentRegistry(Protocol):
    """Where segments are published and found."""

    def register(self, segment: Segment) -> None:
        """Publish ``segment`` (replacing a previous one with the same name)."""

    def unregister(self, name: str) -> None:
        """Remove a segment; unknown names are ignored."""

    def get(self, name: str) -> Segment | None:
        """Return the segment called ``name``, or None."""

    def list(self, node: str | None = None) -> list[Segment]:
        """Return every segment, or those owned by ``node``."""


class MemoryRegistry:
    """An in-process registry (thread-safe)."""

    def __init__(self) -> None:
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()

    def register(self, segment: Segment) -> None:
        with self._lock:
            self._segments[segment.name] = segment

    def unregister(self, name: str) -> None:
        with self._lock:
            self._segments.pop(name, None)

    def get(self, name: str) -> Segment | None:
        with self._lock:
            return self._segments.get(name)

    def list(self, node: str | None = None) -> list[Segment]:
        with self._lock:
            return [s for s in self._segments.values() if node is None or s.node == node]


class RedisRegistry:
    """A registry in Redis, shared by every process that uses the same URL and prefix."""

    def __init__(self, url: str, prefix: str = "mooncake:") -> None:
        import redis  # imported here so the in-memory path never needs it

        self._redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._key = f"{prefix}segments"

    def register(self, segment: Segment) -> None:
        self._redis.hset(self._key, segment.name, json.dumps(segment.to_dict()))

    def unregister(self, name: str) -> None:
        self._redis.hdel(self._key, name)

    def get(self, name: str) -> Segment | None:
        raw = self._redis.hget(self._key, name)
        return None if raw is None else Segment.from_dict(json.loads(raw))

    def list(self, node: str | None = None) -> list[Segment]:
        segments = [Segment.from_dict(json.loads(v)) for v in self._redis.hvals(self._key)]
        return [s for s in segments if node is None or s.node == node]

    def close(self) -> None:
        self._redis.close()


def make_registry(redis_url: str | None, prefix: str = "mooncake:") -> SegmentRegistry:
    """Return a Redis registry when ``redis_url`` is given, else an in-memory one."""
    return RedisRegistry(redis_url, prefix) if redis_url else MemoryRegistry()
