"""The rdma backend: one-sided RDMA READ and WRITE over reliable-connected queue pairs, through pyverbs.

The same batched reads and writes of slices as the shm and tcp backends, with the NIC
moving the bytes: no copy and no thread on the segment owner's side.

1. **Device.** :func:`probe` picks the device and port (the first active one unless
   given) and reads what the queue pairs need: LID, GID at ``gid_index``, link layer
   (InfiniBand or RoCE), active MTU, the largest message and queue depths. Without
   pyverbs, a device or an active port it raises :class:`RdmaUnavailable` saying which.
2. **Memory.** Each segment the engine serves is registered once as a memory region
   (local write, remote read, remote write); its rkey and address travel in the segment's
   entry (``Segment.rdma_rkey``, ``rdma_addr``: the registry, and the pool's SegmentInfo).
   A caller's buffer outside every registered segment is registered for its batch and
   deregistered once the batch has resolved (memory may be freed and reused after that).
3. **Connections.** The first batch to a peer creates ``queue_pairs`` RC queue pairs and
   brings each up INIT -> RTR -> RTS (transfer/verbs.py) with the peer's QP number, PSN,
   LID/GID and MTU, exchanged over the peer's tcp transfer port (op CONNECT, mutual TLS
   like every tcp request): the peer creates its half and answers with it. That tcp
   connection stays open (with keepalive) while the pair is used: when it ends (the pair
   replaced or closed, the process dead, its host silent for about a minute) the peer
   frees its half, so a long-lived pool node holds queue pairs only for live peers.
4. **Work.** A job's span is cut to the port's largest message; requests are posted as
   linked lists that fit the free send queue, one signalled completion per
   ``signal_every`` requests; the rest waits for completions to free slots.
5. **Completions.** Each queue pair has a completion queue of its own, deep enough for
   every request its send queue holds (a queue pair in error flushes each one, signalled
   or not, so a shared CQ could overflow and break every pair on it). One thread polls the
   CQs of the pairs with requests in flight, busy for ``SPIN_S`` after the last completion
   and then napping up to ``NAP_S``, and sleeps on an event when none has any (a channel
   wait could not be woken to close). A signalled completion finishes every job whose
   requests it covers; an error completion (or a cancelled batch, which moves the QP to
   the error state to stop the NIC touching the buffer) fails exactly the jobs still open
   on that queue pair, naming the peer, and the queue pair is replaced at the next batch.

This module has not run on an RDMA NIC: none of this project's machines has one (see
README.md, RDMA). transfer/verbs.py holds every decision it makes, tested without one.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass

from transfer.backend import Backend, Job, fail_jobs
from transfer.rdma_structs import access_flags, buffer_address, qp_attr, send_chain
from transfer.types import BackendKind, OpKind, Segment, TransferError
from transfer.verbs import (
    MTU_BYTES,
    CompletionLedger,
    PortInfo,
    QPSettings,
    post_rounds,
    rc_transitions,
    work_requests,
)

log = logging.getLogger(__name__)

PYVERBS_HINT = "pyverbs comes with rdma-core, not PyPI: see README.md, RDMA (`make rdma`)"
SPIN_S = 200e-6  # the completion thread polls without pause this long after the last completion...
NAP_S = 50e-6  # ...then sleeps this long between polls while requests are in flight


class RdmaUnavailable(RuntimeError):
    """No usable RDMA here: pyverbs missing, no device, no active port, or a bad GID index (the message says which)."""


class _Enums:
    """libibverbs' constants by name (``IBV_QPS_ERR``...), wherever this pyverbs keeps them: module level in
    ``pyverbs.libibverbs_enums`` (or ``pyverbs.enums`` before rdma-core 50), or inside its enum classes."""

    def __init__(self, module) -> None:
        self._module = module
        self._cache: dict[str, int] = {}

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._cache:
            value = getattr(self._module, name, None)
            if value is None:
                for attr in vars(self._module).values():
                    if isinstance(attr, type) and hasattr(attr, name):
                        value = getattr(attr, name)
                        break
            if value is None:
                raise RdmaUnavailable(f"this pyverbs has no {name}")
            self._cache[name] = int(value)
        return self._cache[name]


def _enums_module():
    try:
        import pyverbs.libibverbs_enums as module
    except ImportError:
        import pyverbs.enums as module
    return module


def _pyverbs():
    try:
        import pyverbs.cq as cq
        import pyverbs.device as device
        import pyverbs.mr as mr
        import pyverbs.pd as pd
        import pyverbs.qp as qp
        import pyverbs.wr as wr
        from pyverbs.addr import GID, AHAttr, GlobalRoute

        e = _Enums(_enums_module())
    except ImportError as err:
        raise RdmaUnavailable(f"pyverbs cannot be imported ({err}); {PYVERBS_HINT}") from None
    return dict(cq=cq, device=device, e=e, mr=mr, pd=pd, qp=qp, wr=wr, GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute)


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    """The device and port this process uses, and what its queue pairs need to know about them."""

    device: str
    port: int
    gid_index: int
    lid: int
    gid: str  # 32 hex digits
    roce: bool
    mtu: int  # ibv_mtu enum value
    max_msg: int  # the port's largest message, bytes
    max_qp_wr: int
    max_rd_atomic: int

    def describe(self) -> str:
        return (
            f"{self.device} port {self.port} ({'RoCE' if self.roce else 'InfiniBand'}, {MTU_BYTES[self.mtu]}-byte MTU)"
        )


def probe(device: str | None = None, port: int | None = None, gid_index: int = 0) -> DeviceChoice:
    """The device and port to use: ``device``/``port`` if given, else the first active port of any device.

    Raises :class:`RdmaUnavailable` with the reason when there is none (what ``auto``
    logs and the READY line shows; what a forced ``rdma`` fails with).
    """
    v = _pyverbs()
    try:
        devices = v["device"].get_device_list()
    except Exception as err:  # pyverbs raises when the kernel has no RDMA support at all (no /sys/class/infiniband)
        raise RdmaUnavailable(f"no RDMA device (listing them failed: {err})") from None
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    if not names:
        raise RdmaUnavailable("no RDMA device (ibv_devices lists none)")
    if device is not None and device not in names:
        raise RdmaUnavailable(f"no RDMA device {device!r}; this host has {', '.join(names)}")
    seen = []
    for name in [device] if device else names:
        ctx = v["device"].Context(name=name)
        try:
            attr = ctx.query_device()
            for p in [port] if port else range(1, attr.phys_port_cnt + 1):
                pa = ctx.query_port(p)
                seen.append(f"{name} port {p}: state {pa.state}")
                if pa.state != v["e"].IBV_PORT_ACTIVE:
                    continue
                roce = pa.link_layer == v["e"].IBV_LINK_LAYER_ETHERNET
                try:
                    gid = ctx.query_gid(p, gid_index).gid.replace(":", "").lower()
                except Exception as err:  # pyverbs raises PyverbsRDMAError for an index past the table
                    raise RdmaUnavailable(f"{name} port {p} has no GID at index {gid_index}: {err}") from None
                if roce and int(gid, 16) == 0:
                    raise RdmaUnavailable(
                        f"{name} port {p} (RoCE) has an empty GID at index {gid_index}: pick another "
                        "with --rdma-gid-index (`show_gids` lists them; RoCE v2 entries carry the IP)"
                    )
                return DeviceChoice(
                    name,
                    p,
                    gid_index,
                    pa.lid,
                    gid,
                    roce,
                    pa.active_mtu,
                    pa.max_msg_sz,
                    attr.max_qp_wr,
                    attr.max_qp_rd_atom,
                )
        finally:
            ctx.close()
    raise RdmaUnavailable(f"no active RDMA port ({'; '.join(seen) or 'no ports'})")


class _QueuePair:
    """One RC queue pair to a peer with its ledger and the requests waiting for send-queue slots."""

    def __init__(self, backend: "RdmaBackend", peer: str, node: str) -> None:
        self.backend, self.peer, self.node = backend, peer, node
        self.session = (
            None  # the handshake's tcp connection, open while the pair is in use (closing it frees the peer's)
        )
        self.cq = backend.v["cq"].CQ(backend.ctx, backend.qp_depth + 16, None, None, 0)  # every request, flushed
        self.qp = backend._create_qp(self.cq)
        self.released = False
        self.ledger = CompletionLedger()
        self.waiting: deque = deque()  # (job id, opcode, local addr, lkey, remote addr, rkey, length)
        self.jobs: dict[int, Job] = {}
        self.broken: TransferError | None = None
        self.lock = threading.Lock()

    def enqueue(self, items: list[tuple[int, Job, list]]) -> None:
        """Queue each job's requests and post what fits."""
        with self.lock:
            if self.broken is not None:
                fail_jobs([job for _, job, _ in items], self.broken)
                return
            for jid, job, reqs in items:
                self.jobs[jid] = job
                self.ledger.expect(jid, len(reqs))
                self.waiting.extend(reqs)
            self._pump_locked()

    def _pump_locked(self) -> None:
        v, b = self.backend.v, self.backend
        for post in post_rounds(len(self.waiting), b.qp_depth - self.ledger.in_flight, b.signal_every):
            reqs = [self.waiting.popleft() for _ in range(post.end - post.start)]
            signalled = tuple(i - post.start for i in post.signalled)
            wr_ids = dict(zip(signalled, self.ledger.post([r[0] for r in reqs], signalled)))
            chain = send_chain(v, reqs, wr_ids)
            for jid in {r[0] for r in reqs}:
                self.jobs[jid].batch.job_started()
            try:
                self.qp.post_send(chain[0])
            except Exception as err:
                self._break_locked(TransferError(f"peer {self.node!r} at {self.peer}: posting RDMA work failed: {err}"))
                return
            self.backend.wake.set()  # the completion thread polls our CQ now

    def poll(self) -> int:
        """Take the completions waiting on this pair's CQ and act on them; return how many there were."""
        with self.lock:  # not while release() destroys the CQ
            if self.released:
                return 0
            n, wcs = self.cq.poll(32)
        for wc in wcs:
            self.backend._on_completion(self, wc)
        return n

    def completed(self, wr_id: int) -> None:
        with self.lock:
            if self.broken is not None:  # its jobs were failed already; a late success changes nothing
                return
            done, _ = self.ledger.complete(wr_id)
            jobs = [self.jobs.pop(jid) for jid in done]
            self._pump_locked()
        for job in jobs:
            job.batch.job_done()

    def fail(self, error: TransferError) -> None:
        with self.lock:
            self._break_locked(error)

    def _break_locked(self, error: TransferError) -> None:
        if self.broken is None:
            self.broken = error
            try:
                attr = self.backend.v["qp"].QPAttr(qp_state=self.backend.v["e"].IBV_QPS_ERR)
                self.qp.modify(attr, self.backend.v["e"].IBV_QP_STATE)  # the NIC stops touching our buffers
            except Exception:
                pass
        open_jobs = [self.jobs.pop(jid) for jid in self.ledger.fail() if jid in self.jobs]
        waiting_ids = {r[0] for r in self.waiting}
        self.waiting.clear()
        open_jobs += [self.jobs.pop(jid) for jid in waiting_ids if jid in self.jobs]
        fail_jobs(open_jobs, error)

    def cancel(self, batch) -> None:
        """Stop ``batch``: its requests may be on the NIC, so the queue pair goes to the error state."""
        with self.lock:
            if any(job.batch is batch for job in self.jobs.values()):
                self._break_locked(TransferError(f"peer {self.node!r} at {self.peer}: batch cancelled"))

    def close(self) -> None:
        self.fail(TransferError(f"peer {self.node!r} at {self.peer}: transfer engine closed"))
        self.release()

    def release(self) -> None:
        """Free the queue pair and its CQ, and the peer's half with them (its end of the session closes)."""
        with self.lock:
            if not self.released:
                self.released = True
                self.qp.close()  # the queue pair before the CQ it completes on
                self.cq.close()
        if self.session is not None:
            self.session.close()


class RdmaBackend(Backend):
    """Client and server side of RDMA for one transfer engine: its memory regions, queue pairs and completion thread.

    ``handshake(tcp_addr, request) -> (answer, session)`` carries a CONNECT to a peer's
    transfer port (the engine's tcp backend does it); the session is a connection kept open
    while the queue pair is used, whose end frees the peer's half (:meth:`accept`).
    """

    kind = BackendKind.RDMA

    def __init__(
        self,
        choice: DeviceChoice,
        settings: QPSettings,
        handshake,
        qp_depth: int = 256,
        signal_every: int = 16,
        queue_pairs: int = 1,
    ) -> None:
        self.v = v = _pyverbs()
        self.choice, self.settings, self._handshake = choice, settings, handshake
        self.qp_depth = min(qp_depth, choice.max_qp_wr)
        self.signal_every = max(1, min(signal_every, self.qp_depth))
        self.queue_pairs = queue_pairs
        self.access = access_flags(v, settings.access)
        self.ctx = v["device"].Context(name=choice.device)
        self.pd = v["pd"].PD(self.ctx)
        self._passive_cq = v["cq"].CQ(self.ctx, 16, None, None, 0)  # for the pairs peers connect to: they post nothing
        self.wake = threading.Event()  # set when a pair posts, and to close
        self._mrs: dict[str, tuple[int, int, object]] = {}  # segment -> (address, length, MR)
        self._links: dict[str, list[_QueuePair]] = {}
        self._accepted: dict[int, object] = {}  # qp number -> a queue pair a peer connected to, while its session lasts
        self._jids = itertools.count(1)
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._poller = threading.Thread(target=self._poll_loop, name="rdma-cq", daemon=True)
        self._poller.start()

    # -- memory ---------------------------------------------------------------------------------

    def register(self, name: str, view: memoryview) -> tuple[int, int]:
        """Register a served segment as a memory region; return (rkey, address) for its Segment entry."""
        addr = buffer_address(view)
        try:
            mr = self.v["mr"].MR(self.pd, len(view), self.access, address=addr)
        except Exception as err:  # most often the memlock limit: registering pins the pages
            raise RdmaUnavailable(
                f"registering {name} ({len(view)} bytes) with {self.choice.device} failed: {err}. "
                "Registration pins memory: raise the memlock limit (`ulimit -l unlimited`; in a "
                "container the IPC_LOCK capability, which the chart's rdma.enabled adds)"
            ) from None
        with self._lock:
            self._mrs[name] = (addr, len(view), mr)
        return mr.rkey, addr

    def unregister(self, name: str) -> None:
        with self._lock:
            entry = self._mrs.pop(name, None)
        if entry is not None:
            entry[2].close()

    def _lkey(self, addr: int, length: int) -> int | None:
        with self._lock:
            for start, size, mr in self._mrs.values():
                if start <= addr and addr + length <= start + size:
                    return mr.lkey
        return None

    # -- queue pairs ------------------------------------------------------------------------------

    def _create_qp(self, cq):
        v = self.v
        cap = v["qp"].QPCap(max_send_wr=self.qp_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = v["qp"].QPInitAttr(qp_type=v["e"].IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
        return v["qp"].QP(self.pd, init)

    def _port_info(self, qp) -> PortInfo:
        c = self.choice
        return PortInfo(c.lid, c.gid, qp.qp_num, random.randrange(1 << 24), c.mtu, c.roce)

    def _bring_up(self, qp, local: PortInfo, remote: PortInfo) -> None:
        for t in rc_transitions(local, remote, self.settings, self.choice.max_rd_atomic):
            qp.modify(*qp_attr(self.v, t))

    def accept(self, request: bytes) -> tuple[bytes, object]:
        """The server side of CONNECT: a queue pair for the peer that sent its half. Returns our half for the answer
        and a callable that frees the pair (the tcp server calls it when the peer's session ends)."""
        remote = PortInfo.from_dict(json.loads(request))
        qp = self._create_qp(self._passive_cq)
        local = self._port_info(qp)
        try:
            self._bring_up(qp, local, remote)
        except Exception:
            qp.close()
            raise
        with self._lock:
            self._accepted[qp.qp_num] = qp

        def release() -> None:
            with self._lock:  # not while close() frees everything (it sets _closed first)
                mine = None if self._closed else self._accepted.pop(qp.qp_num, None)
                if mine is not None:
                    mine.close()

        return json.dumps(local.to_dict()).encode(), release

    def _connect(self, segment: Segment) -> _QueuePair:
        conn = _QueuePair(self, segment.tcp_addr, segment.node)
        try:
            local = self._port_info(conn.qp)
            answer, conn.session = self._handshake(segment.tcp_addr, json.dumps(local.to_dict()).encode())
            self._bring_up(conn.qp, local, PortInfo.from_dict(json.loads(answer)))
        except Exception as err:
            conn.release()
            raise TransferError(f"peer {segment.node!r} at {segment.tcp_addr}: RDMA connection failed: {err}") from err
        return conn

    def _link(self, segment: Segment) -> list[_QueuePair]:
        with self._lock:
            if self._closed:
                raise TransferError("transfer engine is closed")
            link = [c for c in self._links.get(segment.tcp_addr, []) if c.broken is None]
            dead = [c for c in self._links.get(segment.tcp_addr, []) if c.broken is not None]
        for conn in dead:  # replaced below; its late (flush) completions go with its CQ
            conn.release()
        while len(link) < self.queue_pairs:
            link.append(self._connect(segment))
        with self._lock:
            self._links[segment.tcp_addr] = link
        return link

    # -- transfers ---------------------------------------------------------------------------------

    def submit(self, segment: Segment, jobs: list[Job]) -> None:
        if not jobs:
            return
        if segment.rdma_rkey is None or segment.tcp_addr is None:
            fail_jobs(
                jobs, TransferError(f"segment {segment.name!r} of node {segment.node!r} is not registered for RDMA")
            )
            return
        try:
            link = self._link(segment)
        except TransferError as err:
            fail_jobs(jobs, err)
            return
        batch = jobs[0].batch
        addrs = [buffer_address(job.local) for job in jobs]
        lkeys = [self._lkey(a, job.length) for a, job in zip(addrs, jobs)]
        if None in lkeys:  # outside every registered segment: a region for this batch, dropped once it settles
            lo, hi = min(addrs), max(a + job.length for a, job in zip(addrs, jobs))
            temp = self.v["mr"].MR(self.pd, hi - lo, self.access, address=lo)
            batch.on_settled(temp.close)  # no request can touch the buffer any more
            lkeys = [temp.lkey] * len(jobs)
        opcode = self.v["e"].IBV_WR_RDMA_READ if jobs[0].kind is OpKind.READ else self.v["e"].IBV_WR_RDMA_WRITE
        per_conn: list[list] = [[] for _ in link]
        start = next(self._rr)
        for i, (job, laddr, lkey) in enumerate(zip(jobs, addrs, lkeys)):
            reqs = work_requests([(laddr, segment.rdma_addr + job.remote_offset, job.length)], self.choice.max_msg)
            jid = next(self._jids)
            per_conn[(start + i) % len(link)].append(
                (
                    jid,
                    job,
                    [(jid, opcode, w.local_addr, lkey, w.remote_addr, segment.rdma_rkey, w.length) for w in reqs],
                )
            )
        for conn, items in zip(link, per_conn):
            if items:
                batch.on_cancel(conn.cancel)
                conn.enqueue(items)

    def _poll_loop(self) -> None:
        last = time.monotonic()
        while not self._closed:
            self.wake.clear()  # before looking: a post after the look sets it again
            with self._lock:
                busy = [c for link in self._links.values() for c in link if c.ledger.in_flight]
            if not busy:
                self.wake.wait()
                last = time.monotonic()
                continue
            try:
                got = sum(conn.poll() for conn in busy)
            except Exception:
                if not self._closed:
                    log.exception("the RDMA completion thread failed")
                return
            now = time.monotonic()
            if got:
                last = now
            elif now - last > SPIN_S:
                time.sleep(NAP_S)

    def _on_completion(self, conn: _QueuePair, wc) -> None:
        if conn.broken is not None:
            return  # its jobs were failed when it broke: flushed requests and late successes change nothing
        if wc.status == self.v["e"].IBV_WC_SUCCESS:
            conn.completed(wc.wr_id)
            return
        to_str = getattr(self.v["cq"], "cqe_status_to_str", None)
        status = to_str(wc.status) if to_str is not None else f"status {wc.status}"
        conn.fail(
            TransferError(
                f"peer {conn.node!r} at {conn.peer}: RDMA work failed ({status}, vendor error "
                f"{wc.vendor_err}); the queue pair is replaced at the next batch"
            )
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for link in self._links.values() for c in link]
            self._links.clear()
            accepted, self._accepted = list(self._accepted.values()), {}
            mrs = [mr for _, _, mr in self._mrs.values()]
            self._mrs.clear()
        self.wake.set()
        self._poller.join(5)
        for conn in conns:
            conn.close()
        for qp in accepted:
            qp.close()
        for mr in mrs:
            mr.close()
        self._passive_cq.close()
        self.pd.close()
        self.ctx.close()
