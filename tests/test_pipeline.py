"""Chunked pipeline parallelism (CPP) in the engine: stages of a model's layers run a prompt chunk by chunk, and a
decode engine given the pipeline's first token and KV goes on exactly as one engine alone."""

from __future__ import annotations

import random

import pytest
import torch

from mooncake.blocks import blocks_for
from mooncake.engine import EngineConfig, LLMEngine
from mooncake.engine.pipeline import LocalPipeline, chunk_bounds
from mooncake.engine.request import PromptKV, RequestOptions, SamplingParams
from mooncake.engine.stage import PipelineStage, split_layers
from prefill.stage_process import StageRequest

BLOCK = 16
MAX_LEN = 1024
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_layers_split_evenly_and_chunks_tile_the_prompt():
    assert split_layers(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert split_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError):
        split_layers(2, 3)
    assert chunk_bounds(32, 100, 30) == [(32, 62), (62, 92), (92, 100)]
    assert chunk_bounds(0, 5, 512) == [(0, 5)]


def stages_of(model_dir, n: int) -> list[PipelineStage]:
    args = dict(num_blocks=128, block_size=BLOCK, max_model_len=MAX_LEN)
    num_layers = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=4, max_model_len=64)).args.num_layers
    return [PipelineStage(str(model_dir), layers, **args) for layers in split_layers(num_layers, n)]


def alone(model_dir, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=BLOCK, num_kv_blocks=256, max_model_len=MAX_LEN))
    return list(engine.generate([prompt], params)[0].output_token_ids)


def decode_after(
    model_dir, prompt: list[int], first: int, kv: torch.Tensor, params: SamplingParams = GREEDY
) -> list[int]:
    """A decode engine taking over from the pipeline: its KV imported, its first token given."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=BLOCK, num_kv_blocks=256, max_model_len=MAX_LEN))
    rid = engine.add_request(prompt, params, kv=PromptKV(len(prompt), kv), options=RequestOptions(outputs=(first,)))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return list(out.output_token_ids)
    raise AssertionError("the decode engine did not finish")


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 290) for _ in range(n)]


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("length", [5, 40, 300, 1000])
def test_a_cpp_prefill_then_decode_equals_one_engine_alone(tiny_models, num_stages, length):
    model = tiny_models["qwen2"]  # 3 layers: 2 stages split 2 + 1, 3 stages 1 each
    pipeline = LocalPipeline(stages_of(model.path, num_stages))
    prompt = prompt_of(length, seed=length)
    out = pipeline.prefill("r", prompt, GREEDY, chunk=64)
    assert out.kv.shape[0] == blocks_for(length, BLOCK)
    assert decode_after(model.path, prompt, out.first_token, out.kv) == alone(model.path, prompt)


def test_a_reused_prefix_is_loaded_into_each_stage_and_the_rest_computed(tiny_models):
    model = tiny_models["llama"]
    pipeline = LocalPipeline(stages_of(model.path, 2))
    shared = prompt_of(96, seed=1)
    first = pipeline.prefill("a", shared + prompt_of(20, seed=2), GREEDY, chunk=32)
    prompt = shared + prompt_of(50, seed=3)
    out = pipeline.prefill("b", prompt, GREEDY, chunk=32, prefix_kv=first.kv[:6], num_prefix_tokens=96)
    assert decode_after(model.path, prompt, out.first_token, out.kv) == alone(model.path, prompt)
    assert all(not s.tables and s.pool.num_free_blocks == 128 for s in pipeline.stages)  # each let go of its blocks


def test_seeded_sampling_of_the_first_token_matches_one_engine(tiny_models):
    model = tiny_models["mistral"]
    pipeline = LocalPipeline(stages_of(model.path, 2))
    prompt = prompt_of(70, seed=7)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True)
    out = pipeline.prefill("s", prompt, params, chunk=16)
    assert decode_after(model.path, prompt, out.first_token, out.kv, params) == alone(model.path, prompt, params)


def test_a_stage_that_fails_mid_request_fails_the_prefill_without_a_hang(tiny_models):
    model = tiny_models["llama"]
    stages = stages_of(model.path, 2)
    real = stages[0].run_chunk
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("stage 0 lost its device")
        return real(*args, **kwargs)

    stages[0].run_chunk = failing
    pipeline = LocalPipeline(stages)
    with pytest.raises(RuntimeError, match="lost its device"):
        pipeline.prefill("f", prompt_of(200, seed=5), GREEDY, chunk=32)
    assert all(not s.tables for s in stages)
    stages[0].run_chunk = real  # the group serves the next request
    prompt = prompt_of(60, seed=6)
    out = pipeline.prefill("g", prompt, GREEDY, chunk=32)
    assert decode_after(model.path, prompt, out.first_token, out.kv) == alone(model.path, prompt)


@pytest.mark.slow
def test_smollm2_3000_token_prompt_through_2_stages_equals_one_engine(smollm2_dir):
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), block_size=BLOCK, num_kv_blocks=256, max_model_len=4096))
    rng = random.Random(3000)
    prompt = [rng.randrange(100, 40000) for _ in range(3000)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = list(engine.generate([prompt], params)[0].output_token_ids)
    stages = [
        PipelineStage(str(smollm2_dir), layers, num_blocks=200, block_size=BLOCK, max_model_len=4096)
        for layers in split_layers(engine.args.num_layers, 2)
    ]
    out = LocalPipeline(stages).prefill("long", prompt, params, chunk=512)
    rid = engine.add_request(
        prompt, params, kv=PromptKV(len(prompt), out.kv), options=RequestOptions(outputs=(out.first_token,))
    )
    got = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished and o.request_id == rid:
                got = list(o.output_token_ids)
    assert got == reference


# -- stages as processes ------------------------------------------------------------------------------


def process_pipeline(model_dir, n: int, max_chunk: int = 64):
    from prefill.stage_process import ProcessPipeline, StageSpec

    num_layers = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=4, max_model_len=64)).args.num_layers
    return ProcessPipeline(
        [
            StageSpec(
                str(model_dir), layers, num_blocks=128, block_size=BLOCK, max_model_len=MAX_LEN, max_chunk=max_chunk
            )
            for layers in split_layers(num_layers, n)
        ]
    )


def test_stages_as_processes_pass_hidden_states_through_the_transfer_engine_and_equal_one_engine(tiny_models):
    model = tiny_models["qwen2"]
    pipeline = process_pipeline(model.path, 3)
    try:
        for length in (5, 300):
            prompt = prompt_of(length, seed=100 + length)
            out = pipeline.prefill(StageRequest(f"p{length}", prompt, GREEDY, 64, export=True))
            assert decode_after(model.path, prompt, out.first_token, out.kv) == alone(model.path, prompt)
        # a reused prefix: each stage process loads its layers of the 300-token prompt's first 256 tokens
        reused = prompt[:256] + prompt_of(90, seed=7)
        again = pipeline.prefill(
            StageRequest("reuse", reused, GREEDY, 64, export=True, prefix_kv=out.kv[:16], num_prefix_tokens=256)
        )
        assert decode_after(model.path, reused, again.first_token, again.kv) == alone(model.path, reused)
    finally:
        pipeline.close()


def test_a_stage_process_killed_mid_prefill_fails_it_without_a_hang(tiny_models):
    import os
    import signal
    import threading

    model = tiny_models["llama"]
    pipeline = process_pipeline(model.path, 2, max_chunk=8)
    victim = pipeline._procs[1].pid
    threading.Timer(0.5, lambda: os.kill(victim, signal.SIGKILL)).start()
    with pytest.raises(RuntimeError, match="died|failed"):
        for i in range(200):  # long enough that the kill lands mid-prefill
            pipeline.prefill(StageRequest(f"k{i}", prompt_of(900, seed=i), GREEDY, 8), timeout_s=60)
    assert not any(p.is_alive() for p in pipeline._procs)
