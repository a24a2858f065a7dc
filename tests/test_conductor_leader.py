"""Leader election among Conductors on a real Redis (conductor/leader.py), and the chart's standby replicas."""

from __future__ import annotations

import subprocess
import sys
import time

import redis
from charts import REPO, container, flags, pod_spec, render
from kvnodes import wait_for

from conductor.leader import LEADER_KEY, LeaderLease
from mooncake.localproc import free_port
from mooncake.runtime.process import parse_ready

LEASE_S = 0.3


def lease(url: str, holder: str, log: list[tuple[str, bool]]) -> LeaderLease:
    return LeaderLease(redis.Redis.from_url(url), holder, LEASE_S, lambda leading: log.append((holder, leading)))


def test_one_conductor_leads_and_a_standby_takes_over_within_the_lease_when_it_dies(redis_url):
    log: list[tuple[str, bool]] = []
    first = lease(redis_url, "c0", log).start()
    second = None
    try:
        wait_for(lambda: first.leading)
        second = lease(redis_url, "c1", log).start()
        time.sleep(3 * LEASE_S)
        assert not second.leading and first.current() == "c0"  # renewed all along: the standby never got it
        first._stop.set()  # dies: no renewal, no hand-over
        first._thread.join()
        died = time.monotonic()
        wait_for(lambda: second.leading)
        assert time.monotonic() - died < LEASE_S * 4 / 3 + 0.2
        wait_for(lambda: len(log) == 2)  # the flag is set just before the service is told
        assert second.current() == "c1" and log == [("c0", True), ("c1", True)]
    finally:
        first._stop.set()
        if second is not None:
            second.close()  # else it campaigns on through the next tests (they share the Redis)


def test_a_leader_that_stops_gives_the_lease_up_at_once(redis_url):
    log: list[tuple[str, bool]] = []
    first = lease(redis_url, "c0", log).start()
    wait_for(lambda: first.leading)
    first.close()
    assert redis.Redis.from_url(redis_url).get(LEADER_KEY) is None
    second = lease(redis_url, "c1", log).start()
    wait_for(lambda: second.leading, timeout_s=LEASE_S)
    second.close()


def test_a_leader_whose_lease_was_taken_steps_down(redis_url):
    log: list[tuple[str, bool]] = []
    first = lease(redis_url, "c0", log).start()
    try:
        wait_for(lambda: first.leading)
        redis.Redis.from_url(redis_url).set(LEADER_KEY, "someone-else", px=10_000)  # it paused past its lease
        # its flag drops just before it tells the service (CI read the flag between the two once): wait for the call
        wait_for(lambda: not first.leading and len(log) == 2)
        assert log == [("c0", True), ("c0", False)]
    finally:
        first.close()  # else it campaigns on through the next tests (they share the Redis), and wins
    assert redis.Redis.from_url(redis_url).get(LEADER_KEY) == b"someone-else"  # not taken from its holder


# -- in Kubernetes: several Conductor replicas, only the leader ready ------------------------------


def test_standby_conductors_elect_a_leader_in_redis_and_only_the_leader_is_ready():
    docs = render("--set", "conductor.replicas=2")
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-conductor"))
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    conductor = container(pod_spec(docs, "conductor"), "conductor")
    assert "--redis-url" in flags(conductor) and "--leader-lease" in flags(conductor)
    probe = conductor["readinessProbe"]["exec"]["command"]
    assert probe[:3] == ["python", "-m", "conductor.probe"]
    # a lone Conductor keeps Recreate and its tcp probe
    lone = render("--set", "conductor.replicas=1")
    single = next(d for d in lone if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-conductor"))
    assert single["spec"]["strategy"]["type"] == "Recreate"
    assert "tcpSocket" in container(pod_spec(lone, "conductor"), "conductor")["readinessProbe"]


def test_the_conductor_probe_says_ready_only_for_a_leader(redis_url):
    """The probe's exit status against real Conductors on one Redis: the leader 0, the standby 1."""
    procs, ports = [], []
    try:
        for _ in range(2):
            port = free_port()
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "conductor",
                        "--port",
                        str(port),
                        "--metrics-port",
                        "-1",
                        "--redis-url",
                        redis_url,
                        "--leader-lease",
                        "1",
                    ],
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
            assert parse_ready(procs[-1].stdout.readline()) is not None
            ports.append(port)

        def probe(port: int) -> int:
            return subprocess.run(
                [sys.executable, "-m", "conductor.probe", f"--address=127.0.0.1:{port}"],
                cwd=REPO,
                capture_output=True,
                timeout=30,
            ).returncode

        assert [probe(p) for p in ports] == [0, 1]
        procs[0].kill()
        procs[0].wait()
        deadline = time.monotonic() + 10
        while probe(ports[1]) != 0:
            assert time.monotonic() < deadline, "the standby did not take over"
            time.sleep(0.2)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_the_charts_default_is_a_standby_conductor_with_redis_and_one_conductor_without():
    """``conductor.replicas: auto``: the chart runs its Redis by default, so two Conductors (one stands by); without
    Redis, one, replaced with Recreate (two would each think they lead)."""
    with_redis = next(d for d in render() if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-conductor"))
    assert with_redis["spec"]["replicas"] == 2 and with_redis["spec"]["strategy"]["type"] == "RollingUpdate"
    alone = next(
        d
        for d in render("--set", "redis.enabled=false")
        if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-conductor")
    )
    assert alone["spec"]["replicas"] == 1 and alone["spec"]["strategy"]["type"] == "Recreate"
