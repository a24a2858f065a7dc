"""What the Conductor's tests share: a hand-built cluster whose answers are known.

Predictors are configured with round numbers (1 ms to prefill a token, 1 ms to move a
block, a decode step of 10 ms + 10 ms per running request), so the expected TTFT and TBT
of each instance can be worked out by hand.
"""

from __future__ import annotations

import hashlib

from conductor.config import ConductorConfig
from conductor.core import Conductor
from conductor.index import KVIndex, PrefixMatch, chain_parents
from conductor.predictors import PredictorConfig, Predictors
from conductor.types import Instance, Load, Rejection, Role, ScheduleRequest, Slo
from kvstore.events import Tier

BT = 16  # tokens per block
BLOCK_BYTES = 1_000_000
# prefill: 1 ms per uncached token, nothing else; transfer: 1 ms per block; decode: 10 ms + 10 ms per request
ROUND = PredictorConfig(
    prefill_tokens_per_s=1000.0,
    prefill_attention_s_per_token2=0.0,
    prefill_overhead_s=0.0,
    decode_base_s=0.01,
    decode_s_per_request=0.01,
    decode_s_per_context_token=0.0,
    transfer_bytes_per_s=1e9,
    transfer_latency_s=0.0,
)


def key(i: int) -> bytes:
    """A block key: 16 uniformly distributed bytes, as mooncake.blocks' chained hashes are."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


KEYS = [key(i) for i in range(64)]
PARENTS = chain_parents(KEYS)  # KEYS is one chain


def request(
    rid: str = "r", blocks: int = 10, prompt: int | None = None, slo_class: str = "default", keys: list[bytes] = KEYS
) -> ScheduleRequest:
    return ScheduleRequest(rid, keys[:blocks], prompt if prompt is not None else blocks * BT, BT, slo_class=slo_class)


def prefill(i: int, queued_s: float = 0.0) -> Instance:
    return Instance(f"p{i}", Role.PREFILL, f"10.0.0.{i}:7000", node=f"kv{i}", load=Load(queued_s=queued_s))


def predictors() -> Predictors:
    return Predictors.from_config(ROUND, BLOCK_BYTES)


def match_of(holdings: dict[str, list[tuple[int, Tier]] | int]) -> PrefixMatch:
    """node -> number of leading DRAM blocks, or an explicit [(key index, tier)] list; matched on KEYS."""
    index = KVIndex()
    for node, held in holdings.items():
        for i, tier in held if isinstance(held, list) else [(i, Tier.DRAM) for i in range(held)]:
            index.stored(node, KEYS[i], tier, PARENTS[i])
    return index.match(KEYS)


def decode(i: int, running: int = 0, capacity: int = 0) -> Instance:
    return Instance(
        f"d{i}", Role.DECODE, f"10.0.1.{i}:7000", node=f"kv{i}", capacity=capacity, load=Load(running_requests=running)
    )


def conductor(
    admission: str,
    policy: str = "kvcache_centric",
    ttft_s: float = 2.0,
    tbt_s: float = 0.1,
    predictors: PredictorConfig = ROUND,
    **kw,
) -> Conductor:
    kw.setdefault(
        "local_prefill", "never"
    )  # the numbers worked by hand are a prefill worker's (test_conductor_local: the decode worker's)
    config = ConductorConfig(
        policy=policy,
        admission=admission,
        slo_classes={"default": Slo(ttft_s=ttft_s, tbt_s=tbt_s)},
        block_bytes=BLOCK_BYTES,
        predictors=predictors,
        **kw,
    )
    return Conductor(config)


def cluster(c: Conductor, prefills: int = 1, decodes: int = 1, now: float = 0.0) -> None:
    for i in range(prefills):
        c.register(prefill(i), now)
    for i in range(decodes):
        c.register(decode(i), now)


def assert_retry_in_bounds(outcome: Rejection) -> None:
    assert 1.0 <= outcome.retry_after_s <= 60.0


def decode_formula(batch: int, context: int) -> float:
    """A decode step's seconds, for predictor samples: 15 ms + 0.4 ms a request + 30 ns a context token."""
    return 0.015 + 4e-4 * batch + 3e-8 * context
