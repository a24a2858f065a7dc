"""Block keys: the one naming scheme for KV blocks across the engine, pool, index and wire.

DESIGN §4. A block is ``block_size`` consecutive tokens; only full blocks get a key.

    root   = H(model_fingerprint || cache_salt_utf8)
    key_0  = H(root    || tokens_0 as little-endian int32)
    key_i  = H(key_i-1 || tokens_i as little-endian int32)

``H`` is xxh3_128 and a key is its 16-byte big-endian digest. Because each key hashes
its parent, a key names a block *and its whole prefix*: two prompts share key ``i`` only
if they share every token up to the end of block ``i``. Matching a prompt against any
holder (the engine's prefix cache, a pool node, the Conductor's index) therefore walks
the chain and stops at the first key the holder lacks.

The model fingerprint is 16 bytes (see :func:`model_fingerprint`), so the concatenation
with the salt is unambiguous.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

KEY_BYTES = 16
FINGERPRINT_BYTES = 16

BlockKey = bytes


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Return how many blocks of ``block_size`` tokens hold ``num_tokens`` (a partial last block counts).

    The one ceiling division of the code: KV slots to allocate, a block table's width, how
    many blocks to load or push. Pure; ``num_tokens`` of 0 needs 0 blocks.
    """
    return -(-num_tokens // block_size)


def model_fingerprint(identity: str | bytes) -> bytes:
    """Return the 16-byte fingerprint of a model from a stable identity string.

    The identity must change whenever the KV a model produces could change (weights,
    architecture, dtype). Callers build it from the model directory's config and weight
    file digests; tests pass any string. Called once per process.
    """
    data = identity.encode("utf-8") if isinstance(identity, str) else bytes(identity)
    return hashlib.blake2b(data, digest_size=FINGERPRINT_BYTES).digest()


def root_key(fingerprint: bytes, cache_salt: str | None = None) -> BlockKey:
    """Return the chain root for a model fingerprint and an optional tenant salt."""
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"model fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    salt = (cache_salt or "").encode("utf-8")
    return xxhash.xxh3_128_digest(fingerprint + salt)


def chain_key(parent: BlockKey, block_tokens: Sequence[int]) -> BlockKey:
    """Return the key of one full block whose prefix is named by ``parent``."""
    data = np.asarray(block_tokens, dtype="<i4").tobytes()
    return xxhash.xxh3_128_digest(parent + data)


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: bytes,
    cache_salt: str | None = None,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Return the keys of every full block of ``token_ids`` (a trailing partial block has none).

    ``parent`` continues an existing chain (its last key) instead of starting at the root;
    ``token_ids`` must then start on a block boundary. Pure; cost is one xxh3 call per block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = parent if parent is not None else root_key(fingerprint, cache_salt)
    tokens = np.asarray(token_ids, dtype="<i4")
    if tokens.ndim != 1:
        raise ValueError("token_ids must be a flat sequence of ints")
    keys: list[BlockKey] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = xxhash.xxh3_128_digest(prev + tokens[start : start + block_size].tobytes())
        keys.append(prev)
    return keys


@dataclass(slots=True)
class KeyChain:
    """Incrementally extended key chain for one sequence (the engine's running requests).

    ``extend`` is called whenever tokens are appended; it hashes each block once, the
    moment it becomes full.
    """

    block_size: int
    root: BlockKey
    keys: list[BlockKey]
    num_hashed_tokens: int = 0

    @classmethod
    def start(cls, block_size: int, fingerprint: bytes, cache_salt: str | None = None) -> "KeyChain":
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        return cls(block_size=block_size, root=root_key(fingerprint, cache_salt), keys=[])

    def extend(self, all_token_ids: Sequence[int]) -> list[BlockKey]:
        """Hash the newly completed full blocks of ``all_token_ids``; return the new keys."""
        new: list[BlockKey] = []
        bs = self.block_size
        while self.num_hashed_tokens + bs <= len(all_token_ids):
            parent = self.keys[-1] if self.keys else self.root
            start = self.num_hashed_tokens
            key = chain_key(parent, all_token_ids[start : start + bs])
            self.keys.append(key)
            new.append(key)
            self.num_hashed_tokens += bs
        return new
