"""Real clusters for the serving tests: LocalCluster (every component its own process) on a tiny model or SmolLM2."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from conductor.auth import bearer
from conductor.local import LocalPrefill
from mooncake import tls
from mooncake.cluster.config import ClusterConfig
from mooncake.cluster.launcher import LocalCluster
from mooncake.engine.config import EngineConfig
from mooncake.engine.engine import LLMEngine
from mooncake.engine.interface import EngineKind, flags_fingerprint
from mooncake.engine.request import SamplingParams
from mooncake.gateway.cluster_backend import ClusterBackend
from mooncake.gateway.recovery import RecoveryConfig
from mooncake.serving.types import GenerationChunk, GenerationRequest
from protos import conductor_pb2 as cpb
from protos import conductor_pb2_grpc as cpb_grpc

MAX_LEN = 1024


def start_cluster(model_dir: Path, workdir: Path, **overrides) -> LocalCluster:
    # generous SLOs: a loaded test machine must not turn requests away
    # (test_serving_cluster tests rejection on its own);
    # every prompt on a prefill worker, the paths these clusters test
    # (test_local_prefill: the decode worker's, and auto)
    config = dict(
        model=str(model_dir),
        model_name="tiny",
        workdir=workdir,
        pool_dram_mib=64,
        max_model_len=MAX_LEN,
        port=0,
        ready_timeout_s=300.0,
        ttft_slo_s=300.0,
        tbt_slo_s=10.0,
        local_prefill=LocalPrefill.NEVER,
    )
    config.update(overrides)
    return LocalCluster(ClusterConfig(**config)).start()


def backend(cluster: LocalCluster) -> ClusterBackend:
    """A ClusterBackend to the cluster (token ids and per-tier cache counts, which the HTTP API does not show)."""
    model = cluster.config.model
    recovery = RecoveryConfig(
        hold_s=cluster.config.hold_s, retry_budget_s=cluster.config.ttft_slo_s
    )  # as its gateway's
    return ClusterBackend(
        cluster.conductor_addresses,
        cluster.config.model_name,
        MAX_LEN,
        cluster.config.block_size,
        flags_fingerprint(
            EngineKind(cluster.config.engine),
            str(model),
            cluster.config.dtype,
            cluster.config.kv_cache_dtype,
            cluster.config.pool_kv_dtype,
        ),
        recovery=recovery,
    )


def generate(be: ClusterBackend, request_id: str, prompt: list[int], max_tokens: int, **kw) -> list[GenerationChunk]:
    async def run() -> list[GenerationChunk]:
        return [c async for c in be.generate(GenerationRequest.of(request_id, prompt, max_tokens, **kw))]

    return asyncio.run(run())


def tokens(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def reference_tokens(
    model_dir: Path, prompt: list[int], max_tokens: int, sampling: dict | None = None, **engine
) -> list[int]:
    """Greedy tokens of one engine alone (the correctness bar for the disaggregated path); ``sampling``: more
    SamplingParams (penalties, biases)."""
    config = EngineConfig(model=str(model_dir), block_size=16, num_kv_blocks=512, max_model_len=MAX_LEN, **engine)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **(sampling or {}))
    out = LLMEngine(config).generate([prompt], params)
    return list(out[0].output_token_ids)


def prefill_metric(cluster: LocalCluster, name: str, worker: str = "prefill-0") -> float:
    """The sum of ``worker``'s Prometheus samples whose line starts with ``name``."""
    import httpx

    text = httpx.get(f"http://{cluster.components[worker].info['metrics']}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def kill_mid_prefill(cluster: LocalCluster, model_dir: Path, request_id: str, prompt: list[int], kill) -> bool:
    """Send ``prompt`` (8 greedy tokens) and call ``kill`` once prefill-0 has it in flight; assert the request still
    ends with one engine's tokens. Returns whether the kill failed that prefill (prefill-0's failed counter rose),
    i.e. whether it landed mid-prefill rather than after it."""
    import threading
    import time

    failed = prefill_metric(cluster, 'mooncake_prefill_requests_total{outcome="failed"}')
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(
            tokens(generate(backend(cluster), request_id, prompt, 8, temperature=0.0, ignore_eos=True))
        )
    )
    thread.start()
    deadline = time.monotonic() + 30
    while prefill_metric(cluster, "mooncake_prefill_inflight") < 1 and time.monotonic() < deadline:
        time.sleep(0.002)
    kill()
    thread.join(timeout=300)
    assert result == [reference_tokens(model_dir, prompt, 8)]
    return prefill_metric(cluster, 'mooncake_prefill_requests_total{outcome="failed"}') > failed


class _Operator(grpc.UnaryUnaryClientInterceptor):
    """Adds the cluster's operator credential to every call (conductor.auth), as the operator CLI does."""

    def __init__(self, token: str | None) -> None:
        self.metadata = list(bearer(token))

    def intercept_unary_unary(self, continuation, details, request):
        details = details._replace(metadata=list(details.metadata or ()) + self.metadata)
        return continuation(details, request)


def conductor(cluster: LocalCluster, operator: bool = True) -> cpb_grpc.ConductorStub:
    """A stub to the cluster's Conductor, with the operator credential (``operator``) or without."""
    channel = tls.grpc_channel(cluster.conductor_address)
    if operator:
        channel = grpc.intercept_channel(channel, _Operator(cluster.operator_token))
    return cpb_grpc.ConductorStub(channel)


def instances(cluster: LocalCluster) -> dict[str, cpb.InstanceInfo]:
    return {i.id: i for i in conductor(cluster).ListInstances(cpb.ListInstancesRequest(), timeout=5).instances}


def vllm_served_as_alone(workdir: Path, model: Path, prompts: list[list[int]], alone: dict, **cluster) -> LocalCluster:
    """Stock vLLM workers (``cluster``: start_cluster's overrides past the engine, its block size and one thread)
    answer each prompt, cold and again with its blocks read back from the pool, with vLLM alone's greedy tokens
    (``alone``: tests/vllm_alone.py's reference arguments, run while the cluster starts: each is mostly vLLM's start).
    Returns the cluster, still running, for the caller's own checks; the caller stops it. 12 tokens a prompt."""
    import concurrent.futures

    import vllm_alone

    args = dict(model=str(model), block_size=32, max_model_len=1024, max_tokens=12, prompts=prompts, **alone)
    reference = concurrent.futures.ThreadPoolExecutor(1).submit(vllm_alone.run, "reference", **args)
    c = start_cluster(
        model,
        workdir,
        engine="vllm",
        vllm_args=["enforce_eager=true"],
        block_size=32,
        gateway=False,
        threads=1,
        **cluster,
    )
    try:
        want = reference.result(timeout=600)
        be = backend(c)
        for i, prompt in enumerate(prompts):
            cold = generate(be, f"cold-{i}", prompt, 12, temperature=0.0, ignore_eos=True)
            warm = generate(be, f"warm-{i}", prompt, 12, temperature=0.0, ignore_eos=True)
            assert tokens(cold) == tokens(warm) == want[i], (i, tokens(cold), tokens(warm), want[i])
            assert warm[-1].cached_tokens == len(prompt) // 32 * 32  # (a 7-token prompt has no whole block)
    except BaseException:
        c.stop()
        raise
    return c
