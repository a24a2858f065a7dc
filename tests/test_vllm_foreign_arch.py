"""``--engine vllm`` serves what vLLM serves: a GPT-NeoX (an architecture our engine does not have), tiny and
random, served disaggregated (a vLLM prefill worker, the pool, a vLLM decode worker) gives vLLM alone's greedy tokens.

Its KV layout (layers, KV heads, head size) comes from vLLM, not from our model arguments: read before loading to
size the pool's blocks, and from the cache vLLM built once loaded for what the workers register. The gateway
tokenizes with the model's own tokenizer. One cluster serves every test here (a vLLM worker takes about a minute to
start on this CPU).
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch
import vllm_alone
from clusters import generate, start_cluster, tokens
from foreign_models import NEOX_HEAD_DIM, NEOX_KV_HEADS, NEOX_LAYERS, make_gpt_neox

from mooncake.engine.interface import EngineKind, engine_fingerprint
from mooncake.engine.model_args import SUPPORTED_ARCHS
from mooncake.engine.tokenizer import Tokenizer
from mooncake.engine.weights import load_hf_config
from mooncake.gateway.cluster_backend import ClusterBackend

pytest.importorskip("vllm", reason="vLLM is installed by `make test` (the project's vllm extra)")
pytest.importorskip("transformers", reason="the foreign model is built with transformers (a dev dependency)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
MAX_LEN = 512
MAX_TOKENS = 12
TEXT = "Prefill is compute bound: it reads the whole prompt at once and writes the KV cache. Decode is memory bound"


def prompt_of(n: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory):
    return make_gpt_neox(tmp_path_factory.mktemp("neox") / "tiny-neox")


@pytest.fixture(scope="module")
def prompts(neox_dir) -> dict[str, list[int]]:
    vocab = load_hf_config(neox_dir)["vocab_size"]
    shared = prompt_of(3 * BLOCK, seed=1, vocab=vocab)
    return {
        "short": prompt_of(7, seed=2, vocab=vocab),  # under a block
        "long": shared + prompt_of(BLOCK + 5, seed=3, vocab=vocab),  # several blocks and a partial one
        "shared": shared + prompt_of(9, seed=4, vocab=vocab),  # the long one's first 3 blocks, from the pool
        "text": Tokenizer.from_dir(neox_dir).encode(TEXT),  # what the gateway sends for TEXT
    }


@pytest.fixture(scope="module")
def references_run(neox_dir, prompts) -> concurrent.futures.Future:
    """vLLM alone (no connector, no prefix cache), greedy, past EOS, on a thread (``references`` waits for it)."""
    return concurrent.futures.ThreadPoolExecutor(1).submit(
        vllm_alone.run,
        "reference",
        model=str(neox_dir),
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        max_tokens=MAX_TOKENS,
        prompts=list(prompts.values()),
    )


@pytest.fixture(scope="module")
def references(prompts, references_run) -> dict[str, list[int]]:
    return dict(zip(prompts, references_run.result(timeout=900)))


@pytest.fixture(scope="module")
def cluster(neox_dir, references_run, tmp_path_factory):  # the references run while it starts (mostly vLLM's start)
    c = start_cluster(
        neox_dir,
        tmp_path_factory.mktemp("vllm-neox-run"),
        model_name="neox",
        engine="vllm",
        vllm_args=["enforce_eager=true"],
        prefill=1,
        decode=1,
        threads=1,
        max_model_len=MAX_LEN,
        pool_dram_mib=64,
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def be(cluster) -> ClusterBackend:
    fp = engine_fingerprint(EngineKind.VLLM, cluster.config.model, torch.float32)
    return ClusterBackend(cluster.conductor_address, "neox", MAX_LEN, BLOCK, fp)


def test_the_model_is_one_our_engine_does_not_have(neox_dir):
    assert load_hf_config(neox_dir)["model_type"] not in SUPPORTED_ARCHS


def test_the_pool_and_the_workers_hold_blocks_of_the_layout_vllm_built(cluster):
    """The pool nodes were sized from vLLM's reading of the model; the prefill worker's engine reports the layout
    of the cache vLLM built, and starts only when the two agree."""
    expected = NEOX_LAYERS * 2 * BLOCK * NEOX_KV_HEADS * NEOX_HEAD_DIM * 4  # float32
    assert cluster.config.block_bytes() == expected
    assert cluster.components["prefill-0"].info["block_bytes"] == expected


def test_a_foreign_architecture_served_disaggregated_gives_vllm_alones_greedy_tokens(be, prompts, references):
    assert all(len(ref) == MAX_TOKENS for ref in references.values())
    for i, name in enumerate(("short", "long")):
        out = generate(be, f"neox-{i}", prompts[name], MAX_TOKENS, temperature=0.0, ignore_eos=True)
        assert tokens(out) == references[name], name


def test_a_prefix_from_the_pool_gives_the_same_tokens(be, prompts, references):
    generate(be, "neox-warm", prompts["long"], 1, temperature=0.0, ignore_eos=True)  # its blocks into the pool
    out = generate(be, "neox-shared", prompts["shared"], MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert tokens(out) == references["shared"]
    assert out[-1].cached_tokens == 3 * BLOCK  # its first 3 blocks, the long prompt's


def test_the_gateway_tokenizes_with_the_models_own_tokenizer(cluster, neox_dir, references):
    resp = httpx.post(
        f"{cluster.endpoint}/completions",
        json={"model": "neox", "prompt": TEXT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["prompt_tokens"] == len(Tokenizer.from_dir(neox_dir).encode(TEXT))
    assert body["choices"][0]["text"] == Tokenizer.from_dir(neox_dir).decode(references["text"])
