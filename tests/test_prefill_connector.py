"""The prefill connector's two ways out of the engine's cache: in place (a CPU cache) and through host staging (a
CUDA cache: a side-stream copy to pinned memory, pushed by a thread). The staged path runs here on the CPU with the
same code (``bind(staged=True)``): its landing and pool bytes must equal the in-place path's, byte for byte.
(The CUDA stream and event calls themselves need a GPU: not run on this machine.)"""

from __future__ import annotations

import uuid

import torch

from mooncake.blocks import blocks_for
from mooncake.engine import EngineConfig, LLMEngine
from mooncake.engine.request import SamplingParams
from prefill.connector import PoolConnector, PrefillJob
from transfer import TransferConfig, TransferEngine


class _TableConnector(PoolConnector):
    """Remembers each request's block table (the engine frees it when the request ends; the blocks keep their KV)."""

    tables: dict[str, list[int]]

    def start_step(self, step) -> None:
        super().start_step(step)
        self.tables = getattr(self, "tables", {}) | {r.request_id: list(r.block_ids) for r in step.requests}


def _push(
    model_dir, prompt: list[int], staged: bool, device: str = "cpu"
) -> tuple[bytes, torch.Tensor, list[torch.Tensor]]:
    """Prefill ``prompt`` (in 32-token steps, on ``device``) with a connector pushing to a landing segment and a pool
    tensor; the landing segment's bytes, the pool, and the request's blocks as the engine's cache holds them at the
    end ([L, 2, bs, Hkv, D] each, on the CPU)."""
    bs = 16
    n = blocks_for(len(prompt), bs)
    owner = TransferEngine(TransferConfig(node=f"land-{uuid.uuid4().hex[:6]}", serve=False))
    sender = TransferEngine(TransferConfig(node=f"push-{uuid.uuid4().hex[:6]}", serve=False))
    connector = _TableConnector(sender, None, bs, io_timeout_s=30)
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            block_size=bs,
            num_kv_blocks=64,
            max_model_len=256,
            max_num_batched_tokens=32,
            device=device,
            use_kernels=False,
        ),
        connector=connector,
    )
    connector.bind(engine.runner.kv_cache, staged=staged)
    block_bytes = engine.block_bytes
    landing = owner.allocate("landing", n * block_bytes)
    sender.add_segment(landing)
    connector.pool = torch.zeros(8, *engine.block_shape)
    connector.jobs["r"] = PrefillJob(
        "r", len(prompt), n, landing.name, [i * block_bytes for i in range(n)], pool_slots={0: 5, 2: 1}
    )
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id="r")
    while engine.has_unfinished():
        engine.step()
    job = connector.jobs["r"]
    assert job.error is None and job.pushed == n
    out = bytes(owner.buffer("landing"))
    cache = engine.runner.kv_cache
    blocks = [cache[:, :, b].cpu() for b in connector.tables["r"][:n]]
    owner.close()
    sender.close()
    return out, connector.pool, blocks


def test_staged_pushes_equal_in_place_pushes_byte_for_byte(tiny_models):
    model = tiny_models["llama"]
    prompt = [(7 * i) % 280 + 10 for i in range(70)]  # 5 blocks, the last partial; 3 engine steps
    direct, direct_pool, _ = _push(model.path, prompt, staged=False)
    staged, staged_pool, _ = _push(model.path, prompt, staged=True)
    assert any(direct) and staged == direct
    assert direct_pool[[5, 1]].abs().sum() > 0 and torch.equal(staged_pool, direct_pool)


def test_a_worker_asked_for_a_gpu_where_there_is_none_exits_saying_so():
    import subprocess
    import sys

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has a GPU")
    for args in (["prefill", "--kvstore", "127.0.0.1:1"], ["decode"]):
        out = subprocess.run(
            [sys.executable, "-m", *args, "--model", "/nowhere", "--device", "cuda"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and "no CUDA GPU here" in out.stderr, out.stderr
