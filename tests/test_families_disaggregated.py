"""Every family added to our engine, served disaggregated: a prefill worker computes the prompt, hands its KV to the
decode worker's cache and stores its blocks in the pool; the tokens equal one engine alone's, cold and again with
the prompt's prefix read back from the pool. The prompt (100 tokens) is longer than the 32-token sliding windows
of mistral and the gemmas, so the windowed layers attend through the handed-off and pooled blocks too.
"""

from __future__ import annotations

import random
import time

import pytest
from clusters import backend, generate, reference_tokens, start_cluster, tokens

from mooncake.engine.tiny import make_tiny

FAMILIES = ["mistral", "phi3", "gemma2", "gemma3_text", "qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    model = make_tiny(tmp_path_factory.mktemp("model") / request.param, request.param)
    cluster = start_cluster(model, tmp_path_factory.mktemp("cluster"), prefill=1, decode=1, gateway=False)
    yield model, cluster
    cluster.stop()


def test_a_family_served_disaggregated_gives_one_engines_tokens_cold_and_from_the_pool(served):
    model, cluster = served
    rng = random.Random(7)
    prompt = [rng.randrange(10, 440) for _ in range(100)]
    reference = reference_tokens(model, prompt, 12)
    be = backend(cluster)
    cold = generate(be, "family-cold", prompt, 12, temperature=0.0, ignore_eos=True)
    assert tokens(cold) == reference and cold[-1].cached_tokens == 0
    deadline = time.monotonic() + 10  # the prompt's blocks reach the pool after the answer (a background write)
    for attempt in range(100):
        warm = generate(be, f"family-warm-{attempt}", prompt, 12, temperature=0.0, ignore_eos=True)
        assert tokens(warm) == reference
        if warm[-1].cached_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert warm[-1].cached_tokens == 96  # six whole blocks of 16 from the pool
