"""The Conductor's global KV index (conductor/index.py): exact prefix lengths per node.

Hand-built holder sets with known answers, and a seeded random event stream checked
against a brute-force model (node -> key -> set of tiers) after every few events.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from conductor.index import ROOT, UNKNOWN, KVIndex, chain_parents
from kvstore.events import Tier


def key(i: int) -> bytes:
    """A block key: 16 uniformly distributed bytes, as mooncake.blocks' chained hashes are."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


K = [key(i) for i in range(12)]
PARENT = dict(zip(K, chain_parents(K)))  # K is one chain: K[0] its first block


def put(index: KVIndex, node: str, k: bytes, tier: Tier = Tier.DRAM) -> None:
    """``node`` stored ``k`` of the chain K (its parent as a pool node reports it)."""
    index.stored(node, k, tier, PARENT[k])


def put_chain(index: KVIndex, node: str, chain: list[bytes], tier: Tier = Tier.DRAM) -> None:
    index.stored_many(node, chain, tier, chain_parents(chain))


class Model:
    """Brute force: node -> key -> tiers; prefixes by walking the chain."""

    def __init__(self) -> None:
        self.held: dict[str, dict[bytes, set[Tier]]] = {}

    def stored(self, node: str, k: bytes, tier: Tier) -> None:
        self.held.setdefault(node, {}).setdefault(k, set()).add(tier)

    def removed(self, node: str, k: bytes, tier: Tier) -> None:
        tiers = self.held.get(node, {}).get(k)
        if tiers is None:
            return
        tiers.discard(tier)
        if not tiers:
            del self.held[node][k]

    def reset(self, node: str) -> None:
        self.held.pop(node, None)

    def prefix(self, node: str, chain: list[bytes], dram: bool) -> int:
        n = 0
        for k in chain:
            tiers = self.held.get(node, {}).get(k, set())
            if not tiers or (dram and Tier.DRAM not in tiers):
                break
            n += 1
        return n

    def expected_match(self, chain: list[bytes], dram: bool) -> dict[str, int]:
        out = {node: self.prefix(node, chain, dram) for node in self.held}
        return {node: n for node, n in out.items() if n}

    def dram_count(self, node: str, chain: list[bytes], start: int, end: int) -> int:
        return sum(1 for k in chain[start:end] if Tier.DRAM in self.held.get(node, {}).get(k, set()))

    def best(self, chain: list[bytes], exclude: str | None) -> tuple[str | None, int]:
        lengths = {n: p for n, p in self.expected_match(chain, dram=False).items() if n != exclude}
        if not lengths:
            return None, 0
        node = min(lengths, key=lambda n: (-lengths[n], n))
        return node, lengths[node]

    def num_blocks(self) -> int:
        return len({k for held in self.held.values() for k in held})

    def holders(self, k: bytes) -> dict[str, Tier]:
        out = {}
        for node, held in self.held.items():
            tiers = held.get(k)
            if tiers:
                out[node] = Tier.DRAM if Tier.DRAM in tiers else Tier.SSD
        return out


def assert_agrees(index: KVIndex, model: Model, chains: list[list[bytes]], keys: list[bytes]) -> None:
    for chain in chains:
        m = index.match(chain)
        assert m.any_tier == model.expected_match(chain, dram=False)
        assert m.dram == model.expected_match(chain, dram=True)
        for node, length in m.any_tier.items():  # DRAM blocks anywhere in the prefix, and in its back half
            assert m.dram_count(node, 0, length) == model.dram_count(node, chain, 0, length)
            assert m.dram_count(node, length // 2, length) == model.dram_count(node, chain, length // 2, length)
        top = model.best(chain, None)
        assert m.best() == top
        assert m.best(exclude=top[0]) == model.best(chain, top[0])
    assert index.num_blocks == model.num_blocks()
    for k in keys:
        assert index.holders(k) == model.holders(k)


# -- hand-built holders -------------------------------------------------------------------


def test_match_gives_each_nodes_leading_prefix_in_any_tier_and_in_dram():
    index = KVIndex()
    for k in K[:5]:
        put(index, "a", k)  # a: 5 leading blocks, all DRAM
    for k in K[:3]:
        put(index, "b", k)  # b: 3 leading blocks
    put(index, "c", K[0])
    put(index, "c", K[1], Tier.SSD)  # c: 4 leading blocks, only the first in DRAM
    put(index, "c", K[2], Tier.SSD)
    put(index, "c", K[3])
    put(index, "d", K[1])  # d: holds later keys but not the first
    put(index, "d", K[2])
    put(index, "e", K[0])  # e: a gap at K[1], so K[2..3] do not count
    put(index, "e", K[2])
    put(index, "e", K[3])
    put(index, "f", K[9])  # f: holds nothing of the chain's start

    m = index.match(K[:6])
    assert m.any_tier == {"a": 5, "b": 3, "c": 4, "e": 1}
    assert m.dram == {"a": 5, "b": 3, "c": 1, "e": 1}
    assert m.blocks("d") == 0 and m.dram_blocks("f") == 0
    assert m.best() == ("a", 5)
    assert m.best(exclude="a") == ("c", 4)
    # c's prefix of 4: blocks 0 and 3 in DRAM, 1 and 2 on SSD
    assert m.dram_count("c", 0, 4) == 2 and m.dram_count("c", 1, 3) == 0 and m.dram_count("c", 2, 4) == 1

    # a chain that starts with a key nobody holds matches nothing
    assert index.match([key(99), *K[:3]]).any_tier == {}
    assert index.match([]).best() == (None, 0)
    # a shorter chain caps everyone at its length; ties go to the name that sorts first
    m2 = index.match(K[:3])
    assert m2.any_tier == {"a": 3, "b": 3, "c": 3, "e": 1}
    assert m2.best() == ("a", 3)


def test_match_stops_at_the_first_key_nobody_holds_even_if_later_keys_are_held():
    index = KVIndex()
    for k in (K[0], K[1], K[3], K[4]):
        put(index, "a", k)
    assert index.match(K[:5]).any_tier == {"a": 2}
    put(index, "a", K[2])  # the hole filled: everything after it counts again
    assert index.match(K[:5]).any_tier == {"a": 5}
    index.removed("a", K[1], Tier.DRAM)  # a hole near the start hides the rest
    m = index.match(K[:5])
    assert m.any_tier == {"a": 1} and m.dram == {"a": 1}
    assert index.node_blocks("a") == 4  # still held, only not counted


def test_a_block_demoted_mid_prefix_moves_the_dram_counts_of_every_block_after_it():
    index = KVIndex()
    put_chain(index, "a", K[:8])
    put(index, "a", K[2], Tier.SSD)
    index.removed("a", K[2], Tier.DRAM)  # demoted to SSD
    m = index.match(K[:8])
    assert m.any_tier == {"a": 8} and m.dram == {"a": 2}
    assert m.dram_count("a", 0, 8) == 7 and m.dram_count("a", 3, 8) == 5 and m.dram_count("a", 2, 3) == 0
    put(index, "a", K[2])  # promoted back
    m = index.match(K[:8])
    assert m.dram == {"a": 8} and m.dram_count("a", 0, 8) == 8


def test_a_block_whose_parent_is_unknown_never_counts_until_the_parent_is_learned():
    index = KVIndex()
    put(index, "a", K[0])
    index.stored("a", K[1], Tier.DRAM, UNKNOWN)  # e.g. a block from an old pool node's SSD
    put(index, "a", K[2])
    assert index.match(K[:3]).any_tier == {"a": 1}
    put(index, "a", K[1])  # stored again by a caller that gave its parent
    assert index.match(K[:3]).any_tier == {"a": 3}


def test_branches_of_one_prefix_match_independently():
    index = KVIndex()
    trunk = K[:4]
    left = [key(100 + i) for i in range(3)]
    right = [key(200 + i) for i in range(5)]
    put_chain(index, "a", trunk)
    index.stored_many("a", left, Tier.DRAM, [trunk[-1], *left[:-1]])
    index.stored_many("b", trunk + right, Tier.SSD, chain_parents(trunk + right))
    assert index.match(trunk + left).any_tier == {"a": 7, "b": 4}
    assert index.match(trunk + right).any_tier == {"a": 4, "b": 9}
    index.removed("a", trunk[1], Tier.DRAM)  # the shared trunk's hole hides a's branch
    assert index.match(trunk + left).any_tier == {"a": 1, "b": 4}


def test_a_long_chain_is_matched_with_a_few_probes_not_one_per_key():
    index = KVIndex()
    chain = [key(1000 + i) for i in range(6250)]  # a 100k-token prompt in 16-token blocks
    for j, length in enumerate((6250, 4000, 4000, 17, 0)):
        put_chain(index, f"n{j}", chain[:length], Tier.DRAM if j % 2 else Tier.SSD)

    class Counting(dict):
        probes = 0

        def get(self, k, default=None):
            Counting.probes += 1
            return super().get(k, default)

    index._flags = Counting(index._flags)
    m = index.match(chain)
    assert m.any_tier == {"n0": 6250, "n1": 4000, "n2": 4000, "n3": 17}
    assert m.dram == {"n1": 4000, "n3": 17}
    assert Counting.probes < 60, Counting.probes  # 3 distinct lengths, about log2(6250) = 13 probes each


def test_more_than_64_nodes_each_with_its_own_prefix():
    index = KVIndex()
    chain = [key(i) for i in range(140)]
    nodes = [f"n{j:03d}" for j in range(130)]  # bits 0..129: three uint64 words
    for j, node in enumerate(nodes):
        put_chain(index, node, chain[: j + 1], Tier.DRAM if j % 2 else Tier.SSD)
    m = index.match(chain)
    assert m.any_tier == {node: j + 1 for j, node in enumerate(nodes)}
    assert m.dram == {node: j + 1 for j, node in enumerate(nodes) if j % 2}
    assert m.best() == ("n129", 130)
    # a node past the first word dies; its neighbours keep their prefixes
    index.reset_node("n100")
    m = index.match(chain)
    assert "n100" not in m.any_tier and m.any_tier["n099"] == 100 and m.any_tier["n101"] == 102


def test_removed_unknown_key_or_node_is_a_no_op():
    index = KVIndex()
    put(index, "a", K[0])
    put(index, "a", K[1])
    index.removed("nobody", K[0], Tier.DRAM)
    index.removed("a", key(77), Tier.DRAM)
    index.removed("a", K[0], Tier.SSD)  # held in DRAM only: removing from SSD changes nothing
    m = index.match(K[:2])
    assert m.any_tier == {"a": 2} and m.dram == {"a": 2}
    assert index.num_blocks == 2 and index.node_blocks("a") == 2
    assert "nobody" not in index.nodes


def test_key_in_dram_and_ssd_removed_from_dram_still_counts_for_any_tier_only():
    index = KVIndex()
    for k in K[:3]:
        put(index, "a", k)
    put(index, "a", K[1], Tier.SSD)
    index.removed("a", K[1], Tier.DRAM)  # demoted: still on SSD
    m = index.match(K[:3])
    assert m.any_tier == {"a": 3}
    assert m.dram == {"a": 1}
    assert index.holders(K[1]) == {"a": Tier.SSD}
    index.removed("a", K[1], Tier.SSD)  # now gone entirely
    assert index.match(K[:3]).any_tier == {"a": 1}
    assert index.holders(K[1]) == {}
    assert index.num_blocks == 2


def test_chains_are_what_another_node_must_copy_to_serve_every_prefix_a_node_serves():
    """One chain per leaf of a node's tree of prefixes, from the chain's first block; blocks behind a hole and other
    nodes' blocks are left out; chains with more blocks in DRAM come first (the hand-off copies those first)."""
    index = KVIndex()
    branch = [key(100), key(101)]  # continues K[:3] another way
    put_chain(index, "a", K[:6], Tier.SSD)
    index.stored_many("a", branch, Tier.DRAM, chain_parents(K[:3] + branch)[3:])
    put_chain(index, "a", [key(200), key(201), key(202)])  # a second tree, all in DRAM
    index.stored("a", key(301), Tier.DRAM, key(300))  # its parent is not held: behind a hole
    index.stored("a", key(400), Tier.DRAM, UNKNOWN)
    put_chain(index, "b", [key(500), key(501)])  # another node's
    chains = index.chains("a")
    assert sorted(chains) == sorted([K[:6], K[:3] + branch, [key(200), key(201), key(202)]])
    assert chains[0] == [key(200), key(201), key(202)]  # 3 in DRAM, then 2 of 5 (the branch), then 0 of 6
    assert chains[1] == K[:3] + branch
    assert index.chains("nobody") == []
    index.removed("a", K[1], Tier.SSD)  # a hole at K[1]: only what hangs off the root before it stays whole
    assert sorted(index.chains("a")) == sorted([[K[0]], [key(200), key(201), key(202)]])


def test_holders_report_the_fastest_tier():
    index = KVIndex()
    put(index, "a", K[0], Tier.SSD)
    put(index, "a", K[0])
    put(index, "b", K[0], Tier.SSD)
    assert index.holders(K[0]) == {"a": Tier.DRAM, "b": Tier.SSD}


def test_reset_node_forgets_its_blocks_and_a_new_node_reusing_its_bit_inherits_none():
    index = KVIndex()
    for k in K[:4]:
        put(index, "a", k)
        put(index, "b", k)
    index.reset_node("a")
    assert index.match(K[:4]).any_tier == {"b": 4}
    assert "a" not in index.nodes
    put(index, "c", K[5], Tier.SSD)  # takes a's freed bit
    m = index.match(K[:4])
    assert m.any_tier == {"b": 4} and m.dram == {"b": 4}
    assert index.holders(K[0]) == {"b": Tier.DRAM}
    assert index.node_blocks("c") == 1
    # a snapshot: reset, then record exactly what the node now holds
    index.reset_node("b", [(K[0], Tier.DRAM, ROOT), (K[1], Tier.SSD, K[0])])
    m = index.match(K[:4])
    assert m.any_tier == {"b": 2} and m.dram == {"b": 1}
    index.reset_node("b")
    index.reset_node("c")
    assert index.num_blocks == 0 and index.match(K).any_tier == {}


def test_rows_are_recycled_without_leaking_old_holders():
    index = KVIndex()  # forces the matrices to grow, and rows to be reused
    first, second = [key(i) for i in range(10)], [key(i) for i in range(100, 110)]
    put_chain(index, "a", first)
    for k in first:
        index.removed("a", k, Tier.DRAM)
    assert index.num_blocks == 0
    put_chain(index, "b", second)
    assert index.match(second).any_tier == {"b": 10}
    assert index.match(first).any_tier == {}


def test_keys_that_share_a_half_are_still_told_apart():
    # keys that are not uniform hashes (the same low or high 8 bytes) collide in any hash table
    same_low = [i.to_bytes(8, "big") + bytes(8) for i in range(1, 40)]
    same_high = [bytes(8) + i.to_bytes(8, "big") for i in range(1, 40)]
    index = KVIndex()
    put_chain(index, "a", same_low[:30])
    put_chain(index, "a", same_high[:20])
    assert index.match(same_low).any_tier == {"a": 30}
    assert index.match(same_high).any_tier == {"a": 20}
    for k in same_low[10:]:  # deleting some leaves the others findable
        index.removed("a", k, Tier.DRAM)
    assert index.match(same_low).any_tier == {"a": 10}
    assert index.match(same_high).any_tier == {"a": 20}
    assert index.num_blocks == 30


# -- randomized consistency against the brute-force model ---------------------------------


def _random_run(
    seed: int, num_nodes: int, num_keys: int, steps: int, reset_every: int, check_every: int = 5
) -> tuple[int, int]:
    """Run the events, checking as it goes; return the longest prefix and the most nodes seen."""
    rng = random.Random(seed)
    index, model = KVIndex(), Model()
    nodes = [f"node{j}" for j in range(num_nodes)]
    keys = [key(i) for i in range(num_keys)]  # the trunk: one long chain
    parent = dict(zip(keys, chain_parents(keys)))
    chains = [keys[:8], keys[:30], keys]
    for b, (fork, length) in enumerate(
        ((3, 12), (10, 5), (0, 9))
    ):  # branches off the trunk (a fork at 0: a chain of its own)
        branch = [key(10_000 * (b + 1) + i) for i in range(length)]
        parent.update(zip(branch, [keys[fork - 1] if fork else ROOT, *branch[:-1]]))
        chains.append(keys[:fork] + branch)
    pool = list(parent)
    longest = most_nodes = 0
    for step in range(steps):
        node = rng.choice(nodes)
        # early keys are hot (as a shared system prompt is), so prefixes grow long
        k = keys[min(num_keys - 1, int(rng.expovariate(1 / 12)))] if rng.random() < 0.8 else rng.choice(pool)
        tier = rng.choice([Tier.DRAM, Tier.SSD])
        if reset_every and step % reset_every == reset_every - 1:
            # the node died, or restarted and sent a snapshot (the same key may be in both tiers)
            picks = [rng.choice(keys[:30] + pool[num_keys:]) for _ in range(rng.choice([0, 5, 20]))]
            snapshot = [(k2, rng.choice([Tier.DRAM, Tier.SSD]), parent[k2]) for k2 in picks]
            index.reset_node(node, snapshot)
            model.reset(node)
            for k2, t2, _ in snapshot:
                model.stored(node, k2, t2)
        elif rng.random() < 0.75:
            index.stored(node, k, tier, parent[k])
            model.stored(node, k, tier)
        else:
            index.removed(node, k, tier)
            model.removed(node, k, tier)
        if step % check_every == 0:
            assert_agrees(index, model, chains, keys[:10] + rng.sample(keys, 5))
            longest = max(longest, *index.match(keys).any_tier.values(), 0)
            most_nodes = max(most_nodes, len(index.nodes))
    assert_agrees(index, model, chains, keys)
    for node in nodes:
        assert index.node_blocks(node) == len(model.held.get(node, {}))
    return longest, most_nodes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_events_over_20_nodes_agree_with_brute_force(seed):
    longest, _ = _random_run(seed, num_nodes=20, num_keys=300, steps=1500, reset_every=0)
    assert longest >= 8  # the run built long prefixes, not only empty matches


def test_random_events_with_node_resets_agree_with_brute_force():
    longest, _ = _random_run(7, num_nodes=20, num_keys=300, steps=1500, reset_every=53)
    assert longest >= 8


def test_random_events_over_more_than_64_nodes_agree_with_brute_force():
    longest, most_nodes = _random_run(11, num_nodes=150, num_keys=200, steps=4000, reset_every=97, check_every=40)
    assert most_nodes > 128  # bits in a third uint64 word, some of them reused after resets
    assert longest >= 5
