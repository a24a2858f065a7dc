"""The whole system for real: Conductor, pool nodes, prefill and decode workers and the gateway as processes.

Clients are the official ``openai`` package over HTTP (and ClusterBackend where the token
ids or the cache tier matter). The correctness bar: greedy output through the
disaggregated path (prefill on one worker, KV through landing slots, decode on another)
equals one engine alone, token for token.
"""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import httpx
import jsonschema
import openai
import pytest
from clusters import backend, conductor, generate, instances, reference_tokens, start_cluster, tokens
from conftest import SERVING_KEY
from rich.console import Console

from mooncake import tls
from mooncake.cli.pool_cmd import status_table
from mooncake.engine import EngineConfig, LLMEngine
from mooncake.engine.grammar import grammar_for
from mooncake.engine.request import RequestOptions, SamplingParams
from mooncake.engine.tokenizer import Tokenizer
from prefill.connector import SLOW_WRITE_ENV
from protos import conductor_pb2 as cpb
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc

KEY = SERVING_KEY
MESSAGES = [{"role": "user", "content": "Tell me a story about a robot that learned to read."}]


@pytest.fixture(scope="module")
def cluster(serving_cluster):
    return serving_cluster  # shared with test_serving_cluster_cancel.py (conftest)


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.endpoint, api_key=KEY, max_retries=0, timeout=60)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids of the tiny vocabulary (the same seed: the same prompt)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 440) for _ in range(n)]


# -- the OpenAI API ---------------------------------------------------------------------------------


def test_every_response_carries_the_conductors_quote(cluster):
    """The headers benchmarks/replay.py compares with what it measures (issue 34; issue 63: the TBT too, and on whole
    responses as well as streamed ones): the Conductor's prediction for the request's placement, in seconds, positive
    and of the order of the prefill and the decode step it predicts."""
    body = {
        "model": "tiny",
        "prompt": prompt_of(200, seed=34),
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    with httpx.stream(
        "POST", f"{cluster.endpoint}/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as r:
        assert r.status_code == 200
        streamed = float(r.headers["x-mooncake-predicted-ttft"]), float(r.headers["x-mooncake-predicted-tbt"])
        assert any(line.startswith("data: ") and '"text"' in line for line in r.iter_lines())
    assert 0 < streamed[0] < 60 and 0 < streamed[1] < 10 and time.perf_counter() - t0 < 60
    whole = httpx.post(
        f"{cluster.endpoint}/completions",
        json=body | {"stream": False, "prompt": prompt_of(200, seed=35)},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert whole.status_code == 200 and whole.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert 0 < float(whole.headers["x-mooncake-predicted-ttft"]) < 60
    assert 0 < float(whole.headers["x-mooncake-predicted-tbt"]) < 10
    # what came out reaches the Conductor in the decode worker's reports: how often its quotes held is published
    deadline = time.monotonic() + 10
    while (listing := conductor(cluster).ListInstances(cpb.ListInstancesRequest(), timeout=5)).quotes_measured.get(
        "tbt", 0
    ) < 2:
        assert time.monotonic() < deadline, f"no TBT quote measured: {dict(listing.quotes_measured)}"
        time.sleep(0.1)
    assert listing.quotes_measured["ttft"] >= 2 and 0 <= listing.quote_held["ttft"] <= 1
    console = Console(record=True, width=200)
    console.print(status_table(listing))
    assert "quotes held (within 25%): TTFT " in console.export_text()


def test_chat_streaming_and_not_give_the_same_greedy_text_and_usage(client, tok):
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    assert full.usage.prompt_tokens == len(tok.encode_chat(MESSAGES))
    assert full.usage.completion_tokens == 24 or full.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(parts) == full.choices[0].message.content
    assert reasons[-1] == full.choices[0].finish_reason
    assert usage.prompt_tokens == full.usage.prompt_tokens and usage.completion_tokens == full.usage.completion_tokens


def test_completion_max_tokens_stop_string_and_prompt_as_ids(client, tok):
    out = client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"
    text = out.choices[0].text
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].strip())
    cut = client.completions.create(
        model="tiny",
        prompt="The quick brown fox",
        max_tokens=7,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    ids = tok.encode("The quick brown fox")
    by_ids = client.completions.create(
        model="tiny", prompt=ids, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == text and by_ids.usage.prompt_tokens == len(ids)


def test_seeded_sampling_is_reproducible(client):
    def sample(seed: int) -> str:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=seed)
        return r.choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_errors_have_openai_shape_and_status(cluster, client):
    with pytest.raises(openai.BadRequestError) as e:  # prompt + max_tokens beyond the 1024-token context
        client.completions.create(model="tiny", prompt=prompt_of(1000), max_tokens=100)
    assert "1024" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=cluster.endpoint, api_key="wrong", max_retries=0).models.list()
    r = httpx.post(
        f"{cluster.endpoint}/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "tiny", "messages": [], "max_tokens": 4},
    )
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}
    assert [m.id for m in client.models.list()] == ["tiny"]
    health = httpx.get(cluster.endpoint.replace("/v1", "/health")).json()
    assert health["alive"] == {"prefill": 2, "decode": 1, "kvstore": 2}


# -- equivalence and the pool ------------------------------------------------------------------------


@pytest.mark.parametrize("length", [5, 16, 100, 700])  # under a block, one block, several, several engine steps
def test_disaggregated_greedy_equals_one_engine(cluster, tiny_dir, length):
    prompt = prompt_of(length, seed=length)
    got = generate(backend(cluster), f"eq-{length}", prompt, 20, temperature=0.0, ignore_eos=True)
    assert tokens(got) == reference_tokens(tiny_dir, prompt, 20)
    assert got[-1].prompt_tokens == length and got[-1].completion_tokens == 20 and got[-1].finish_reason == "length"


def test_a_shared_prefix_is_served_from_the_pool_with_the_same_tokens(cluster, client, tiny_dir):
    shared = prompt_of(320, seed=99)
    first = client.completions.create(
        model="tiny",
        prompt=shared + prompt_of(40, seed=1),
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second_prompt = shared + prompt_of(50, seed=2)
    second = client.completions.create(
        model="tiny", prompt=second_prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert second.usage.prompt_tokens_details.cached_tokens == 320  # the 20 shared blocks
    tok = Tokenizer.from_dir(tiny_dir)
    assert second.choices[0].text == tok.decode(reference_tokens(tiny_dir, second_prompt, 12))
    metrics = httpx.get(cluster.endpoint.replace("/v1", "/metrics")).text
    cached = [line for line in metrics.splitlines() if line.startswith("mooncake_gateway_cached_prompt_tokens_total{")]
    assert cached and sum(float(line.rsplit(" ", 1)[1]) for line in cached) >= 320


def test_a_prefix_on_the_other_prefill_node_is_pulled_and_kept(cluster, tiny_dir):
    """prefill-0 computes a prompt into kv0; with prefill-0 draining, prefill-1 serves the next one by pulling from
    kv0."""
    stub = conductor(cluster)
    listed = instances(cluster)

    def reregister(name: str) -> None:  # a drained instance comes back by registering again
        i = listed[name]
        stub.Register(
            cpb.RegisterRequest(
                id=i.id, role=i.role, address=i.address, node=i.node, model=i.model, capacity=i.capacity
            ),
            timeout=5,
        )

    shared = prompt_of(256, seed=1234)
    be = backend(cluster)
    try:
        stub.Drain(cpb.DrainRequest(id="prefill-1"), timeout=5)
        generate(be, "pull-a", shared + [7, 8, 9], 4, temperature=0.0, ignore_eos=True)
        reregister("prefill-1")
        stub.Drain(cpb.DrainRequest(id="prefill-0"), timeout=5)
        prompt = shared + [11, 12, 13, 14, 15]
        got = generate(be, "pull-b", prompt, 16, temperature=0.0, ignore_eos=True)
    finally:
        reregister("prefill-0")
        reregister("prefill-1")
    assert got[-1].cached_tokens_by_tier.get("remote") == 256
    assert tokens(got) == reference_tokens(tiny_dir, prompt, 16)
    deadline = time.monotonic() + 5  # kept on kv1 (hot blocks replicate): the Conductor's index hears of it
    while instances(cluster)["kv1"].indexed_blocks < 16 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert instances(cluster)["kv1"].indexed_blocks >= 16


# -- overload and failures ------------------------------------------------------------------------------


def test_the_conductors_early_rejection_is_429_with_retry_after(tiny_dir, tmp_path):
    c = start_cluster(tiny_dir, tmp_path, tbt_slo_s=0.001)  # no decode step can meet it: every request is turned away
    try:
        r = httpx.post(
            f"{c.endpoint}/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4}, timeout=30
        )
        assert r.status_code == 429
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error" and "TBT" in r.json()["error"]["message"]
        # what it could have instead: a start later (its Retry-After); no SLO class would take it (there is one)
        offer = r.json()["error"]["offer"]
        assert 0 < offer["start_in_s"] <= int(r.headers["Retry-After"])
        assert offer["slo_class"] is None
    finally:
        c.stop()


def test_a_request_may_name_its_slo_class_and_ask_for_tighter_targets_over_http(cluster):
    """The SLO extensions of a request body: its own TTFT target, tighter than the class's (300 s here), is what it is
    admitted by (1 ms: no prefill meets it, 429 saying so); a looser one is the class's (it is served); an SLO class
    the Conductor does not have, or a target of 0, is a 400 naming the problem."""
    url, auth = f"{cluster.endpoint}/chat/completions", {"Authorization": f"Bearer {KEY}"}

    def post(**extra) -> httpx.Response:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **extra}
        return httpx.post(url, json=body, headers=auth, timeout=60)

    r = post(ttft_slo_s=0.001)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error" and "0.001 s SLO" in r.json()["error"]["message"]
    r = post(ttft_slo_s=3000.0, tbt_slo_s=50.0)  # looser than the class's: the class's
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    r = post(slo_class="no-such-class")
    assert r.status_code == 400 and "no-such-class" in r.json()["error"]["message"]
    r = post(tbt_slo_s=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tbt_slo_s"


def test_a_request_the_decode_worker_refuses_leaves_the_conductors_count_of_its_batch(cluster, client):
    """The decode worker reports what it holds (its batch cap, its landing blocks), and the Conductor refuses what it
    would. A request the Conductor placed but the worker then refused (here: malformed) is reported finished: else the
    Conductor would count it in the worker's batch, and after a batch of them refuse everything (decode_busy)."""

    def idle(d: cpb.InstanceInfo) -> bool:  # the previous test's request gone from its heartbeat too
        held = d.load.running_blocks + d.load.landing_held_blocks + d.kv_held
        return d.load.batch_cap > 0 and held == 0 and d.load.free_kv_blocks == d.kv_blocks

    deadline = time.monotonic() + 30
    while not idle(decode := next(i for i in instances(cluster).values() if i.role == cpb.DECODE)):
        assert time.monotonic() < deadline, f"the decode worker's heartbeat never said it was idle: {decode.load}"
        time.sleep(0.2)
    # prompts land in its engine's own cache: the room it reports is that cache's free blocks (none reserved now)
    assert decode.load.landing_blocks == decode.load.free_kv_blocks > 0
    # and it registered that cache as its KV capacity, shared with its batch: idle, nothing of it is held
    assert decode.kv_blocks == decode.load.free_kv_blocks and decode.kv_held == 0
    assert decode.load.running_blocks == decode.load.landing_held_blocks == 0
    console = Console(record=True, width=200)
    console.print(status_table(conductor(cluster).ListInstances(cpb.ListInstancesRequest(), timeout=5)))
    shown = console.export_text()
    assert f" of {decode.load.batch_cap}" in shown  # `mooncake status` shows the running batch against its cap
    assert f"0 of {decode.kv_blocks} held" in shown  # and its KV: the blocks held of its capacity
    # and how each component's KV crosses hosts: tcp on this machine (no RDMA device), the reason in ListInstances
    assert "decode (native, KV over tcp)" in shown and "kvstore (pool, KV over tcp)" in shown
    assert instances(cluster)["decode-0"].transport.startswith("tcp (no RDMA device")
    stub = conductor(cluster)
    worker = wpb_grpc.DecodeStub(tls.grpc_channel(decode.address))
    for n in range(decode.load.batch_cap + 2):
        deadline = time.monotonic() + 5  # the worker's report reaches the Conductor in milliseconds
        while (
            placed := stub.Schedule(
                cpb.ScheduleRequest(request_id=f"refused-{n}", prompt_tokens=8, block_tokens=16), timeout=10
            )
        ).HasField("rejection"):
            assert time.monotonic() < deadline, f"request {n}: {placed.rejection.message}"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as refused:
            list(
                worker.Generate(wpb.GenerateRequest(request_id=f"refused-{n}", placement=placed.placement), timeout=10)
            )
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "empty" in refused.value.details()
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3 or out.choices[0].finish_reason == "stop"


def test_with_one_worker_of_each_role_a_killed_workers_requests_wait_for_its_restart_and_complete(tiny_dir, tmp_path):
    """``make up``'s shape: the decode worker dies mid-stream (the stream resumes on it once it is back, with the
    tokens an undisturbed run gives), then the prefill worker dies (a new request waits for it)."""
    c = start_cluster(tiny_dir, tmp_path, max_model_len=2048)
    client = openai.OpenAI(base_url=c.endpoint, api_key="none", max_retries=0, timeout=120)
    ask = dict(model="tiny", prompt="Once upon a time", max_tokens=300, temperature=0, extra_body={"ignore_eos": True})
    try:
        undisturbed = client.completions.create(**ask)
        stream = client.completions.create(**ask, stream=True)
        it = iter(stream)
        texts = [next(it).choices[0].text]
        os.kill(c.component("decode-0").proc.pid, signal.SIGKILL)
        for chunk in it:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
        assert "".join(texts) == undisturbed.choices[0].text
        assert c.component("decode-0").restarts == 1
        # a constrained stream with logprobs: the new decode worker replays the client's tokens into its grammar
        # matcher, and the text, the logprobs and the JSON are the undisturbed run's
        numbers = {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 60,
            "maxItems": 60,
        }
        ask_json = dict(
            model="tiny",
            messages=[{"role": "user", "content": "Sixty numbers"}],
            max_tokens=600,
            temperature=0,
            logprobs=True,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": numbers}},
        )
        undisturbed = client.chat.completions.create(**ask_json).choices[0]
        it = iter(client.chat.completions.create(**ask_json, stream=True))
        chunks = [next(it), next(it)]  # the role, then the first token
        os.kill(c.component("decode-0").proc.pid, signal.SIGKILL)
        chunks += [chunk for chunk in it if chunk.choices]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        logprobs = [e.logprob for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
        assert text == undisturbed.message.content
        jsonschema.validate(json.loads(text), numbers)
        assert logprobs == pytest.approx([e.logprob for e in undisturbed.logprobs.content], abs=1e-4)
        assert c.component("decode-0").restarts == 2
        os.kill(c.component("prefill-0").proc.pid, signal.SIGKILL)
        r = client.completions.create(**{**ask, "max_tokens": 8})
        assert (
            r.usage.completion_tokens == 8
            and r.choices[0].text == client.completions.create(**{**ask, "max_tokens": 8}).choices[0].text
        )
        assert c.component("prefill-0").restarts == 1
    finally:
        c.stop()


def test_penalties_and_biases_hold_across_the_prefill_decode_hand_off(cluster, client, tok, tiny_dir):
    """The first token is sampled on the prefill worker, the rest on the decode worker: both apply them."""
    biased = client.completions.create(
        model="tiny",
        prompt=prompt_of(20, seed=3),
        max_tokens=6,
        temperature=0,
        logit_bias={"123": 100},
        extra_body={"ignore_eos": True},
    )
    assert biased.choices[0].text == tok.decode([123] * 6) and biased.usage.completion_tokens == 6
    be = backend(cluster)
    prompt = prompt_of(40, seed=4)
    shaping = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2, min_tokens=3)
    chunks = generate(be, "penalised", prompt, 24, temperature=0.0, ignore_eos=True, **shaping)
    assert tokens(chunks) == reference_tokens(tiny_dir, prompt, 24, sampling=shaping)
    assert tokens(chunks) != reference_tokens(tiny_dir, prompt, 24)  # they did change the output
    bad = httpx.post(
        f"{cluster.endpoint}/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 4, "logit_bias": {"999999": 5}},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_logprobs_and_a_grammar_hold_across_the_prefill_decode_hand_off(cluster, client, tok, tiny_dir):
    """The prefill worker's first token carries its logprobs and starts the grammar; the decode worker replays
    that token into its own matcher and goes on: the same tokens, logprobs and valid JSON as one engine alone."""
    prompt = prompt_of(30, seed=8)
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=5, extra_body={"ignore_eos": True}
    )
    engine = LLMEngine(
        EngineConfig(model=str(tiny_dir), block_size=16, num_kv_blocks=512, max_model_len=1024), tokenizer=tok
    )
    alone = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5))[0]
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in alone.output_token_ids]
    ref = reference_steps(engine, prompt, alone.output_token_ids)
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref], abs=1e-4)
    for got, want in zip(lp.top_logprobs, ref):  # keyed by text: tokens of the same text (U+FFFD pieces) share a key
        want_by_text = {}
        for t, v in want.top:
            want_by_text.setdefault(tok.decode([t], skip_special_tokens=False), v)
        assert got == pytest.approx(want_by_text, abs=1e-4)
    # echo + logprobs: the prefill worker computes the (pool-cached) prompt whole for the prompt's logprobs
    echoed = (
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            logprobs=2,
            echo=True,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .logprobs
    )
    whole = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    assert echoed.token_logprobs[0] is None
    assert echoed.token_logprobs[1:30] == pytest.approx([x.logprob for x in whole.prompt_logprobs], abs=1e-4)
    assert echoed.token_logprobs[30:] == pytest.approx(lp.token_logprobs[:2], abs=1e-4)
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        },
        "required": ["n", "tags"],
        "additionalProperties": False,
    }
    grammar = grammar_for(json_schema=schema)
    be = backend(cluster)
    for seed in range(6):
        chunks = generate(be, f"json-{seed}", prompt, 60, temperature=1.0, seed=seed, grammar=grammar)
        text = "".join(c.text for c in chunks)
        jsonschema.validate(json.loads(text), schema)
        one = engine.generate([prompt], SamplingParams(max_tokens=60, temperature=1.0, seed=seed, grammar=grammar))[0]
        assert tokens(chunks) == one.output_token_ids


def test_a_seed_over_2_63_and_a_top_k_over_2_32_are_served_as_one_engine_serves_them(client, tiny_dir):
    """Both are valid OpenAI values the wire (int64, uint32) cannot hold as they are (found by tests/test_fuzz.py)."""
    prompt = prompt_of(12, seed=9)
    kwargs = dict(
        model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True, "top_k": 2**40}
    )
    big = client.completions.create(seed=2**64 - 3, **kwargs).choices[0].text
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), block_size=16, num_kv_blocks=64, max_model_len=1024))
    alone = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=2**64 - 3, ignore_eos=True))[0]
    assert big == Tokenizer.from_dir(tiny_dir).decode(alone.output_token_ids)


def reference_steps(engine: LLMEngine, prompt: list[int], outputs: list[int]) -> list:
    """One engine's logprobs of each given token, step by step (teacher-forced through initial outputs)."""
    steps = []
    for i in range(len(outputs)):
        params = SamplingParams(max_tokens=i + 1, temperature=0.0, ignore_eos=True, logprobs=5)
        rid = engine.add_request(prompt, params, options=RequestOptions(outputs=tuple(outputs[:i])))
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.new_logprobs:
                    steps.append(out.new_logprobs[-1])
    return steps


def computed_tokens(cluster) -> float:
    """Prompt tokens the cluster's prefill workers computed (their metrics)."""
    total = 0.0
    for name in ("prefill-0", "prefill-1"):
        lines = httpx.get(f"http://{cluster.component(name).info['metrics']}/metrics", timeout=10).text.splitlines()
        total += sum(
            float(x.split()[-1])
            for x in lines
            if x.startswith('mooncake_prefill_prompt_tokens_total{source="computed"}')
        )
    return total


def assert_n_choices_prefill_their_prompt_once(cluster, client: openai.OpenAI, seed: int) -> None:
    prompt = prompt_of(100, seed=seed)  # 6 full blocks of 16 and 4 tokens
    before = computed_tokens(cluster)
    r = client.completions.create(
        model="tiny", prompt=prompt, n=4, max_tokens=6, temperature=1.0, seed=1, extra_body={"ignore_eos": True}
    )
    assert len({c.text for c in r.choices}) == 4
    assert r.usage.prompt_tokens == 100 and r.usage.completion_tokens == 24
    assert computed_tokens(cluster) - before == 100 + 3 * 4  # once whole, then each sibling's last 4 tokens


def test_n_choices_prefill_their_prompt_once(cluster, client):
    """Choice 0 is prefilled; its siblings start once it has its first token and compute only the last, partial block
    (prefill workers' metrics)."""
    assert_n_choices_prefill_their_prompt_once(cluster, client, seed=21)


def test_n_choices_prefill_their_prompt_once_while_the_pool_write_lags(tiny_dir, tmp_path, monkeypatch):
    """The pool write that follows the first choice's answer lags half a second (a fault): its siblings, sent at its
    first token, meet neither the blocks in the pool nor the Conductor's index knowing of them. They follow the first
    choice (the Conductor places them where its blocks are being written) and their prefill waits for the write;
    without that they computed the whole prompt again (400 tokens), as a loaded CI machine once saw."""
    monkeypatch.setenv(SLOW_WRITE_ENV, "0.5")  # the cluster's prefill workers inherit it
    c = start_cluster(tiny_dir, tmp_path, prefill=2, decode=1)
    try:
        client = openai.OpenAI(base_url=c.endpoint, api_key="none", max_retries=0, timeout=60)
        assert_n_choices_prefill_their_prompt_once(c, client, seed=22)
    finally:
        c.stop()


@pytest.mark.slow
def test_smollm2_disaggregated_equals_one_engine_with_and_without_the_pool(smollm2_dir, tmp_path):
    c = start_cluster(smollm2_dir, tmp_path, model_name="smollm2", pool_dram_mib=256, max_model_len=1024)
    try:
        tok = Tokenizer.from_dir(smollm2_dir)
        long_question = [
            {"role": "system", "content": "You are a helpful assistant. " * 20},
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
        ]
        prompt = tok.encode_chat(long_question)
        be = backend(c)
        cold = generate(be, "smol-cold", prompt, 24, temperature=0.0, ignore_eos=True)
        warm = generate(be, "smol-warm", prompt, 24, temperature=0.0, ignore_eos=True)
        ref = reference_tokens(smollm2_dir, prompt, 24)
        assert cold[-1].cached_tokens == 0 and warm[-1].cached_tokens == len(prompt) // 16 * 16
        assert tokens(cold) == ref
        assert tokens(warm) == ref
        text = "".join(ch.text for ch in cold)
        assert text == tok.decode(ref)
    finally:
        c.stop()


def test_with_no_decode_worker_alive_requests_wait_hold_s_then_get_503_with_retry_after(tiny_dir, tmp_path):
    c = start_cluster(tiny_dir, tmp_path, restart=False, hold_s=2.0, ttft_slo_s=3.0)  # the retry budget: the TTFT SLO
    try:
        c.component("decode-0").kill()
        start = time.monotonic()
        r = httpx.post(
            f"{c.endpoint}/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4}, timeout=30
        )
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert int(r.headers["retry-after"]) >= 1
        assert time.monotonic() - start >= 2.0  # it waited for the cluster to recover first
        assert (
            httpx.get(c.endpoint.replace("/v1", "/health")).status_code == 503 or True
        )  # until the Conductor expires it
    finally:
        c.stop()


def test_a_worker_whose_kv_would_differ_is_refused_and_exits_saying_why(cluster, tiny_dir, tmp_path):
    """A bfloat16 decode worker joining a float32 cluster (or a vLLM one joining ours): the Conductor refuses it."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "decode",
            "--id",
            "decode-bf16",
            "--model",
            str(tiny_dir),
            "--dtype",
            "bfloat16",
            "--conductor",
            cluster.conductor_address,
            "--num-kv-blocks",
            "64",
            "--shm-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "the Conductor refused this worker" in proc.stderr and "decode-bf16 (native engine" in proc.stderr
    assert "READY" not in proc.stdout
    assert "decode-bf16" not in instances(cluster)
