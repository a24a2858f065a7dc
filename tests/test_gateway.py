"""The OpenAI gateway over a real engine: a uvicorn server on loopback, the official
``openai`` client and raw ``httpx``, a tiny random-weight llama (LocalBackend).

Overload and dead workers cannot be caused on one local engine, so a second server runs
over ``FaultyBackend``: the same real backend, failing on demand the way the cluster
backend does (before the first chunk, or in the middle of a stream).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from mooncake.engine.config import EngineConfig
from mooncake.engine.tokenizer import Tokenizer
from mooncake.gateway import GatewayConfig, create_app
from mooncake.gateway.local_backend import LocalBackend
from mooncake.localproc import free_port
from mooncake.serving.types import GenerationBackend, GenerationChunk, GenerationRequest, Offer, Rejected, Unavailable

pytestmark = pytest.mark.timeout(120)

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 512
MESSAGES = [{"role": "user", "content": "Tell me about the quick brown fox."}]

# A template like Llama 2's and Mistral's, which refuse two user turns in a row.
STRICT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class FaultyBackend(GenerationBackend):
    """``inner``, failing as ``fault`` says: "reject" (429), "unavailable" (503), "midstream" (503 after 2 chunks),
    "shed" (429 before any work: ``shedding``)."""

    def __init__(self, inner: GenerationBackend) -> None:
        self.inner = inner
        self.model_name = inner.model_name
        self.max_model_len = inner.max_model_len
        self.fault: str | None = None
        self.generated = 0  # requests that reached generate

    def shedding(self) -> Rejected | None:
        return (
            Rejected("every prefill queue is past the TTFT SLO", code="ttft_slo", retry_after_s=4.2)
            if self.fault == "shed"
            else None
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.generated += 1
        if self.fault == "reject":
            raise Rejected("the decode instances are over their TBT SLO", retry_after_s=2.5, offer=Offer(2.5, "batch"))
        if self.fault == "unavailable":
            raise Unavailable("no decode worker is alive")
        chunks = self.inner.generate(request)
        try:
            sent = 0
            async for chunk in chunks:
                yield chunk
                sent += 1
                if self.fault == "midstream" and sent == 2:
                    raise Unavailable("the decode worker died")
        finally:
            await chunks.aclose()

    async def health(self) -> dict:
        if self.fault == "unavailable":
            raise Unavailable("no decode worker is alive")
        return await self.inner.health()

    async def close(self) -> None:
        pass  # the inner backend belongs to the main server


class Served:
    """``app`` on a uvicorn server on a free loopback port, in a thread."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def backend(tiny_dir) -> Iterator[LocalBackend]:
    config = EngineConfig(
        model=str(tiny_dir), dtype="float32", block_size=16, num_kv_blocks=256, max_model_len=MAX_MODEL_LEN
    )
    local = LocalBackend(config, "tiny")
    yield local
    asyncio.run(local.close())  # idempotent: the main server's shutdown closed it already


@pytest.fixture(scope="module")
def gateway(backend, tokenizer) -> Iterator[str]:
    served = Served(create_app(backend, tokenizer, GatewayConfig(served_model_name="tiny", api_key=API_KEY)))
    yield served.url
    served.stop()


@pytest.fixture(scope="module")
def faulty(backend, tokenizer) -> Iterator[tuple[str, FaultyBackend]]:
    strict = Tokenizer(
        tokenizer.backend,
        special_tokens={"eos_token": "<|im_end|>"},
        chat_template=STRICT_TEMPLATE,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    wrapper = FaultyBackend(backend)
    served = Served(create_app(wrapper, strict, GatewayConfig(served_model_name="tiny")))
    yield served.url, wrapper
    served.stop()


@pytest.fixture
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=API_KEY, max_retries=0, timeout=30)


@pytest.fixture
def http(gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, headers=AUTH, timeout=30) as c:
        yield c


# -- helpers --------------------------------------------------------------------------------


def sse_events(response: httpx.Response) -> list:
    """The ``data:`` payloads of an SSE response: dicts, and the string "[DONE]"."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metric(base_url: str, name: str, **labels: str) -> float:
    """The value of one sample on /metrics (0 when absent)."""
    text = httpx.get(f"{base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_until_idle(backend: LocalBackend, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if backend.loop.num_running == 0 and not backend.engine.has_unfinished():
            return True
        time.sleep(0.02)
    return False


# -- generation -------------------------------------------------------------------------------


def test_chat_streamed_text_equals_whole_text_and_usage_counts_tokens(client, tokenizer):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=24)
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion" and whole.model == "tiny"
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    usage = whole.usage
    assert usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))
    assert 1 <= usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # EOS before the budget is "stop"; running out of it is "length".
    assert choice.finish_reason == ("length" if usage.completion_tokens == 24 else "stop")

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in with_choices][-1] == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert with_choices[-1].choices[0].delta.content is None  # the finishing chunk carries no text
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == usage.completion_tokens
    assert last.usage.prompt_tokens == usage.prompt_tokens
    # The second run found the first one's prompt blocks in the prefix cache.
    assert last.usage.prompt_tokens_details.cached_tokens > 0


def test_logit_bias_and_penalties_reach_the_engine(client, tokenizer):
    biased = client.completions.create(
        model="tiny",
        prompt="Once",
        max_tokens=5,
        temperature=0,
        logit_bias={"123": 100},
        extra_body={"ignore_eos": True},
    )
    assert biased.choices[0].text == tokenizer.decode([123] * 5)
    # the same token forced again and again: a frequency penalty of 2 per repetition overcomes a bias of 7 by the 4th
    forced = dict(
        model="tiny", prompt="Once", max_tokens=6, temperature=0, logit_bias={"123": 7}, extra_body={"ignore_eos": True}
    )
    plain = client.completions.create(**forced).choices[0].text
    penalised = client.completions.create(**forced, frequency_penalty=2.0).choices[0].text
    assert plain == tokenizer.decode([123] * 6) and penalised != plain


def test_stream_without_include_usage_has_no_usage_and_ends_with_done(http):
    with http.stream(
        "POST", "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "stream": True}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["delta"] == {} and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_ignore_eos_gives_exactly_max_tokens(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    # max_completion_tokens wins over max_tokens.
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=9, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_completion_of_text_and_of_token_ids(client, tokenizer):
    prompt = "Prefill is compute bound"
    ids = tokenizer.encode(prompt)
    by_text = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=12)
    assert by_text.id.startswith("cmpl-") and by_text.object == "text_completion"
    assert by_text.usage.prompt_tokens == len(ids)
    by_ids = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=12)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.completion_tokens == by_text.usage.completion_tokens
    streamed = list(
        client.completions.create(
            model="tiny",
            prompt=[ids],
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == by_text.choices[0].text
    assert streamed[-1].usage.completion_tokens == by_text.usage.completion_tokens


def test_stop_string_cuts_the_text_before_it(client):
    ask = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=48, extra_body={"ignore_eos": True})
    free = client.chat.completions.create(**ask).choices[0].message.content
    # An ASCII piece from the middle of the text, first seen where we take it.
    stop = next(
        free[i : i + 3]
        for i in range(len(free) // 3, len(free) - 3)
        if free[i : i + 3].isascii() and free[i : i + 3].strip() and free.find(free[i : i + 3]) == i
    )
    expected = free[: free.index(stop)]
    cut = client.chat.completions.create(**ask, stop=[stop])
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    streamed = list(client.chat.completions.create(**ask, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_seeds_differ(client):
    def sample(seed: int) -> str:
        out = client.completions.create(
            model="tiny",
            prompt="A serving system",
            temperature=1.0,
            seed=seed,
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(seed) for seed in range(4)}) > 1


def test_unknown_and_neutral_fields_are_accepted(http):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 3,
        "logprobs": False,
        "user": "alice",
        "parallel_tool_calls": False,
        "top_k": 5,
        "presence_penalty": 0,
        "cache_salt": "tenant-a",
        "n": 1,
        "service_tier": "auto",  # OpenAI's, cannot matter here: accepted (unknown fields: test_openai_serving_fields)
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == r.json()["id"]


# -- endpoints ------------------------------------------------------------------------------


def test_models_health_and_metrics(client, gateway):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    health = httpx.get(f"{gateway}/health")  # open without the key, like /metrics
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert metric(gateway, "mooncake_gateway_requests_total", endpoint="/v1/chat/completions", status="200") >= 1
    assert metric(gateway, "mooncake_gateway_requests_total", endpoint="/v1/models", status="200") >= 1
    assert metric(gateway, "mooncake_gateway_ttft_seconds_count") >= 1
    assert metric(gateway, "mooncake_gateway_tbt_seconds_count") >= 1
    assert metric(gateway, "mooncake_gateway_e2e_seconds_count") >= 1
    assert metric(gateway, "mooncake_gateway_prompt_tokens_total") >= len(MESSAGES)
    assert metric(gateway, "mooncake_gateway_completion_tokens_total") >= 4
    assert metric(gateway, "mooncake_gateway_cached_prompt_tokens_total", tier="engine") > 0
    assert metric(gateway, "mooncake_gateway_running_requests") == 0


# -- errors ---------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG_IDS = [100] * 600


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, {"model": "tiny", "messages": MESSAGES, "temperature": 2.5}, "temperature"),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "temperature": -0.1}, "temperature"),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "top_p": 0}, "top_p"),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "max_tokens": "many"}, "max_tokens"),
        (CHAT, {"model": "tiny", "messages": []}, "messages"),
        (CHAT, {"model": "tiny"}, "messages"),
        (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        (CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            CHAT,
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "n": 0}, "n"),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "n": 17}, "n"),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format.type"),
        (
            CHAT,
            {"model": "tiny", "messages": MESSAGES, "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
        ),
        (
            CHAT,
            {
                "model": "tiny",
                "messages": MESSAGES,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                    },
                },
            },
            "response_format",
        ),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
        (
            CHAT,
            {
                "model": "tiny",
                "messages": MESSAGES,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            CHAT,
            {"model": "tiny", "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "stream": "yes please"}, "stream"),
        (CHAT, {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        (COMPLETIONS, {"model": "tiny", "prompt": ""}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": []}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": ["x"] * 65}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": "x", "n": 2, "best_of": 1}, "best_of"),
        (COMPLETIONS, {"model": "tiny", "prompt": "x", "best_of": 3, "stream": True}, "best_of"),
        (COMPLETIONS, {"model": "tiny", "prompt": "x", "logprobs": 6}, "logprobs"),
        (COMPLETIONS, {"model": "tiny", "prompt": [10**6]}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": LONG_IDS}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": "x", "seed": 2**70}, "seed"),
        (COMPLETIONS, {"model": "tiny", "prompt": 5}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        (COMPLETIONS, {"model": "tiny", "prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
        (COMPLETIONS, {"model": "tiny", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        (COMPLETIONS, {"model": "tiny", "prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
        (COMPLETIONS, {"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        (COMPLETIONS, {"model": "tiny", "prompt": "x", "logit_bias": {"1000000": 1}}, "logit_bias"),
        (COMPLETIONS, {"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ],
)
def test_bad_requests_are_400_with_the_offending_param(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_malformed_json_and_non_object_bodies_are_400(http):
    for content in (b'{"model": "tiny", "messages": [', b"[1, 2]", b"null"):
        r = http.post(CHAT, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "path, body",
    [
        (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        (COMPLETIONS, b'{"model": "\\udc00", "prompt": "hi"}'),
        ("/tokenize", b'{"prompt": "\\ud800"}'),
    ],
)
def test_a_lone_surrogate_in_a_string_is_400_and_a_pair_is_text(http, path, body):
    # found by tests/test_fuzz.py: the tokenizer, protobuf and the error response itself failed on these (500)
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_unicode"
    emoji = http.post(
        "/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}', headers={"content-type": "application/json"}
    )
    assert emoji.status_code == 200, emoji.text


def test_context_overflow_messages_say_the_numbers(http):
    r = http.post(COMPLETIONS, json={"model": "tiny", "prompt": LONG_IDS})
    assert r.status_code == 400 and "512" in r.json()["error"]["message"] and "600" in r.json()["error"]["message"]
    r = http.post(COMPLETIONS, json={"model": "tiny", "prompt": [100] * 100, "max_tokens": 500})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "512" in error["message"] and "600" in error["message"]
    # Without max_tokens the rest of the context is the budget, so a 500-token prompt still fits.
    r = http.post(COMPLETIONS, json={"model": "tiny", "prompt": [100] * 500, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 500


def test_chat_template_refusal_is_400(faulty):
    url, _ = faulty
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    r = httpx.post(f"{url}{CHAT}", json=body)
    assert r.status_code == 400 and "alternate" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"


def test_api_key_is_required_on_v1_only(gateway):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{gateway}{CHAT}", json={"model": "tiny", "messages": MESSAGES}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{gateway}/v1/models").status_code == 401
    wrong = openai.OpenAI(base_url=f"{gateway}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{gateway}/health").status_code == 200
    assert httpx.get(f"{gateway}/metrics").status_code == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert caught.value.code == "model_not_found"


def test_backend_rejection_is_429_with_retry_after(faulty):
    url, backend = faulty
    backend.fault = "reject"
    try:
        for stream in (False, True):  # a stream is refused before its first event: still a plain 429
            r = httpx.post(f"{url}{CHAT}", json={"model": "tiny", "messages": MESSAGES, "stream": stream})
            assert r.status_code == 429 and r.headers["retry-after"] == "3"  # 2.5 s, rounded up
            assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "overloaded"
            # what the cluster could serve instead: a later start, or another SLO class at once
            assert r.json()["error"]["offer"] == {"start_in_s": 2.5, "slo_class": "batch"}
        assert metric(url, "mooncake_gateway_rejections_total", reason="overloaded") == 2
        assert metric(url, "mooncake_gateway_requests_total", endpoint=CHAT, status="429") == 2
    finally:
        backend.fault = None


def test_a_shedding_backend_gets_429_before_the_prompt_is_even_tokenized(faulty):
    url, backend = faulty
    backend.fault = "shed"
    before = backend.generated
    try:
        for path, body in (
            (CHAT, {"model": "tiny", "messages": MESSAGES, "stream": True}),
            (COMPLETIONS, {"model": "tiny", "prompt": "x"}),
        ):
            r = httpx.post(f"{url}{path}", json=body)
            assert r.status_code == 429 and r.headers["retry-after"] == "5"
            assert r.json()["error"]["code"] == "ttft_slo" and "TTFT SLO" in r.json()["error"]["message"]
        assert backend.generated == before  # refused before the backend was asked
        assert metric(url, "mooncake_gateway_rejections_total", reason="ttft_slo") == 2
        assert metric(url, "mooncake_gateway_rejection_seconds_count") >= 2
        # a request that is wrong anyway still hears why (its 4xx), not the 429
        r = httpx.post(f"{url}{CHAT}", json={"model": "no-such-model", "messages": MESSAGES})
        assert r.status_code == 404
    finally:
        backend.fault = None
    r = httpx.post(f"{url}{COMPLETIONS}", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and backend.generated == before + 1


def test_backend_unavailable_is_503_and_health_says_so(faulty):
    url, backend = faulty
    backend.fault = "unavailable"
    try:
        r = httpx.post(f"{url}{COMPLETIONS}", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable"
    finally:
        backend.fault = None
    assert httpx.get(f"{url}/health").status_code == 200


def test_failure_mid_stream_is_an_error_event_then_done(faulty, backend):
    url, faulty_backend = faulty
    faulty_backend.fault = "midstream"
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 20, "ignore_eos": True, "temperature": 0}
    try:
        with httpx.stream("POST", f"{url}{CHAT}", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "unavailable"
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
        r = httpx.post(f"{url}{CHAT}", json=body)  # not streaming: the error's own status
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        faulty_backend.fault = None
    assert wait_until_idle(backend)  # the failed requests were cancelled in the engine
    assert metric(url, "mooncake_gateway_requests_total", endpoint=CHAT, status="503") == 2


# -- client disconnect --------------------------------------------------------------------------


def test_client_leaving_a_stream_cancels_its_request(gateway, backend):
    assert wait_until_idle(backend)  # so that what runs next is ours
    budget = MAX_MODEL_LEN - 2
    gone_before = metric(gateway, "mooncake_gateway_requests_total", endpoint=COMPLETIONS, status="499")
    tokens_before = metric(gateway, "mooncake_gateway_completion_tokens_total")
    body = {"model": "tiny", "prompt": [100, 101], "max_tokens": budget, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=gateway, headers=AUTH, timeout=30) as c:
        with c.stream("POST", COMPLETIONS, json=body) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
    assert wait_until_idle(backend)
    assert metric(gateway, "mooncake_gateway_requests_total", endpoint=COMPLETIONS, status="499") == gone_before + 1
    assert metric(gateway, "mooncake_gateway_completion_tokens_total") - tokens_before < budget  # cut short
    assert metric(gateway, "mooncake_gateway_running_requests") == 0


def test_client_leaving_before_a_whole_response_cancels_its_request(gateway, backend):
    assert wait_until_idle(backend)  # so that what runs next is ours
    budget = MAX_MODEL_LEN - 2
    gone_before = metric(gateway, "mooncake_gateway_requests_total", endpoint=COMPLETIONS, status="499")
    tokens_before = metric(gateway, "mooncake_gateway_completion_tokens_total")
    body = json.dumps({"model": "tiny", "prompt": [100, 102], "max_tokens": budget, "ignore_eos": True}).encode()
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    url = httpx.URL(gateway)
    with socket.create_connection((url.host, url.port)) as conn:
        conn.sendall(head + body)
        deadline = time.monotonic() + 5
        while backend.loop.num_running == 0:  # leave once the engine is generating it
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.002)
    assert wait_until_idle(backend)
    assert metric(gateway, "mooncake_gateway_requests_total", endpoint=COMPLETIONS, status="499") == gone_before + 1
    assert metric(gateway, "mooncake_gateway_completion_tokens_total") - tokens_before < budget


# -- vLLM's /tokenize and /detokenize ----------------------------------------------------------


def test_tokenize_gives_the_ids_the_completions_see_and_detokenize_reverses_them(http, tokenizer):
    r = http.post("/tokenize", json={"model": "tiny", "prompt": "The quick brown fox"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode("The quick brown fox") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == tokenizer.encode_chat(MESSAGES)
    back = http.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == tokenizer.decode(body["tokens"])


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_tokenize_and_detokenize_refuse_bad_input_in_openai_shape(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_needs_the_api_key_as_v1_does(gateway):
    r = httpx.post(f"{gateway}/tokenize", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
