"""A client that goes away, at each stage its request can be in: what the cluster held for it comes back.

    stage                                   held for the request                       test
    its prefill call on its way             decode: cache blocks for its KV            ..._mid_prefill_...
    its prefill waiting on the pool node    prefill: the call; decode: cache blocks    ..._waits_on_the_pool_node_...
    its KV landed, decoding not begun       decode: cache blocks, the request          ..._after_its_kv_landed_...
    decoding                                decode: the request, its landing slots     ..._goes_away_cancels_...
    its Abort before its prefill call       prefill: nothing (the call is refused)     ..._aborted_before_it_arrives_...

A stage is held still by stopping (SIGSTOP) the processes the request waits on, so the client hangs up in it for
sure; then they go on. Every count ``replays.idle_counts`` reads (the pool nodes' leases and reservations, the
decode worker's running requests, reserved cache blocks and free landing slots, the prefill workers' calls in
flight) must be back at its idle value. The cluster is test_serving_cluster.py's (``serving_cluster``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import time

import grpc
import httpx
import pytest
from clusters import backend, generate, instances
from conftest import SERVING_KEY
from replays import idle_counts, wait_idle

from mooncake import tls
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc

RESERVED = "mooncake_decode_reserved_cache_blocks"
CANCELLED = 'mooncake_decode_requests_total{outcome="cancelled"}'


@pytest.fixture(scope="module")
def cluster(serving_cluster):
    """The shared cluster, its decode worker connected to both prefill workers (a first call to a stopped worker
    fails at once and is placed again: the test would see two reservations)."""
    ok = 'mooncake_prefill_requests_total{outcome="ok"}'
    for attempt in range(5):
        if all(metric(serving_cluster, f"prefill-{i}", ok) for i in range(2)):
            return serving_cluster
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            body = {"model": "tiny", "max_tokens": 2}
            list(
                pool.map(
                    lambda n: httpx.post(
                        f"{serving_cluster.endpoint}/completions",
                        headers={"Authorization": f"Bearer {SERVING_KEY}"},
                        json=body | {"prompt": prompt_of(200, seed=1000 * attempt + n)},
                        timeout=60,
                    ).raise_for_status(),
                    range(4),
                )
            )
    pytest.fail("the Conductor placed no request on one of the prefill workers")


def prompt_of(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 440) for _ in range(n)]


def metric(cluster, component: str, name: str) -> float:
    """``name`` (with its labels) from ``component``'s /metrics; 0 when not exported yet."""
    lines = httpx.get(f"http://{cluster.component(component).info['metrics']}/metrics", timeout=5).text.splitlines()
    return float(next((line.split()[-1] for line in lines if line.startswith(name)), 0))


def prefill_total(cluster, name: str) -> float:
    return sum(metric(cluster, f"prefill-{i}", name) for i in range(cluster.config.prefill))


def wait_for(condition, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.01)


@contextlib.contextmanager
def client_sending(cluster, prompt: list[int], max_tokens: int = 8):
    """A client with a completion request sent; it hangs up (closes its connection) when the block ends."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}).encode()
    url = httpx.URL(cluster.endpoint)
    with socket.create_connection((url.host, url.port)) as client:
        client.sendall(
            f"POST {url.path}/completions HTTP/1.1\r\nHost: {url.host}\r\nAuthorization: Bearer {SERVING_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        yield


@contextlib.contextmanager
def stopped(pids: list[int]):
    """SIGSTOP ``pids`` until the block ends (SIGCONT then, whatever happened)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def pids(cluster, *names: str) -> list[int]:
    return [cluster.component(n).proc.pid for n in names]


def test_a_client_gone_mid_prefill_gives_the_decode_workers_cache_blocks_back_at_once(cluster):
    """The prefill workers are stopped (SIGSTOP) while a prompt is on its way to one: the decode worker holds cache
    blocks for its KV. The client goes away; the workers go on. The prefill worker confirms the abandoned call writes
    nothing more (Prefill.Abort), so the blocks are back at once: not the write grace later (3 s, kept for a
    prefill worker that does not answer), which would leave an abort storm's blocks held long after it."""
    cancelled_before = metric(cluster, "decode-0", CANCELLED)
    assert metric(cluster, "decode-0", RESERVED) == 0
    with stopped(pids(cluster, "prefill-0", "prefill-1")):
        with client_sending(cluster, prompt_of(300, seed=7)):
            wait_for(lambda: metric(cluster, "decode-0", RESERVED) > 0, "the decode worker reserved no blocks")
            assert metric(cluster, "decode-0", RESERVED) == 19  # 300 tokens in blocks of 16, for the prefill's writes
        time.sleep(0.5)  # the client is gone: the gateway and the decode worker have given the request up
        resumed = time.monotonic()
    while metric(cluster, "decode-0", RESERVED) > 0 and time.monotonic() - resumed < 10:
        time.sleep(0.01)
    back_s = time.monotonic() - resumed
    assert metric(cluster, "decode-0", RESERVED) == 0
    # released on the prefill worker's word (0.06 s here), not by the write grace: that would be 3 s after the
    # decode worker gave up, which was 0.5 s before the workers went on
    assert back_s < 1.5
    print(f"the reserved blocks were back {back_s:.3f} s after the prefill workers went on")
    assert metric(cluster, "decode-0", CANCELLED) == cancelled_before + 1


def test_a_client_gone_while_its_prefill_waits_on_the_pool_node_gives_everything_back(cluster):
    """The pool nodes are stopped: the prefill worker that took the call waits for its reservation of the prompt's
    blocks. The client goes away and the nodes go on: the prefill ends before the engine computes the prompt (so
    nothing is stored: the same prompt afterwards finds no block of it in the pool), its reservation is aborted,
    and the decode worker's cache blocks come back."""
    idle = idle_counts(cluster)
    cancelled_before = metric(cluster, "decode-0", CANCELLED)
    prompt = prompt_of(300, seed=81)
    with stopped(pids(cluster, "kv0", "kv1")):
        with client_sending(cluster, prompt):
            wait_for(lambda: prefill_total(cluster, "mooncake_prefill_inflight") > 0, "no prefill call arrived")
            assert metric(cluster, "decode-0", RESERVED) == 19
        time.sleep(0.5)
    assert wait_idle(cluster, idle, 5) == idle
    assert metric(cluster, "decode-0", CANCELLED) == cancelled_before + 1
    again = generate(backend(cluster), "after-cancel", prompt, 2, temperature=0.0)
    assert again[-1].cached_tokens == 0  # computed now, for the first time


def test_a_client_gone_after_its_kv_landed_and_before_its_decoding_gives_everything_back(cluster):
    """The prompt's KV is written into the decode worker's cache and the prefill worker has answered, but the
    decode worker (stopped) has not taken it up when the client goes away. Going on, it finds the request cancelled:
    the cache blocks holding that KV and its place in the batch come back."""
    idle = idle_counts(cluster)
    cancelled_before = metric(cluster, "decode-0", CANCELLED)
    answered = prefill_total(cluster, 'mooncake_prefill_requests_total{outcome="ok"}')
    (decode,) = pids(cluster, "decode-0")
    try:
        with client_sending(cluster, prompt_of(300, seed=82)):
            with stopped(pids(cluster, "prefill-0", "prefill-1")):
                wait_for(lambda: metric(cluster, "decode-0", RESERVED) > 0, "the decode worker reserved no blocks")
                os.kill(decode, signal.SIGSTOP)  # its prefill call is out; it will not see the answer until it goes on
            wait_for(
                lambda: prefill_total(cluster, 'mooncake_prefill_requests_total{outcome="ok"}') > answered,
                "the prefill worker did not answer",
            )
        time.sleep(0.5)  # the client is gone: the gateway has given the request up
    finally:
        os.kill(decode, signal.SIGCONT)
    assert wait_idle(cluster, idle, 5) == idle
    assert metric(cluster, "decode-0", CANCELLED) == cancelled_before + 1


def test_a_client_that_goes_away_cancels_its_request_everywhere(cluster):
    """Close a stream after its first token: the decode worker drops the request, its landing slots come back, and
    so does every other count at idle."""
    idle = idle_counts(cluster)
    slots_before = metric(cluster, "decode-0", "mooncake_decode_landing_free_slots")
    cancelled_before = metric(cluster, "decode-0", CANCELLED)
    with httpx.stream(
        "POST",
        f"{cluster.endpoint}/completions",
        headers={"Authorization": f"Bearer {SERVING_KEY}"},
        timeout=30,
        json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "stream": True, "ignore_eos": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then the client goes away
    deadline = time.monotonic() + 10
    while metric(cluster, "decode-0", CANCELLED) == cancelled_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(cluster, "decode-0", CANCELLED) == cancelled_before + 1  # cancelled, not with its 1,000 tokens
    assert httpx.get(f"http://{cluster.component('decode-0').info['metrics']}/health").json()["running"] == 0
    assert metric(cluster, "decode-0", "mooncake_decode_landing_free_slots") == slots_before
    assert wait_idle(cluster, idle, 5) == idle


def test_a_prefill_call_aborted_before_it_arrives_is_refused_when_it_comes(cluster):
    """Prefill.Abort for a call the worker has not seen (its caller gave up while it was on its way) answers at once
    that it writes nothing; the call, should it come after all, is refused before it touches anything."""
    stub = wpb_grpc.PrefillStub(tls.grpc_channel(instances(cluster)["prefill-0"].address))
    token = os.urandom(8).hex()

    def prefill(landing_token: str) -> grpc.StatusCode:
        landing = wpb.Landing(token=landing_token)
        with pytest.raises(grpc.RpcError) as e:
            stub.Prefill(wpb.PrefillRequest(request_id="late", prompt_token_ids=[5, 6, 7], landing=landing), timeout=5)
        return e.value.code()

    assert stub.Abort(wpb.AbortRequest(request_id="late", landing_token=token), timeout=5).stopped
    assert prefill(token) is grpc.StatusCode.CANCELLED
    assert prefill(token + "0") is grpc.StatusCode.INVALID_ARGUMENT  # not aborted: looked at, and its landing is wrong
