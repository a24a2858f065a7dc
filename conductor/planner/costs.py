"""What work costs in the Conductor's twin (conductor.planner.twin) and the cluster simulator (benchmarks.sim).

Nothing here makes a decision: the Conductor decides (conductor.planner.twin drives it), and
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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK_TOKENS = 512  # tokens a block holds (a Mooncake trace's hash id names 512)


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
    block_tokens: int = BLOCK_TOKENS
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
