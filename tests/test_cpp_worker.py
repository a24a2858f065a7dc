"""A pipelined prefill group (CPP) serving for real: ``mooncake up``'s cluster with its only prefill worker a 2-stage
group (two stage processes, each half the layers), a pool node, a decode worker, the gateway.

The bar is the one every disaggregated request meets: greedy tokens equal one engine alone, cold and with a prefix
each stage reads back from the pool; the sampling that happens on the prefill side (penalties, a grammar's first
token, logprobs, prompt logprobs) is the same; a stage killed mid-request loses no request.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest
from clusters import backend, generate, instances, kill_mid_prefill, reference_tokens, start_cluster, tokens

from mooncake.engine import EngineConfig, LLMEngine
from mooncake.engine.grammar import grammar_for
from mooncake.engine.request import SamplingParams
from protos import conductor_pb2 as cpb

KEY = "sk-test"


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    # chunks of 64 tokens: a 700-token prompt runs as 11 chunks through the two stages
    c = start_cluster(
        tiny_dir,
        tmp_path_factory.mktemp("cpp"),
        prefill=1,
        prefill_groups=1,
        group_size=2,
        decode=1,
        api_key=KEY,
        max_num_batched_tokens=64,
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.endpoint, api_key=KEY, max_retries=0, timeout=120)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 440) for _ in range(n)]


def stages(cluster) -> list[dict]:
    """The group's stages as its /health lists them (layers, alive, pid)."""
    metrics = cluster.components["prefill-0"].info["metrics"]
    return httpx.get(f"http://{metrics}/health", timeout=5).json()["stages"]


def test_the_group_registers_as_one_prefill_instance_with_its_stages(cluster):
    group = instances(cluster)["prefill-0"]
    assert group.role == cpb.PREFILL and group.pipeline_stages == 2 and group.pipeline_chunk == 64
    listed = stages(cluster)
    assert [s["layers"] for s in listed] == [[0, 1], [1, 2]] and all(s["alive"] for s in listed)
    from clusters import conductor
    from rich.console import Console

    from mooncake.cli.pool_cmd import status_table

    console = Console(record=True, width=250)
    console.print(status_table(conductor(cluster).ListInstances(cpb.ListInstancesRequest(), timeout=5)))
    assert "prefill (native, 2-stage group, 64-token chunks, KV over tcp)" in console.export_text()  # `mooncake status`


@pytest.mark.parametrize("length", [5, 64, 100, 700])  # under a block, one chunk, two chunks, eleven
def test_greedy_through_the_group_then_decode_equals_one_engine(cluster, tiny_dir, length):
    prompt = prompt_of(length, seed=length)
    got = generate(backend(cluster), f"cpp-{length}", prompt, 16, temperature=0.0, ignore_eos=True)
    assert tokens(got) == reference_tokens(tiny_dir, prompt, 16)


def test_a_reused_prefix_is_read_by_each_stage_from_the_pool(cluster, client, tiny_dir, tok):
    shared = prompt_of(320, seed=99)
    first = client.completions.create(
        model="tiny",
        prompt=shared + prompt_of(40, seed=1),
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    prompt = shared + prompt_of(130, seed=2)
    second = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert second.usage.prompt_tokens_details.cached_tokens == 320  # each stage read its layers of the 20 blocks
    assert second.choices[0].text == tok.decode(reference_tokens(tiny_dir, prompt, 12))
    assert instances(cluster)["kv0"].indexed_blocks >= 20 + 8  # both prompts' full blocks, written by both stages


def test_sampling_on_the_prefill_side_is_one_engines(cluster, client, tok, tiny_dir):
    """Penalties, a grammar's first token and logprobs are applied by the last stage; prompt logprobs come from the
    last stage's chunks: the same as one engine alone."""
    be = backend(cluster)
    prompt = prompt_of(90, seed=4)
    shaping = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2, min_tokens=3)
    chunks = generate(be, "cpp-penalised", prompt, 12, temperature=0.0, ignore_eos=True, **shaping)
    assert tokens(chunks) == reference_tokens(tiny_dir, prompt, 12, sampling=shaping)
    engine = LLMEngine(
        EngineConfig(model=str(tiny_dir), block_size=16, num_kv_blocks=512, max_model_len=1024), tokenizer=tok
    )
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    grammar = grammar_for(json_schema=schema)
    for seed in range(3):
        got = generate(be, f"cpp-json-{seed}", prompt, 40, temperature=1.0, seed=seed, grammar=grammar)
        one = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=1.0, seed=seed, grammar=grammar))[0]
        assert tokens(got) == one.output_token_ids
        json.loads("".join(c.text for c in got))
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=3, echo=True, extra_body={"ignore_eos": True}
    )
    whole = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, prompt_logprobs=3))[0]
    lp = r.choices[0].logprobs.token_logprobs
    assert lp[0] is None and len(lp) == 93
    assert lp[1:90] == pytest.approx([x.logprob for x in whole.prompt_logprobs], abs=1e-4)
    assert lp[90] == pytest.approx(whole.new_logprobs[-1].logprob, abs=1e-4)  # the first token's, from the last stage


def test_a_stage_killed_mid_request_loses_no_request(cluster, tiny_dir):
    """A stage is SIGKILLed while the group runs a prefill. That prefill fails (UNAVAILABLE), the group starts its
    stages anew, the gateway places the request again: it ends with one engine's tokens, and the stages are new
    processes. (Tried until a kill lands mid-prefill, which the worker's failed-prefill counter shows.)"""
    for attempt in range(5):
        before = stages(cluster)
        victim = before[attempt % 2]["pid"]
        landed = kill_mid_prefill(
            cluster,
            tiny_dir,
            f"cpp-kill-{attempt}",
            prompt_of(900, seed=500 + attempt),
            lambda: os.kill(victim, signal.SIGKILL),
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            after = stages(cluster)
            if all(s["alive"] for s in after) and {s["pid"] for s in after}.isdisjoint({s["pid"] for s in before}):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the stages did not come back: {after}")
        if landed:
            return
    pytest.fail("no kill landed mid-prefill in 5 tries")
