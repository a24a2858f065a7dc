"""The global KV index: which pool node holds which block, in which tier.

Built from the kvstore nodes' event streams (a block stored or removed, with its tier and
its parent: the block before it in its key chain), so it is exact. The question it
answers on every request is: for each node, how many leading keys of this key chain does
it hold (in any tier, and in DRAM)? Block keys are chained (DESIGN §4), so a node's match
ends at the first key of the chain that node lacks.

Holdings are kept prefix-closed: a key counts for a node only while the node holds its
whole chain up to it (the key, its parent, the parent's parent ... the chain's first
block). A hole hides everything after it. Then, along any chain, the set of nodes a key
counts for can only shrink, and each node's longest prefix is where its bit drops out:
a search over the chain that probes O(log n) keys per distinct prefix length, not all n.

    chain   k0     k1     k2     k3     ...  k6249
    counts  1011   1011   0011   0011   ...  0000     (bits: nodes 3..0)
            node 3 drops out after k1 -> 2 blocks; where nodes 0 and 1 drop, bisection finds

Representation: every node gets a number b; each key a Python int of flags, bit 2b set
while the key counts for node b and bit 2b + 1 while node b holds it and its whole
prefix in DRAM (a dict key -> flags; a probe is one dict lookup, and a match probes a
few hundred keys at most, so nothing per key needs numpy). Per node, a dict key ->
(tier bits, parent, ssd), where ``ssd`` is how many blocks of the key's prefix (itself
included) that node holds on SSD only, or -1 while the prefix has a hole; it answers
"how many of blocks [start, end) are in DRAM" with two lookups. An event updates the
key and, when its ``ssd`` changes, the keys that hang off it on that node (children
are linked per node), so the work per event is the part of the tree whose answer
changed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.events import Tier

DRAM_BIT, SSD_BIT = 1, 2
_TIER_BITS = {Tier.DRAM: DRAM_BIT, Tier.SSD: SSD_BIT}
ROOT = b""  # the parent of a chain's first block
UNKNOWN = None  # a parent nobody told us: the block never counts (as if a hole came before it)
_BITS, _PARENT, _SSD = 0, 1, 2  # fields of a node's record of a key

Parent = bytes | None


def chain_parents(keys: Sequence[bytes]) -> list[bytes]:
    """The parent of each key of a chain that starts at its first block."""
    return [ROOT, *keys[:-1]] if len(keys) else []


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Leading blocks of one key chain held by each node (nodes holding none are absent)."""

    any_tier: dict[str, int]
    dram: dict[str, int]  # leading blocks in DRAM
    keys: Sequence[bytes] | None = field(default=None, compare=False, repr=False)
    held: dict[str, dict] | None = field(default=None, compare=False, repr=False)  # the index's per-node records
    # node -> where its held prefix ends in the index; the blocks after it, up to ``any_tier[node]``, are being
    # written to its DRAM (``with_coming``)
    coming: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def blocks(self, node: str) -> int:
        return self.any_tier.get(node, 0)

    def dram_blocks(self, node: str) -> int:
        return self.dram.get(node, 0)

    def dram_count(self, node: str, start: int = 0, end: int | None = None) -> int:
        """How many of blocks ``[start, end)`` of ``node``'s prefix it holds in DRAM (the rest are on SSD)."""
        end = self.blocks(node) if end is None else min(end, self.blocks(node))
        boundary = self.coming.get(node)
        if boundary is not None and end > boundary:  # the blocks on their way land in DRAM
            before = self.dram_count(node, start, boundary) if start < boundary else 0
            return end - max(start, boundary) + before
        held = self.held.get(node) if self.held is not None else None
        if held is None or start >= end:
            return 0
        before = held[self.keys[start - 1]][_SSD] if start > 0 else 0
        return (end - start) - (held[self.keys[end - 1]][_SSD] - before)

    def with_coming(self, node: str, blocks: int) -> PrefixMatch:
        """This match with ``node`` holding ``blocks`` leading blocks in DRAM, those past what it holds being written
        there now."""
        if blocks <= self.blocks(node):
            return self
        return PrefixMatch(
            {**self.any_tier, node: blocks},
            {**self.dram, node: blocks} if self.dram_blocks(node) == self.blocks(node) else self.dram,
            self.keys,
            self.held,
            {**self.coming, node: self.blocks(node)},
        )

    def best(self, exclude: str | None = None) -> tuple[str | None, int]:
        """The node holding the longest prefix (ties: the name that sorts first), and its length."""
        candidates = [n for n in self.any_tier if n != exclude]
        if not candidates:
            return None, 0
        node = min(candidates, key=lambda n: (-self.any_tier[n], n))
        return node, self.any_tier[node]


class KVIndex:
    """Exact map of blocks to the nodes (and tiers) that hold them. Not thread-safe: one owner."""

    def __init__(self) -> None:
        self._flags: dict[
            bytes, int
        ] = {}  # key -> bit 2b: counts for node b; bit 2b + 1: and in DRAM down to it (never 0)
        self._refs: dict[bytes, int] = {}  # key -> nodes holding it, whether it counts for them or not
        # tuples, not lists: a tuple of ints and bytes drops out of the garbage collector's sight, so a million
        # records do not make every full collection walk them
        self._held: dict[str, dict[bytes, tuple]] = {}  # node -> key -> (tier bits, parent, ssd)
        self._kids: dict[str, dict[bytes, tuple[bytes, ...]]] = {}  # node -> parent -> the keys it holds under it
        self._bit: dict[str, int] = {}  # node -> its number b
        self._node_of_bit: dict[int, str] = {}
        self._free_bits: list[int] = []

    # -- updates (from the kvstore event streams) --------------------------------------

    def stored(self, node: str, key: bytes, tier: Tier, parent: Parent) -> None:
        """``node`` now holds ``key`` in ``tier``; ``parent`` is the block before it in its chain
        (``ROOT`` for a chain's first block, ``UNKNOWN`` if not known: then it never counts)."""
        self._add(node, [(key, _TIER_BITS[tier], parent)])

    def stored_many(self, node: str, keys: Sequence[bytes], tier: Tier, parents: Sequence[Parent]) -> None:
        """``node`` now holds every key of ``keys`` (each with its parent) in ``tier``: one update for all of them."""
        if len(parents) != len(keys):
            raise ValueError(f"{len(parents)} parents for {len(keys)} keys")
        bit = _TIER_BITS[tier]
        self._add(node, [(k, bit, p) for k, p in zip(keys, parents)])

    def removed(self, node: str, key: bytes, tier: Tier) -> None:
        """``node`` no longer holds ``key`` in ``tier`` (unknown keys are ignored)."""
        held = self._held.get(node)
        record = held.get(key) if held is not None else None
        if record is None:
            return
        bits = record[_BITS] & ~_TIER_BITS[tier]
        record = held[key] = (bits, record[_PARENT], record[_SSD])
        self._refresh(node, [key])
        if not bits:
            del held[key]
            self._unlink(node, key, record[_PARENT])
            self._unref(key)

    def reset_node(self, node: str, blocks: Iterable[tuple[bytes, Tier, Parent]] | None = None) -> None:
        """Forget everything ``node`` held (it died, or a snapshot follows); then record ``blocks``."""
        held = self._held.pop(node, None)
        if held is not None:
            bit = self._bit.pop(node)
            both = ~(3 << (2 * bit))
            flags = self._flags
            for key, record in held.items():
                if record[_SSD] >= 0:
                    left = flags[key] & both
                    if left:
                        flags[key] = left
                    else:
                        del flags[key]
                self._unref(key)
            del self._kids[node]
            del self._node_of_bit[bit]
            self._free_bits.append(bit)
        blocks = [(k, _TIER_BITS[t], p) for k, t, p in blocks or ()]
        if blocks:
            self._add(node, blocks)

    def _node(self, node: str) -> dict[bytes, tuple]:
        held = self._held.get(node)
        if held is None:
            held = self._held[node] = {}
            self._kids[node] = {}
            bit = self._free_bits.pop() if self._free_bits else len(self._bit)
            self._bit[node], self._node_of_bit[bit] = bit, node
        return held

    def _add(self, node: str, blocks: list[tuple[bytes, int, Parent]]) -> None:
        held, kids, refs = self._node(node), self._kids[node], self._refs
        for key, bits, parent in blocks:
            if parent is not UNKNOWN and parent == key:
                raise ValueError("a block cannot be its own parent")
            record = held.get(key)
            if record is None:
                record = (0, parent, -1)
                refs[key] = refs.get(key, 0) + 1
                if parent:
                    kids[parent] = kids.get(parent, ()) + (key,)
            elif parent is not UNKNOWN and record[_PARENT] != parent:  # a parent learned late (or corrected)
                self._unlink(node, key, record[_PARENT])
                record = (record[_BITS], parent, record[_SSD])
                if parent:
                    kids[parent] = kids.get(parent, ()) + (key,)
            held[key] = (record[_BITS] | bits, record[_PARENT], record[_SSD])
        self._refresh(node, [k for k, _, _ in blocks])

    def _unlink(self, node: str, key: bytes, parent: Parent) -> None:
        if not parent:
            return
        kids = self._kids[node]
        siblings = tuple(k for k in kids.get(parent, ()) if k != key)
        if siblings:
            kids[parent] = siblings
        else:
            kids.pop(parent, None)

    def _unref(self, key: bytes) -> None:
        n = self._refs[key] - 1
        if n:
            self._refs[key] = n
        else:
            del self._refs[key]

    def _refresh(self, node: str, keys: list[bytes]) -> None:
        """Recompute whether each of ``keys`` counts for ``node`` (and its ssd count), and so on down the keys
        that hang off any that changed, setting their flags as it goes."""
        held, kids, flags = self._held[node], self._kids[node], self._flags
        bit = self._bit[node]
        any_flag, dram_flag, both = 1 << (2 * bit), 1 << (2 * bit + 1), ~(3 << (2 * bit))
        stack = list(reversed(keys))
        while stack:  # a cycle of parent links (a client's bug) ends too: it has no ROOT, so nothing in it counts
            key = stack.pop()
            record = held.get(key)
            if record is None:
                continue
            ssd = -1
            if record[_BITS]:
                parent = record[_PARENT]
                if parent == ROOT:
                    base = 0
                elif parent is UNKNOWN:
                    base = -1
                else:
                    above = held.get(parent)
                    base = above[_SSD] if above is not None else -1
                if base >= 0:
                    ssd = base + (0 if record[_BITS] & DRAM_BIT else 1)
            if ssd == record[_SSD]:
                continue
            held[key] = (record[_BITS], record[_PARENT], ssd)
            f = flags.get(key, 0) & both
            if ssd >= 0:
                f |= any_flag if ssd else any_flag | dram_flag
            if f:
                flags[key] = f
            else:
                flags.pop(key, None)
            stack.extend(kids.get(key, ()))

    # -- queries ------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Distinct keys held anywhere."""
        return len(self._refs)

    def node_blocks(self, node: str) -> int:
        return len(self._held.get(node, ()))

    def node_dram_blocks(self, node: str) -> int:
        """Of ``node_blocks``, those held in DRAM (an admin figure: one pass over the node's blocks)."""
        return sum(1 for r in self._held.get(node, {}).values() if r[_BITS] & DRAM_BIT)

    @property
    def nodes(self) -> list[str]:
        return list(self._held)

    def chains(self, node: str) -> list[list[bytes]]:
        """The key chains ``node`` holds whole (``chains_of``)."""
        return chains_of(*self.node_tree(node))

    def node_tree(self, node: str) -> tuple[dict[bytes, tuple], dict[bytes, tuple]]:
        """A copy of ``node``'s records and children links, for ``chains_of`` to walk without the index's owner's
        lock (a copy is a few ms for 100,000 blocks; the walk is longer)."""
        return dict(self._held.get(node, {})), dict(self._kids.get(node, {}))

    def holders(self, key: bytes) -> dict[str, Tier]:
        """Who holds ``key`` (whether or not its prefix is whole), with the fastest tier each has it in."""
        out = {}
        for node, held in self._held.items():
            record = held.get(key)
            if record is not None:
                out[node] = Tier.DRAM if record[_BITS] & DRAM_BIT else Tier.SSD
        return out

    def match(self, keys: Sequence[bytes]) -> PrefixMatch:
        """For every node, the number of leading ``keys`` it holds (any tier; and in DRAM).

        Cost: bisection over the chain. Holdings are prefix-closed, so along the chain a
        key's flags only lose bits: an interval whose two ends carry the same flags holds
        no change, and every other interval is halved until the change is pinned between
        two neighbours. That is about log2(n) dict lookups per distinct prefix length
        (a 6,250-key chain held to 9 different depths: about 100), not n. Each probe's
        flags are ANDed with those before it, so a made-up chain (keys from different
        chains) never gets more than its real leading run. Called once per Schedule.
        """
        n = len(keys)
        if not n:
            return PrefixMatch({}, {})
        blob = getattr(keys, "blob", None)  # a KeyChain (as Schedule gets them): slice it; else a list of keys
        get = self._flags.get
        first = get(blob[:16] if blob is not None else keys[0], 0)
        if not first:
            return PrefixMatch({}, {})
        last = get(blob[-16:] if blob is not None else keys[n - 1], 0) & first
        drops: list[tuple[int, int]] = [(n, last)]  # (prefix length, the flags that end there)
        stack = [(0, first, n - 1, last)]
        while stack:
            i, at_i, j, at_j = stack.pop()
            if at_i == at_j:
                continue
            if j == i + 1:
                drops.append((i + 1, at_i & ~at_j))
                continue
            mid = (i + j) >> 1
            at_mid = get(blob[16 * mid : 16 * mid + 16] if blob is not None else keys[mid], 0) & at_i
            stack.append((mid, at_mid, j, at_j & at_mid))
            stack.append((i, at_i, mid, at_mid))
        any_tier: dict[str, int] = {}
        dram: dict[str, int] = {}
        node_of_bit = self._node_of_bit
        for length, dropped in drops:
            while dropped:
                low = dropped & -dropped
                e = low.bit_length() - 1
                (dram if e & 1 else any_tier)[node_of_bit[e >> 1]] = length
                dropped ^= low
        return PrefixMatch(any_tier, dram, keys, self._held)


def chains_of(held: dict[bytes, tuple], kids: dict[bytes, tuple]) -> list[list[bytes]]:
    """The key chains a node holds whole (its records and children links: ``KVIndex.node_tree``), each from its first
    block to a block nothing on the node continues (a tree of shared prefixes gives one chain per leaf; blocks behind a
    hole are left out): what another node must copy to serve every prefix this one serves. Chains with more blocks in
    DRAM first."""

    def whole(key: bytes) -> bool:
        record = held.get(key)
        return record is not None and record[_SSD] >= 0

    out = []
    for key, record in held.items():
        if record[_SSD] < 0 or any(whole(k) for k in kids.get(key, ())):
            continue
        chain = [key]
        while held[chain[-1]][_PARENT] != ROOT:
            chain.append(held[chain[-1]][_PARENT])
        chain.reverse()
        out.append((record[_SSD] - len(chain), chain))  # -(blocks in DRAM)
    out.sort(key=lambda c: c[0])
    return [chain for _, chain in out]


@dataclass(frozen=True, slots=True)
class _Written:
    node: str
    blocks: int
    last: bytes  # the last of those blocks' keys
    until: float


class PromptWrites:
    """Where each prompt placed lately has its prefill write its new blocks, so that a request of the same prompt that
    ``follows`` it (a sibling choice, sent once the first has its first token) is planned with them there.

    The node stores a prefill's new blocks after its answer and its event reaches the index a moment later: a sibling
    placed in between was planned without them, often on another worker, and computed the whole prompt again
    (tests/test_serving_cluster.py saw 400 tokens computed for a 100-token prompt of 4 choices, 112 being due). The
    prefill worker waits for the blocks its plan counts that are being written (``KVStore.get``'s ``wait_s``). Only a
    request that names the one it follows gets this: others go by what the nodes report. Not thread-safe: the
    Conductor's owner thread calls it."""

    MAX_KEPT = 65536

    def __init__(self) -> None:
        self._by_id: OrderedDict[str, _Written] = OrderedDict()

    def placed(self, request_id: str, node: str, keys: Sequence[bytes], until: float) -> None:
        """``request_id``'s prefill stores ``keys`` (its prompt's full blocks) on ``node``, by ``until``."""
        self._by_id.pop(request_id, None)
        if node and len(keys):
            self._by_id[request_id] = _Written(node, len(keys), bytes(keys[len(keys) - 1]), until)
        while len(self._by_id) > self.MAX_KEPT:
            self._by_id.popitem(last=False)

    def follow(self, leader: str, keys: Sequence[bytes], match: PrefixMatch, now: float) -> PrefixMatch:
        """``match`` (of ``keys``) with the blocks ``leader``'s prefill is writing, when ``keys`` begin with them."""
        while self._by_id:  # mostly in time order: the oldest go first
            first = next(iter(self._by_id.values()))
            if first.until > now:
                break
            self._by_id.popitem(last=False)
        w = self._by_id.get(leader)
        if w is None or w.until <= now or w.blocks > len(keys) or bytes(keys[w.blocks - 1]) != w.last:
            return match
        return match.with_coming(w.node, w.blocks)
