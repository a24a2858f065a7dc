"""Prefill and decode workers at different tensor-parallel sizes (issue 64), on a real cluster: every component its
own process, each worker's ranks processes of their own (gloo on the CPU).

A prompt prefilled by two ranks is decoded by one, and one prefilled by one rank is decoded by two: the greedy tokens
equal one engine alone's, cold and again with the prompt's prefix read back from the pool (written at the prefill's
size, read at the same size, imported at the other by heads). The pool keeps every KV head of a block whatever the
sizes (DESIGN §4), so no conversion happens anywhere: a rank reads its heads of what the pool holds.
"""

from __future__ import annotations

import random
import time

import pytest
from clusters import backend, generate, instances, reference_tokens, start_cluster, tokens

from mooncake.engine.tiny import make_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("model") / "llama", "llama")


def served_cold_and_warm(model, cluster, name: str) -> None:
    rng = random.Random(len(name))
    prompt = [rng.randrange(10, 440) for _ in range(70)]
    reference = reference_tokens(model, prompt, 12)
    be = backend(cluster)
    cold = generate(be, f"{name}-cold", prompt, 12, temperature=0.0, ignore_eos=True)
    assert tokens(cold) == reference and cold[-1].cached_tokens == 0
    deadline = time.monotonic() + 10  # the prompt's blocks reach the pool after the answer (a background write)
    for attempt in range(100):
        warm = generate(be, f"{name}-warm-{attempt}", prompt, 12, temperature=0.0, ignore_eos=True)
        assert tokens(warm) == reference
        if warm[-1].cached_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert warm[-1].cached_tokens == 64  # four whole blocks of 16 from the pool


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_a_prompt_prefilled_at_one_size_and_decoded_at_another_gives_one_engines_tokens(
    model, tmp_path, prefill_tp, decode_tp
):
    cluster = start_cluster(model, tmp_path, prefill_tp=prefill_tp, decode_tp=decode_tp, gateway=False, threads=1)
    try:
        served_cold_and_warm(model, cluster, f"p{prefill_tp}d{decode_tp}")
        sizes = {name: i.tensor_parallel_size for name, i in instances(cluster).items() if i.engine}  # the workers
        assert sizes == {"prefill-0": prefill_tp, "decode-0": decode_tp}
    finally:
        cluster.stop()
