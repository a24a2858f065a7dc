"""Tensor parallelism in our engine (mooncake.engine.parallel): a model split over ranks generates what it does whole.

Each family `mooncake model make-tiny` writes (MoE included), served by two gloo ranks on the CPU, each holding its
heads, its slice of every MLP and expert and its rows of the vocabulary: the greedy tokens and log-probabilities of
the same engine on one rank. At four ranks the two KV heads are each kept by two ranks (replicated). A shape that
does not split is refused naming it.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_engine
from tp_ranks import run_ranks

from mooncake.engine import SamplingParams
from mooncake.engine.model_args import ModelArgs
from mooncake.engine.parallel import TensorParallel
from mooncake.engine.tiny import TINY_ARCHS, make_tiny
from mooncake.engine.weights import load_hf_config

ATOL = 1e-4  # float32 sums in another order: log-probabilities agree to about 1e-6


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # one past the 32-token windows of mistral and gemma, one short: a batch of two, prefilled in 32-token chunks
    return [[rng.randrange(3, 200) for _ in range(45)], [rng.randrange(3, 200) for _ in range(7)]]


def alone(model_dir, batch: list[list[int]], **overrides) -> list[tuple[list[int], list[float]]]:
    engine = make_engine(model_dir, **overrides)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True)
    ids = [engine.add_request(p, params, request_id=f"r{n}") for n, p in enumerate(batch)]
    got = {i: ([], []) for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id][0].extend(o.new_token_ids)
            got[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs or [])
    return [got[i] for i in ids]


def assert_same(split, whole, label: str) -> None:
    for n, ((tokens, logprobs), (want, want_lp)) in enumerate(zip(split, whole)):
        assert len(tokens) == 16 and len(logprobs) == 16, label
        # the first token where they differ may only be a near-tie; every token before it must be equal
        same = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), len(want))
        assert same == len(want) or abs(logprobs[same] - want_lp[same]) < ATOL, (label, n, tokens, want)
        diff = torch.tensor(logprobs[:same]) - torch.tensor(want_lp[:same])
        assert same == 0 or diff.abs().max() < ATOL, (label, n, diff.abs().max())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-families")
    return {arch: make_tiny(root / arch, arch, seed=i + 2) for i, arch in enumerate(TINY_ARCHS)}


def test_every_family_split_over_two_ranks_generates_what_one_rank_does(models, tmp_path):
    jobs = [(models[arch], prompts(i), {}) for i, arch in enumerate(TINY_ARCHS)]
    split = run_ranks(2, jobs, tmp_path)
    for i, arch in enumerate(TINY_ARCHS):
        assert_same(split[i], alone(models[arch], prompts(i)), arch)


def test_four_ranks_share_two_kv_heads_and_the_decode_graph_path_too(models, tmp_path):
    """4 ranks, 2 KV heads: ranks 0-1 keep head 0, ranks 2-3 head 1; with decode graphs (the static-buffer step)."""
    jobs = [(models["llama"], prompts(0), {"decode_graphs": True}), (models["qwen2"], prompts(1), {})]
    split = run_ranks(4, jobs, tmp_path)
    assert_same(split[0], alone(models["llama"], prompts(0), decode_graphs=True), "llama, graphs")
    assert_same(split[1], alone(models["qwen2"], prompts(1)), "qwen2 (bias)")


def test_a_rank_holds_its_part_and_a_shape_that_does_not_split_is_refused_naming_it(models):
    args = ModelArgs.from_hf_config(load_hf_config(models["llama"]))  # 4 heads, 2 KV heads, intermediate 128
    assert TensorParallel(1, 2).q_heads(args) == slice(2, 4) and TensorParallel(1, 2).kv_heads(args) == slice(1, 2)
    assert [TensorParallel(r, 4).kv_heads(args) for r in range(4)] == [slice(0, 1)] * 2 + [slice(1, 2)] * 2
    vocab = args.vocab_size
    last = TensorParallel(2, 3).vocab(args)
    assert last.stop >= vocab > last.start  # the last rank's rows run past the vocabulary (padding)
    with pytest.raises(ValueError, match="attention heads"):
        TensorParallel(0, 3).check(args)
    with pytest.raises(ValueError, match="KV heads"):
        TensorParallel(0, 8).check(
            ModelArgs.from_hf_config(
                {**load_hf_config(models["llama"]), "num_key_value_heads": 3, "num_attention_heads": 24}
            )
        )
