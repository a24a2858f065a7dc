"""A worker's (or pool node's) line to the Conductor: register, heartbeat the load, report measurements.

    link = ConductorLink("127.0.0.1:7000", pb.RegisterRequest(id="p0", role=pb.PREFILL, ...), load=lambda: pb.Load(...))
    link.start()                             # registers (retrying until the Conductor answers), then heartbeats
    link.prefill_sample(prompt, cached, s)   # queued; sent in one Report with the others
    link.beat_soon()                         # the load changed (a prefill ended): heartbeat now, not at the interval
    link.close()                             # deregisters: the Conductor stops sending work at once

One daemon thread per link. A Conductor that restarted without Redis answers a heartbeat
with ``known=False``; the link then registers again. While the Conductor is unreachable
the link keeps trying (logging once per outage), and measurements queue up to a bound.
Given several addresses ("a:7000,b:7000": a leader and its standbys, conductor/leader.py),
a failed call moves the link to the next one, where it registers again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc

from mooncake import tls
from mooncake.runtime.channels import RECONNECT_OPTIONS, Conductors
from protos import conductor_pb2 as pb
from protos import conductor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_QUEUED = 10_000
REPORT_EVERY_S = 0.2
RETRY_S = 0.25  # while the Conductor does not answer: a restarted one has every worker back within about this
MIN_BEAT_GAP_S = 0.05  # beat_soon's heartbeats come at most this often


class ConductorLink:
    def __init__(
        self,
        address: str,
        registration: pb.RegisterRequest,
        load: Callable[[], pb.Load],
        interval_s: float | None = None,
        rpc_timeout_s: float = 3.0,
        on_heartbeat: Callable[[pb.HeartbeatResponse], None] | None = None,
        busy: Callable[[], int] | None = None,
        busy_interval_s: float | None = None,
    ) -> None:
        """``on_heartbeat``: called (on the link's thread) with each answer to a heartbeat of a known instance.
        ``busy`` and ``busy_interval_s``: while ``busy()`` is above 0 the link beats at least every
        ``busy_interval_s`` (a prefill worker's queue: between heartbeats the Conductor only guesses how it drains)."""
        self.conductors = Conductors(address)
        self.registration = registration
        self._load = load
        self._interval = interval_s
        self._busy, self._busy_interval = busy, busy_interval_s
        self._beat_soon = False
        self._rpc_timeout = rpc_timeout_s
        self._on_heartbeat = on_heartbeat
        self._channel = tls.grpc_channel(self.address, options=RECONNECT_OPTIONS)
        self.stub = pb_grpc.ConductorStub(self._channel)
        self._prefill: deque[pb.PrefillSample] = deque(maxlen=MAX_QUEUED)
        self._transfer: deque[pb.TransferSample] = deque(maxlen=MAX_QUEUED)
        self._events: deque[pb.RequestEvent] = deque(maxlen=MAX_QUEUED)
        self._token = b""  # the latest registration's instance token (conductor.auth)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.registered = threading.Event()
        self.refused: str | None = None  # why the Conductor will not take this instance (it stops trying)
        self.settled = threading.Event()  # registered or refused
        self._thread = threading.Thread(target=self._run, name=f"conductor-link-{registration.id}", daemon=True)

    def start(self) -> "ConductorLink":
        self._thread.start()
        return self

    # -- measurements (any thread) -----------------------------------------------------------

    def prefill_sample(self, prompt_tokens: int, cached_tokens: int, seconds: float) -> None:
        if prompt_tokens > 0 and seconds > 0:
            self._prefill.append(
                pb.PrefillSample(
                    prompt_tokens=prompt_tokens, cached_tokens=min(cached_tokens, prompt_tokens), seconds=seconds
                )
            )

    def transfer_sample(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self._transfer.append(pb.TransferSample(bytes=num_bytes, seconds=seconds))

    def decode_started(
        self,
        request_id: str,
        measured_ttft_s: float = 0.0,
        handoff_s: float = 0.0,
        queue_s: float = 0.0,
        prefill_s: float = 0.0,
    ) -> None:
        """``request_id`` joined the batch ``measured_ttft_s`` after it arrived, ``handoff_s`` of it the hand-off,
        ``queue_s`` and ``prefill_s`` the prefill worker's own queue and prefill (the Conductor scores each part of its
        prediction)."""
        self._event(pb.RequestEvent.DECODE_STARTED, request_id, measured_ttft_s, handoff_s, queue_s, prefill_s)

    def finished(
        self,
        request_id: str,
        measured_ttft_s: float = 0.0,
        handoff_s: float = 0.0,
        queue_s: float = 0.0,
        prefill_s: float = 0.0,
        output_tokens: int = 0,
        tbt_s: float = 0.0,
    ) -> None:
        """``request_id`` left; ``measured_ttft_s``: when it got its first token (0: it never did); ``handoff_s``,
        ``queue_s`` and ``prefill_s``: its parts, when not reported with DECODE_STARTED; ``output_tokens``: what it
        generated (0: not known); ``tbt_s``: the mean time between its tokens (0: not measured)."""
        self._event(
            pb.RequestEvent.FINISHED, request_id, measured_ttft_s, handoff_s, queue_s, prefill_s, output_tokens, tbt_s
        )

    def beat_soon(self) -> None:
        """The load changed (a prefill worker's prompt ended): heartbeat now (at most every ``MIN_BEAT_GAP_S``), so the
        Conductor places the next request on the queue as it is, not as its drain guessed it since the last beat."""
        self._beat_soon = True
        self._wake.set()

    def _event(
        self,
        kind,
        request_id: str,
        ttft_s: float,
        handoff_s: float,
        queue_s: float,
        prefill_s: float,
        output_tokens: int = 0,
        tbt_s: float = 0.0,
    ) -> None:
        self._events.append(
            pb.RequestEvent(
                request_id=request_id,
                kind=kind,
                measured_ttft_s=ttft_s,
                handoff_s=handoff_s,
                queue_s=queue_s,
                prefill_s=prefill_s,
                output_tokens=output_tokens,
                measured_tbt_s=tbt_s,
            )
        )
        self._wake.set()

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        down_since = None
        next_beat = last_beat = 0.0
        while not self._stop.is_set():
            try:
                if not self.registered.is_set():
                    r = self.stub.Register(self.registration, timeout=self._rpc_timeout)
                    self._token = r.instance_token  # what lets it deregister itself
                    if self._interval is None:
                        self._interval = max(0.2, r.heartbeat_interval_s)
                    self.registered.set()
                    self.settled.set()
                    log.info("registered %s with the Conductor at %s", self.registration.id, self.address)
                    next_beat = 0.0
                now = time.monotonic()
                if self._beat_soon and now >= last_beat + MIN_BEAT_GAP_S:
                    next_beat = now
                if now >= next_beat:
                    self._beat_soon = False
                    load, interval = self._load(), self._next_interval()  # busy as this load stands
                    beat = self.stub.Heartbeat(
                        pb.HeartbeatRequest(id=self.registration.id, load=load), timeout=self._rpc_timeout
                    )
                    last_beat, next_beat = now, now + interval
                    if not beat.known:
                        log.warning(
                            "the Conductor does not know %s (it restarted): registering again", self.registration.id
                        )
                        self.registered.clear()
                        continue
                    if self._on_heartbeat is not None:
                        self._on_heartbeat(beat)
                self._flush()
                if down_since is not None:
                    log.info(
                        "the Conductor at %s answers again (after %.1f s)", self.address, time.monotonic() - down_since
                    )
                    down_since = None
            except grpc.RpcError as e:
                if e.code() is grpc.StatusCode.FAILED_PRECONDITION:
                    self.refused = e.details()
                    self.settled.set()
                    log.error("the Conductor refused %s: %s", self.registration.id, self.refused)
                    return
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("the Conductor at %s does not answer (%s); retrying", self.address, e.code().name)
                self._next_conductor()
                self._stop.wait(RETRY_S / len(self.conductors.addresses))
                continue
            self._wake.wait(min(REPORT_EVERY_S, max(0.0, next_beat - time.monotonic())))
            self._wake.clear()

    def _next_interval(self) -> float:
        """Seconds to the next heartbeat: the Conductor's interval, or ``busy_interval_s`` while busy."""
        if self._busy_interval is not None and self._busy is not None and self._busy() > 0:
            return min(self._interval, self._busy_interval)
        return self._interval

    @property
    def address(self) -> str:
        """The Conductor this link calls now."""
        return self.conductors.current

    def _next_conductor(self) -> None:
        """Move to the next Conductor (the one that failed may be dead or a standby now), and register there."""
        if not self.conductors.failed(self.address):
            return
        old = self._channel
        self._channel = tls.grpc_channel(self.address, options=RECONNECT_OPTIONS)
        self.stub = pb_grpc.ConductorStub(self._channel)
        self.registered.clear()
        old.close()

    def _flush(self) -> None:
        if not (self._prefill or self._transfer or self._events):
            return
        batch = pb.ReportRequest(
            id=self.registration.id,
            prefill=_drain(self._prefill),
            transfer=_drain(self._transfer),
            requests=_drain(self._events),
        )
        try:
            self.stub.Report(batch, timeout=self._rpc_timeout)
        except grpc.RpcError:
            self._prefill.extendleft(reversed(batch.prefill))  # keep them for the next try
            self._transfer.extendleft(reversed(batch.transfer))
            self._events.extendleft(reversed(batch.requests))
            raise

    def close(self, deregister: bool = True, hand_off_s: float = 0.0) -> None:
        """Stop the thread; deregister (so nothing new is sent here) unless told not to. A pool node with
        ``hand_off_s``: the Conductor has the other nodes copy its chains first, for up to that long."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if deregister and self.registered.is_set():
            try:
                self._flush()
                self.stub.Deregister(
                    pb.DeregisterRequest(id=self.registration.id, instance_token=self._token, hand_off=hand_off_s > 0),
                    timeout=hand_off_s or self._rpc_timeout,
                )
            except grpc.RpcError:
                pass  # the Conductor will expire us
        self._channel.close()


def _drain(queue: deque) -> list:
    out = []
    while queue:
        out.append(queue.popleft())
    return out
