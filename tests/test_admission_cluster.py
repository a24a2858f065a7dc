"""Wait-or-refuse admission and tenants' priorities in a real cluster (processes, gRPC, HTTP).

The decode worker runs a batch of one (``decode_max_seqs=1``), so a second request that
arrives while a long one decodes finds the batch full: early_predictive refuses it (429),
early_wait holds it at the gateway until the batch has room and then serves it, with the
tokens one engine alone gives. The Conductor's own metrics say what it decided, per
tenant and priority.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from clusters import MAX_LEN, backend, generate, reference_tokens, start_cluster, tokens

GOLD, FREE = "sk-gold-tenant", "sk-free-tenant"
TENANTS = f"""
tenants:
  - name: gold
    keys: [{GOLD}]
    priority: 1
    weight: 2
  - name: free
    keys: [{FREE}]
    priority: -1
"""


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    tenants = workdir / "tenants.yaml"
    tenants.write_text(TENANTS)
    c = start_cluster(
        tiny_dir,
        workdir,
        admission="early_wait",
        decode_max_seqs=1,
        tbt_slo_s=0.5,
        ttft_slo_s=60.0,
        tenants_file=tenants,
    )
    yield c
    c.stop()


def prompt_of(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 440) for _ in range(n)]


def complete(cluster, key: str, prompt: list[int], max_tokens: int, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(
        f"{cluster.endpoint}/completions",
        json={**body, **extra},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def conductor_samples(cluster, name: str) -> dict[tuple, float]:
    """The Conductor's samples of metric ``name``: labels (sorted) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{cluster.components['conductor'].info['metrics']}/metrics", timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_a_request_that_finds_the_batch_full_waits_and_is_served_with_one_engines_tokens(cluster, tiny_dir):
    long_prompt, short_prompt = prompt_of(24, seed=1), prompt_of(40, seed=2)
    streaming = threading.Event()
    first: list[httpx.Response] = []

    def long_request() -> None:
        body = {
            "model": "tiny",
            "prompt": long_prompt,
            "max_tokens": MAX_LEN - 64,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST",
            f"{cluster.endpoint}/completions",
            json=body,
            headers={"Authorization": f"Bearer {GOLD}"},
            timeout=120,
        ) as r:
            first.append(r)
            for _ in r.iter_lines():
                streaming.set()  # it holds the batch's only place now

    runner = threading.Thread(target=long_request)
    runner.start()
    try:
        assert streaming.wait(60), "the long request never streamed"
        # the gateway's backend (the token ids); early_predictive refuses it: the batch is full when its prefill ends
        chunks = generate(backend(cluster), "short", short_prompt, 8, temperature=0.0, ignore_eos=True)
    finally:
        runner.join(120)
    assert first and first[0].status_code == 200
    assert tokens(chunks) == reference_tokens(tiny_dir, short_prompt, 8)
    seen = conductor_samples(cluster, "mooncake_conductor_admissions_total")
    assert seen.get((("outcome", "wait"), ("priority", "0"), ("tenant", "")), 0) >= 1
    assert seen.get((("outcome", "scheduled"), ("priority", "0"), ("tenant", "")), 0) == 1
    assert seen.get((("outcome", "scheduled"), ("priority", "1"), ("tenant", "gold")), 0) == 1


def test_a_tenants_priority_is_its_default_and_the_most_a_request_may_ask_for(cluster):
    assert complete(cluster, FREE, prompt_of(20, seed=3), 2).status_code == 200
    assert complete(cluster, FREE, prompt_of(20, seed=4), 2, priority=50).status_code == 200  # capped at its -1
    assert complete(cluster, GOLD, prompt_of(20, seed=5), 2, priority=0).status_code == 200  # less than its 1: asked
    seen = conductor_samples(cluster, "mooncake_conductor_admissions_total")
    assert seen.get((("outcome", "scheduled"), ("priority", "-1"), ("tenant", "free")), 0) == 2
    assert seen.get((("outcome", "scheduled"), ("priority", "0"), ("tenant", "gold")), 0) == 1
    bad = complete(cluster, GOLD, prompt_of(20, seed=6), 2, priority=101)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


def test_the_conductor_logs_each_requests_prediction_beside_what_its_workers_measured(cluster):
    """conductor.audit, as `mooncake up` runs it: a served request's line names its prefill worker, its prompt, and
    the TTFT its decode worker measured split into the prefill worker's queue and prefill and the rest."""
    import json
    import time

    assert complete(cluster, GOLD, prompt_of(37, seed=7), 2).status_code == 200
    log = cluster.run_dir / "logs" / "conductor-predictions.jsonl"
    deadline = time.monotonic() + 30  # the decode worker reports its requests' events in batches
    rows: list[dict] = []
    while not rows and time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        rows = [r for r in map(json.loads, lines) if r["prompt_tokens"] == 37]
        time.sleep(0.2)
    (row,) = rows
    assert row["instance"].startswith("prefill-") and row["compute_tokens"] == 37
    assert row["predicted"]["ttft"] > 0 and row["measured"]["ttft"] > 0
    measured = row["measured"]
    assert measured["queue"] + measured["prefill"] > 0  # the prefill worker measured its own parts
    assert measured["queue"] + measured["prefill"] + measured["transfer"] == pytest.approx(measured["ttft"], abs=2e-4)
