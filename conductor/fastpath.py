"""Schedule without gRPC: the Conductor's hot call over the framed protocol of the pool's control port.

A gRPC unary call from Python costs about 0.6 ms of CPU on these 2-core machines, more
than a decision itself (conductor/index.py: tens of microseconds for a 100k-token
prompt). Schedule (and Heartbeat and Report, which workers send all the time) therefore
also travel as framed protobuf on a plain tcp port (mooncake/runtime/framed.py: the same
messages, the same servicer methods, the same status codes), which the Conductor
advertises in ``ListInstancesResponse.control_port``. Everything else stays on gRPC.

    server = start_fast_path(servicer, host, port)            # in the Conductor
    channel = AsyncFastChannel("10.0.0.1:7001")                 # in a gateway (asyncio)
    resp = await channel.call("Schedule", pb.ScheduleRequest(...), timeout=5)

The asyncio client keeps one connection and pipelines on it: calls go out as they come,
the Conductor answers a connection's calls in order, and each answer completes the
oldest call waiting. The gateway's event loop never blocks on it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket

from mooncake import tls
from mooncake.runtime.framed import MAX_MESSAGE, REQUEST, RESPONSE, ControlError, ControlServer, Methods, status_code
from protos import conductor_pb2 as pb

log = logging.getLogger(__name__)

# method id -> (servicer method name, request type, response type); ids are the wire format
METHODS: Methods = {
    1: ("Schedule", pb.ScheduleRequest, pb.ScheduleResponse),
    2: ("Heartbeat", pb.HeartbeatRequest, pb.HeartbeatResponse),
    3: ("Report", pb.ReportRequest, pb.ReportResponse),
}
METHOD_IDS = {name: mid for mid, (name, _, _) in METHODS.items()}


def start_fast_path(servicer, host: str, port: int = 0) -> ControlServer:
    """Serve ``servicer``'s fast-path methods on ``host:port`` (0: any free port; the server's ``port`` says which).

    No busy polling between calls (the kvstore's control port spins for the next call of
    a worker; a Conductor's clients are many and it shares its cores)."""
    return ControlServer(servicer, METHODS, host, port, spin_s=0.0, name="conductor-fast")


class AsyncFastChannel:
    """One pipelined connection to a Conductor's fast path, for one event loop.

    ``call`` raises ControlError for an answer that is not OK (its gRPC code) and
    ConnectionError (or TimeoutError) when the Conductor cannot be reached or does not
    answer in time; a broken connection fails every call waiting on it and the next call
    dials again.
    """

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target, self._host, self._port = target, host.strip("[]"), int(port)
        self._writer: asyncio.StreamWriter | None = None
        self._pending: collections.deque[asyncio.Future] = collections.deque()
        self._reader_task: asyncio.Task | None = None
        self._connecting: asyncio.Lock | None = None

    async def call(self, name: str, request, timeout: float):
        mid = METHOD_IDS[name]
        body = request.SerializeToString()
        writer = await asyncio.wait_for(self._connect(), timeout)
        if writer is not self._writer:  # the connection broke while we waited (its reader is gone): dial again
            writer = await asyncio.wait_for(self._connect(), timeout)
        future = asyncio.get_running_loop().create_future()
        self._pending.append(future)  # answers come in the order the calls were written
        writer.write(REQUEST.pack(mid, 0, len(body)) + body)
        try:
            code, payload = await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            if self._writer is writer:  # a Conductor that does not answer: the next call dials afresh
                self._writer = None
                writer.close()
            raise
        if code:
            raise ControlError(status_code(code), payload.decode("utf-8", "replace"))
        return METHODS[mid][2].FromString(payload)

    async def _connect(self) -> asyncio.StreamWriter:
        if self._writer is not None:
            return self._writer
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is None:
                try:
                    reader, writer = await self._open()
                except OSError as e:
                    raise ConnectionError(f"the Conductor's fast path at {self.target}: {e}") from None
                self._writer = writer
                self._reader_task = asyncio.create_task(self._read(reader, writer))
        return self._writer

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Dial the Conductor; with an identity, the handshake (mooncake.tls) runs on a thread, off the event loop."""
        if tls.identity() is None:
            return await asyncio.open_connection(self._host, self._port)
        sock = await asyncio.to_thread(tls.create_connection, (self._host, self._port), tls.HANDSHAKE_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        return await asyncio.open_connection(sock=sock)

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        error: BaseException = ConnectionError(f"the Conductor's fast path at {self.target} closed the connection")
        try:
            while True:
                code, length = RESPONSE.unpack(await reader.readexactly(RESPONSE.size))
                if length > MAX_MESSAGE:
                    raise ConnectionError(f"an answer of {length} bytes is over the {MAX_MESSAGE}-byte limit")
                payload = await reader.readexactly(length)
                future = self._pending.popleft()
                if not future.done():  # its caller may have timed out; the answer is dropped
                    future.set_result((code, payload))
        except (asyncio.IncompleteReadError, OSError, ConnectionError, IndexError) as e:
            if not isinstance(e, asyncio.IncompleteReadError):
                error = ConnectionError(f"the Conductor's fast path at {self.target}: {e}")
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()
            while self._pending:
                future = self._pending.popleft()
                if not future.done():
                    future.set_exception(error)

    async def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task
