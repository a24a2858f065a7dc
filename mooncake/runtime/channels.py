"""gRPC channel options for calls between components that restart or drop off the network.

Restarts: gRPC's default reconnect backoff grows from 1 s to 120 s, so a channel to a
component that was down for a few seconds keeps failing calls fast for up to two minutes
after it is back. Calls here retry on their own schedule (mooncake.gateway.recovery, the
Conductor link's loop), so the channel reconnects about as often as they do.

Partitions: a killed process resets its connections at once, but a host that drops off the
network goes silent, and a stream from it (a decode worker's tokens, a prefill's answer)
would wait forever. Keepalive pings find it: a connection whose ping is unanswered for
``detect_s`` fails its calls with UNAVAILABLE, which the caller treats as the peer's death.
Servers must accept pings that often (``SERVER_OPTIONS``), or they answer them with GOAWAY.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

LOCAL_HOST = "127.0.0.1"  # where a component binds by default: this host only
DETECT_S = 2.0  # default: a silent peer is declared failed after about this long (plus one ping interval)

RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    # gRPC reads this as the least time a connection attempt gets (TCP, the TLS handshake and the server's first
    # HTTP/2 frame): at 100 ms, new connections on 2 saturated cores timed out before the server's SETTINGS frame and
    # failed their calls (an abort storm of 100 saw prefill calls fail so). A silent peer gets as long (DETECT_S).
    ("grpc.min_reconnect_backoff_ms", int(DETECT_S * 1000)),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
PING_INTERVAL_MS = 1000

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", PING_INTERVAL_MS // 2),
    ("grpc.http2.min_ping_interval_without_data_ms", PING_INTERVAL_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    # gRPC binds with SO_REUSEPORT by default: two servers given one port would both bind it and share its
    # connections, a client reaching the wrong one (UNIMPLEMENTED). Without it the second fails to bind, loudly.
    ("grpc.so_reuseport", 0),
)


def client_options(detect_s: float = DETECT_S) -> tuple[tuple[str, int], ...]:
    """Options of a channel whose calls must fail within about ``detect_s`` + 1 s of the peer going silent."""
    return RECONNECT_OPTIONS + (
        ("grpc.keepalive_time_ms", PING_INTERVAL_MS),
        ("grpc.keepalive_timeout_ms", int(detect_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    )


class ByAddress(Generic[T]):
    """One client (a gRPC stub, a pool node's KVStoreClient) per peer address, made on first use; thread-safe.

    ``close`` closes those that have a ``close`` (a stub's channel lives as long as the process)."""

    def __init__(self, make: Callable[[str], T]) -> None:
        self._make = make
        self._clients: dict[str, T] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> T:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = self._make(address)
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            close = getattr(client, "close", None)
            if close is not None:
                close()


class Conductors:
    """The Conductor addresses a component was given (``"a:1,b:2"``: a leader and its standbys, any order) and the one
    it calls now. A gateway and a worker move on the same way: to the next address, once, however many calls saw
    the current one fail."""

    def __init__(self, spec: str) -> None:
        self.addresses = [a.strip() for a in spec.split(",") if a.strip()]
        if not self.addresses:
            raise ValueError("no Conductor address")
        self.current = self.addresses[0]

    def failed(self, address: str) -> bool:
        """The Conductor at ``address`` did not answer: call the next one. False if there is no other, or another
        caller has moved on already (``address`` is not the current one)."""
        if len(self.addresses) < 2 or address != self.current:
            return False
        self.current = self.addresses[(self.addresses.index(address) + 1) % len(self.addresses)]
        return True
