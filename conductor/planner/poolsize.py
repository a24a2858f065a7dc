"""Pool sizing from the working set: how much more DRAM would raise the cache hit rate by how much.

Pure: the recent prompts' block keys in, a hit-rate curve and a recommendation out. Called by the
planner once a plan, on its thread (a few hundred milliseconds for 100,000 block reads).

    reuse distance   for each block a prompt reads, how many *other* blocks were read since that
                     block's last read (Mattson's LRU stack distance; infinite the first time):
                     an LRU cache of C blocks holds it then iff the distance is below C. One pass
                     with a Fenwick tree over read times, O(reads x log reads).
    hit curve        H(C) = the share of reads with distance < C, at the pool's capacity now and
                     with more nodes of the same size (the pool's own eviction is LRU-like: a
                     prefix outlives its suffixes; this is the estimate, not its exact figure)
    recommendation   nodes come with prefill workers here (``mooncake up`` pairs kv{i} with
                     prefill-{i}; the chart runs them in one pod), so a node is worth adding when the
                     prefill seconds its extra hits save (the uncached tokens they turn into reused
                     ones, at the prefill predictor's rate) are at least ``min_gain`` of an
                     instance's time; the planner then plans at least that many prefill instances.

Only the window the planner keeps is seen (``Planner.reads``: the last ``READS_KEPT`` block reads), so
a reuse farther back than that counts as a first read: the curve is a lower bound for a large pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

READS_KEPT = 200_000  # block reads the planner keeps for this (16 bytes each: 3.2 MB)


def reuse_distances(reads: list[bytes]) -> np.ndarray:
    """Each read's LRU stack distance: the distinct other keys read since its key's last read (-1: never before)."""
    n = len(reads)
    tree = [0] * (n + 1)  # Fenwick tree: 1 at the time of each key's latest read (a list: numpy's scalars are slower)
    last: dict[bytes, int] = {}
    out = [-1] * n
    live = 0
    for t, key in enumerate(reads):
        prev = last.get(key)
        if prev is not None:
            # distinct keys read after prev = latest-read markers in (prev, t) = live - markers in [0, prev]
            i, upto = prev + 1, 0
            while i > 0:
                upto += tree[i]
                i -= i & -i
            out[t] = live - upto
            i = prev + 1
            while i <= n:
                tree[i] -= 1
                i += i & -i
            live -= 1
        i = t + 1
        while i <= n:
            tree[i] += 1
            i += i & -i
        live += 1
        last[key] = t
    return np.array(out, dtype=np.int64)


def hit_ratio(distances: np.ndarray, capacity_blocks: float) -> float:
    """The share of reads an LRU cache of ``capacity_blocks`` would have served."""
    if not len(distances):
        return 0.0
    return float(np.count_nonzero((distances >= 0) & (distances < capacity_blocks))) / len(distances)


@dataclass(frozen=True, slots=True)
class PoolAdvice:
    """What more pool nodes would do, and how many to run."""

    nodes: int  # the pool's nodes now
    node_blocks: float  # a node's blocks (the mean of the registered nodes' capacity)
    hit_now: float  # the hit rate the curve gives at the pool's capacity now
    curve: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (nodes, hit rate) for more nodes
    recommended: int = 0  # the nodes worth running (at least ``nodes``)
    saved_s_per_s: float = 0.0  # prefill seconds a second the recommended nodes save over the nodes now
    reads: int = 0  # the block reads the curve is from

    def describe(self) -> str:
        if not self.curve:
            return "pool: no block reads seen yet"
        points = ", ".join(f"{n} nodes {h:.1%}" for n, h in self.curve)
        advice = (
            f"{self.recommended} nodes recommended (they save {self.saved_s_per_s:.2f} prefill-seconds a second)"
            if self.recommended > self.nodes
            else "more nodes would not pay for themselves"
        )
        return (
            f"pool: {self.nodes} nodes of {self.node_blocks:.0f} blocks hit {self.hit_now:.1%} of reads (LRU estimate"
            f" from {self.reads} reads); with {points}; {advice}"
        )


def advise_pool(
    reads: list[bytes],
    nodes: int,
    node_blocks: float,
    reads_per_s: float,
    prefill_s_per_block: float,
    min_gain: float = 0.5,
    most: int = 8,
) -> PoolAdvice:
    """The hit curve for ``nodes`` .. ``nodes + most`` nodes of ``node_blocks`` each, and the most nodes whose last one
    still saves ``min_gain`` of an instance's time: a block read a second turned from a miss into a hit saves
    ``prefill_s_per_block`` seconds of prefill (the predictor's cost of a block of uncached tokens)."""
    if not reads or nodes < 1 or node_blocks <= 0:
        return PoolAdvice(nodes, node_blocks, 0.0, reads=len(reads), recommended=nodes)
    d = reuse_distances(reads)
    curve = tuple((n, hit_ratio(d, n * node_blocks)) for n in range(nodes, nodes + most + 1))
    hit_now = curve[0][1]
    recommended, saved = nodes, 0.0
    for (n, h), (_, h_before) in zip(curve[1:], curve[:-1]):
        gain_s = (h - h_before) * reads_per_s * prefill_s_per_block  # prefill seconds a second this node saves
        if gain_s < min_gain or math.isnan(gain_s):
            break
        recommended, saved = n, (h - hit_now) * reads_per_s * prefill_s_per_block
    return PoolAdvice(nodes, node_blocks, hit_now, curve, recommended, saved, reads=len(reads))
