"""What benchmarks/chaos.py does to a cluster and how it sees the cluster recover: the victims of a replay (killed
together, or drained), the launcher's events, the wait until every instance is back (or the drained one stopped)."""

from __future__ import annotations

import threading
import time

import grpc
from rich.console import Console

from benchmarks.chaos_report import Replay
from conductor.auth import bearer
from mooncake import tls
from mooncake.cluster.launcher import LocalCluster
from protos import conductor_pb2 as cpb
from protos import conductor_pb2_grpc as cpb_grpc


class Events:
    """The launcher's messages (it calls ``on_event`` from its supervisor thread), with when they came."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._lock = threading.Lock()
        self.seen: list[tuple[float, str]] = []  # (perf_counter, message)

    def on_event(self, msg: str) -> None:
        with self._lock:
            self.seen.append((time.perf_counter(), msg))
        if "exited" in msg or "back" in msg:
            self._console.log(f"launcher: {msg}")

    def since(self, t: float) -> list[tuple[float, str]]:
        with self._lock:
            return [(when, m) for when, m in self.seen if when >= t]


def wait_recovered(cluster: LocalCluster, events: Events, result: Replay, since: float, timeout_s: float) -> None:
    """Until the launcher restarted every victim and the Conductor lists every worker and pool node alive."""
    victim, deadline = result.victim, time.monotonic() + timeout_s
    back = []
    for name in victims(victim):
        while not (now_back := [when for when, m in events.since(since) if m == f"{name} is back"]):
            if failed := [m for _, m in events.since(since) if m.startswith(f"{name} did not come back")]:
                raise RuntimeError(f"the launcher could not restart {name}: {failed[0]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not restarted within {timeout_s:.0f} s")
            time.sleep(0.05)
        back.append(now_back[0])
    result.back_after_s = max(back) - since
    c = cluster.config
    want = (
        {f"kv{i}" for i in range(c.prefill)}
        | {f"prefill-{i}" for i in range(c.prefill)}
        | {f"decode-{i}" for i in range(c.decode)}
    )
    while True:
        try:
            listing = leader_call(cluster, "ListInstances", cpb.ListInstancesRequest())
            alive = {i.id for i in listing.instances if i.state == cpb.ALIVE}
        except grpc.RpcError:
            alive = set()
        if want <= alive:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"after {victim} was killed, the Conductor lists only {sorted(alive)} alive within {timeout_s:.0f} s"
            )
        time.sleep(0.05)
    result.registered_after_s = time.perf_counter() - since


DRAIN = "drain:"  # a victim drained (``mooncake pool drain``: no new work, then stopped once idle), not killed


def victims(victim: str) -> list[str]:
    """The components of one replay's victim: ``decode-0+prefill-1`` is two, killed together; ``drain:decode-0`` is
    decode-0."""
    return victim.removeprefix(DRAIN).split("+")


def drain(cluster: LocalCluster, name: str) -> None:
    """What ``mooncake pool drain NAME`` does: the Conductor sends it no new work and stops it once idle."""
    leader_call(cluster, "Drain", cpb.DrainRequest(id=name, remove=True), metadata=bearer(cluster.operator_token))


def leader_call(cluster: LocalCluster, method: str, request, **kw):
    """``method`` on the Conductor that answers: the only one, or (``--conductors``) whichever leads now."""
    error = None
    for address in cluster.conductor_addresses.split(","):
        with tls.grpc_channel(address) as channel:
            try:
                return getattr(cpb_grpc.ConductorStub(channel), method)(request, timeout=5, **kw)
            except grpc.RpcError as e:  # down, or a standby refusing
                error = e
    raise error


def wait_drained(cluster: LocalCluster, result: Replay, since: float, timeout_s: float) -> None:
    """Until the drained component has stopped (``back_after_s``: drain -> stopped)."""
    name, deadline = victims(result.victim)[0], time.monotonic() + timeout_s
    while name in cluster.components and cluster.components[name].alive:  # the launcher forgets a removed one
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} was drained and had not stopped {timeout_s:.0f} s later")
        time.sleep(0.1)
    result.back_after_s = time.perf_counter() - since
