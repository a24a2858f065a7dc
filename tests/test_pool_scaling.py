"""Scaling the pools while traffic flows, for real: the Conductor's local pool provider and `mooncake up`'s processes.

prefill 1 -> 2 -> 1 and decode 1 -> 2 -> 1 with clients sending requests the whole time:
no request fails, the new instances take work, the drained ones finish theirs and exit.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from clusters import conductor, start_cluster

from protos import conductor_pb2 as cpb


class Traffic:
    """Client threads sending requests back to back until stopped; every outcome is kept."""

    def __init__(self, endpoint: str, clients: int = 3) -> None:
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._client = openai.OpenAI(base_url=endpoint, api_key="none", max_retries=0, timeout=60)
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                r = self._client.completions.create(
                    model="tiny",
                    prompt=f"request {n}-{i}: the quick brown fox",
                    max_tokens=24,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                assert r.usage.completion_tokens == 24
                self.ok += 1
            except (openai.APIError, AssertionError) as e:
                self.failures.append(f"{n}-{i}: {e}")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)


def alive(cluster, role: int) -> dict[str, cpb.InstanceInfo]:
    listing = conductor(cluster).ListInstances(cpb.ListInstancesRequest(role=role), timeout=5)
    return {i.id: i for i in listing.instances}


def scale(cluster, role: int, replicas: int, timeout_s: float = 120.0) -> cpb.ScalePoolResponse:
    """ScalePool, then wait until exactly ``replicas`` are alive and none is draining."""
    r = conductor(cluster).ScalePool(cpb.ScalePoolRequest(role=role, replicas=replicas), timeout=30)
    deadline = time.monotonic() + timeout_s
    while True:
        listed = alive(cluster, role).values()
        if sum(i.state == cpb.ALIVE for i in listed) == replicas and not any(i.state == cpb.DRAINING for i in listed):
            return r
        assert time.monotonic() < deadline, f"pool did not reach {replicas}: {[(i.id, i.state) for i in listed]}"
        time.sleep(0.2)


def decode_served(cluster, name: str) -> float:
    """Requests ``name`` served; 0 until its READY line is read (a worker registers with the Conductor, and so counts as
    alive, before it prints READY)."""
    address = cluster.component(name).info.get("metrics")
    if address is None:
        return 0.0
    metrics = httpx.get(f"http://{address}/metrics").text
    return sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith('mooncake_decode_requests_total{outcome="ok"}')
    )


PROMPT = " ".join(f"line {i}: the pool keeps what it was given." for i in range(20))


def complete(cluster, prompt: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=cluster.endpoint, api_key="none", max_retries=0, timeout=60)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)


def test_scaling_both_pools_up_and_down_under_traffic_loses_no_request(tiny_dir, tmp_path):
    """Prefill 1 -> 2, then `mooncake pool drain kv0` (the first pool node, with prefill-0 on it) under traffic:
    what kv0 held is served from kv1 afterwards, with the same tokens."""
    c = start_cluster(tiny_dir, tmp_path, prefill=1, decode=1)
    first = complete(c, PROMPT)  # its blocks are on kv0, the only pool node
    traffic = Traffic(c.endpoint)
    try:
        time.sleep(1)
        r = scale(c, cpb.PREFILL, 2)
        assert r.provider == "local" and r.started == ["prefill-1"]
        deadline = time.monotonic() + 30
        while alive(c, cpb.PREFILL)["prefill-1"].decisions == 0:  # the new worker takes work
            assert time.monotonic() < deadline, "prefill-1 was never given a request"
            time.sleep(0.2)
        prefill_procs = {n: c.component(n).proc for n in ("prefill-0", "prefill-1", "kv0", "kv1")}
        drained = conductor(c).Drain(cpb.DrainRequest(id="kv0", remove=True), timeout=30)
        assert drained.state == cpb.DRAINING
        scale(c, cpb.PREFILL, 1)  # waits until prefill-0, drained with its node, has gone
        assert prefill_procs["prefill-0"].wait(30) == 0 and prefill_procs["kv0"].wait(30) == 0  # stopped cleanly
        deadline = time.monotonic() + 30
        while "kv0" in alive(c, cpb.KVSTORE):  # and its blocks left the index with it
            assert time.monotonic() < deadline
            time.sleep(0.2)
        again = complete(c, PROMPT)  # kv0's blocks were copied to kv1 before it went
        assert again.choices[0].text == first.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens >= 16 * (first.usage.prompt_tokens // 16 - 1)

        r = scale(c, cpb.DECODE, 2)
        assert r.started == ["decode-1"]
        deadline = time.monotonic() + 30
        while decode_served(c, "decode-1") == 0:
            assert time.monotonic() < deadline, "decode-1 never finished a request"
            time.sleep(0.2)
        decode_procs = {n: c.component(n).proc for n in ("decode-0", "decode-1")}
        r = scale(c, cpb.DECODE, 1)
        (drained,) = r.draining
        assert decode_procs[drained].wait(30) == 0  # it finished what it ran and exited cleanly
        scaling_is_refused_clearly_below_one_or_for_the_pool_and_status_lists_the_rest(c)
    finally:
        traffic.stop()
        c.stop()
    assert traffic.failures == []
    assert traffic.ok >= 20


def scaling_is_refused_clearly_below_one_or_for_the_pool_and_status_lists_the_rest(c) -> None:
    """Checked on the scaled cluster at the end of the test above (a cluster of its own took 30 s to start): a pool
    below one, or of pool nodes, is refused with a clear message; `mooncake status` lists every instance alive."""
    stub = conductor(c)
    with pytest.raises(Exception) as e:
        stub.ScalePool(cpb.ScalePoolRequest(role=cpb.DECODE, replicas=0), timeout=5)
    assert "at least one" in e.value.details()
    with pytest.raises(Exception) as e:
        stub.ScalePool(cpb.ScalePoolRequest(role=cpb.KVSTORE, replicas=2), timeout=5)
    assert "PREFILL or DECODE" in e.value.details()
    out = subprocess.run(
        [sys.executable, "-m", "mooncake.cli.main", "status", "--conductor", c.conductor_address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    names = [name for role in (cpb.PREFILL, cpb.DECODE, cpb.KVSTORE) for name in alive(c, role)]
    assert len(names) == 3  # one prefill worker, its pool node, one decode worker
    for name in (*names, "alive"):
        assert name in out.stdout
