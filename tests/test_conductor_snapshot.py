"""A kvstore node's snapshot (KVIndex.reset_node / stored_many) gives the same index as its events one by one."""

from __future__ import annotations

import os
import random

from conductor.index import ROOT, KVIndex
from kvstore.events import Tier


def test_snapshot_equals_events_one_by_one():
    rng = random.Random(7)
    keys = [os.urandom(16) for _ in range(3000)]
    parent = {k: ROOT if i % 300 == 0 else keys[i - 1] for i, k in enumerate(keys)}  # 10 chains of 300 blocks
    one_by_one, bulk = KVIndex(), KVIndex()  # both must grow their matrices
    for n in range(70):  # more nodes than one 64-bit word
        start = rng.randrange(0, 3000, 300)  # a run from a chain's start, with holes, plus strays
        run = [k for k in keys[start : start + rng.randint(0, 300)] if rng.random() > 0.02]
        blocks = [
            (k, rng.choice([Tier.DRAM, Tier.SSD]), parent[k]) for k in run + rng.sample(keys, rng.randint(0, 100))
        ]
        for key, tier, p in blocks:
            one_by_one.stored(f"n{n}", key, tier, p)
        rng.shuffle(blocks)  # a snapshot lists blocks in any order: children before their parents too
        bulk.reset_node(f"n{n}", blocks)
    bulk.reset_node("n3", [(k, Tier.DRAM, parent[k]) for k in keys[:50]])  # a resync replaces what n3 had
    one_by_one.reset_node("n3")
    for key in keys[:50]:
        one_by_one.stored("n3", key, Tier.DRAM, parent[key])
    assert bulk.num_blocks == one_by_one.num_blocks
    lengths = []
    for start in range(0, 3000, 300):
        chain = keys[start : start + 300]
        assert bulk.match(chain) == one_by_one.match(chain)
        for node, length in bulk.match(chain).any_tier.items():
            assert bulk.match(chain).dram_count(node) == one_by_one.match(chain).dram_count(node)
        lengths += bulk.match(chain).any_tier.values()
    assert max(lengths) > 20  # the chains really are held in long runs
    assert all(bulk.holders(k) == one_by_one.holders(k) for k in keys[::37])
