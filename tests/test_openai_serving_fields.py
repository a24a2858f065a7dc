"""Per-family serving as vLLM's server does it (issue 61, part 3), through real HTTP and the official client:
reasoning_content, chat_template_kwargs, the tool-call formats, generation_config.json defaults, vLLM's sampling
fields end to end, and the 400 for a field neither OpenAI nor vLLM knows.

Reasoning and tool-call output is scripted (a backend that answers a fixed text, cut into awkward pieces), since a
random tiny model writes neither; the sampling fields run on the tiny engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_gateway import Served
from tokenizers import Tokenizer as BackendTokenizer

from mooncake.engine.config import EngineConfig
from mooncake.engine.request import SamplingParams
from mooncake.engine.tokenizer import Tokenizer
from mooncake.gateway import GatewayConfig, create_app
from mooncake.gateway.local_backend import LocalBackend
from mooncake.gateway.tool_parsers import ToolCallParser, detect
from mooncake.serving.sampling import params_from_pb, sampling_to_pb
from mooncake.serving.types import GenerationBackend, GenerationChunk, GenerationRequest

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
IGNORE_EOS = {"ignore_eos": True}

# Qwen3's template, cut down to what matters here: enable_thinking=false closes an empty think block in the prompt
QWEN3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
# DeepSeek-R1's later templates open the think block themselves
R1_TEMPLATE = (
    "{% for message in messages %}{{ '<｜User｜>' + message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


# -- backends and gateways ---------------------------------------------------------------------------------


class Scripted(GenerationBackend):
    """Answers every request with ``text``, in pieces of ``piece`` characters; keeps the last request."""

    def __init__(self, text: str, piece: int = 3) -> None:
        self.text, self.piece = text, piece
        self.model_name, self.max_model_len = "tiny", 1024
        self.last: GenerationRequest | None = None

    async def generate(self, request: GenerationRequest):
        self.last = request
        pieces = [self.text[i : i + self.piece] for i in range(0, len(self.text), self.piece)]
        n = len(request.prompt_token_ids)
        for k, text in enumerate(pieces):
            last = k == len(pieces) - 1
            yield GenerationChunk([7], text, "stop" if last else None, prompt_tokens=n, completion_tokens=k + 1)


class Shared(GenerationBackend):
    """The module's engine behind one more gateway, which must not close it when it stops."""

    def __init__(self, inner: GenerationBackend) -> None:
        self.inner, self.model_name, self.max_model_len = inner, inner.model_name, inner.max_model_len

    def generate(self, request: GenerationRequest):
        return self.inner.generate(request)


def with_think_tokens(tok: Tokenizer, template: str) -> Tokenizer:
    """``tok`` with ``<think>`` and ``</think>`` added (as Qwen3's and DeepSeek-R1's tokenizers have) and
    ``template``."""
    backend = BackendTokenizer.from_str(tok.backend.to_str())
    backend.add_tokens(["<think>", "</think>"])
    specials = {"eos_token": "<|im_end|>"}
    return Tokenizer(backend, special_tokens=specials, chat_template=template, eos_token_ids=tok.eos_token_ids)


class Gateway:
    """A gateway on a free port and an official client of it; ``stop()`` when done."""

    def __init__(self, backend: GenerationBackend, tok: Tokenizer, **config) -> None:
        self.served = Served(create_app(backend, tok, GatewayConfig(served_model_name="tiny", **config)))
        self.url = self.served.url
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)

    def stop(self) -> None:
        self.served.stop()


@pytest.fixture
def gateway_of():
    started: list[Gateway] = []

    def start(backend: GenerationBackend, tok: Tokenizer, **config) -> Gateway:
        started.append(Gateway(backend, tok, **config))
        return started[-1]

    yield start
    for g in started:
        g.stop()


@pytest.fixture(scope="module")
def engine(tiny_dir) -> Iterator[LocalBackend]:
    config = EngineConfig(model=str(tiny_dir), dtype="float32", block_size=16, num_kv_blocks=256, max_model_len=1024)
    local = LocalBackend(config, "tiny")
    yield local
    asyncio.run(local.close())


@pytest.fixture(scope="module")
def real(engine, tok) -> Iterator[Gateway]:
    g = Gateway(Shared(engine), tok)
    yield g
    g.stop()


def stream_chat(client: openai.OpenAI, **kwargs) -> tuple[list[tuple[str, str]], list, str | None]:
    """A streamed chat's (reasoning, content) deltas in order, its tool call deltas, and its finish reason."""
    deltas, calls, finish = [], [], None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kwargs):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content") or choice.delta.content:
                deltas.append((extra.get("reasoning_content") or "", choice.delta.content or ""))
            calls.extend(choice.delta.tool_calls or ())
            finish = choice.finish_reason or finish
    return deltas, calls, finish


# -- reasoning ---------------------------------------------------------------------------------------------


QWEN3_OUTPUT = "<think>\nThe user adds 2 and 2.\nThat makes 4.\n</think>\n\nIt is 4."


def test_qwen3_reasoning_goes_to_reasoning_content_whole_and_streamed(tok, gateway_of):
    g = gateway_of(Scripted(QWEN3_OUTPUT, piece=4), with_think_tokens(tok, QWEN3_TEMPLATE))  # auto: <think> tokens
    message = g.client.chat.completions.create(model="tiny", messages=MESSAGES).choices[0].message
    assert message.model_extra["reasoning_content"] == "The user adds 2 and 2.\nThat makes 4."
    assert message.content == "It is 4."

    deltas, _, finish = stream_chat(g.client, messages=MESSAGES)
    reasoning = "".join(r for r, _ in deltas)
    content = "".join(c for _, c in deltas)
    assert (reasoning, content, finish) == ("The user adds 2 and 2.\nThat makes 4.", "It is 4.", "stop")
    first_content = next(k for k, (_, c) in enumerate(deltas) if c)
    assert all(not r for r, _ in deltas[first_content:]), "reasoning after the answer began"
    assert all("think>" not in r + c for r, c in deltas)


def test_qwen3_output_without_think_is_all_content_and_include_reasoning_false_drops_it(tok, gateway_of):
    qwen3 = with_think_tokens(tok, QWEN3_TEMPLATE)
    plain = gateway_of(Scripted("Just 4.", piece=2), qwen3)
    message = plain.client.chat.completions.create(model="tiny", messages=MESSAGES).choices[0].message
    assert message.content == "Just 4." and "reasoning_content" not in (message.model_extra or {})

    g = gateway_of(Scripted(QWEN3_OUTPUT), qwen3)
    message = (
        g.client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"include_reasoning": False})
        .choices[0]
        .message
    )
    assert message.content == "It is 4." and "reasoning_content" not in (message.model_extra or {})


def test_deepseek_r1_output_has_only_the_end_tag_and_is_split_there(tok, gateway_of):
    output = "Two and two.\nFour.\n</think>\n\nThe answer is 4."
    g = gateway_of(Scripted(output, piece=5), with_think_tokens(tok, R1_TEMPLATE))  # auto: DeepSeek's template
    message = g.client.chat.completions.create(model="tiny", messages=MESSAGES).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("Two and two.\nFour.", "The answer is 4.")
    deltas, _, _ = stream_chat(g.client, messages=MESSAGES)
    assert "".join(r for r, _ in deltas) == "Two and two.\nFour."
    assert "".join(c for _, c in deltas) == "The answer is 4."

    # the flag over a template that does not open <think>: still reasoning up to </think>
    flagged = gateway_of(Scripted(output), with_think_tokens(tok, QWEN3_TEMPLATE), reasoning_parser="deepseek_r1")
    message = flagged.client.chat.completions.create(model="tiny", messages=MESSAGES).choices[0].message
    assert message.model_extra["reasoning_content"] == "Two and two.\nFour."


def test_reasoning_parser_none_leaves_the_tags_in_the_content(tok, gateway_of):
    g = gateway_of(Scripted(QWEN3_OUTPUT), with_think_tokens(tok, QWEN3_TEMPLATE), reasoning_parser="none")
    message = g.client.chat.completions.create(model="tiny", messages=MESSAGES).choices[0].message
    assert message.content == QWEN3_OUTPUT and "reasoning_content" not in (message.model_extra or {})


def test_enable_thinking_false_in_chat_template_kwargs_closes_the_think_block_in_the_prompt(tok, gateway_of):
    qwen3 = with_think_tokens(tok, QWEN3_TEMPLATE)
    backend = Scripted("Just 4.")
    g = gateway_of(backend, qwen3)
    g.client.chat.completions.create(model="tiny", messages=MESSAGES)
    thinking = qwen3.decode(backend.last.prompt_token_ids, skip_special_tokens=False)
    g.client.chat.completions.create(
        model="tiny", messages=MESSAGES, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    not_thinking = qwen3.decode(backend.last.prompt_token_ids, skip_special_tokens=False)
    assert not thinking.endswith("</think>\n\n")
    assert not_thinking == thinking + "<think>\n\n</think>\n\n"
    counted = httpx.post(
        f"{g.url}/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert counted.json()["tokens"] == backend.last.prompt_token_ids  # /tokenize renders it the same way
    odd = httpx.post(
        f"{g.url}/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "chat_template_kwargs": {"messages": []}},
    )
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "chat_template_kwargs"


def test_a_prompt_that_opens_think_starts_the_output_in_reasoning(tok, gateway_of):
    template = QWEN3_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    g = gateway_of(Scripted("Hmm.\n</think>\n\n4."), with_think_tokens(tok, template))
    message = g.client.chat.completions.create(model="tiny", messages=MESSAGES).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("Hmm.", "4.")


# -- tool calls ------------------------------------------------------------------------------------------------


TOOL_OUTPUTS = {
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"name": "get_time", "parameters": {}}',
    "mistral": 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '{"name": "get_time", "arguments": {}}]',
    "pythonic": '[get_weather(city="Oslo"), get_time()]',
}
TOOL_CONTENT = {"hermes": "Checking.", "llama3_json": None, "mistral": "Checking.", "pythonic": None}


@pytest.mark.parametrize("parser", sorted(TOOL_OUTPUTS))
def test_each_tool_call_format_is_parsed_into_tool_calls_whole_and_streamed(tok, gateway_of, parser):
    g = gateway_of(Scripted(TOOL_OUTPUTS[parser], piece=4), tok, tool_call_parser=parser)
    choice = g.client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert choice.message.content == TOOL_CONTENT[parser]

    deltas, calls, finish = stream_chat(g.client, messages=MESSAGES, tools=[WEATHER, TIME])
    assert finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert "".join(c for _, c in deltas).strip() == (TOOL_CONTENT[parser] or "")


def test_text_that_is_not_a_call_of_a_given_tool_stays_content(tok, gateway_of):
    g = gateway_of(Scripted('{"name": "launch_rockets", "parameters": {}}'), tok, tool_call_parser="llama3_json")
    choice = g.client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == '{"name": "launch_rockets", "parameters": {}}'


def test_the_tool_call_format_is_detected_from_the_chat_template():
    assert detect("{{ messages }}") == ToolCallParser.HERMES  # renders no tools: ours, in Hermes' format
    assert detect("{% if tools %}<tool_call>{% endif %}") == ToolCallParser.HERMES
    assert detect("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") == ToolCallParser.MISTRAL
    llama31 = (
        '{% if tools %}{"name": function name, "parameters": dictionary of argument name}<|python_tag|>{% endif %}'
    )
    assert detect(llama31) == ToolCallParser.LLAMA3_JSON
    assert detect("{% if tools %}[func_name1(params_name1=params_value1)]{% endif %}") == ToolCallParser.PYTHONIC


def test_a_mistral_request_with_tools_keeps_special_tokens_so_tool_calls_show(tok, gateway_of):
    backend = Scripted("no call")
    g = gateway_of(backend, tok, tool_call_parser="mistral")
    g.client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER])
    assert backend.last.sampling.skip_special_tokens is False
    g.client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert backend.last.sampling.skip_special_tokens is True


# -- generation_config.json ------------------------------------------------------------------------------


def test_generation_config_defaults_apply_to_what_a_request_leaves_unset(engine, tok, gateway_of, real, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 5, "temperature": 0.7}))
    g = gateway_of(Shared(engine), tok, generation_config=str(tmp_path))
    greedy = real.client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, extra_body=IGNORE_EOS
    )
    out = g.client.completions.create(model="tiny", prompt="Once upon a time", extra_body=IGNORE_EOS)
    assert out.usage.completion_tokens == 5  # max_new_tokens
    assert out.choices[0].text == greedy.choices[0].text  # top_k 1: only the likeliest token is left
    longer = g.client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=7, extra_body=IGNORE_EOS)
    assert longer.usage.completion_tokens == 7  # what the request sets wins

    # without the file, the same request samples at temperature 1 among all tokens: some seed leaves greedy
    sampled = {
        real.client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=5, seed=s, extra_body=IGNORE_EOS
        )
        .choices[0]
        .text
        for s in range(4)
    }
    assert sampled != {greedy.choices[0].text}


# -- sampling fields end to end ------------------------------------------------------------------------------


def test_min_p_of_1_leaves_only_the_likeliest_token(real):
    ask = dict(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=1.0)
    greedy = real.client.completions.create(**{**ask, "temperature": 0}, extra_body=IGNORE_EOS).choices[0].text
    for seed in range(3):
        out = real.client.completions.create(**ask, seed=seed, extra_body={**IGNORE_EOS, "min_p": 1.0})
        assert out.choices[0].text == greedy
    free = {
        real.client.completions.create(**ask, seed=seed, extra_body=IGNORE_EOS).choices[0].text for seed in range(4)
    }
    assert free != {greedy}


def greedy_ids(engine: LocalBackend, prompt: list[int], n: int) -> list[int]:
    """The engine's first ``n`` greedy output ids (EOS ignored), asked directly."""

    async def run() -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return [
            t async for chunk in engine.generate(GenerationRequest("probe", prompt, params)) for t in chunk.token_ids
        ]

    return asyncio.run(run())


def test_stop_token_ids_end_the_output_and_include_stop_str_in_output_shows_the_token(engine, real, tok):
    prompt = tok.encode("Once upon a time")
    ids = greedy_ids(engine, prompt, 8)
    at = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k])  # the first repeat would stop earlier
    ask = dict(model="tiny", prompt=prompt, temperature=0, max_tokens=8)
    stop = {**IGNORE_EOS, "stop_token_ids": [ids[at]]}
    out = real.client.completions.create(**ask, extra_body=stop)
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == at + 1
    assert out.choices[0].text == tok.decode(ids[:at])  # the stop token's text is not shown
    shown = real.client.completions.create(**ask, extra_body={**stop, "include_stop_str_in_output": True})
    assert shown.choices[0].text == tok.decode(ids[: at + 1]) != tok.decode(ids[:at])
    streamed = real.client.completions.create(**ask, stream=True, extra_body=stop)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == tok.decode(ids[:at])


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_shows_special_tokens(real, tok, stream):
    end = tok.token_to_id("<|im_end|>")
    ask = dict(model="tiny", prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(end): 100})

    def pieces(**extra) -> list[str]:
        out = real.client.completions.create(**ask, stream=stream, extra_body={**IGNORE_EOS, **extra})
        return [c.choices[0].text for c in out if c.choices and c.choices[0].text] if stream else [out.choices[0].text]

    assert "".join(pieces()) == ""
    # streamed, each token's text as it comes
    assert pieces(skip_special_tokens=False) == ["<|im_end|>"] * 3 if stream else ["<|im_end|>" * 3]


def test_truncate_prompt_tokens_and_add_generation_prompt_change_the_prompt(real, tok):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    out = real.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": 10}
    )
    assert out.usage.prompt_tokens == 10
    with_prompt = real.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    without = real.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1, extra_body={"add_generation_prompt": False}
    )
    assert with_prompt.usage.prompt_tokens == len(tok.encode_chat(MESSAGES, True))
    assert without.usage.prompt_tokens == len(tok.encode_chat(MESSAGES, False)) < with_prompt.usage.prompt_tokens


def test_guided_choice_and_guided_regex_constrain_the_output(real):
    for seed in range(3):
        out = real.client.chat.completions.create(
            model="tiny", messages=MESSAGES, seed=seed, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
        )
        assert out.choices[0].message.content in ("yes", "no")
    out = real.client.completions.create(
        model="tiny", prompt="Digits:", seed=1, max_tokens=8, extra_body={"guided_regex": "[0-9]{3}"}
    )
    assert len(out.choices[0].text) == 3 and out.choices[0].text.isdigit()


def test_sampling_fields_survive_the_wire():
    params = SamplingParams(
        max_tokens=9,
        min_p=0.25,
        stop_token_ids=(5, 6),
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    assert params_from_pb(sampling_to_pb(params)) == params
    assert params_from_pb(sampling_to_pb(SamplingParams())).skip_special_tokens is True


# -- which fields are accepted ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": "Hi"}),
    ],
)
def test_a_field_neither_openai_nor_vllm_knows_is_a_400_naming_it(real, path, body):
    r = httpx.post(f"{real.url}{path}", json={"model": "tiny", "max_tokens": 2, **body, "temprature": 0.5})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "temprature" in error["message"] and error["param"] == "temprature"
    assert error["type"] == "invalid_request_error" and error["code"] == "unknown_parameter"
    r = httpx.post(f"{real.url}{path}", json={"model": "tiny", "max_tokens": 2, **body, "foo": 1, "bar": 2})
    assert r.status_code == 400 and "foo" in r.json()["error"]["message"] and "bar" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "field,value",
    [("use_beam_search", True), ("functions", [WEATHER["function"]]), ("bad_words", ["fox"]), ("echo", True)],
)
def test_a_known_field_this_server_cannot_honour_is_a_400_not_silence(real, field, value):
    r = httpx.post(
        f"{real.url}/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2, field: value},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["code"] == "unsupported_parameter"


def test_the_official_client_with_most_of_its_parameters_gets_no_400(real):
    chat = real.client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, *MESSAGES],
        frequency_penalty=0.1,
        presence_penalty=0.1,
        logit_bias={"5": 1.0},
        logprobs=True,
        top_logprobs=2,
        max_completion_tokens=4,
        metadata={"team": "a"},
        modalities=["text"],
        n=2,
        parallel_tool_calls=True,
        prediction={"type": "content", "content": "4"},
        prompt_cache_key="k",
        reasoning_effort="low",
        response_format={"type": "text"},
        safety_identifier="user-1",
        seed=3,
        service_tier="auto",
        stop=["\n\n"],
        store=False,
        temperature=0.8,
        top_p=0.9,
        user="alice",
        verbosity="low",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 1,
            "stop_token_ids": [3],
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "include_stop_str_in_output": False,
            "chat_template_kwargs": {"enable_thinking": False},
            "ignore_eos": True,
            "priority": 0,
        },
    )
    assert len(chat.choices) == 2 and chat.usage.completion_tokens > 0
    streamed = real.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    assert [c for c in streamed if c.usage is not None][0].usage.completion_tokens >= 1
    completion = real.client.completions.create(
        model="tiny",
        prompt="Once upon a time",
        best_of=2,
        echo=True,
        frequency_penalty=0.1,
        logit_bias={"5": 1.0},
        logprobs=1,
        max_tokens=4,
        n=1,
        presence_penalty=0.1,
        seed=4,
        stop="\n",
        temperature=0.7,
        top_p=0.95,
        user="bob",
        extra_body={"top_k": 10, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True},
    )
    assert completion.choices[0].text.startswith("Once upon a time")


# -- across the prefill/decode hand-off ----------------------------------------------------------------------


def test_min_p_stop_token_ids_and_special_tokens_hold_across_the_prefill_decode_hand_off(
    serving_cluster, tok, tiny_dir
):
    """The prefill worker samples the first token, the decode worker the rest: both read the fields off the wire."""
    from clusters import reference_tokens
    from conftest import SERVING_KEY

    client = openai.OpenAI(base_url=serving_cluster.endpoint, api_key=SERVING_KEY, max_retries=0, timeout=60)
    prompt = tok.encode("Once upon a time there was a robot")
    ids = reference_tokens(tiny_dir, prompt, 8)
    ask = dict(model="tiny", prompt=prompt, max_tokens=8)
    for seed in range(2):
        out = client.completions.create(**ask, temperature=1.0, seed=seed, extra_body={**IGNORE_EOS, "min_p": 1.0})
        assert out.choices[0].text == tok.decode(ids)
    at = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k])
    for stop, shown in ((ids[0], 0), (ids[at], at)):  # the prefill's token, then one of the decode worker's
        out = client.completions.create(**ask, temperature=0, extra_body={**IGNORE_EOS, "stop_token_ids": [stop]})
        assert (out.choices[0].text, out.choices[0].finish_reason) == (tok.decode(ids[:shown]), "stop")
        out = client.completions.create(
            **ask,
            temperature=0,
            extra_body={**IGNORE_EOS, "stop_token_ids": [stop], "include_stop_str_in_output": True},
        )
        assert out.choices[0].text == tok.decode(ids[: shown + 1])
    end = tok.token_to_id("<|im_end|>")
    special = client.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=3,
        temperature=0,
        logit_bias={str(end): 100},
        extra_body={**IGNORE_EOS, "skip_special_tokens": False},
    )
    assert special.choices[0].text == "<|im_end|>" * 3
