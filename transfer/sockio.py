"""Socket I/O for latency-bound paths: non-blocking sockets, bounded busy-polling, deadlines.

Waking a thread that sleeps in ``recv`` costs about 20 us on the 2-core VMs this
project runs on, several times the work of answering a small request (a Python
ping-pong over a Unix socket takes 43 us with both sides sleeping and 5 us with both
polling). So a reader first polls the non-blocking socket for up to ``spin_s`` (the
next request, or the answer, usually arrives within that) and only then sleeps in
``poll(2)``. Only one thread of a process polls at a time, for at most ``spin_s``.

Every function takes an absolute ``deadline`` (``time.monotonic()``; None: none) and
raises ``TimeoutError`` past it; ``ConnectionError`` when the peer closes mid-message.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time

from transfer import handshake

log = logging.getLogger(__name__)

SPIN_S = 100e-6
REFUSAL_LOG_S = 60.0


def wait_ready(sock: socket.socket, event: int, deadline: float | None) -> None:
    """Sleep until ``sock`` is ready for ``event`` (select.POLLIN/POLLOUT); TimeoutError past ``deadline``."""
    remaining = None if deadline is None else deadline - time.monotonic()
    if remaining is not None and remaining <= 0:
        raise TimeoutError("timed out")
    poller = select.poll()
    poller.register(sock, event)
    if not poller.poll(None if remaining is None else max(1, int(remaining * 1000 + 0.5))):
        raise TimeoutError("timed out")


_spinner = threading.Lock()  # one polling reader per process (see recv_some)


def recv_some(sock: socket.socket, view: memoryview, deadline: float | None, spin_s: float = SPIN_S) -> int:
    """Receive at least one byte into ``view`` (0 means the peer closed); polls up to ``spin_s`` before sleeping.

    Only one thread per process polls at a time: a polling thread takes the GIL back
    right after each ``recv``, before a woken thread can get it, so two pollers (or a
    poller and a thread with work) would delay each other by the whole window.
    """
    try:
        return sock.recv_into(view)
    except BlockingIOError:
        pass
    if spin_s > 0 and _spinner.acquire(blocking=False):
        try:
            spin_until = time.perf_counter() + spin_s
            while time.perf_counter() < spin_until:
                try:
                    return sock.recv_into(view)
                except BlockingIOError:
                    pass
        finally:
            _spinner.release()
    while True:
        wait_ready(sock, select.POLLIN, deadline)
        try:
            return sock.recv_into(view)
        except BlockingIOError:
            pass  # a spurious wake-up


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None, spin_s: float = SPIN_S) -> None:
    """Fill ``view``; ``ConnectionError`` if the peer closes first."""
    pos, end = 0, len(view)
    while pos < end:
        n = recv_some(sock, view[pos:], deadline, spin_s)
        if n == 0:
            raise ConnectionError("connection closed by peer")
        pos += n


def send_all(sock: socket.socket, buffers: list, deadline: float | None) -> None:
    """Send every byte of ``buffers`` with gathered ``sendmsg`` calls (no joining copy)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        try:
            sent = sock.sendmsg(views)
        except BlockingIOError:
            wait_ready(sock, select.POLLOUT, deadline)
            continue
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def deadline_after(seconds: float | None) -> float | None:
    return None if seconds is None else time.monotonic() + seconds


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3


def keepalive(sock: socket.socket) -> None:
    """Probe an idle tcp connection so a peer that vanished (host down, cable out) ends it in about a minute, not the
    kernel's default two hours (every accepted connection; the client end of an RDMA queue pair's, transfer/tcp.py)."""
    if sock.family == socket.AF_UNIX:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class ConnectionServer:
    """Accepts on ``listeners``; each connection gets a daemon thread running ``handle(conn)``.

    Accepted sockets are non-blocking (this module's functions do the waiting), with
    TCP_NODELAY and keepalive on tcp. ``handle`` returns when the peer is done; an
    ``OSError`` it raises ends that connection quietly. :meth:`close` stops accepting
    and shuts every open connection down, which ends their handlers.
    """

    def __init__(
        self, listeners: list[socket.socket], handle, name: str, identity: handshake.Identity | None = None
    ) -> None:
        self._listeners = listeners
        self._identity = identity  # None: every peer is let in (transfer.handshake)
        self._handle = handle
        self._name = name
        self._conns: set[socket.socket] = set()
        self._warned: dict[str, float] = {}  # peer address -> when a refusal of it was last logged as a warning
        self._lock = threading.Lock()
        self.closed = False
        for listener in listeners:
            threading.Thread(target=self._accept_loop, args=(listener,), name=f"{name}-accept", daemon=True).start()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self.closed:
            try:
                conn, addr = listener.accept()
            except OSError:
                return
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                keepalive(conn)
            conn.setblocking(False)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._run, args=(conn, addr), name=self._name, daemon=True).start()

    def _run(self, conn: socket.socket, addr) -> None:
        try:
            conn = self._authenticate(conn, addr)
            if conn is not None:
                self._handle(conn)
        except OSError as e:
            if not self.closed:
                log.debug("%s connection closed: %s", self._name, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            if conn is not None:
                conn.close()

    def _authenticate(self, conn: socket.socket, addr) -> socket.socket | None:
        """The connection once its peer has shown the cluster's certificate (transfer.handshake); None if it has not."""
        with self._lock:
            self._conns.discard(conn)
        try:
            plain = handshake.accept(conn, self._identity)
        except (ssl.SSLError, OSError) as e:
            conn.close()
            if not self.closed:
                self._refused(addr, e)
            return None
        plain.setblocking(False)
        with self._lock:
            if self.closed:
                plain.close()
                return None
            self._conns.add(plain)
        return plain

    def _refused(self, addr, error: BaseException) -> None:
        """Log a refused peer: a warning at most once a minute per address (a scanner must not flood the log)."""
        who = addr[0] if isinstance(addr, tuple) and addr else "a local socket"
        now = time.monotonic()
        with self._lock:
            quiet = now - self._warned.get(who, -REFUSAL_LOG_S) < REFUSAL_LOG_S
            if not quiet:
                self._warned[who] = now
        (log.debug if quiet else log.warning)("%s refused a connection from %s: %s", self._name, addr or who, error)

    def close(self) -> None:
        self.closed = True
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
