"""Framed RPC: hot calls as protobuf messages over a lean framed socket instead of gRPC.

A gRPC unary call from Python costs about 600 us on this project's 2-core machines (the
call stack of grpcio on both sides, and a thread handoff in its server), which would
make a one-block get from the pool several times slower than a Redis GET. So the calls made
per request travel over a plain socket, carrying the same protobuf messages, answered by
the same servicer methods, with the same error codes: the pool node's (kvstore/control.py:
its method table) and the Conductor's Schedule (conductor/fastpath.py: its own table, and
an asyncio client for the gateway). Each caller gives its table (``Methods``); ids are the
wire format. Same-host clients use a Unix socket, others a tcp port.

Framing (little-endian), on a connection used by one caller at a time:

    request  = method:u8  flags:u8  length:u32  then a serialized request message
    response = code:u8  length:u32  then the response message (code 0) or a UTF-8 error

``code`` is the gRPC status code value. A request with ``flags & ONEWAY`` gets no
response (a pool Release after a read: the caller does not wait for it; the server handles a
connection's requests in order, so a later call on that connection sees it done).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from mooncake import tls
from transfer.sockio import SPIN_S, ConnectionServer, deadline_after, recv_some, send_all

log = logging.getLogger(__name__)

REQUEST = struct.Struct("<BBI")
RESPONSE = struct.Struct("<BI")
ONEWAY = 1
MAX_MESSAGE = 64 << 20
IO_TIMEOUT_S = 30.0  # the server's limit for sending an answer

Methods = dict[int, tuple[str, type, type]]  # method id -> (servicer method name, request type, response type)


class ControlError(Exception):
    """A call answered with a non-OK status (``code`` is a :class:`grpc.StatusCode`)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The gRPC status code a frame's ``code`` byte carries (UNKNOWN for a value gRPC has not defined)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


class _Context:
    """What a servicer method needs of a gRPC context: ``abort`` raises."""

    __slots__ = ()

    def abort(self, code: grpc.StatusCode, details: str):
        raise ControlError(code, details)

    def is_active(self) -> bool:
        return True


class StaleConnection(ConnectionError):
    """The peer closed the connection before sending a single byte of the awaited frame."""


class FramedSocket:
    """A non-blocking socket carrying frames: buffered reads that busy-poll briefly (transfer.sockio).

    One recv usually brings a whole frame, header and body.
    """

    def __init__(self, sock: socket.socket, spin_s: float, buffer_bytes: int = 64 << 10) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.spin_s = spin_s
        self._buf = bytearray(buffer_bytes)
        self._start = self._end = 0

    def read_frame(self, header: struct.Struct, timeout: float | None) -> tuple[tuple, bytes]:
        """Read one frame whose header ends in its body length; return (header fields, body)."""
        deadline = deadline_after(timeout)
        self._fill(header.size, deadline, first=True)
        fields = header.unpack_from(self._buf, self._start)
        length = fields[-1]
        if length > MAX_MESSAGE:
            raise ConnectionError(f"frame of {length} bytes is over the {MAX_MESSAGE}-byte limit")
        self._start += header.size
        self._fill(length, deadline, first=False)
        body = bytes(self._buf[self._start : self._start + length])
        self._start += length
        if self._start == self._end:
            self._start = self._end = 0
        return fields, body

    def _fill(self, need: int, deadline: float | None, first: bool) -> None:
        if self._end - self._start >= need:
            return
        if self._start + need > len(self._buf):  # make room: move what is buffered to the front
            pending = self._buf[self._start : self._end]
            if need > len(self._buf):
                self._buf = bytearray(need)
            self._buf[: len(pending)] = pending
            self._start, self._end = 0, len(pending)
        view = memoryview(self._buf)
        while self._end - self._start < need:
            n = recv_some(self.sock, view[self._end :], deadline, self.spin_s)
            if n == 0:
                raise (StaleConnection if first and self._end == self._start else ConnectionError)(
                    "connection closed by peer"
                )
            self._end += n

    def send(self, data: bytes, timeout: float | None) -> None:
        send_all(self.sock, [data], deadline_after(timeout))

    def close(self) -> None:
        self.sock.close()


class ControlServer:
    """Answers framed calls with ``servicer``'s methods (``methods``: id -> (name, request type, response type))
    on a tcp port and, optionally, a Unix socket."""

    def __init__(
        self,
        servicer,
        methods: Methods,
        host: str,
        port: int = 0,
        uds_path: str | None = None,
        spin_s: float = SPIN_S,
        name: str = "control",
    ) -> None:
        self._servicer = servicer
        self._spin_s = spin_s
        self._handlers: dict[int, tuple[Callable, type]] = {
            mid: (getattr(servicer, method), req_type) for mid, (method, req_type, _) in methods.items()
        }
        listeners = [socket.create_server((host, port), backlog=128)]
        self.port = listeners[0].getsockname()[1]
        self.uds_path = uds_path
        if uds_path is not None:
            if os.path.exists(uds_path):
                os.unlink(uds_path)  # a stale socket file from a killed node
            uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            uds.bind(uds_path)
            uds.listen(128)
            listeners.append(uds)
        self._server = ConnectionServer(listeners, self._serve, name, tls.identity())

    def _serve(self, conn: socket.socket) -> None:
        context = _Context()
        framed = FramedSocket(conn, self._spin_s)  # polls for the client's next call (a get's release, the next get)
        while True:
            try:
                (method, flags, _), body = framed.read_frame(REQUEST, None)
            except StaleConnection:
                return
            code, payload = self._call(method, body, context)
            if flags & ONEWAY:
                if code:
                    log.debug("one-way call %d failed: %s", method, payload.decode("utf-8", "replace"))
                continue
            framed.send(RESPONSE.pack(code, len(payload)) + payload, IO_TIMEOUT_S)

    def _call(self, method: int, body: bytes, context: _Context) -> tuple[int, bytes]:
        handler = self._handlers.get(method)
        if handler is None:
            return grpc.StatusCode.UNIMPLEMENTED.value[0], f"unknown control method {method}".encode()
        fn, req_type = handler
        try:
            response = fn(req_type.FromString(body), context)
        except ControlError as e:
            return e.code.value[0], e.details.encode("utf-8")
        except Exception as e:  # a bug must not kill the connection's other callers
            log.exception("control method %d failed", method)
            return grpc.StatusCode.INTERNAL.value[0], f"internal error: {e}".encode("utf-8")
        return 0, response.SerializeToString()

    def close(self) -> None:
        self._server.close()
        if self.uds_path is not None:
            try:
                os.unlink(self.uds_path)
            except OSError:
                pass


@dataclass(frozen=True, slots=True)
class ControlAddress:
    """Where a node's control fast path listens: ``unix:PATH`` or ``host:port``."""

    target: str

    def connect(self, timeout: float) -> socket.socket:
        if self.target.startswith("unix:"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(self.target[len("unix:") :])
            except OSError:
                sock.close()
                raise
            return sock
        host, _, port = self.target.rpartition(":")
        sock = tls.create_connection((host.strip("[]"), int(port)), timeout)  # authenticated (mooncake.tls)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


class ControlChannel:
    """Client side: a pool of connections, each used by one calling thread at a time."""

    def __init__(self, address: ControlAddress, methods: Methods, spin_s: float = SPIN_S) -> None:
        self.address = address
        self.spin_s = spin_s
        self._methods = methods
        self._ids = {name: mid for mid, (name, _, _) in methods.items()}
        self._idle: list[FramedSocket] = []
        self._lock = threading.Lock()
        self._closed = False

    def call(self, name: str, request, timeout: float, oneway: bool = False):
        """Send ``request`` to method ``name``; return its response (None when ``oneway``).

        Raises :class:`ControlError` for a non-OK answer and ``OSError`` (incl.
        ``TimeoutError``) when the node cannot be reached or does not answer in time.
        """
        mid = self._ids[name]
        body = request.SerializeToString()
        frame = REQUEST.pack(mid, ONEWAY if oneway else 0, len(body)) + body
        conn, pooled = self._take(timeout)
        try:
            code, payload = self._exchange(conn, frame, oneway, timeout)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, StaleConnection) as e:
            if not pooled:
                raise
            # an idle connection the node dropped (it restarted): nothing was answered, try once afresh
            log.debug("control connection to %s went stale (%s); reconnecting", self.address.target, e)
            code, payload = self._exchange(self._connect(timeout), frame, oneway, timeout)
        if oneway:
            return None
        if code:
            raise ControlError(status_code(code), payload.decode("utf-8", "replace"))
        return self._methods[mid][2].FromString(payload)

    def _exchange(self, conn: FramedSocket, frame: bytes, oneway: bool, timeout: float) -> tuple[int, bytes]:
        """Send one frame and read its answer; the connection goes back to the pool only if the exchange completed."""
        try:
            conn.send(frame, timeout)
            if oneway:
                code, payload = 0, b""
            else:
                (code, _), payload = conn.read_frame(RESPONSE, timeout)
        except BaseException:
            conn.close()  # its stream position is unknown now
            raise
        self._give(conn)
        return code, payload

    def _connect(self, timeout: float) -> FramedSocket:
        return FramedSocket(self.address.connect(timeout), self.spin_s, buffer_bytes=4 << 10)

    def _take(self, timeout: float) -> tuple[FramedSocket, bool]:
        """A connection, and whether it came from the pool (it may have gone stale while idle)."""
        with self._lock:
            if self._closed:
                raise ConnectionError("control channel is closed")
            if self._idle:
                return self._idle.pop(), True
        return self._connect(timeout), False

    def _give(self, conn: FramedSocket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
