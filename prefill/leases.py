"""What a prefill holds on the pool until it ends, and how it takes and gives it back: the plan's local prefix leased
(read in place), its fetched blocks pulled layer by layer from another node into slots reserved here, the prompt's
new full blocks' slots reserved, then committed (the blocks become visible) or aborted, and the leases released.

``PoolLeases`` is a part ``prefill.worker.PrefillWorker`` holds (``worker.leases``), built whole with what it needs:
the pool node's client and its name, other nodes' clients, the transfer engine, the pool's layout and the config's
values it uses (reservation TTL, I/O timeout, whether new blocks are stored). It owns the mapping of its node's memory
(``pool``) and the state around it (the prefills using it, a pending remap, how long the node stays away); the worker
hears of each new mapping through ``on_map``.

    worker.prefill
      held = Held(...)
      leases.enter(held)              may this prefill use the pool? (counts it as a user)
      leases.load_plan(plan, keys, held)  -> local slots, SSD hits, fetched slots (being pulled)
      leases.reserve_new(keys, first, held)  -> {block: slot} for the new full blocks
      ... the engine reads ``leases.pool`` (and waits on ``held.wait_layer``), writes the new blocks ...
      leases.commit(held)             the blocks become visible
      leases.release(held)            leases released, the rest aborted; no longer a user

The worker reads and writes its pool node's DRAM tier in place, mapped from the node's shared-memory file. A pool
node that restarted serves a new file: slots it names are not in the old mapping, so a reply naming another owner
(``_same_node``) is not used (its lease released, its reservation aborted: the prompt is computed and not stored),
new prefills go without the pool, and the part maps the new file (``_map``) once no prefill holds anything of the
old one (``enter``). Writing the new node's slots through the old mapping would commit blocks whose bytes never
reached the node: another request's prefix would then read garbage.

A pool node that does not answer (killed, restarting) does not stop the worker: the prefill that finds it gone computes
its whole prompt and stores nothing, and the prefills after it go without the pool for ``POOL_RETRY_S`` before one asks
the node again (``_pool_gone``). The Conductor's index drops a node's blocks once it misses its heartbeats.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvstore.client import KVStoreClient, KVStoreUnavailable, StoreFull
from kvstore.wire import segment_from_pb
from mooncake.runtime.channels import ByAddress
from mooncake.serving.kvlayout import slot_tensor
from protos import kvstore_pb2 as kpb
from transfer import Segment, SharedRegion, Slice, TransferEngine, TransferError

log = logging.getLogger(__name__)

# the longest a prefill waits for planned blocks another writer is storing on the pool node (a write after an answer
# takes milliseconds; a writer that died keeps its reservation until the node's TTL: the blocks are computed instead)
WRITE_WAIT_S = 2.0

POOL_RETRY_S = 1.0  # how long prefills go without a pool node that did not answer before one asks it again


@dataclass(eq=False)
class Held:
    """Pool resources a prefill holds until it ends: leases to release, reservations to commit or abort."""

    local_lease: str | None = None
    remote: tuple[KVStoreClient, str] | None = None  # (client, lease id)
    fetch_reservation: str | None = None
    keep_fetched: bool = True
    new_reservation: str | None = None
    fetch_batches: list = field(default_factory=list)  # one transfer batch per layer
    fetch_slices: list = field(default_factory=list)  # each layer's slices (a failed pull is sent again once)
    fetch_read: object = None  # slices -> a new batch reading them (the worker's transfer engine)
    fetch_started: float = 0.0
    fetch_seconds: float = 0.0  # issue to the last layer landing (as the engine waited for it)
    io_timeout_s: float = 30.0
    uses_pool: bool = False  # counted among the prefills that hold the pool's mapping (``PoolLeases.enter``)

    def wait_layer(self, layer: int) -> None:
        """Block until layer ``layer`` of the pull has landed (the engine calls it just before that layer). A pull that
        fails at once (a connection reset, an error answer) is sent again once: a second failure, or one after half the
        timeout, fails the engine's step."""
        try:
            self.fetch_batches[layer].wait(self.io_timeout_s)
        except TransferError as e:
            failed = self.fetch_batches[layer]
            if (failed.finished_at or time.monotonic()) - failed.started_at >= self.io_timeout_s / 2:
                raise  # a silent peer, not a reset: pulling again would wait as long again
            log.warning("pulling layer %d of a prefix failed, pulling it again: %s", layer, e)
            self.fetch_batches[layer] = self.fetch_read(self.fetch_slices[layer])
            self.fetch_batches[layer].wait(self.io_timeout_s)
        if layer == len(self.fetch_batches) - 1:
            self.fetch_seconds = time.perf_counter() - self.fetch_started


class PoolLeases:
    """The pool's side of the prefills of one worker: its node's memory mapped here, the leases and reservations each
    prefill takes (in its ``Held``), and whether prefills may use the pool now. Called from the worker's gRPC threads
    (every method is thread-safe) and, for ``commit`` and ``release`` after a pool write, the connector's writer.

    ``kv``, ``remote`` and ``transfer`` stay their maker's to close; ``close`` unmaps the pool. ``on_map(pool,
    segment)`` is called with each mapping (the first, in the constructor, and one after a node restart), before any
    prefill uses it: the slot tensor [slots, *block_shape] and the node's segment, for those that write it too."""

    def __init__(
        self,
        kv: KVStoreClient,
        node: str,
        remote: ByAddress[KVStoreClient],
        transfer: TransferEngine,
        segment: kpb.SegmentInfo,
        block_shape: tuple[int, ...],
        block_bytes: int,
        dtype: torch.dtype,
        *,
        reservation_ttl_s: float,
        store_new_blocks: bool,
        io_timeout_s: float,
        on_map: Callable[[torch.Tensor, Segment], None],
    ) -> None:
        self._kv = kv
        self._node = node
        self._remote = remote
        self._transfer = transfer
        self._block_shape = tuple(block_shape)
        self._block_bytes = block_bytes
        self._layer_bytes = block_bytes // block_shape[0]
        self._dtype = dtype
        self._reservation_ttl_s = reservation_ttl_s
        self._store_new_blocks = store_new_blocks
        self._io_timeout_s = io_timeout_s
        self._on_map = on_map
        self._lock = threading.Lock()  # the mapping and its users
        self._users = 0  # prefills holding slots of the mapped pool (until ``release``)
        self._remap_pending = False  # the pool node restarted: map its new memory once ``_users`` is 0
        self._away_until = 0.0  # monotonic: the pool node did not answer; prefills go without it until then
        self._region: SharedRegion | None = None
        self._segment: Segment | None = None  # the node's memory as mapped (``_same_node`` compares replies with it)
        self._bytes: memoryview | None = None  # the mapping's bytes, pinned in the transfer engine (pulls land in it)
        self._pool: torch.Tensor | None = None
        self._map(segment)

    @property
    def pool(self) -> torch.Tensor:
        """The mapped pool as slots [slots, *block_shape]: what a prefill's slots index while it uses the pool."""
        return self._pool

    def _map(self, segment: kpb.SegmentInfo) -> None:
        """Map the pool node's DRAM tier (``segment``: its shared-memory file): the slots prefixes are read from in
        place, pulls land in and new blocks are written to. Again after the node restarted, once no prefill holds
        anything of the old mapping (``enter``)."""
        old = self._region
        self._region = SharedRegion.open(segment.shm_path)
        self._segment = segment_from_pb(segment)
        self._pool = slot_tensor(self._region.buffer, self._block_shape, self._dtype)
        self._on_map(self._pool, self._segment)
        if old is not None:
            self._transfer.unpin(self._bytes)
            old.close()
            log.info("mapped pool node %s's memory again (owner pid %d)", self._node, segment.pid)
        self._bytes = memoryview(self._region.buffer).cast("B")
        self._transfer.pin(self._bytes)  # fetches land in it: registered with an RDMA device once, not per fetch

    def close(self) -> None:
        """Unmap the pool (after the engine, the pulls and the transfer engine have stopped)."""
        self._region.close()

    def enter(self, held: Held) -> bool:
        """Whether this prefill may use the pool (True: it counts as a user until ``release``). Not for a while after
        the node did not answer (``_pool_gone``). After a pool node restart, not until every prefill that used the old
        mapping has ended; the first one after that maps the new memory."""
        if time.monotonic() < self._away_until:
            return False
        with self._lock:
            if self._remap_pending and self._users == 0:
                try:
                    self._map(self._kv.stats().segment)
                    self._remap_pending = False
                except (KVStoreUnavailable, OSError, ValueError) as e:
                    log.warning("mapping pool node %s's memory again failed (%s): prefilling without it", self._node, e)
            if self._remap_pending:
                return False
            self._users += 1
            held.uses_pool = True
            return True

    def _same_node(self, segment) -> bool:
        """Whether ``segment`` (in a reply of the pool node) is the memory mapped here; if not, the node restarted: its
        slots are not used, and its new memory is mapped when no prefill holds the old (``enter``)."""
        mapped = self._segment
        if segment.pid == mapped.pid and (segment.shm_path or None) == mapped.shm_path:
            return True
        with self._lock:
            if not self._remap_pending:
                log.warning(
                    "pool node %s restarted (its memory is owned by pid %d, not %d): prefilling without the pool until "
                    "no prefill holds the old memory, then mapping the new",
                    self._node,
                    segment.pid,
                    mapped.pid,
                )
            self._remap_pending = True
        return False

    def _pool_gone(self, e: Exception) -> None:
        """The pool node did not answer: prefills go without it (computing whole prompts, storing nothing) for
        ``POOL_RETRY_S``, then one asks it again."""
        if time.monotonic() >= self._away_until:
            log.warning(
                "pool node %s did not answer (%s): prefilling without the pool, asking it again every %.0f s",
                self._node,
                e,
                POOL_RETRY_S,
            )
        self._away_until = time.monotonic() + POOL_RETRY_S

    def load_plan(self, plan, keys: list[bytes], held: Held, extend: bool = False) -> tuple[list[int], int, list[int]]:
        """Lease the local prefix and start pulling the fetched blocks; return (local slots, SSD hits, fetched
        slots). Nothing when the pool node does not answer.

        ``extend`` (a resumed stream whose plan fetches nothing): lease as long a prefix as the node holds, not just
        the plan's. The plan comes from the Conductor's index, which hears of a commit a moment after the node has it:
        a stream resumed at once after its decode worker died was planned without the blocks that worker wrote just
        before (tests/test_chaos.py saw 45 tokens computed again where one block was due). A new prompt keeps to its
        plan (a tier-aware plan may stop its prefix short of SSD blocks on purpose).

        Blocks the plan counts that a prefill of the same prompt is writing to the node now are waited for (up to
        ``WRITE_WAIT_S``; a fetch's too), not computed again: a prompt's ``n`` siblings, sent once its first token is
        out, are planned with the blocks the first's prefill writes after its answer (``conductor.index.PromptWrites``).
        Not past the plan (``extend``): a resumed stream's dead decode worker may hold a reservation it never ends.
        """
        local: list[int] = []
        ssd_hits = 0
        want = min(plan.local_blocks, len(keys))
        ask = len(keys) if extend and not plan.fetch_blocks else want
        if ask:
            try:
                got = self._kv.get_locations(keys[:ask], wait_s=0.0 if extend else WRITE_WAIT_S)
            except KVStoreUnavailable as e:
                self._pool_gone(e)
                return [], 0, []
            held.local_lease = got.lease_id
            if got.slots and not self._same_node(got.segment):
                return [], 0, []
            local = [s.offset // self._block_bytes for s in got.slots]
            ssd_hits = got.ssd_hits
        fetched: list[int] = []
        n = min(plan.fetch_blocks, len(keys) - want)
        if (
            n > 0 and plan.fetch_address and len(local) == want
        ):  # the fetch continues the local prefix only if it is whole
            try:
                fetched = self._start_fetch(
                    plan.fetch_address, keys[want : want + n], want, held, keys[want - 1] if want else None
                )
            except (KVStoreUnavailable, TransferError, StoreFull, KeyError) as e:
                log.warning("fetching %d blocks from %s failed (%s): computing them instead", n, plan.fetch_node, e)
                self._release_fetch(held)
                fetched = []
        return local, ssd_hits, fetched

    def _start_fetch(self, address: str, keys: list[bytes], first: int, held: Held, parent: bytes | None) -> list[int]:
        """Lease ``keys`` on the node at ``address``, reserve slots for them here and start pulling them layer by layer
        (``held.wait_layer`` waits for each); return the reserved slots (fewer when the node has fewer, none when they
        are stored here meanwhile or the reservation names memory not mapped here)."""
        remote = self._remote.get(address)
        got = remote.get_locations(keys, wait_s=WRITE_WAIT_S)  # blocks being written there: as load_plan
        held.remote = (remote, got.lease_id)
        n = len(got.slots)
        if not n:
            return []
        res = self._kv.reserve(
            keys[:n], positions=list(range(first, first + n)), ttl_s=self._reservation_ttl_s, parent=parent
        )
        held.fetch_reservation = res.reservation_id
        if res.existing or (res.slots and not self._same_node(res.segment)):
            self._release_fetch(held)  # stored here meanwhile (not worth the bookkeeping), or not in our mapping
            return []
        slot_of = {bytes(s.key): s.offset for s in res.slots}
        local_offsets = [slot_of[k] for k in keys[:n]]
        seg = remote._segment(got.segment)
        lb = self._layer_bytes
        held.fetch_started = time.perf_counter()
        for layer in range(self._block_shape[0]):
            slices = [
                Slice(local_offsets[i] + layer * lb, seg.name, got.slots[i].offset + layer * lb, lb, got.lease_id)
                for i in range(n)
            ]
            held.fetch_slices.append(slices)
            held.fetch_batches.append(self._transfer.read(self._bytes, slices))
        pool_bytes = self._bytes
        held.fetch_read = lambda slices: self._transfer.read(pool_bytes, slices)
        return [o // self._block_bytes for o in local_offsets]

    def reserve_new(self, keys: list[bytes], first: int, held: Held) -> dict[int, int]:
        """Reserve pool slots for full blocks ``first..`` (those the pool lacks); return {block index: slot}. Nothing
        when the config stores no new blocks or the pool node is away, full or restarted."""
        new = keys[first:]
        if not new or not self._store_new_blocks or time.monotonic() < self._away_until:
            return {}
        try:
            res = self._kv.reserve(
                new,
                positions=list(range(first, len(keys))),
                ttl_s=self._reservation_ttl_s,
                parent=keys[first - 1] if first else None,
            )
        except StoreFull as e:
            log.info("pool node %s is full (%s): not storing this prompt's blocks", self._node, e)
            return {}
        except KVStoreUnavailable as e:
            self._pool_gone(e)
            return {}
        held.new_reservation = res.reservation_id
        if res.slots and not self._same_node(res.segment):
            _quietly(self._kv.abort, res.reservation_id)  # its slots are not in our mapping: never committed
            held.new_reservation = None
            return {}
        index = {k: first + i for i, k in enumerate(new)}
        return {index[bytes(s.key)]: s.offset // self._block_bytes for s in res.slots}

    def commit(self, held: Held) -> None:
        """Make the pulled (when kept) and new blocks visible in the pool. The request does not depend on it: its KV
        is on the decode worker already, so a reservation that expired only costs the pool these blocks."""
        for name in ("fetch_reservation", "new_reservation"):
            rid = getattr(held, name)
            if rid is None:
                continue
            setattr(held, name, None)
            try:
                if name == "fetch_reservation" and not held.keep_fetched:
                    self._kv.abort(rid)
                else:
                    self._kv.commit(rid)
            except (KeyError, KVStoreUnavailable) as e:
                log.warning("pool reservation %s ended before its commit (%s): these blocks are not stored", rid, e)

    def release(self, held: Held) -> None:
        """Release leases; abort what was not committed (after every pull has stopped touching the slots)."""
        self._release_fetch(held)
        for rid in (held.new_reservation,):
            if rid is not None:
                _quietly(self._kv.abort, rid)
        held.new_reservation = None
        if held.local_lease is not None:
            _quietly(self._kv.release, held.local_lease, False)
            held.local_lease = None
        if held.uses_pool:
            held.uses_pool = False
            with self._lock:
                self._users -= 1

    def _release_fetch(self, held: Held) -> None:
        for batch in held.fetch_batches:
            try:
                batch.wait(self._io_timeout_s)
            except TransferError:
                pass
        if held.fetch_reservation is not None:
            _quietly(self._kv.abort, held.fetch_reservation)
            held.fetch_reservation = None
        if held.remote is not None:
            client, lease = held.remote
            _quietly(client.release, lease, False)
            held.remote = None


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except (KeyError, KVStoreUnavailable):
        pass  # expired or the node is gone: nothing left to free
