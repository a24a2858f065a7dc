"""Eviction policies: which blocks of a tier go first. Pure: no I/O, no clocks, no locks.

The store tells a policy what entered, what was used and what left, with a logical tick
(a counter the store advances), and asks it for victims among the blocks it may evict
(not leased, not pinned). The three policies are the paper's (Figure 8):

- ``LRU``: least recently used first. The store touches a chain tail-first, so the
  head of a prompt counts as more recent than its tail and a shared prefix outlives the
  suffixes hanging off it.
- ``LFU``: fewest uses first, oldest use breaking ties.
- ``LENGTH`` (length-aware): LFU-like, but among blocks used as often it evicts the one
  that sits later in its prompt first (block position in the key chain), since a
  later block is only reusable by requests that share everything before it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from kvstore.config import EvictionKind


class EvictionPolicy(Protocol):
    def insert(self, key: bytes, position: int, tick: int) -> None:
        """A block entered the tier."""

    def touch(self, key: bytes, tick: int) -> None:
        """A block was used (a hit)."""

    def remove(self, key: bytes) -> None:
        """A block left the tier (evicted, demoted, or found corrupt)."""

    def victims(self, count: int, evictable: Callable[[bytes], bool]) -> list[bytes]:
        """Return up to ``count`` evictable keys, first to go first."""

    def __len__(self) -> int: ...


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes, position: int, tick: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: bytes, tick: int) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victims(self, count: int, evictable: Callable[[bytes], bool]) -> list[bytes]:
        out: list[bytes] = []
        for key in self._order:
            if len(out) >= count:
                break
            if evictable(key):
                out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._order)


class _ScoredPolicy:
    """Shared book-keeping of the frequency-based policies: key -> [uses, position, last tick]."""

    def __init__(self) -> None:
        self._meta: dict[bytes, list[int]] = {}

    def insert(self, key: bytes, position: int, tick: int) -> None:
        old = self._meta.get(key)
        self._meta[key] = [old[0] if old else 1, position, tick]

    def touch(self, key: bytes, tick: int) -> None:
        meta = self._meta.get(key)
        if meta is not None:
            meta[0] += 1
            meta[2] = tick

    def remove(self, key: bytes) -> None:
        self._meta.pop(key, None)

    def _score(self, meta: list[int]) -> tuple:
        raise NotImplementedError

    def victims(self, count: int, evictable: Callable[[bytes], bool]) -> list[bytes]:
        candidates: Iterable[tuple[tuple, bytes]] = (
            (self._score(meta), key) for key, meta in self._meta.items() if evictable(key)
        )
        return [key for _, key in heapq.nsmallest(count, candidates)]

    def __len__(self) -> int:
        return len(self._meta)


class LFUPolicy(_ScoredPolicy):
    def _score(self, meta: list[int]) -> tuple:
        uses, _, last = meta
        return (uses, last)


class LengthAwarePolicy(_ScoredPolicy):
    def _score(self, meta: list[int]) -> tuple:
        uses, position, last = meta
        return (uses, -position, last)


def make_policy(kind: EvictionKind | str) -> EvictionPolicy:
    """Return a fresh policy of the given kind."""
    kind = EvictionKind(kind)
    if kind is EvictionKind.LRU:
        return LRUPolicy()
    if kind is EvictionKind.LFU:
        return LFUPolicy()
    return LengthAwarePolicy()
