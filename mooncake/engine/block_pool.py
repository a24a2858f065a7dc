"""The paged KV cache's bookkeeping: ref-counted blocks, prefix cache, eviction order.

Pure (no torch): it hands out block ids; the model runner owns the tensors they index.

Every block is in exactly one of three states:

    in use     ref_cnt > 0, held by one or more requests' block tables
    cached     ref_cnt == 0, has a key, sits in the free queue, reusable by key
    empty      ref_cnt == 0, no key, sits in the free queue

The free queue is kept in eviction order, oldest first:

    front -> [ empty blocks ... | cached blocks, least recently freed first ... ] <- back

Allocation pops from the front (an empty block if any, else evicts the least recently
freed cached block, dropping its key). A request frees its blocks tail first, so a
sequence's last blocks are evicted before its shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from mooncake.blocks import BlockKey


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    key: BlockKey | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    queried_blocks: int = 0
    hit_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


class BlockPool:
    """Owns all KV blocks of one engine. Called by the scheduler on every step."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockKey, KVBlock] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (empty or evictable cached)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, keys: Sequence[BlockKey]) -> list[KVBlock]:
        """Longest run of leading keys held in the cache (no references taken, no stats)."""
        hits: list[KVBlock] = []
        if not self.enable_prefix_caching:
            return hits
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count one admitted request's prefix lookup (a retried admission is not a new query)."""
        self.stats.queried_blocks += num_queried
        self.stats.hit_blocks += num_hit

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on each block (reviving cached blocks out of the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the front of the free queue; raise RuntimeError if short.

        Callers check ``num_free_blocks`` first; running short here is a broken invariant.
        """
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.key is not None:
                if self._cached.get(block.key) is block:
                    del self._cached[block.key]
                block.key = None
                self.stats.evicted_blocks += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, freeing the tail of ``block_ids`` first."""
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {bid} freed more times than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[bid] = block
                if block.key is None:
                    self._free.move_to_end(bid, last=False)  # nothing worth keeping: reuse first

    def cache(self, block_id: int, key: BlockKey) -> None:
        """Record that ``block_id`` holds the fully computed block named ``key``.

        If another block already holds that key, this one stays unnamed (a duplicate).
        """
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.key is not None:
            if block.key != key:
                raise RuntimeError(f"block {block_id} already named by another key")
            return
        if key in self._cached:
            return
        block.key = key
        self._cached[key] = block

    def reset_prefix_cache(self) -> int:
        """Forget every cached key not in use; return how many were dropped."""
        dropped = 0
        for block in list(self._cached.values()):
            if block.ref_cnt == 0:
                del self._cached[block.key]
                block.key = None
                self._free.move_to_end(block.block_id, last=False)
                dropped += 1
        return dropped
