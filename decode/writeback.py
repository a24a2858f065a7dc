"""Write-behind: a decode worker's generated blocks go into the pool as they fill, so a resumed stream loads them.

    request thread (generate)            engine thread (between steps)     writer thread
      an output completes block b  -->  computed_blocks(request, b..)  -->  put(keys, KV) on the pool node that
      of the request's KV               copies those blocks out             holds the request's prompt (the
                                        (a few hundred KB per block)        prefill's node): reserve, write, commit

A block's KV is complete one step after its last token was sampled (that step computes
it), so the blocks written trail the stream by one token. A request that ended (a short
answer ends before its prompt's blocks are read) keeps its blocks in the engine until the
reads queued for it are done (``RequestOptions.hold``; the worker's ``Decoding.close``
releases them after them on the engine's thread). They are written under the
request's own block keys (prompt + output, DESIGN §4), on the node whose chain they
continue, so the Conductor's index sees one prefix there: a stream resumed on another
decode worker then loads all of it but the last partial block. Nothing here is on the
step's critical path except the copy; a write that fails (the node gone, the pool full)
only means a resume recomputes more, so it is logged and dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from kvstore.client import KVStoreClient, KVStoreUnavailable, StoreFull
from mooncake.runtime.channels import ByAddress
from mooncake.serving.engine_loop import EngineLoop
from mooncake.serving.kvlayout import tensor_bytes
from transfer import TransferEngine, TransferError

log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 30.0


@dataclass(slots=True)
class Written:
    """One request's write-behind: where its blocks go and the next block to write."""

    request_id: str
    node_address: str
    next_block: int


class BlockWriter:
    """Copies completed blocks out of the engine and writes them into the pool, one background thread per worker."""

    def __init__(self, loop: EngineLoop, transfer: TransferEngine, owner: str, block_size: int) -> None:
        self.loop, self.transfer, self.owner, self.block_size = loop, transfer, owner, block_size
        self._queue: queue.Queue[tuple[Written, int, Future] | None] = queue.Queue()
        self._clients = ByAddress(lambda address: KVStoreClient(address, engine=transfer, owner=owner))  # pool nodes
        self.blocks_written = 0  # blocks now in the pool through the write-behind (written, or found there already)
        self.holds = False  # the engine keeps an ended request's blocks until released (ours: RequestOptions.hold)
        self._thread = threading.Thread(target=self._run, name="decode-writeback", daemon=True)
        self._thread.start()

    def start(self, request_id: str, node_address: str, num_tokens: int) -> Written | None:
        """Track a request that joined the batch with ``num_tokens`` of KV (its prompt's full blocks are in the pool
        already: the prefill wrote them). None when there is no node to write to."""
        if not node_address:
            return None
        return Written(request_id, node_address, num_tokens // self.block_size)

    def progress(self, written: Written | None, num_computed_tokens: int) -> None:
        """The request has ``num_computed_tokens`` of KV in the engine: queue the blocks that completed since the last
        call."""
        if written is None or num_computed_tokens // self.block_size <= written.next_block:
            return
        first = written.next_block
        written.next_block = num_computed_tokens // self.block_size
        rid = written.request_id
        self._queue.put((written, first, self.loop.call(lambda engine: engine.computed_blocks(rid, first))))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            written, first, future = item
            try:
                keys, kv, parent = future.result(timeout=EXPORT_TIMEOUT_S)
                if keys:
                    data = tensor_bytes(kv)
                    result = self._clients.get(written.node_address).put(
                        keys, data, positions=list(range(first, first + len(keys))), parent=parent
                    )
                    self.blocks_written += result.stored + result.existing
            except (KVStoreUnavailable, StoreFull, TransferError, KeyError, ValueError, TimeoutError) as e:
                log.info(
                    "write-behind of %s blocks %d.. to %s failed (%s): a resume recomputes them",
                    written.request_id,
                    first,
                    written.node_address,
                    e,
                )
            except Exception:
                log.exception("write-behind of %s failed", written.request_id)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._clients.close()
