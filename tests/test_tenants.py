"""Tenants (mooncake.gateway.tenants): API keys by tenant, each tenant's KV cache apart, per-tenant limits.

The cluster tests run the whole system as processes (``mooncake up``'s launcher, the tiny
model) and look where a user would: the usage's cached tokens, the Conductor's index, HTTP
statuses and Retry-After.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import openai
import pytest
import yaml
from clusters import conductor, start_cluster

from mooncake.gateway.tenants import SALT_JOIN, Tenants
from protos import conductor_pb2 as cpb

ACME, GLOBEX, INITECH, HOOLI = "sk-acme-000001", "sk-globex-0001", "sk-initech-001", "sk-hooli-0001"
TENANTS = {
    "tenants": [
        {"name": "acme", "keys": [ACME, "sk-acme-000002"]},
        {"name": "globex", "keys": [GLOBEX], "requests_per_s": 0.05, "burst": 3},
        {"name": "initech", "keys": [INITECH], "max_concurrent": 1},
        {"name": "hooli", "keys": [HOOLI], "slo_classes": ["default"], "min_ttft_slo_s": 300.0},
    ]
}


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 440) for _ in range(n)]


# -- the tenants file ---------------------------------------------------------------------------------


def test_a_key_finds_its_tenant_and_the_salt_is_always_the_tenants(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(TENANTS))
    roster = Tenants.load(path)
    assert roster.authenticate(b"sk-acme-000002").name == "acme"
    assert roster.authenticate(GLOBEX.encode()).name == "globex"
    assert roster.authenticate(b"sk-acme-00000") is None and roster.authenticate(b"") is None
    acme = roster.authenticate(ACME.encode())
    assert acme.salt(None) == "tenant/acme"
    assert acme.salt("tenant/globex") == "tenant/acme" + SALT_JOIN + "tenant/globex"  # no way into another's cache
    path.write_text(json.dumps(TENANTS))  # JSON is YAML too
    assert Tenants.load(path).authenticate(INITECH.encode()).name == "initech"


@pytest.mark.parametrize(
    "tenants, problem",
    [
        ({"tenants": [{"name": "a", "keys": ["sk-short"[:7]]}]}, "at least 8 characters"),
        ({"tenants": [{"name": "a", "keys": [ACME]}, {"name": "b", "keys": [ACME]}]}, "given twice"),
        ({"tenants": [{"name": "a", "keys": [ACME]}, {"name": "a", "keys": [GLOBEX]}]}, "names repeat"),
        ({"tenants": [{"name": "a b", "keys": [ACME]}]}, "tenants.0.name"),
        ({"tenants": [{"name": "a", "keys": [ACME], "requests_per_s": 0}]}, "tenants.0.requests_per_s"),
        ({"tenants": [{"name": "a", "keys": [ACME], "quota": 3}]}, "tenants.0.quota"),
        ({"tenants": []}, "tenants"),
    ],
)
def test_a_bad_tenants_file_is_refused_saying_why_and_never_showing_a_key(tmp_path, tenants, problem):
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(tenants))
    with pytest.raises(ValueError) as e:
        Tenants.load(path)
    assert problem in str(e.value) and str(path) in str(e.value)
    assert ACME not in str(e.value) and GLOBEX not in str(e.value) and "sk-shor" not in str(e.value)


def test_a_missing_or_unreadable_tenants_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read the tenants file"):
        Tenants.load(tmp_path / "absent.yaml")
    (tmp_path / "bad.yaml").write_text("tenants: [unclosed")
    with pytest.raises(ValueError, match="not YAML or JSON"):
        Tenants.load(tmp_path / "bad.yaml")


# -- the whole system ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("tenants")
    path = work / "tenants.yaml"
    path.write_text(yaml.safe_dump(TENANTS))
    c = start_cluster(tiny_dir, work / "run", prefill=1, decode=1, tenants_file=path)
    yield c
    c.stop()


def client(cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.endpoint, api_key=key, max_retries=0, timeout=60)


def indexed_blocks(cluster) -> int:
    return conductor(cluster).ListInstances(cpb.ListInstancesRequest(), timeout=5).index_blocks


def complete(cluster, key: str, prompt: list[int], max_tokens: int = 2, **extra):
    return client(cluster, key).completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True, **extra}
    )


def wait_for_index(cluster, at_least: int) -> int:
    """The index's block count once the pool's events for the last request have come in (at least ``at_least``)."""
    deadline, seen = time.monotonic() + 10, indexed_blocks(cluster)
    while seen < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = indexed_blocks(cluster)
    time.sleep(0.5)  # and nothing more arrives
    return indexed_blocks(cluster)


def test_two_tenants_share_no_kv_while_each_tenants_repeat_is_a_cache_hit(cluster):
    prompt = prompt_of(170, seed=7)  # 10 full blocks and a partial one
    before = indexed_blocks(cluster)
    first = complete(cluster, ACME, prompt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    after_acme = wait_for_index(cluster, before + 10)
    assert after_acme >= before + 10
    again = complete(cluster, "sk-acme-000002", prompt)  # the same tenant, its other key
    assert again.usage.prompt_tokens_details.cached_tokens == 160  # its 10 full blocks
    assert again.choices[0].text == first.choices[0].text
    other = complete(cluster, INITECH, prompt)  # the same prompt, another tenant
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].text == first.choices[0].text  # a salt changes where KV lives, never the tokens
    after_initech = wait_for_index(cluster, after_acme + 10)
    assert (
        after_initech - after_acme == after_acme - before
    )  # initech's prompt got blocks of its own, as many as acme's
    # a client's own cache_salt cannot reach another tenant's blocks: it is added to its tenant's, never instead
    spoof = complete(cluster, INITECH, prompt, cache_salt="tenant/acme")
    assert spoof.usage.prompt_tokens_details.cached_tokens == 0


def test_a_tenant_over_its_rate_limit_gets_429_while_another_is_served(cluster):
    prompt = prompt_of(20, seed=11)
    statuses = []
    for _ in range(5):
        r = httpx.post(
            f"{cluster.endpoint}/completions",
            headers={"Authorization": f"Bearer {GLOBEX}"},
            json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
            timeout=60,
        )
        statuses.append(r.status_code)
        if r.status_code == 429:
            body = r.json()["error"]
            assert (
                body["code"] == "tenant_rate_limit"
                and body["type"] == "rate_limit_error"
                and "globex" in body["message"]
            )
            assert int(r.headers["Retry-After"]) >= 1  # 0.05 a second: the next request is seconds away
    assert statuses == [200, 200, 200, 429, 429]  # a burst of 3, then nothing at this rate
    assert complete(cluster, ACME, prompt).choices[0].finish_reason == "length"  # acme is untouched
    metrics = httpx.get(cluster.endpoint.replace("/v1", "/metrics")).text
    assert 'mooncake_gateway_tenant_rejections_total{reason="tenant_rate_limit",tenant="globex"} 2.0' in metrics
    assert GLOBEX not in metrics and ACME not in metrics


def test_a_tenant_at_its_cap_on_requests_in_flight_gets_429_until_one_ends(cluster):
    auth = {"Authorization": f"Bearer {INITECH}"}

    def one() -> int:
        r = httpx.post(
            f"{cluster.endpoint}/completions",
            headers=auth,
            json={"model": "tiny", "prompt": prompt_of(20, seed=3), "max_tokens": 1},
            timeout=60,
        )
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "tenant_concurrency" and int(r.headers["Retry-After"]) >= 1
        return r.status_code

    body = {"model": "tiny", "prompt": prompt_of(20, seed=3), "max_tokens": 900, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{cluster.endpoint}/completions", headers=auth, json=body) as long,
    ):
        assert long.status_code == 200
        lines = long.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)  # streaming: in flight
        assert one() == 429
        assert complete(cluster, ACME, prompt_of(20, seed=3)).choices  # another tenant is not held by initech's cap
    deadline = time.monotonic() + 10
    while (status := one()) == 429 and time.monotonic() < deadline:
        time.sleep(0.1)  # the long one's client left: it is cancelled and its place frees
    assert status == 200


def test_a_wrong_or_missing_key_is_401_and_the_key_is_not_logged(cluster):
    r = httpx.post(
        f"{cluster.endpoint}/completions",
        headers={"Authorization": "Bearer sk-acme-000009"},
        json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
        timeout=30,
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{cluster.endpoint}/models", timeout=30).status_code == 401
    assert (
        httpx.get(f"{cluster.endpoint}/models", headers={"Authorization": f"Bearer {ACME}"}, timeout=30).status_code
        == 200
    )
    logs = "".join(p.read_text(errors="replace") for p in (cluster.run_dir / "logs").glob("*.log"))
    for key in (ACME, GLOBEX, INITECH, "sk-acme-000009"):
        assert key not in logs


def test_a_tenants_slo_targets_are_bounded_by_its_own_and_it_names_only_its_classes(cluster):
    """A request's own TTFT target is served at its tenant's bound when tighter (hooli: 300 s, so a 1 ms target is
    served; acme has no bound, and 1 ms is refused, 429, as no prefill meets it); an SLO class the tenant may not use
    is a 403 naming the ones it may."""
    url = f"{cluster.endpoint}/chat/completions"

    def post(key: str, **extra) -> httpx.Response:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}
        return httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    r = post(ACME, ttft_slo_s=0.001)
    assert r.status_code == 429 and "0.001 s SLO" in r.json()["error"]["message"], r.text
    r = post(HOOLI, ttft_slo_s=0.001)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = post(HOOLI, slo_class="batch")
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["code"] == "slo_class_not_allowed" and error["param"] == "slo_class"
    assert "may use: default" in error["message"]
