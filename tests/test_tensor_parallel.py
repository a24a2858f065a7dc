"""Tensor parallelism in our engine (mooncake.engine.parallel): a model split over ranks generates what it does whole.

Each family `mooncake model make-tiny` writes (MoE included), served by two gloo ranks on the CPU, each holding its
heads, its slice of every MLP and expert and its rows of the vocabulary: the greedy tokens and log-probabilities of
the same engine on one rank. At four ranks the two KV heads are each kept by two ranks (replicated). A shape that
does not split is refused naming it. A worker's engine is rank 0's (``mooncake.engine.ranks.Leader``): the other
ranks are given nothing but its broadcast calls and generate the same. KV exported at two ranks (every head, gathered)
continues at one rank, and the reverse: the pool's layout is the same whatever the ranks.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import make_engine
from tp_ranks import generate, rank_processes, run_led, run_ranks

from mooncake.cluster.component import Component
from mooncake.engine import SamplingParams
from mooncake.engine.model_args import ModelArgs
from mooncake.engine.parallel import TensorParallel
from mooncake.engine.ranks import RANK_LOST_EXIT
from mooncake.engine.request import PromptKV, RequestOptions
from mooncake.engine.tiny import TINY_ARCHS, make_tiny
from mooncake.engine.weights import load_hf_config

ATOL = 1e-4  # float32 sums in another order: log-probabilities agree to about 1e-6


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # one past the 32-token windows of mistral and gemma, one short: a batch of two, prefilled in 32-token chunks
    return [[rng.randrange(3, 200) for _ in range(45)], [rng.randrange(3, 200) for _ in range(7)]]


def alone(model_dir, batch: list[list[int]], **overrides) -> list[tuple[list[int], list[float]]]:
    return generate(make_engine(model_dir, **overrides), batch)


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


def test_ranks_given_only_rank_0s_calls_generate_what_one_rank_does(models, tmp_path):
    jobs = [(models[arch], prompts(i)[0], None, 0) for i, arch in enumerate(("llama", "qwen3_moe", "gemma2"))]
    led = run_led(2, jobs, tmp_path)
    for (tokens, logprobs, _), (model, prompt, _, _) in zip(led, jobs):
        assert_same([(tokens, logprobs)], alone(model, [prompt]), str(model))


def continue_alone(model_dir, prompt: list[int], exported) -> tuple[list[int], list[float]]:
    """One rank's engine continuing ``prompt`` from KV exported elsewhere (``((tokens, kv), outputs so far)``)."""
    (n, kv), so_far = exported
    kv, options = PromptKV(n, torch.from_numpy(kv)), RequestOptions(outputs=tuple(so_far))
    ((tokens, logprobs),) = generate(make_engine(model_dir), [prompt], kv=kv, options=options)
    return list(so_far) + tokens, logprobs


def test_kv_written_at_two_ranks_continues_at_one_and_kv_written_at_one_continues_at_two(models, tmp_path):
    model, prompt = models["llama"], prompts(3)[0]
    ((want, want_lp),) = alone(model, [prompt])
    # two ranks generate 4 tokens, export the request's KV (every head, gathered from both) and stop
    ((_, _, exported),) = run_led(2, [(model, prompt, None, 4)], tmp_path)
    (n, kv), so_far = exported
    assert kv.shape[-2] == 2 and n == len(prompt) + len(so_far) - 1  # both KV heads, as one rank's pool blocks
    tokens, logprobs = continue_alone(model, prompt, exported)
    assert_same(
        [(tokens, [0.0] * len(so_far) + logprobs)], [(want, [0.0] * len(so_far) + want_lp[len(so_far) :])], "2 -> 1"
    )
    # the reverse: one rank's KV, each rank importing its head of it
    engine = make_engine(model)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rid, so_far = engine.add_request(prompt, params), []
    while len(so_far) < 4:
        for o in engine.step():
            so_far = o.output_token_ids
    kv = engine.export_kv(engine.request_block_ids(rid)).numpy()  # numpy: a tensor in a queue leaves with its process
    leading = ((len(prompt) + len(so_far) - 1, kv), list(so_far))
    (back := tmp_path / "back").mkdir()
    ((tokens, logprobs, _),) = run_led(2, [(model, prompt, leading, 0)], back)
    assert_same(
        [(list(so_far) + tokens, [0.0] * len(so_far) + logprobs)],
        [(want, [0.0] * len(so_far) + want_lp[len(so_far) :])],
        "1 -> 2",
    )


def completion_text(model, work: Path, tp: int, prompt: list[int]) -> tuple[str, list[int]]:
    """A --local gateway at ``tp`` ranks: its greedy completion of ``prompt``, and the rank processes it ran."""
    argv = [sys.executable, "-m", "mooncake.gateway", "--local", "--model", str(model), "--model-name", "tiny"]
    argv += ["--port", "0", "--max-model-len", "512", "--threads", "1", "--tensor-parallel-size", str(tp)]
    gateway = Component(f"gateway-tp{tp}", [*argv, "--log-level", "WARNING"], work / f"gateway-tp{tp}.log")
    gateway.start()
    try:
        url = gateway.wait_ready(150.0)["http"]
        ranks = rank_processes(gateway.proc.pid)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16
        return r.json()["choices"][0]["text"], ranks
    finally:
        gateway.terminate()
        try:
            gateway.proc.wait(30)
        except subprocess.TimeoutExpired:
            gateway.kill()


def test_a_local_gateway_at_two_ranks_answers_as_at_one_and_its_ranks_end_with_it(models, tmp_path):
    model, prompt = models["llama"], prompts(5)[0]
    one, _ = completion_text(model, tmp_path, 1, prompt)
    two, ranks = completion_text(model, tmp_path, 2, prompt)
    assert two == one and len(one) > 0
    assert len(ranks) == 1  # rank 1, started by the gateway (rank 0)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{p}").exists() for p in ranks), "a rank outlived its gateway"


def test_a_gateway_asked_for_ranks_the_model_does_not_split_into_stops_saying_why(models):
    argv = [sys.executable, "-m", "mooncake.gateway", "--local", "--model", str(models["llama"]), "--port", "0"]
    done = subprocess.run([*argv, "--tensor-parallel-size", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "attention heads (4) cannot be split evenly among 3 tensor-parallel ranks" in done.stderr + done.stdout


def test_a_rank_killed_takes_its_gateway_down_whole_instead_of_serving_half_a_model(models, tmp_path):
    """The gateway's other rank killed: the next request fails (an error or a dropped connection, never text) and the
    gateway exits with RANK_LOST_EXIT (a restart serves again) rather than go on without half of every layer."""
    argv = [sys.executable, "-m", "mooncake.gateway", "--local", "--model", str(models["llama"]), "--port", "0"]
    argv += ["--model-name", "tiny", "--threads", "1", "--tensor-parallel-size", "2", "--log-level", "WARNING"]
    gateway = Component("gateway-tp-kill", argv, tmp_path / "gateway.log")
    gateway.start()
    try:
        url = gateway.wait_ready(150.0)["http"]
        (rank,) = rank_processes(gateway.proc.pid)
        os.kill(rank, signal.SIGKILL)
        body = {"model": "tiny", "prompt": prompts(6)[1], "max_tokens": 4, "temperature": 0}
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code >= 500, r.text
        except httpx.TransportError:
            pass  # the process went down while answering
        assert gateway.proc.wait(30) == RANK_LOST_EXIT
        assert "a tensor-parallel rank is gone" in (tmp_path / "gateway.log").read_text()
    finally:
        gateway.kill()
