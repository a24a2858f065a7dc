"""The OpenAI API as applications use it, through the official client: logprobs, n, best_of, batched prompts,
echo, structured output and tools, streamed and not (issue 18), on one engine behind the gateway.

The disaggregated path (the same features across the prefill/decode hand-off) is in
test_serving_cluster.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
import torch
import transformers
from test_gateway import Served

from mooncake.engine.config import EngineConfig
from mooncake.engine.tokenizer import Tokenizer
from mooncake.gateway import GatewayConfig, create_app
from mooncake.gateway import tools as tool_format
from mooncake.gateway.local_backend import LocalBackend
from mooncake.gateway.protocol import ToolDefinition
from mooncake.serving.types import GenerationBackend, GenerationRequest, Rejected, Unavailable

MESSAGES = [{"role": "user", "content": "Tell me about the quick brown fox."}]

# nested objects, enums, arrays, bounded strings and integers: every output must validate
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def hf(tiny_dir) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def backend(tiny_dir) -> Iterator[LocalBackend]:
    config = EngineConfig(model=str(tiny_dir), dtype="float32", block_size=16, num_kv_blocks=512, max_model_len=1024)
    local = LocalBackend(config, "tiny")
    yield local
    asyncio.run(local.close())  # idempotent


def serve(backend: GenerationBackend, tok: Tokenizer) -> tuple[Served, openai.OpenAI]:
    served = Served(create_app(backend, tok, GatewayConfig(served_model_name="tiny")))
    return served, openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(backend, tok) -> Iterator[openai.OpenAI]:
    served, c = serve(backend, tok)
    yield c
    served.stop()


class TwoAtATime(GenerationBackend):
    """Turns a generation away (429) while two others run, as a full decode worker does."""

    def __init__(self, inner: GenerationBackend) -> None:
        self.inner, self.model_name, self.max_model_len = inner, inner.model_name, inner.max_model_len
        self.running = self.rejected = 0

    async def generate(self, request: GenerationRequest):
        if self.running >= 2:
            self.rejected += 1
            raise Rejected("two at a time")
        self.running += 1
        try:
            async for chunk in self.inner.generate(request):
                yield chunk
        finally:
            self.running -= 1


def chat_prompt(tok: Tokenizer, messages=MESSAGES) -> list[int]:
    return tok.encode_chat(messages)


@torch.inference_mode()
def greedy_logprobs(hf, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """The reference: transformers' greedy tokens (past EOS) and the log-softmax of the logits before each,
    [steps, V]."""
    ids, rows = list(prompt), []
    for _ in range(steps):
        row = hf(input_ids=torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        rows.append(row)
        ids.append(int(row.argmax()))
    return ids[len(prompt) :], torch.stack(rows)


def texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


# -- logprobs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_models_log_softmax_at_each_greedy_step(client, tok, hf, stream):
    kwargs = dict(
        model="tiny",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    if stream:
        entries = []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                entries.extend(chunk.choices[0].logprobs.content)
    else:
        entries = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    ids, ref = greedy_logprobs(hf, chat_prompt(tok), 12)
    assert [e.token for e in entries] == texts(tok, ids)
    for step, e in enumerate(entries):
        assert e.logprob == pytest.approx(ref[step, ids[step]].item(), abs=1e-4)
        assert e.bytes == list(e.token.encode())
        top = ref[step].topk(5)
        assert [t.token for t in e.top_logprobs] == texts(tok, top.indices.tolist())
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_completion_logprobs_have_tokens_offsets_and_top_dicts(client, tok, hf):
    prompt = tok.encode("The quick brown fox")
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    ids, ref = greedy_logprobs(hf, prompt, 8)
    assert lp.tokens == texts(tok, ids)
    assert lp.token_logprobs == pytest.approx([ref[i, t].item() for i, t in enumerate(ids)], abs=1e-4)
    assert all(
        len(top) == 3 and max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)
        for i, top in enumerate(lp.top_logprobs)
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


# -- n, best_of, batches, echo ----------------------------------------------------------------------


def test_n_4_with_a_seed_gives_4_different_choices_and_counts_the_prompt_once(client, tok):
    kwargs = dict(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=7, n=4, extra_body={"ignore_eos": True}
    )
    r = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len(set(texts)) == 4
    assert r.usage.prompt_tokens == len(chat_prompt(tok))
    assert r.usage.completion_tokens == 4 * 16
    assert r.usage.prompt_tokens_details.cached_tokens == 0 or r.usage.prompt_tokens_details.cached_tokens % 16 == 0
    # each choice is its own seed stream: choice j is the request with seed 7 + j alone
    alone = [
        client.chat.completions.create(**{**kwargs, "n": 1, "seed": 7 + j}).choices[0].message.content for j in range(4)
    ]
    assert texts == alone
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(4)] == texts


def test_n_larger_than_the_backend_serves_at_once_waits_for_room_instead_of_failing(backend, client, tok):
    limited = TwoAtATime(backend)
    served, small = serve(limited, tok)
    try:
        kwargs = dict(
            model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=3, extra_body={"ignore_eos": True}
        )
        r = small.chat.completions.create(n=5, **kwargs)
    finally:
        served.stop()
    assert limited.rejected > 0  # it was turned away, and waited
    alone = [client.chat.completions.create(**{**kwargs, "seed": 3 + j}).choices[0].message.content for j in range(5)]
    assert [c.message.content for c in sorted(r.choices, key=lambda c: c.index)] == alone


class SecondChoiceDies(GenerationBackend):
    """Choice 1 of every request fails after three chunks, as a decode worker lost for good does."""

    def __init__(self, inner: GenerationBackend) -> None:
        self.inner, self.model_name, self.max_model_len = inner, inner.model_name, inner.max_model_len

    async def generate(self, request: GenerationRequest):
        n = 0
        async for chunk in self.inner.generate(request):
            if request.request_id.endswith("-0-1") and n == 3:
                raise Unavailable("decode worker lost")
            n += 1
            yield chunk


def test_a_choice_that_fails_fails_the_request_and_stops_its_siblings(backend, tok):
    served, c = serve(SecondChoiceDies(backend), tok)
    try:
        kwargs = dict(
            model="tiny",
            messages=MESSAGES,
            max_tokens=200,
            temperature=1.0,
            seed=1,
            n=3,
            extra_body={"ignore_eos": True},
        )
        with pytest.raises(openai.InternalServerError) as e:  # 503
            c.chat.completions.create(**kwargs)
        assert e.value.status_code == 503
        # streamed: the response opened with choice 0's first token, so the failure arrives as an error event
        with pytest.raises(openai.APIError, match="decode worker lost"):
            for _ in c.chat.completions.create(stream=True, **kwargs):
                pass
    finally:
        metrics = httpx.get(f"{served.url}/metrics").text
        served.stop()
    running = [ln for ln in metrics.splitlines() if ln.startswith("mooncake_gateway_running_requests ")]
    assert running == ["mooncake_gateway_running_requests 0.0"]  # no choice left generating
    assert backend.loop.num_running == 0


def test_a_batch_of_prompts_gets_n_choices_each_indexed_prompt_major(client):
    prompts = ["The quick brown fox", "Once upon a time"]
    r = client.completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=3, extra_body={"ignore_eos": True}
    )
    got = {c.index: c.text for c in r.choices}
    for p, prompt in enumerate(prompts):
        for j in range(2):
            alone = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=3 + j, extra_body={"ignore_eos": True}
            )
            assert got[2 * p + j] == alone.choices[0].text


def test_best_of_returns_the_likeliest_candidate(client):
    kwargs = dict(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    )
    candidates = client.completions.create(n=4, logprobs=0, **kwargs).choices
    best = max(candidates, key=lambda c: sum(c.logprobs.token_logprobs))
    r = client.completions.create(best_of=4, **kwargs)
    assert len(r.choices) == 1 and r.choices[0].text == best.text
    assert r.choices[0].logprobs is None  # ranked on logprobs it did not ask to see


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion(client, tok, hf, stream):
    words = "The quick brown fox jumps over the lazy dog, again and again and again"  # more than two blocks of 16
    kwargs = dict(model="tiny", prompt=words, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].text
    client.completions.create(**kwargs)  # now the prompt is in the prefix cache: its logprobs must be computed anyway
    if stream:
        text, tokens, values = "", [], []
        for chunk in client.completions.create(stream=True, echo=True, logprobs=2, **kwargs):
            for c in chunk.choices:
                text += c.text
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    values += c.logprobs.token_logprobs
    else:
        choice = client.completions.create(echo=True, logprobs=2, **kwargs).choices[0]
        text, tokens, values = choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs
        assert choice.logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert text == words + plain
    prompt = tok.encode(words)
    assert len(prompt) > 32
    ids, ref = greedy_logprobs(hf, prompt, 4)
    with torch.inference_mode():
        prompt_ref = hf(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert tokens == texts(tok, prompt + ids)
    assert values[0] is None  # nothing precedes the first prompt token
    want = [prompt_ref[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)] + [
        ref[i, t].item() for i, t in enumerate(ids)
    ]
    assert values[1:] == pytest.approx(want, abs=1e-4)
    no_logprobs = client.completions.create(echo=True, **kwargs).choices[0]
    assert no_logprobs.text == text and no_logprobs.logprobs is None


# -- structured output ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_always_validates_over_20_seeded_samples_at_temperature_1(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(10 if stream else 20):
        kwargs = dict(model="tiny", messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=300, response_format=fmt)
        if stream:
            text, finish = "", None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            text, finish = choice.message.content, choice.finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_mode_gives_a_json_object(client):
    """Any JSON object is allowed, so a random model's may run past max_tokens: every output that ended parses."""
    finished = 0
    for seed in range(10):
        r = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            temperature=1.0,
            seed=seed,
            max_tokens=300,
            response_format={"type": "json_object"},
        )
        text = r.choices[0].message.content
        assert text.startswith("{")
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
    assert finished >= 3


def test_a_schema_the_grammar_library_cannot_compile_is_a_400_saying_why(client):
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/no"}}}},
    }
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=bad)
    assert e.value.body["param"] == "response_format"
    assert "/no" in e.value.body["message"]


# -- tools ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_is_parsed_into_tool_calls_with_valid_arguments(client, stream):
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=5,
        max_tokens=200,
    )
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or ():
                    call = calls.setdefault(d.index, {"name": "", "arguments": "", "id": d.id})
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
        got = [(c["name"], c["arguments"], c["id"]) for c in calls.values()]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        assert choice.message.content is None
        got = [(c.function.name, c.function.arguments, c.id) for c in choice.message.tool_calls]
    assert finish == "tool_calls"
    assert len(got) == 1
    name, arguments, call_id = got[0]
    assert call_id.startswith("call_")
    schema = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
    jsonschema.validate(json.loads(arguments), schema)


def test_a_named_tool_choice_calls_that_function_and_a_second_turn_takes_its_result(client, tok):
    first = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=100,
    ).choices[0]
    (call,) = first.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    history = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00 UTC"},
    ]
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER, TIME], temperature=0, max_tokens=5
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the model saw the call and its result (the Hermes format: SmolLM2-style templates have no tool support)
    rendered, _ = tool_format.render_messages(
        [
            {
                "role": m["role"],
                "content": m["content"] or "",
                **(
                    {
                        "tool_calls": [
                            {"function": {"name": "get_time", "arguments": json.loads(call.function.arguments)}}
                        ]
                    }
                    if m.get("tool_calls")
                    else {}
                ),
            }
            for m in history
        ],
        tool_format.plan([ToolDefinition(**WEATHER), ToolDefinition(**TIME)], "auto", None),
        native=False,
    )
    assert second.usage.prompt_tokens == len(tok.encode_chat(rendered))
    assert "<tool_response>\n12:00 UTC\n</tool_response>" in rendered[-1]["content"]


def test_auto_tool_output_is_parsed_when_the_model_writes_a_call():
    plan = tool_format.plan([ToolDefinition(**WEATHER), ToolDefinition(**TIME)], "auto", True)
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    )
    content, calls = tool_format.parse(text, plan)
    assert [c.function.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].function.arguments) == {"zone": "utc"}
    assert content.startswith("Let me check.")
    assert tool_format.parse("no call here", plan) == ("no call here", [])
    assert tool_format.may_open_call("so <tool_") and not tool_format.may_open_call("so <b>")
