"""Golden vectors for block keys (DESIGN §4): the spec every package hashes against.

The hex strings below are the contract. tests/golden_block_keys.json holds the same
vectors for other packages (pool, index, transfer) to check themselves against; this
file checks that the JSON, the hard-coded values and mooncake.blocks all agree, and
recomputes a key from first principles with xxhash alone.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import xxhash

from mooncake.blocks import KEY_BYTES, KeyChain, block_keys, blocks_for, chain_key, model_fingerprint, root_key

GOLDEN_FILE = Path(__file__).with_name("golden_block_keys.json")
FINGERPRINT = model_fingerprint("mooncake-golden")
TOKENS = list(range(40))
BLOCK_SIZE = 16

FINGERPRINT_HEX = "d75a087465c90efe974fb932ffddbbfb"
ROOT_HEX = "dae50f5b2a7b3637cf48b96441f32049"
KEYS_HEX = ["eb403e67ac54afd33b580037b27b7d86", "d52c59c9f45974b6db3063cfd1b722ba"]
SALTED_ROOT_HEX = "f5faf26b8bda7688c07c83523a325556"
SALTED_KEYS_HEX = ["8cc68a7950a08a93d0dc8fd109c2ee62", "6efd0f3c3e32543634bcc473ac223c6b"]
LARGE_IDS = [100000 + 7 * i for i in range(32)]
LARGE_KEYS_HEX = ["d54a09edf52c6baf5d33624d381e9f14", "0babf759bd591d0eb77ff447563b8a4e"]


def hexes(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


def test_golden_keys():
    assert FINGERPRINT.hex() == FINGERPRINT_HEX
    assert root_key(FINGERPRINT).hex() == ROOT_HEX
    assert root_key(FINGERPRINT, "tenant-a").hex() == SALTED_ROOT_HEX
    assert hexes(block_keys(TOKENS, BLOCK_SIZE, FINGERPRINT)) == KEYS_HEX
    assert hexes(block_keys(TOKENS, BLOCK_SIZE, FINGERPRINT, cache_salt="tenant-a")) == SALTED_KEYS_HEX
    # Ids above 2**16 pin the int32 width of the token encoding.
    assert hexes(block_keys(LARGE_IDS, BLOCK_SIZE, FINGERPRINT)) == LARGE_KEYS_HEX
    assert all(len(k) == KEY_BYTES == 16 for k in block_keys(TOKENS, BLOCK_SIZE, FINGERPRINT))


def test_golden_file_matches_the_spec():
    doc = json.loads(GOLDEN_FILE.read_text())
    assert doc["fingerprint"] == FINGERPRINT_HEX
    assert model_fingerprint(doc["fingerprint_identity"]).hex() == doc["fingerprint"]
    assert doc["block_size"] == BLOCK_SIZE
    expected = {
        "range40": (TOKENS, None, ROOT_HEX, KEYS_HEX),
        "range40-salted": (TOKENS, "tenant-a", SALTED_ROOT_HEX, SALTED_KEYS_HEX),
        "large-ids": (LARGE_IDS, None, ROOT_HEX, LARGE_KEYS_HEX),
    }
    assert {c["name"] for c in doc["cases"]} == set(expected)
    fp = bytes.fromhex(doc["fingerprint"])
    for case in doc["cases"]:
        tokens, salt, root, keys = expected[case["name"]]
        assert (case["token_ids"], case["cache_salt"], case["root"], case["keys"]) == (tokens, salt, root, keys)
        assert hexes(block_keys(case["token_ids"], doc["block_size"], fp, case["cache_salt"])) == keys


def test_first_principles_recomputation():
    """root = xxh3_128(fingerprint + salt); key = xxh3_128(parent + int32 LE tokens); big-endian digest."""
    fp = hashlib.blake2b(b"mooncake-golden", digest_size=16).digest()
    assert fp.hex() == FINGERPRINT_HEX
    for salt, root_hex, keys_hex in [(b"", ROOT_HEX, KEYS_HEX), (b"tenant-a", SALTED_ROOT_HEX, SALTED_KEYS_HEX)]:
        root = xxhash.xxh3_128(fp + salt).intdigest().to_bytes(16, "big")
        assert root.hex() == root_hex
        parent = root
        for i, key_hex in enumerate(keys_hex):
            block = TOKENS[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            key = xxhash.xxh3_128(parent + struct.pack(f"<{BLOCK_SIZE}i", *block)).intdigest().to_bytes(16, "big")
            assert key.hex() == key_hex
            parent = key


def test_partial_block_has_no_key():
    assert block_keys(TOKENS[:15], BLOCK_SIZE, FINGERPRINT) == []
    assert hexes(block_keys(TOKENS[:16], BLOCK_SIZE, FINGERPRINT)) == KEYS_HEX[:1]
    assert hexes(block_keys(TOKENS[:31], BLOCK_SIZE, FINGERPRINT)) == KEYS_HEX[:1]
    assert hexes(block_keys(TOKENS[:32], BLOCK_SIZE, FINGERPRINT)) == KEYS_HEX
    assert block_keys([], BLOCK_SIZE, FINGERPRINT) == []


def test_blocks_for_counts_a_partial_last_block_as_a_whole_one():
    assert [blocks_for(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert blocks_for(37, 8) == 5 == len(block_keys(list(range(37)), 8, b"f" * 16)) + 1


def test_salt_changes_every_key():
    plain = block_keys(TOKENS, BLOCK_SIZE, FINGERPRINT)
    for salt in ("tenant-a", "tenant-b", " "):
        salted = block_keys(TOKENS, BLOCK_SIZE, FINGERPRINT, cache_salt=salt)
        assert len(salted) == len(plain) and all(a != b for a, b in zip(plain, salted))
    # An empty salt is no salt.
    assert block_keys(TOKENS, BLOCK_SIZE, FINGERPRINT, cache_salt="") == plain
    # Another model never shares a key either.
    other = block_keys(TOKENS, BLOCK_SIZE, model_fingerprint("another-model"))
    assert all(a != b for a, b in zip(plain, other))


def test_chain_property():
    tokens = list(range(64))
    base = block_keys(tokens, BLOCK_SIZE, FINGERPRINT)
    changed = list(tokens)
    changed[BLOCK_SIZE + 3] += 1  # a token in block 1
    keys = block_keys(changed, BLOCK_SIZE, FINGERPRINT)
    assert keys[0] == base[0]
    assert all(a != b for a, b in zip(keys[1:], base[1:]))
    # Same block contents after a different prefix: a different key.
    assert block_keys(tokens[16:32], BLOCK_SIZE, FINGERPRINT)[0] != base[1]
    # Continuing from a parent equals hashing the whole sequence.
    assert block_keys(tokens[32:], BLOCK_SIZE, FINGERPRINT, parent=base[1]) == base[2:]
    assert chain_key(base[0], tokens[16:32]) == base[1]


def test_key_chain_extend_agrees_with_block_keys():
    tokens = list(range(100, 171))
    expected = block_keys(tokens, BLOCK_SIZE, FINGERPRINT, cache_salt="tenant-a")
    chain = KeyChain.start(BLOCK_SIZE, FINGERPRINT, cache_salt="tenant-a")
    seen: list[bytes] = []
    # Grow one token at a time, as a decoding request does, and in uneven jumps.
    for end in [1, 15, 16, 17, 31, 33, 34, 60, 64, 71]:
        new = chain.extend(tokens[:end])
        seen.extend(new)
        assert chain.keys == expected[: end // BLOCK_SIZE]
        assert chain.num_hashed_tokens == (end // BLOCK_SIZE) * BLOCK_SIZE
    assert seen == expected
    assert chain.extend(tokens) == []  # nothing new


@pytest.mark.parametrize("bad", [0, -16])
def test_non_positive_block_size_is_refused(bad):
    with pytest.raises(ValueError, match="block_size"):
        block_keys(TOKENS, bad, FINGERPRINT)
    with pytest.raises(ValueError, match="block_size"):
        KeyChain.start(bad, FINGERPRINT)


def test_fingerprint_must_be_16_bytes():
    with pytest.raises(ValueError, match="16 bytes"):
        block_keys(TOKENS, BLOCK_SIZE, b"short")
