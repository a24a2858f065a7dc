"""The global KV index: which pool node holds which block, in which tier.

Built from the kvstore nodes' event streams (a block stored or removed, with its tier),
so it is exact. The question it answers on every request is: for each node, how many
leading keys of this key chain does it hold (in any tier, and in DRAM)? Block keys are
chained (DESIGN §4), so a match walks the chain from the start and stops for a node at
the first key that node lacks.

Representation: every node gets a bit; each key gets a row in two bit-matrices (nodes
holding it in any tier, nodes holding it in DRAM), 64 nodes per uint64 word. A match is a
running AND down the rows of the chain's keys: a node's prefix ends where its bit drops
out. Everything per key happens in numpy (conductor.keytable maps keys to rows).

    key k1 -> 0b1011   (nodes 0, 1, 3)
    key k2 -> 0b0011
    key k3 -> 0b0001   running AND: 1011, 0011, 0001 -> node 3: 1 block, node 1: 2, node 0: 3
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from conductor.keytable import KeyTable

from kvstore.events import Tier

DRAM_BIT, SSD_BIT = 1, 2
_TIER_BITS = {Tier.DRAM: DRAM_BIT, Tier.SSD: SSD_BIT}


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Leading blocks of one key chain held by each node (nodes holding none are absent)."""

    any_tier: dict[str, int]
    dram: dict[str, int]  # leading blocks in DRAM
    dram_masks: np.ndarray | None = field(default=None, compare=False, repr=False)  # [matched keys, words]: DRAM holders
    bits: dict[str, int] | None = field(default=None, compare=False, repr=False)  # node -> its bit in the masks

    def blocks(self, node: str) -> int:
        return self.any_tier.get(node, 0)

    def dram_blocks(self, node: str) -> int:
        return self.dram.get(node, 0)

    def dram_count(self, node: str, start: int = 0, end: int | None = None) -> int:
        """How many of blocks ``[start, end)`` of the chain ``node`` holds in DRAM (the rest of its prefix is on SSD)."""
        if self.dram_masks is None or self.bits is None or node not in self.bits:
            return 0
        bit = self.bits[node]
        column = self.dram_masks[start:end, bit // 64]
        return int(np.count_nonzero(column & np.uint64(1 << (bit % 64))))

    def best(self, exclude: str | None = None) -> tuple[str | None, int]:
        """The node holding the longest prefix (ties: the name that sorts first), and its length."""
        candidates = [n for n in self.any_tier if n != exclude]
        if not candidates:
            return None, 0
        node = min(candidates, key=lambda n: (-self.any_tier[n], n))
        return node, self.any_tier[node]


class KVIndex:
    """Exact map of blocks to the nodes (and tiers) that hold them. Not thread-safe: one owner."""

    def __init__(self, initial_rows: int = 1024) -> None:
        self._rows = KeyTable(initial_rows)  # key -> its row in the matrices
        self._free_rows: list[int] = []
        self._next_row = 0
        self._words = 1
        # [row, 2 * words]: the first ``words`` columns are the nodes holding the key in any
        # tier, the next ``words`` those holding it in DRAM (one gather per key on a match)
        self._bits = np.zeros((initial_rows, 2), dtype=np.uint64)
        self._held: dict[str, dict[bytes, int]] = {}  # node -> key -> tier bits
        self._bit: dict[str, int] = {}  # node -> its bit number
        self._node_of_bit: dict[int, str] = {}
        self._free_bits: list[int] = []

    # -- updates (from the kvstore event streams) --------------------------------------

    def stored(self, node: str, key: bytes, tier: Tier) -> None:
        """``node`` now holds ``key`` in ``tier``."""
        held = self._held.get(node)
        if held is None:
            held = self._held[node] = {}
            bit = self._free_bits.pop() if self._free_bits else len(self._bit)
            self._bit[node], self._node_of_bit[bit] = bit, node
            if bit >= 64 * self._words:
                self._widen()
        bits = held.get(key, 0) | _TIER_BITS[tier]
        held[key] = bits
        self._set(node, key, bits)

    def stored_many(self, node: str, keys: list[bytes], tier: Tier) -> None:
        """``node`` now holds every key of ``keys`` in ``tier`` (a snapshot: one numpy update, not one per key)."""
        if not keys:
            return
        keys = list(dict.fromkeys(keys))  # the table takes each key once
        held = self._held.get(node)
        if held is None:
            self.stored(node, keys[0], tier)
            held = self._held[node]
        tier_bit = _TIER_BITS[tier]
        for key in keys:
            held[key] = held.get(key, 0) | tier_bit
        rows = self._rows.lookup_many(keys)
        new = np.flatnonzero(rows < 0)
        if len(new):
            fresh = self._new_rows(len(new))
            rows[new] = fresh
            self._rows.put_many([keys[i] for i in new.tolist()], fresh)
        bit = self._bit[node]
        word, flag = bit // 64, np.uint64(1 << (bit % 64))
        self._bits[rows, word] |= flag
        if tier is Tier.DRAM:
            self._bits[rows, self._words + word] |= flag

    def removed(self, node: str, key: bytes, tier: Tier) -> None:
        """``node`` no longer holds ``key`` in ``tier`` (unknown keys are ignored)."""
        held = self._held.get(node)
        if held is None or key not in held:
            return
        bits = held[key] & ~_TIER_BITS[tier]
        if bits:
            held[key] = bits
        else:
            del held[key]
        self._set(node, key, bits)

    def reset_node(self, node: str, blocks: list[tuple[bytes, Tier]] | None = None) -> None:
        """Forget everything ``node`` held (it died, or a snapshot follows); then record ``blocks``."""
        held = self._held.pop(node, None)
        if held is not None:
            for key in held:
                self._set(node, key, 0)
            bit = self._bit.pop(node)
            del self._node_of_bit[bit]
            self._free_bits.append(bit)
        by_tier: dict[Tier, list[bytes]] = {}
        for key, tier in blocks or ():
            by_tier.setdefault(tier, []).append(key)
        for tier, keys in by_tier.items():
            self.stored_many(node, keys, tier)

    def _set(self, node: str, key: bytes, bits: int) -> None:
        bit = self._bit[node]
        word, flag = bit // 64, np.uint64(1 << (bit % 64))
        row = self._rows.get(key)
        if row < 0:
            if not bits:
                return
            row = int(self._new_rows(1)[0])
            self._rows.put(key, row)
        for column, has in ((word, bits != 0), (self._words + word, bool(bits & DRAM_BIT))):
            if has:
                self._bits[row, column] |= flag
            else:
                self._bits[row, column] &= ~flag
        if not self._bits[row, : self._words].any():  # nobody holds it any more: recycle the row
            self._rows.delete(key)
            self._free_rows.append(row)

    def _new_rows(self, n: int) -> np.ndarray:
        """``n`` unused rows (recycled first), growing the matrices as needed."""
        reused = [self._free_rows.pop() for _ in range(min(n, len(self._free_rows)))]
        start, self._next_row = self._next_row, self._next_row + (n - len(reused))
        while self._next_row > len(self._bits):
            self._bits = np.concatenate([self._bits, np.zeros_like(self._bits)])
        return np.array(reused + list(range(start, self._next_row)), dtype=np.int64)

    def _widen(self) -> None:
        w, pad = self._words, np.zeros((len(self._bits), 1), dtype=np.uint64)
        self._bits = np.hstack([self._bits[:, :w], pad, self._bits[:, w:], pad])
        self._words += 1

    # -- queries ------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Distinct keys held anywhere."""
        return len(self._rows)

    def node_blocks(self, node: str) -> int:
        return len(self._held.get(node, ()))

    def node_dram_blocks(self, node: str) -> int:
        """Of ``node_blocks``, those held in DRAM (an admin figure: one pass over the node's blocks)."""
        return sum(1 for bits in self._held.get(node, {}).values() if bits & DRAM_BIT)

    @property
    def nodes(self) -> list[str]:
        return list(self._held)

    def holders(self, key: bytes) -> dict[str, Tier]:
        """Who holds ``key``, with the fastest tier each has it in."""
        out = {}
        for node, held in self._held.items():
            bits = held.get(key, 0)
            if bits:
                out[node] = Tier.DRAM if bits & DRAM_BIT else Tier.SSD
        return out

    def match(self, keys: list[bytes]) -> PrefixMatch:
        """For every node, the number of leading ``keys`` it holds (any tier; and in DRAM).

        Cost: one vectorised hash-table probe of the whole chain (conductor.keytable), cut
        at the first key nobody holds, then a running AND over those rows. Called once per
        Schedule.
        """
        if not keys:
            return PrefixMatch({}, {})
        rows = self._rows.lookup_many(keys)
        absent = np.flatnonzero(rows < 0)
        if len(absent):
            rows = rows[: absent[0]]
        if not len(rows):
            return PrefixMatch({}, {})
        masks = np.take(self._bits, rows, axis=0)  # np.take: several times faster than fancy indexing here
        dram = masks[:, self._words :]
        return PrefixMatch(self._prefixes(masks[:, : self._words]), self._prefixes(dram), dram, self._bit)

    def _prefixes(self, masks: np.ndarray) -> dict[str, int]:
        """[keys, words] masks in chain order -> {node: leading keys whose masks include it}."""
        acc = np.bitwise_and.accumulate(masks, axis=0)
        changes = (np.flatnonzero((acc[1:] != acc[:-1]).any(axis=1)) + 1).tolist()
        steps = acc[[0, *changes]].tolist()  # the running AND where it changes, as Python ints
        out: dict[str, int] = {}
        node_of_bit = self._node_of_bit
        for end, before, after in zip([*changes, len(masks)], steps, [*steps[1:], [0] * self._words]):
            for w in range(self._words):
                dropped = before[w] & ~after[w]  # nodes whose prefix ends at ``end``
                while dropped:
                    low = dropped & -dropped
                    out[node_of_bit[64 * w + low.bit_length() - 1]] = end
                    dropped ^= low
        return out
