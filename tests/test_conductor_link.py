"""A worker's line to the Conductor (mooncake.runtime.conductor_link) against a real Conductor over gRPC: the
heartbeats that carry a prefill worker's queue come when the queue changes and often while it is busy, so the
Conductor places requests on the queue as it is."""

from __future__ import annotations

import time

from conductor.config import ConductorConfig
from conductor.service import ConductorService
from conductor.servicer import start_server
from mooncake.runtime.conductor_link import ConductorLink
from protos import conductor_pb2 as pb


class Queue:
    """A prefill worker's queue as its heartbeats report it."""

    def __init__(self) -> None:
        self.tokens = 0

    def load(self) -> pb.Load:
        return pb.Load(queued_tokens=self.tokens, queued_requests=1 if self.tokens else 0)

    def busy(self) -> int:
        return 1 if self.tokens else 0


def queued_tokens_seen(service: ConductorService, until: float, want: int) -> bool:
    while time.monotonic() < until:
        with service._lock:
            inst = service.conductor.instances.get("p0")
            if inst is not None and inst.load.queued_tokens == want:
                return True
        time.sleep(0.01)
    return False


def test_a_prefill_worker_beats_when_its_queue_changes_and_often_while_it_is_busy():
    service = ConductorService(ConductorConfig())
    server, port = start_server(service)
    queue = Queue()
    link = ConductorLink(
        f"127.0.0.1:{port}",
        pb.RegisterRequest(id="p0", role=pb.PREFILL, address="127.0.0.1:1", node="kv0", model="m"),
        queue.load,
        interval_s=60.0,  # no periodic beat within the test
        busy=queue.busy,
        busy_interval_s=0.2,
    )
    try:
        link.start()
        assert link.registered.wait(10)
        assert queued_tokens_seen(service, time.monotonic() + 5, 0)
        queue.tokens = 700
        link.beat_soon()  # a prompt arrived or ended: heard at once, not a minute later
        assert queued_tokens_seen(service, time.monotonic() + 2, 700)
        queue.tokens = 300  # busy: the next beats come every 0.2 s without being asked
        assert queued_tokens_seen(service, time.monotonic() + 2, 300)
        queue.tokens = 0
        assert queued_tokens_seen(service, time.monotonic() + 2, 0)
        queue.tokens = 100  # idle at the last beat: the next one is the minute's, unless asked
        assert not queued_tokens_seen(service, time.monotonic() + 1.0, 100)
        link.beat_soon()
        assert queued_tokens_seen(service, time.monotonic() + 2, 100)
    finally:
        link.close()
        server.stop(grace=0)
        service.close()
