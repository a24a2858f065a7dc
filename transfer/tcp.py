"""The tcp backend: one-sided reads and writes against a peer's transfer server.

Wire format (little-endian), one request after another on a connection, answered in
order, so a client pipelines: it sends requests while reading earlier answers.

    request  = op:u8  name_len:u16  token_len:u8  req_id:u64  offset:u64  length:u64
               name[name_len]  token[token_len]
               then, for a WRITE, ``length`` payload bytes
    response = req_id:u64  status:u8  length:u64
               then ``length`` bytes: READ data when status is 0, a UTF-8 error otherwise

Data never goes through an intermediate buffer: senders pass memoryviews of the
registered memory to ``sendmsg`` (header and payload gathered in one call) and receivers
``recv_into`` the destination slice. Each peer gets several connections; the engine cuts
large slices into chunks that are spread over them.

Op 3 (CONNECT) carries the RDMA handshake instead of data: ``length`` bytes of the
caller's queue-pair description, answered with the server's (transfer/rdma.py).

``token`` is the capability the segment's owner issued for those bytes (Slice.token);
a segment served with a guard (a pool node's DRAM) answers an error, and reads or writes
nothing, unless its guard accepts the token for exactly that range. Each connection is
authenticated first (transfer.handshake).

A connection that breaks (peer killed, reset, or silent past ``io_timeout_s`` while an
answer is due) fails every job queued or in flight on it at once, with the peer named
in the error; the next batch to that peer reconnects.
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

from transfer import handshake
from transfer.backend import Backend, Job, fail_jobs
from transfer.handshake import Identity
from transfer.sockio import SPIN_S, ConnectionServer, deadline_after, keepalive, recv_exact, recv_some, send_all
from transfer.types import BackendKind, OpKind, Segment, TransferError

log = logging.getLogger(__name__)

# (token, write, offset, length) -> None to allow those bytes of a segment, or why not (TransferEngine.allocate)
Guard = Callable[[str, bool, int, int], "str | None"]

REQUEST = struct.Struct("<BHBQQQ")
RESPONSE = struct.Struct("<QBQ")
OP_CODES = {OpKind.READ: 1, OpKind.WRITE: 2}
OP_RDMA_CONNECT = 3  # payload: the caller's half of an RDMA queue pair (JSON); answer: ours (transfer/rdma.py)
MAX_CONNECT_BYTES = 4096
STATUS_OK, STATUS_ERROR = 0, 1
MAX_ERROR_BYTES = 4096
SEND_BATCH = 64  # requests gathered into one sendmsg (well under IOV_MAX)
INLINE_WRITE_BYTES = 256 << 10  # writes up to this size are sent by the submitting thread


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad tcp address {addr!r}; expected host:port")
    return host.strip("[]"), int(port)


class TcpServer:
    """Serves one-sided reads and writes into this process's registered segments.

    ``lookup(name)`` returns the writable memoryview of a local segment or None. One
    thread accepts; each connection gets a thread that answers its requests in order.
    """

    def __init__(
        self,
        host: str,
        port: int,
        lookup: Callable[[str], memoryview | None],
        guard: Callable[[str], Guard | None] = lambda name: None,
        identity: Identity | None = None,
    ) -> None:
        self._lookup = lookup
        self._guard = guard
        # set by an engine with an RDMA port: the caller's half of a queue pair -> (our half, a callable freeing ours)
        self.rdma_accept: Callable[[bytes], tuple[bytes, Callable[[], None]]] | None = None
        listener = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.port = listener.getsockname()[1]
        self._server = ConnectionServer([listener], self._serve, "tcp-serve", identity)

    def _serve(self, conn: socket.socket) -> None:
        releases: list[Callable[[], None]] = []  # the queue pairs accepted on this connection: they live as long as it
        try:
            self._serve_requests(conn, releases)
        finally:
            for release in releases:
                release()

    def _serve_requests(self, conn: socket.socket, releases: list[Callable[[], None]]) -> None:
        header = bytearray(REQUEST.size)
        hview = memoryview(header)
        name_buf = bytearray((1 << 16) + 256)
        while True:
            try:
                recv_exact(conn, hview, None)
            except ConnectionError:
                return
            op, name_len, token_len, req_id, offset, length = REQUEST.unpack(header)
            recv_exact(conn, memoryview(name_buf)[: name_len + token_len], None)
            name = name_buf[:name_len].decode("utf-8", "replace")
            token = name_buf[name_len : name_len + token_len].decode("ascii", "replace")
            if op == OP_RDMA_CONNECT:
                self._connect(conn, req_id, length, releases)
                continue
            error = self._check(op, name, offset, length, token)
            if op == OP_CODES[OpKind.WRITE]:
                if error is None:
                    recv_exact(conn, self._lookup(name)[offset : offset + length], None)
                else:
                    self._discard(conn, length)
            if error is not None:
                msg = error.encode("utf-8")[:MAX_ERROR_BYTES]
                send_all(conn, [RESPONSE.pack(req_id, STATUS_ERROR, len(msg)), msg], None)
            elif op == OP_CODES[OpKind.READ]:
                send_all(
                    conn, [RESPONSE.pack(req_id, STATUS_OK, length), self._lookup(name)[offset : offset + length]], None
                )
            else:
                send_all(conn, [RESPONSE.pack(req_id, STATUS_OK, 0)], None)

    def _check(self, op: int, name: str, offset: int, length: int, token: str) -> str | None:
        if op not in OP_CODES.values():
            return f"unknown operation code {op}"
        buf = self._lookup(name)
        if buf is None:
            return f"unknown segment {name!r}"
        if offset + length > len(buf):
            return f"segment {name!r}: [{offset}, {offset + length}) is past its end ({len(buf)})"
        guard = self._guard(name)
        if guard is not None:
            refused = guard(token, op == OP_CODES[OpKind.WRITE], offset, length)
            if refused is not None:
                return f"segment {name!r}: [{offset}, {offset + length}) refused: {refused}"
        return None

    def _connect(self, conn: socket.socket, req_id: int, length: int, releases: list[Callable[[], None]]) -> None:
        """Answer an RDMA handshake: our queue pair for the caller's (or why not). Ours lives until this connection
        ends: the caller holds it open while it uses the pair, and a caller that dies or goes silent (every accepted
        connection has keepalive, transfer/sockio.py) takes it down with it."""
        if length > MAX_CONNECT_BYTES:
            raise ConnectionError(f"an RDMA handshake of {length} bytes")  # not a peer of ours: hang up
        request = bytearray(length)
        recv_exact(conn, memoryview(request), None)
        try:
            if self.rdma_accept is None:
                raise RuntimeError("this node has no RDMA port")
            answer, release = self.rdma_accept(bytes(request))
            releases.append(release)
            status = STATUS_OK
        except Exception as e:  # the caller falls back to reporting it; this connection carries on
            answer, status = f"RDMA handshake refused: {e}".encode("utf-8")[:MAX_ERROR_BYTES], STATUS_ERROR
        send_all(conn, [RESPONSE.pack(req_id, status, len(answer)), answer], None)

    @staticmethod
    def _discard(conn: socket.socket, length: int) -> None:
        scratch = memoryview(bytearray(min(length, 1 << 20) or 1))
        while length:
            n = recv_some(conn, scratch[: min(length, len(scratch))], None)
            if n == 0:
                raise ConnectionError("connection closed by peer")
            length -= n

    def close(self) -> None:
        self._server.close()


class _Connection:
    """One client connection with a sender thread and a receiver thread (pipelined)."""

    _ids = itertools.count(1)

    def __init__(
        self, addr: str, node: str, connect_timeout: float, io_timeout: float, identity: Identity | None
    ) -> None:
        self.addr, self.node = addr, node
        try:
            self._sock = handshake.create_connection(parse_addr(addr), connect_timeout, identity)  # authenticated
        except OSError as e:
            raise TransferError(f"peer {node!r} at {addr}: cannot connect: {e}") from e
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setblocking(False)  # transfer.sockio: deadlines are explicit
        self._io_timeout = io_timeout
        self._queue: deque[Job] = deque()
        self._inflight: deque[tuple[int, Job, float]] = deque()  # (request id, job, time sent)
        self._cond = threading.Condition()
        self.broken: TransferError | None = None
        self._closing = False
        self._sending = False  # the send turn: whoever holds it writes to the socket
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"tcp-send-{addr}", daemon=True),
            threading.Thread(target=self._recv_loop, name=f"tcp-recv-{addr}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def enqueue(self, jobs: list[Job], inline: bool = False) -> None:
        """Queue ``jobs``; with ``inline``, send them from this thread when no one else is sending.

        Sending inline saves waking the sender thread (a read request is a few dozen
        bytes); the sender thread sends whatever is queued while another send is on.
        """
        with self._cond:
            if self.broken is not None:
                fail_jobs(jobs, self.broken)
                return
            self._queue.extend(jobs)
            if not inline or self._sending:
                self._cond.notify_all()
                return
            self._sending = True
            items = self._take_locked()
        self._send(items)

    def _take_locked(self) -> list[tuple[int, Job]]:
        """Pop up to ``SEND_BATCH`` queued jobs into flight, in wire order (caller holds the send turn)."""
        items = []
        while self._queue and len(items) < SEND_BATCH:
            job = self._queue.popleft()
            if job.batch.state.finished:  # failed elsewhere or timed out: don't send it
                job.batch.job_failed(job.batch.error or TransferError("batch cancelled"))
                continue
            req_id = next(self._ids)
            self._inflight.append((req_id, job, time.monotonic()))
            items.append((req_id, job))
        self._cond.notify_all()
        return items

    def _send(self, items: list[tuple[int, Job]]) -> None:
        """Send ``items``' requests (and write payloads) in one gathered call, then give up the send turn."""
        try:
            buffers: list = []
            for req_id, job in items:
                job.batch.job_started()
                name = job.segment.name.encode("utf-8")
                buffers.append(
                    REQUEST.pack(OP_CODES[job.kind], len(name), len(job.token), req_id, job.remote_offset, job.length)
                    + name
                    + job.token
                )
                if job.kind is OpKind.WRITE:
                    buffers.append(job.local)
            send_all(self._sock, buffers, deadline_after(self._io_timeout))
        except (OSError, ValueError) as e:
            self._break(e)
        finally:
            with self._cond:
                self._sending = False
                self._cond.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while (not self._queue or self._sending) and self.broken is None and not self._closing:
                    self._cond.wait()
                if self.broken is not None or self._closing:
                    return
                self._sending = True
                items = self._take_locked()
            self._send(items)

    def _recv_header(self, view: memoryview) -> None:
        """Block for the next answer's header, idle as long as nothing is in flight.

        The receiver sits in ``recv`` (not on a condition) so an answer wakes it once.
        A timeout is an error only when the oldest request in flight has waited
        ``io_timeout_s`` for its answer.
        """
        pos = 0
        while pos < len(view):
            try:
                spin = SPIN_S if self._inflight else 0.0  # an idle connection sleeps at once: the caller wants the GIL
                n = recv_some(self._sock, view[pos:], deadline_after(self._io_timeout), spin)
            except TimeoutError:
                with self._cond:
                    oldest = self._inflight[0][2] if self._inflight else None
                if pos == 0 and (oldest is None or time.monotonic() - oldest < self._io_timeout):
                    continue
                raise
            if n == 0:
                raise ConnectionError("connection closed by peer")
            pos += n

    def _recv_loop(self) -> None:
        header = bytearray(RESPONSE.size)
        hview = memoryview(header)
        try:
            while True:
                self._recv_header(hview)
                with self._cond:
                    if not self._inflight:
                        raise ConnectionError("protocol error: an answer to no request")
                    req_id, job, _ = self._inflight[0]
                got_id, status, length = RESPONSE.unpack(header)
                if got_id != req_id:
                    raise ConnectionError(f"protocol error: answer to request {got_id}, expected {req_id}")
                if status == STATUS_OK and job.kind is OpKind.READ:
                    if length != job.length:
                        raise ConnectionError(f"protocol error: {length} bytes for a {job.length}-byte read")
                    recv_exact(self._sock, job.local, deadline_after(self._io_timeout))
                    error = None
                elif status == STATUS_OK:
                    error = None
                else:
                    msg = bytearray(length)
                    recv_exact(self._sock, memoryview(msg), deadline_after(self._io_timeout))
                    error = TransferError(f"peer {self.node!r} at {self.addr}: {msg.decode('utf-8', 'replace')}")
                with self._cond:
                    if self.broken is not None:  # broken meanwhile (a cancel): _break has failed the job
                        return
                    self._inflight.popleft()
                if error is None:
                    job.batch.job_done()
                else:
                    job.batch.job_failed(error)
        except (OSError, ValueError) as e:
            self._break(e)

    def cancel(self, batch) -> None:
        """Drop ``batch``'s queued jobs; if one is on the wire, close the connection (the only way to stop it)."""
        with self._cond:
            queued = [job for job in self._queue if job.batch is batch]
            if queued:
                self._queue = deque(job for job in self._queue if job.batch is not batch)
            on_wire = any(job.batch is batch for _, job, _ in self._inflight)
        fail_jobs(queued, TransferError("batch cancelled"))
        if on_wire:
            self._break(ConnectionError("closed to cancel an abandoned batch"))

    def _break(self, cause: BaseException) -> None:
        if isinstance(cause, TimeoutError) or isinstance(cause, socket.timeout):
            what = f"no answer within {self._io_timeout} s"
        else:
            what = f"connection lost ({cause})"
        error = TransferError(f"peer {self.node!r} at {self.addr}: {what}")
        with self._cond:
            if self.broken is not None:
                return
            if self._closing:
                error = TransferError(f"peer {self.node!r} at {self.addr}: transfer engine closed")
            self.broken = error
            jobs = [job for _, job, _ in self._inflight] + list(self._queue)
            self._inflight.clear()
            self._queue.clear()
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        fail_jobs(jobs, error)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._break(ConnectionError("closed"))


class TcpBackend(Backend):
    """Client side: ``connections`` pipelined connections per peer address, chosen round-robin."""

    kind = BackendKind.TCP

    def __init__(
        self, connections: int, connect_timeout: float, io_timeout: float, identity: Identity | None = None
    ) -> None:
        if connections < 1:
            raise ValueError(f"tcp connections per peer must be at least 1, got {connections}")
        self._n = connections
        self._connect_timeout = connect_timeout
        self._io_timeout = io_timeout
        self._identity = identity
        self._links: dict[str, list[_Connection]] = {}
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._closed = False

    def rdma_handshake(self, addr: str, request: bytes) -> tuple[bytes, socket.socket]:
        """Send an RDMA CONNECT to the transfer server at ``addr`` on a connection of its own; return its answer and
        the connection, which the caller keeps open exactly as long as it uses the queue pair (closing it frees the
        server's half)."""
        sock = handshake.create_connection(parse_addr(addr), self._connect_timeout, self._identity)
        try:
            sock.settimeout(self._io_timeout)
            sock.sendall(REQUEST.pack(OP_RDMA_CONNECT, 0, 0, 0, 0, len(request)) + request)
            header = bytearray(RESPONSE.size)
            recv_exact(sock, memoryview(header), deadline_after(self._io_timeout))
            _, status, length = RESPONSE.unpack(header)
            if length > MAX_CONNECT_BYTES:
                raise TransferError(f"{addr}: an RDMA handshake answer of {length} bytes")
            body = bytearray(length)
            recv_exact(sock, memoryview(body), deadline_after(self._io_timeout))
            if status != STATUS_OK:
                raise TransferError(f"{addr}: {body.decode('utf-8', 'replace')}")
        except BaseException:
            sock.close()
            raise
        keepalive(sock)
        return bytes(body), sock

    def _link(self, segment: Segment) -> list[_Connection]:
        if segment.tcp_addr is None:
            raise TransferError(f"segment {segment.name!r} of node {segment.node!r} has no tcp address")
        with self._lock:
            if self._closed:
                raise TransferError("transfer engine is closed")
            link = [c for c in self._links.get(segment.tcp_addr, []) if c.broken is None]
            while len(link) < self._n:
                link.append(
                    _Connection(segment.tcp_addr, segment.node, self._connect_timeout, self._io_timeout, self._identity)
                )
            self._links[segment.tcp_addr] = link
            return link

    def submit(self, segment: Segment, jobs: list[Job]) -> None:
        try:
            link = self._link(segment)
        except TransferError as e:
            fail_jobs(jobs, e)
            return
        per_conn: list[list[Job]] = [[] for _ in link]
        start = next(self._rr)
        for i, job in enumerate(jobs):
            per_conn[(start + i) % len(link)].append(job)
        batch = jobs[0].batch if jobs else None
        for conn, assigned in zip(link, per_conn):
            if assigned:
                batch.on_cancel(conn.cancel)
                inline = (
                    all(j.kind is OpKind.READ for j in assigned)
                    or sum(j.length for j in assigned) <= INLINE_WRITE_BYTES
                )
                conn.enqueue(assigned, inline)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = [c for link in self._links.values() for c in link]
            self._links.clear()
        for conn in links:
            conn.close()
