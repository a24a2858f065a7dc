"""Decode steps through DecodeGraphs (mooncake/engine/decode_graph.py) against the eager step, token for token.

On a CUDA GPU the steps replay captured CUDA graphs; on the CPU the same graph-ready step (static buffers, batch
buckets, padded rows) runs uncaptured, so this file runs everywhere. MOONCAKE_TEST_DEVICE picks the device (default:
cuda where there is one).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from conftest import RecordingConnector, make_engine, run_to_completion

from mooncake.engine.config import EngineConfig
from mooncake.engine.decode_graph import graph_buckets
from mooncake.engine.grammar import grammar_for
from mooncake.engine.request import SamplingParams

DEVICE = os.environ.get("MOONCAKE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


def prompt_of(n: int, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def test_every_batch_size_has_a_bucket_no_smaller_and_the_buckets_follow_the_schedule():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert graph_buckets(1) == [1] and graph_buckets(6) == [1, 2, 4, 6]


def test_graphs_are_on_by_default_on_cuda_only_and_the_step_budget_follows_the_device(tiny_llama):
    cpu = EngineConfig(model=str(tiny_llama.path))
    assert cpu.decode_graphs is False and cpu.max_num_batched_tokens == 512
    assert EngineConfig(model=str(tiny_llama.path), max_num_batched_tokens=64).max_num_batched_tokens == 64
    with pytest.raises(ValueError, match="contradict"):
        EngineConfig(model=str(tiny_llama.path), decode_graphs=True, enforce_eager=True)
    if torch.cuda.is_available():
        cuda = EngineConfig(model=str(tiny_llama.path), device="cuda")
        assert cuda.decode_graphs is True and cuda.captures_graphs and cuda.max_num_batched_tokens == 4096
        assert EngineConfig(model=str(tiny_llama.path), device="cuda", enforce_eager=True).decode_graphs is False


def graph_engines(model_dir, **overrides):
    """An engine whose decode steps run through DecodeGraphs (captured on CUDA) and its eager twin."""
    cfg = dict(device=DEVICE, max_model_len=1024, max_num_seqs=16, num_kv_blocks=512, **overrides)
    graphs = make_engine(model_dir, decode_graphs=True, **cfg)
    eager = make_engine(model_dir, enforce_eager=True, **cfg)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    assert bool(graphs.runner.graphs.graphs) == DEVICE.startswith("cuda")  # captured only where there are graphs
    return graphs, eager


def run_both(graphs, eager, prompts, params):
    out = []
    for engine in (graphs, eager):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, request_id=str(i))
        out.append(run_to_completion(engine))
    return out


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 11, 16])
def test_a_graph_replay_gives_the_eager_steps_tokens_at_every_bucket_with_padding(tiny_llama, batch):
    """Buckets 1, 2, 4, 8, 16: batches of 3, 5 and 11 run padded (rows repeating row 0); requests finish at different
    steps, so the batch shrinks through the buckets as it runs. Greedy, seeded sampling with top-k/top-p, penalties
    and biases, and logprobs: every token equal to the eager engine's, and the last token's logprobs."""
    graphs, eager = graph_engines(tiny_llama.path)
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, top_k=40, seed=7),
        dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={17: 5.0}),
        dict(temperature=1.0, seed=3, logprobs=3),
    ]
    prompts = [prompt_of(3 + 29 * i, seed=i) for i in range(batch)]
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, **kinds[i % len(kinds)]) for i in range(batch)]
    got, want = run_both(graphs, eager, prompts, params)
    for i in range(batch):
        assert list(got[str(i)].output_token_ids) == list(want[str(i)].output_token_ids), f"request {i}"
        if params[i].logprobs:
            (a,), (b,) = got[str(i)].new_logprobs, want[str(i)].new_logprobs
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert graphs.runner.step_id == eager.runner.step_id


def test_a_graph_step_is_each_request_alone(tiny_llama):
    """Twelve requests decoding together through the graphs give what each gives alone through them."""
    graphs, _ = graph_engines(tiny_llama.path)
    prompts = [prompt_of(n, seed=n) for n in (4, 9, 31, 64, 65, 100, 130, 200, 250, 333, 400, 17)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    together = graphs.generate(prompts, params)
    for p, out in zip(prompts, together):
        assert out.output_token_ids == graphs.generate([p], params)[0].output_token_ids


def test_a_graph_step_gives_the_connector_every_layer_and_the_kv_the_eager_step_wrote(tiny_llama):
    """Hooks run around the graph: every layer's load before it and save after it, once per step; the K/V rows a
    connector reads at save equal the eager step's."""
    conns = RecordingConnector(), RecordingConnector()
    graphs = make_engine(tiny_llama.path, conns[0], device=DEVICE, decode_graphs=True, max_num_seqs=4)
    eager = make_engine(tiny_llama.path, conns[1], device=DEVICE, enforce_eager=True, max_num_seqs=4)
    for engine in (graphs, eager):
        engine.add_request(prompt_of(20, seed=5), SamplingParams(max_tokens=5, temperature=0.0), request_id="r")
        run_to_completion(engine)
    layers = tiny_llama.hf.config.num_hidden_layers
    decode_step = [
        ("start", conns[0].steps[-1].step_id),
        *[("load", i) for i in range(layers)],
        *[("save", i) for i in range(layers)],
        ("end",),
    ]
    assert conns[0].events[-len(decode_step) :] == decode_step
    for layer in range(layers):
        got, want = conns[0].saved_k[("r", layer)], conns[1].saved_k[("r", layer)]
        assert len(got) == len(want) and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))


def test_a_grammar_constrained_request_through_the_graphs_equals_eager(tiny_dir, tok):
    schema = {
        "type": "object",
        "properties": {"k": {"enum": [1, 2, 3]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(max_tokens=30, temperature=1.0, seed=s, grammar=grammar_for(json_schema=schema))
        for s in range(3)
    ]
    outs = []
    for flags in (dict(decode_graphs=True), dict(enforce_eager=True)):
        engine = make_engine(tiny_dir, tokenizer=tok, device=DEVICE, block_size=16, max_model_len=512, **flags)
        outs.append([o.output_token_ids for o in engine.generate([tok.encode("x")] * 3, params)])
    assert outs[0] == outs[1]
