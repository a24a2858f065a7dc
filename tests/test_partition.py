"""Hosts that drop off the network (issue 17): a killed process resets its connections at once, a host that
drops off the network goes silent, and only timeouts notice.

Each prefill worker (with its pool node: one machine's pool) and each decode worker runs on a network host of
its own (mooncake/cluster/netns.py: a namespace per host, veth pairs into a bridge, its own hostname, so KV
between hosts crosses tcp); the Conductor and the gateway are on the bridge's side. Mid-replay a host's link
goes down: every request still completes with the undisturbed run's tokens, and once the link is back,
nothing stays held. Needs root (network namespaces); skipped otherwise.
"""

from __future__ import annotations

import time

import pytest
from clusters import conductor, start_cluster
from replays import replay, undisturbed_run, wait_idle

from mooncake.cluster.netns import VirtualNetwork
from mooncake.engine.tiny import make_tiny
from protos import conductor_pb2 as cpb

pytestmark = pytest.mark.skipif(not VirtualNetwork.available(), reason="network namespaces need root and iproute2")

DETECT_S = 1.0  # keepalive: a silent peer fails its calls after about this plus a 1 s ping interval


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # its own copy, not conftest's session-wide one: with that one this module's undisturbed run saw a decode worker
    # fail to reach a prefill worker's host, in two CI runs out of two (not understood yet)
    return make_tiny(tmp_path_factory.mktemp("tiny-partition") / "model", "llama")


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    c = start_cluster(
        tiny_dir,
        tmp_path_factory.mktemp("partition"),
        prefill=2,
        decode=2,
        max_model_len=512,
        hold_s=30.0,
        network_hosts=True,
        detect_s=DETECT_S,
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def undisturbed(cluster):
    return undisturbed_run(cluster)


def busiest_prefill(cluster) -> str:
    """The prefill worker the Conductor is placing prompts on now: the most placements in half a second. (The replay's
    prompts share four prefixes, and placement follows the pool node that holds a prefix: a CI run's cut of prefill-0
    hit no request at all, its recoveries empty, as if every prompt went to prefill-1 then.)"""

    def placements() -> dict[str, int]:
        listing = conductor(cluster).ListInstances(cpb.ListInstancesRequest(role=cpb.PREFILL), timeout=5)
        return {i.id: i.decisions for i in listing.instances}

    before = placements()
    time.sleep(0.5)
    after = placements()
    return max(after, key=lambda name: (after[name] - before.get(name, 0), after[name]))


@pytest.mark.parametrize("victim", ["decode-0", "prefill"])
def test_a_host_cut_off_mid_run_loses_no_request_and_changes_no_token(cluster, undisturbed, victim, capsys):
    """``prefill``: the prefill worker taking the replay's prompts when it strikes."""
    expected, idle = undisturbed
    struck: list[float] = []
    cut_off: list[str] = []

    def cut(cluster, victim: str) -> None:
        name = busiest_prefill(cluster) if victim == "prefill" else victim
        cut_off.append(name)
        struck.append(time.monotonic())
        cluster.cut(name)

    try:
        outputs, errors, recoveries = replay(cluster, victim, strike=cut)
    finally:
        for name in cut_off:
            cluster.heal(name)
    (victim,) = cut_off
    assert errors == {}, f"{len(errors)} requests failed after {victim}'s host was cut off"
    assert outputs == expected
    seen = [t for r in recoveries for f, t in zip(r.faults, r.fault_times) if f.endswith(victim)]
    assert seen, recoveries  # the cut hit requests in flight, and they went on elsewhere
    with capsys.disabled():
        print(
            f"\n{victim}'s host cut off: its first failed call noticed after {min(seen) - struck[0]:.2f} s "
            f"(detect_s={DETECT_S}); {len(recoveries)} requests outlived it"
        )
    # once the link is back: its streams' and prefills' leftovers end, it registers again, nothing stays held
    assert wait_idle(cluster, idle, 90) == idle
