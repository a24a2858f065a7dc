"""No block reused while a writer may still write it: the decode engine's connector, its scheduler side.

A Prefill call writes a request's KV into blocks of this worker's engine cache (in place: by shared memory, CUDA IPC or
through the transfer server) or into its landing slots. Once the call has answered, its writes are over. A call given up
on (its client gone, its deadline passed, its worker unreachable) may still write, for as long as its worker runs the
step it is in: a worker stalled inside a step, or one whose cancellation never reached it. Its blocks and slots are
therefore held, never handed to another request, until there is proof that its writes are over:

    the writer says so       its Abort answers ``stopped`` from the process that writes (asked at once, then every
                             ``grace_s`` while anything of it is held)
    the writer is dead       it runs on this host (the call's first metadata names it: host, pid, start time) and
                             that process is gone

Without either (a writer alive but silent, or on another host and unreachable) they stay held ("quarantined": the
heartbeat counts them as held, ``quarantined_blocks`` says how many, and a log line names the writer).

The engine asks ``request_finished`` before it frees a finished or aborted request's blocks (True: held here) and takes
back what ``released_blocks`` returns before each step; ``wake`` has it do so when it is idle. Landing slots, the
worker's own, are held the same way (``after_writes``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from mooncake.engine.connector import KVConnector
from mooncake.runtime.process import process_gone

log = logging.getLogger(__name__)


class Writer:
    """One Prefill call's writes into this worker: where to ask about them, who writes (once its metadata came), and
    what is held for it."""

    def __init__(self, request_id: str, address: str, token: str) -> None:
        self.request_id, self.address, self.token = request_id, address, token
        self.identity = ""  # the writing process (mooncake.runtime.process.process_identity); "" until known
        self.done = False  # its writes are over
        self.blocks: list[int] = []  # engine blocks held for it
        self.after: list[Callable[[], None]] = []  # releases run once it is done


class Fence(KVConnector):
    """Holds what writers that may still write would write into, until each is proven done. See the module docstring.

    ``ask(writer)``: the Abort call, ``(stopped, identity of the process that answered)``; False when it could not
    ask. ``wake()``: have the engine take back released blocks now (it does before every step anyway)."""

    def __init__(self, grace_s: float, ask: Callable[[Writer], tuple[bool, str]], wake: Callable[[], None]) -> None:
        self.grace_s, self._ask, self._wake = grace_s, ask, wake
        self._lock = threading.Lock()
        # request id -> its writers not yet done, newest last (a request id the gateway sends again, to this worker, may
        # meet the writer of its last attempt still held)
        self._writers: dict[str, list[Writer]] = {}
        self._released: list[int] = []
        self._closed = threading.Event()

    # -- the worker's side ------------------------------------------------------------------

    def open(self, request_id: str, address: str, token: str) -> Writer:
        """A Prefill call about to write for ``request_id``: until it is done, what it writes into is held."""
        writer = Writer(request_id, address, token)
        with self._lock:
            self._writers.setdefault(request_id, []).append(writer)
        return writer

    def answered(self, writer: Writer) -> None:
        """The call answered (whatever the answer): its writes are over."""
        self._done(writer, "it answered")

    def give_up(self, writer: Writer, identity: str) -> None:
        """Its caller gave up on the call (``identity``: the writer its metadata named, "" if none came): proof that
        its writes are over is sought now and every ``grace_s`` after, on a thread of its own."""
        writer.identity = identity
        threading.Thread(target=self._prove, args=(writer,), name="write-fence", daemon=True).start()

    def after_writes(self, request_id: str, release: Callable[[], None]) -> None:
        """Run ``release`` once ``request_id``'s newest writer is done (now, when it has none)."""
        with self._lock:
            writer = self._pending(request_id)
            if writer is not None:
                writer.after.append(release)
                return
        release()

    @property
    def quarantined_blocks(self) -> int:
        """Engine blocks held for writers not proven done."""
        with self._lock:
            return sum(len(w.blocks) for ws in self._writers.values() for w in ws)

    def close(self) -> None:
        self._closed.set()

    # -- the engine's side (KVConnector) ------------------------------------------------------

    def request_finished(self, request_id: str, block_ids: list[int]) -> bool:
        with self._lock:
            writer = self._pending(request_id)
            if writer is None:
                return False
            writer.blocks.extend(block_ids)
        return True

    def released_blocks(self) -> list[int]:
        with self._lock:
            released, self._released = self._released, []
        return released

    # -- proof ---------------------------------------------------------------------------------

    def _pending(self, request_id: str) -> Writer | None:
        writers = self._writers.get(request_id)
        return writers[-1] if writers else None

    def _done(self, writer: Writer, why: str) -> None:
        with self._lock:
            if writer.done:
                return
            writer.done = True
            writers = self._writers.get(writer.request_id, [])
            if writer in writers:
                writers.remove(writer)
                if not writers:
                    del self._writers[writer.request_id]
            blocks, after = writer.blocks, writer.after
            writer.blocks, writer.after = [], []
            self._released.extend(blocks)
        if blocks or after:
            log.info("the writes of %s's prefill are over (%s): what it held goes back", writer.request_id, why)
        for release in after:
            release()
        if blocks:
            self._wake()

    def _prove(self, writer: Writer) -> None:
        """Seek proof that ``writer``'s writes are over until there is some (or the worker closes)."""
        warned = False
        while not writer.done and not self._closed.is_set():
            if writer.identity and process_gone(writer.identity):
                self._done(writer, f"its process {writer.identity} is gone")
                return
            stopped, by = self._ask(writer)
            if stopped and (not writer.identity or by == writer.identity):
                self._done(writer, "it says so")
                return
            if not warned and (writer.blocks or writer.after):
                warned = True
                log.warning(
                    "the prefill of %s at %s (%s) may still write: what it writes into stays held until it says it"
                    " stopped or its process is gone",
                    writer.request_id,
                    writer.address,
                    writer.identity or "writer not known",
                )
            self._closed.wait(self.grace_s)
