"""The cluster simulator's world: cost models, the trace, and each pool node's KV cache.

Nothing here makes a decision: the Conductor decides (benchmarks/sim/cluster.py drives it), and
this module says what a decision costs. Every constant is stated with its source in
``ModelConfig``; benchmarks/README.md lists them with the results.

Cost models (a LLaMA3-70B-shaped model served by nodes of 8 x A800-80GB, as in the paper):

    prefill   T(n new tokens, c cached) = a + b * n + k * n * (c + n / 2)
              b = 2 * params / (gpus * peak_flops * mfu)           linear layers, 2 FLOPs per weight
              k = 4 * hidden * layers / (gpus * peak_flops * mfu)  attention: QK^T and PV, 2 * hidden
                                                                   FLOPs each per (query, key) pair
                                                                   and layer; a causal chunk of n
                                                                   after c cached has n * (c + n/2)
    decode    T_step(batch B, context tokens C) = base + per_request * B + per_token * C
              base      = weight_bytes / (gpus * hbm_bytes_per_s * hbm_efficiency)
              per_token = kv_bytes_per_token / (gpus * hbm_bytes_per_s * hbm_efficiency)
    transfer  T(bytes) = latency + bytes / net_bytes_per_s       RDMA between nodes
    ssd       T(bytes) = bytes / ssd_bytes_per_s                 a block read from a node's SSD

The Conductor's predictors fit exactly these shapes (conductor/predictors.py), so with
``noise = 0`` they become exact after a few samples; ``noise`` multiplies every prefill
and decode step time by a log-normal factor (a fixed seed), so predictions keep an error.

Node cache (``NodeCache``): a DRAM tier of ``dram_blocks`` blocks (None: unbounded) and an
optional SSD tier, with the kvstore's own eviction policies (kvstore.eviction.make_policy)
driven as kvstore/store.py drives them: a put inserts the new blocks head first, a read
touches the blocks it uses tail first (so a prefix outlives its suffixes under LRU);
when DRAM use passes the high watermark it is brought back to the low one (StoreConfig's
0.95 / 0.85), evicted DRAM blocks are demoted to the SSD when there is one, and an
SSD block that is read is promoted back to DRAM. Every change is reported to a listener
(the Conductor) as a stored or removed event, so the Conductor's index is exact.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.trace import TRACE_BLOCK_TOKENS, open_trace
from conductor.types import KeyChain
from kvstore.events import Tier
from kvstore.eviction import make_policy

HIGH_WATERMARK, LOW_WATERMARK = 0.95, 0.85  # kvstore.config.StoreConfig defaults


@dataclass(frozen=True)
class ModelConfig:
    """The simulated hardware and model. Sources: the paper (FAST'25 §8: LLaMA3-70B-shaped model,
    8 x A800 per node, RDMA), the model's public shape, and NVIDIA's A800 data sheet.
    Fields marked *free* are our assumptions; the rest follow from the model and the hardware."""

    params: float = 70.6e9  # LLaMA3-70B parameters
    layers: int = 80
    hidden: int = 8192  # 64 query heads x 128
    kv_bytes_per_token: int = 2 * 80 * 8 * 128 * 2  # K and V, 80 layers, 8 KV heads (GQA), head 128, fp16 = 320 KiB
    weight_bytes: float = 2 * 70.6e9  # fp16
    gpus: int = 8  # per node (instance)
    gpu_peak_flops: float = 312e12  # A800 dense fp16/bf16 tensor cores
    gpu_hbm_bytes_per_s: float = 2.039e12  # A800 80GB HBM2e
    gpu_memory_bytes: float = 80e9
    mfu: float = 0.4  # *free*: fraction of peak FLOPs a long prefill reaches (linear and attention alike)
    prefill_overhead_s: float = 0.02  # *free*: per prefill: scheduling, launches, pipeline fill
    hbm_efficiency: float = 0.7  # *free*: fraction of HBM bandwidth a decode step reaches
    decode_per_request_s: float = 1e-4  # *free*: per running request per step (sampling, bookkeeping)
    kv_memory_fraction: float = 0.9  # *free*: of the HBM left after the weights, the share for KV
    net_bytes_per_s: float = 100e9  # 8 x 200 Gbps RDMA NICs per node = 200 GB/s line rate; we take half
    net_latency_s: float = 1e-4
    ssd_bytes_per_s: float = 5e9  # *free*: a node's NVMe read bandwidth (a few drives)
    decode_push_fraction: float = 1 / 80  # of the prompt's KV, the share still in flight to decode when prefill
    # ends: prefill streams each layer's KV as soon as it is computed (DESIGN §3), so the last layer's remains
    block_tokens: int = TRACE_BLOCK_TOKENS
    noise: float = 0.0  # *free*: log-normal sigma on prefill and decode step times (0: exact)

    # -- derived constants ----------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_tokens  # 160 MiB for a 512-token block

    @property
    def _flops(self) -> float:
        return self.gpus * self.gpu_peak_flops * self.mfu

    @property
    def prefill_s_per_token(self) -> float:
        return 2 * self.params / self._flops

    @property
    def prefill_s_per_token_pair(self) -> float:
        return 4 * self.hidden * self.layers / self._flops

    @property
    def _hbm(self) -> float:
        return self.gpus * self.gpu_hbm_bytes_per_s * self.hbm_efficiency

    @property
    def decode_base_s(self) -> float:
        return self.weight_bytes / self._hbm

    @property
    def decode_s_per_context_token(self) -> float:
        return self.kv_bytes_per_token / self._hbm

    @property
    def decode_kv_tokens(self) -> int:
        """Tokens of KV one decode instance holds (its HBM less the weights, times the KV share)."""
        free = self.gpus * self.gpu_memory_bytes - self.weight_bytes
        return int(free * self.kv_memory_fraction / self.kv_bytes_per_token)

    # -- costs --------------------------------------------------------------------------------

    def prefill_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        new = prompt_tokens - cached_tokens
        attention = self.prefill_s_per_token_pair * new * (cached_tokens + new / 2)
        return self.prefill_overhead_s + self.prefill_s_per_token * new + attention

    def pipelined_prefill_s(self, prompt_tokens: int, cached_tokens: int, stages: int, chunk: int) -> float:
        """Chunked pipeline parallelism (§5.1) over ``stages`` nodes, each holding 1/stages of the layers: the new
        tokens cut into chunks of ``chunk``; chunk j costs a stage prefill_s(chunk j after what precedes it) / stages,
        plus one hop of its hidden states (fp16) to the next stage; stage i runs chunk j once stage i - 1 finished it
        and stage i finished chunk j - 1. With one stage: ``prefill_s``."""
        if stages == 1:
            return self.prefill_s(prompt_tokens, cached_tokens)
        done = [0.0] * stages  # when each stage finished its previous chunk
        for a in range(cached_tokens, prompt_tokens, chunk):
            n = min(chunk, prompt_tokens - a)
            work = (self.prefill_s_per_token * n + self.prefill_s_per_token_pair * n * (a + n / 2)) / stages
            hop = self.transfer_s(n * self.hidden * 2)
            ready = 0.0
            for i in range(stages):
                done[i] = max(done[i], ready) + work
                ready = done[i] + hop
        return self.prefill_overhead_s + done[-1]

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.decode_base_s + self.decode_per_request_s * batch + self.decode_s_per_context_token * context_tokens

    def transfer_s(self, num_bytes: float) -> float:
        return 0.0 if num_bytes <= 0 else self.net_latency_s + num_bytes / self.net_bytes_per_s

    def ssd_s(self, blocks: int) -> float:
        return blocks * self.block_bytes / self.ssd_bytes_per_s

    def describe(self) -> dict[str, float]:
        """The derived constants, for the report."""
        return {
            "block_bytes": self.block_bytes,
            "prefill_s_per_token": self.prefill_s_per_token,
            "prefill_s_per_token_pair": self.prefill_s_per_token_pair,
            "prefill_overhead_s": self.prefill_overhead_s,
            "decode_base_s": self.decode_base_s,
            "decode_s_per_request": self.decode_per_request_s,
            "decode_s_per_context_token": self.decode_s_per_context_token,
            "decode_kv_tokens": self.decode_kv_tokens,
            "net_bytes_per_s": self.net_bytes_per_s,
            "ssd_bytes_per_s": self.ssd_bytes_per_s,
        }


DECODE_PROFILES: dict[str, dict[str, float]] = {
    # the roofline one above: at 2x on this trace the decode pool runs a fifth of what its TBT SLO allows
    "roofline": {},
    # *free*, for a decode-bound cluster: 30% of HBM bandwidth and 1 ms of per-request work a step (a step
    # of 10 requests at 12k tokens of context is then about 50 ms instead of 17 ms)
    "slow": {"hbm_efficiency": 0.3, "decode_per_request_s": 1e-3},
}


def model_config(decode_profile: str = "roofline", **overrides) -> ModelConfig:
    """``ModelConfig`` with one of ``DECODE_PROFILES`` applied (and any other field overridden)."""
    if decode_profile not in DECODE_PROFILES:
        raise ValueError(f"unknown decode profile {decode_profile!r}; choose from {', '.join(DECODE_PROFILES)}")
    return ModelConfig(**{**DECODE_PROFILES[decode_profile], **overrides})


class Jitter:
    """Multiplicative log-normal noise with mean 1 (sigma 0: always 1)."""

    def __init__(self, sigma: float, seed: int | tuple[int, ...]) -> None:  # a tuple: a stream of its own beside seed's
        self.sigma = sigma
        self._rng = np.random.default_rng(seed)

    def __call__(self) -> float:
        if self.sigma <= 0:
            return 1.0
        return float(self._rng.lognormal(-self.sigma * self.sigma / 2, self.sigma))

    def many(self, n: int) -> np.ndarray | float:
        if self.sigma <= 0:
            return 1.0
        return self._rng.lognormal(-self.sigma * self.sigma / 2, self.sigma, n)


# -- the trace --------------------------------------------------------------------------------


@dataclass(slots=True)
class TraceRequest:
    """One request of the trace, with its arrival already scaled by the replay speed."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    keys: list[bytes]  # the 16-byte keys of its full 512-token blocks, in chain order
    chain: KeyChain  # the same keys as one byte string (what the Conductor is sent)


def block_key(hash_id: int) -> bytes:
    """The 16-byte block key of a trace hash id (an id already names its whole prefix, so no chaining)."""
    return hashlib.blake2b(hash_id.to_bytes(8, "little"), digest_size=16).digest()


def load_trace(path: Path, speed: float = 1.0, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake trace (JSON lines); arrival = timestamp / speed. Only full blocks get keys."""
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    keys_of: dict[int, bytes] = {}
    out: list[TraceRequest] = []
    with open_trace(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            prompt = int(rec["input_length"])
            ids = rec["hash_ids"][: min(prompt // TRACE_BLOCK_TOKENS, len(rec["hash_ids"]))]
            keys = []
            for h in ids:
                k = keys_of.get(h)
                if k is None:
                    k = keys_of[h] = block_key(h)
                keys.append(k)
            out.append(
                TraceRequest(
                    len(out),
                    rec["timestamp"] / 1000.0 / speed,
                    prompt,
                    max(1, int(rec["output_length"])),
                    keys,
                    KeyChain(b"".join(keys)),
                )
            )
    return out


# -- a pool node's KV cache --------------------------------------------------------------------

Event = tuple[
    bool, bytes, Tier, bytes | None
]  # (stored: True, removed: False), key, tier, parent (b"": a chain's first)
Sink = Callable[[str, list[Event]], None]  # (node, the events of one operation, in order)


class NodeCache:
    """One kvstore node's blocks: DRAM (``dram_blocks``; None: unbounded) and an optional SSD tier.

    ``sink`` hears every block entering or leaving a tier, one call per operation (a
    read or a put) with its events in order. Blocks in ``leased`` (the running
    prefill's) are never evicted. Not a byte store: only which keys are where.
    """

    def __init__(self, node: str, dram_blocks: int | None, ssd_blocks: int, eviction: str, sink: Sink) -> None:
        if dram_blocks is not None and dram_blocks <= 0:
            raise ValueError(f"dram_blocks must be positive (or None: unbounded), got {dram_blocks}")
        self.node = node
        self.dram_blocks, self.ssd_blocks = dram_blocks, ssd_blocks
        self.dram: set[bytes] = set()
        self.ssd: set[bytes] = set()
        self._dram_policy = make_policy(eviction)
        self._ssd_policy = make_policy(eviction)
        self._chain: dict[
            bytes, tuple[int, bytes]
        ] = {}  # key -> (its position, the block before it), as a pool node records them
        self._tick = 0
        self.leased: set[bytes] = set()
        self._sink = sink
        self._events: list[Event] = []
        self.evictions = 0

    def holds(self, key: bytes) -> bool:
        return key in self.dram or key in self.ssd

    def leading(self, keys: list[bytes], start: int = 0, end: int | None = None) -> int:
        """How many of ``keys[start:end]``, from ``start`` on, this node holds without a gap."""
        n = 0
        for key in keys[start:end]:
            if key not in self.dram and key not in self.ssd:
                break
            n += 1
        return n

    def read(self, keys: list[bytes]) -> int:
        """Use ``keys`` (all held): touch them tail first, promote SSD-only ones to DRAM; return how many came from
        SSD."""
        self._tick += 1
        from_ssd = 0
        for key in reversed(keys):
            if key in self.dram:
                self._dram_policy.touch(key, self._tick)
            elif key in self.ssd:
                from_ssd += 1
                self._ssd_policy.touch(key, self._tick)
                self._insert_dram(key)
        if from_ssd:
            self._enforce()
        self._flush()
        return from_ssd

    def put(self, keys: list[bytes]) -> int:
        """Store a prompt's blocks (chain order) in DRAM; return how many were new to this node."""
        new = 0
        for position, key in enumerate(keys):
            if key in self.dram:
                continue
            self._chain[key] = (position, keys[position - 1] if position else b"")
            if key in self.ssd:  # a copy on SSD: the fresh one goes to DRAM as well
                self._ssd_policy.touch(key, self._tick)
            else:
                new += 1
            self._insert_dram(key)
        self._enforce()
        self._flush()
        return new

    def _insert_dram(self, key: bytes) -> None:
        self._tick += 1
        self.dram.add(key)
        position, parent = self._chain.get(key, (0, None))
        self._dram_policy.insert(key, position, self._tick)
        self._events.append((True, key, Tier.DRAM, parent))

    def _flush(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self._sink(self.node, events)

    def _enforce(self) -> None:
        """Bring DRAM back to the low watermark once it passes the high one (kvstore.store._after_insert)."""
        cap = self.dram_blocks
        if cap is None or len(self.dram) <= HIGH_WATERMARK * cap:
            return
        excess = len(self.dram) - int(LOW_WATERMARK * cap)
        leased = self.leased
        victims = self._dram_policy.victims(excess, lambda k: k not in leased)
        if len(self.dram) - len(victims) > cap:  # leases hold more than fits: the store would refuse the put;
            rest = len(self.dram) - len(victims) - cap  # here the most expendable leased blocks go instead
            chosen = set(victims)
            victims += self._dram_policy.victims(rest, lambda k: k not in chosen)
        self._evict_dram(victims)

    def _evict_dram(self, victims: list[bytes]) -> None:
        """Drop ``victims`` from DRAM, demoting each to the SSD when there is one and it has no copy there.

        Events go out grouped (the SSD's removals, its stores, then DRAM's removals): the
        keys differ, so the index ends the same, and a group of stores is one index update.
        """
        ssd_removed: list[bytes] = []
        ssd_stored: list[bytes] = []
        for key in victims:
            self._dram_policy.remove(key)
            self.dram.discard(key)
            if self.ssd_blocks <= 0 or key in self.ssd:
                continue
            if len(self.ssd) >= self.ssd_blocks:
                # 5% at a time, not one (the store's way): LFU's victim search scans the whole tier
                for victim in self._ssd_policy.victims(max(1, self.ssd_blocks // 20), lambda k: True):
                    self._ssd_policy.remove(victim)
                    self.ssd.discard(victim)
                    ssd_removed.append(victim)
            self._tick += 1
            self.ssd.add(key)
            self._ssd_policy.insert(key, self._chain.get(key, (0, None))[0], self._tick)
            ssd_stored.append(key)
        self.evictions += len(victims)
        events = self._events
        events += [(False, k, Tier.SSD, None) for k in ssd_removed if k not in self.ssd]
        events += [(True, k, Tier.SSD, self._chain.get(k, (0, None))[1]) for k in ssd_stored if k in self.ssd]
        events += [(False, k, Tier.DRAM, None) for k in victims]
        for key in (*ssd_removed, *victims):
            if key not in self.dram and key not in self.ssd:
                self._chain.pop(key, None)
