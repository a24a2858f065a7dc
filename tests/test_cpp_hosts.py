"""A pipelined prefill group across hosts: every component on a network host of its own (a namespace on a bridge, its
own hostname), the group's two stages as stage servers (``python -m prefill.stage``) on two more hosts. Hidden states
cross between the stage hosts over tcp, each stage pushes its layers' KV over tcp to the decode host's landing slots and
the worker host's pool node, and reads a reused prefix from that node the same way.

The bar: greedy tokens equal one engine alone, cold and from the pool; a stage server killed mid-prefill (restarted
by the supervisor, as `mooncake up` and Kubernetes do) loses no request; a connection without the group's key is
refused by a stage server.
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import AuthenticationError, Client

import pytest
from clusters import backend, generate, instances, kill_mid_prefill, reference_tokens, start_cluster, tokens

from mooncake.cluster.netns import VirtualNetwork

pytestmark = pytest.mark.skipif(not VirtualNetwork.available(), reason="network namespaces need root and iproute2")


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    c = start_cluster(
        tiny_dir,
        tmp_path_factory.mktemp("cpp-hosts"),
        prefill=1,
        prefill_groups=1,
        group_size=2,
        decode=1,
        max_num_batched_tokens=64,
        network_hosts=True,
    )
    yield c
    c.stop()


def prompt_of(n: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 440) for _ in range(n)]


def test_the_stages_run_on_hosts_of_their_own(cluster):
    hosts = {cluster.hosts[name] for name in ("prefill-0", "prefill-0-stage0", "prefill-0-stage1", "decode-0")}
    assert len(hosts) == 4
    assert instances(cluster)["prefill-0"].pipeline_stages == 2


@pytest.mark.parametrize("length", [5, 300, 700])
def test_greedy_through_stages_on_other_hosts_equals_one_engine(cluster, tiny_dir, length):
    prompt = prompt_of(length, seed=length)
    got = generate(backend(cluster), f"hosts-{length}", prompt, 12, temperature=0.0, ignore_eos=True)
    assert tokens(got) == reference_tokens(tiny_dir, prompt, 12)


def test_a_prefix_the_stages_read_back_over_tcp(cluster, tiny_dir):
    shared = prompt_of(256, seed=77)
    generate(backend(cluster), "hosts-a", shared + prompt_of(20, seed=1), 4, temperature=0.0, ignore_eos=True)
    prompt = shared + prompt_of(100, seed=2)
    got = generate(backend(cluster), "hosts-b", prompt, 12, temperature=0.0, ignore_eos=True)
    assert got[-1].cached_tokens == 256
    assert tokens(got) == reference_tokens(tiny_dir, prompt, 12)


def test_a_stage_server_refuses_a_connection_without_the_groups_key(cluster):
    comp = cluster.components["prefill-0-stage1"]
    host, port = comp.info["address"].rsplit(":", 1)
    with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
        Client((host, int(port)), authkey=b"not-the-group-key-at-all")


def test_a_stage_server_killed_mid_prefill_loses_no_request(cluster, tiny_dir):
    """The supervisor restarts the killed stage server; the worker dials the stages again; the gateway places the
    failed prefill again: the request ends with one engine's tokens. (Tried until a kill lands mid-prefill, which the
    worker's failed-prefill counter shows.)"""
    victim = cluster.components["prefill-0-stage1"]
    for attempt in range(5):
        pid, restarts = victim.proc.pid, victim.restarts
        landed = kill_mid_prefill(
            cluster,
            tiny_dir,
            f"hosts-kill-{attempt}",
            prompt_of(900, seed=321 + attempt),
            lambda: os.kill(pid, signal.SIGKILL),
        )
        deadline = time.monotonic() + 120
        while (
            victim.restarts == restarts or not victim.alive or "address" not in victim.info
        ) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert victim.restarts > restarts and victim.proc.pid != pid  # restarted by the supervisor
        if landed:
            return
    pytest.fail("no kill landed mid-prefill in 5 tries")
