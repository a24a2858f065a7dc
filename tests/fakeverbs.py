"""An RDMA fabric with pyverbs' interface, for running transfer/rdma.py where there is no NIC.

Not a model of a NIC's timing, only of the semantics the backend relies on:
memory regions with lkeys and rkeys and access flags; RC queue pairs that must be
brought to RTS before they post and that know their peer; RDMA READ/WRITE executed
in posting order (a real memmove between the registered addresses); a send queue of
``max_send_wr`` slots, freed only when a signalled completion covering them is polled
(posting past it fails, as ibv_post_send does); completions on a CQ, polled; and an
injectable error: the next request fails with
``IBV_WC_RETRY_EXC_ERR``, the queue pair goes to the error state, and every later
request on it, signalled or not, completes with ``IBV_WC_WR_FLUSH_ERR``. A CQ holds as many
completions as it was created for; one more is an overflow (``errors``).

In one process the fabric is a dict: two transfer engines, or a pool node and its
client, share it.

    fabric = Fabric(max_msg=64 << 10)
    monkeypatch.setattr("transfer.rdma._pyverbs", fabric.modules)

Across processes, every process's fabric shares a directory (``shared``): each memory
region and queue pair is a file there naming its process, keys and queue-pair numbers
are unique across them, and a request on another process's memory is carried out by
``process_vm_readv``/``process_vm_writev`` (one-sided, as RDMA is: the owner runs
nothing). A process imports it as ``pyverbs`` from tests/fakeverbs_site (PYTHONPATH,
with ``FAKEVERBS_DIR``); the tests' ``fake-rdma`` group runs the transfer and pool suites
that way (tests/conftest.py).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

E = SimpleNamespace(
    IBV_QPT_RC=2,
    IBV_SEND_SIGNALED=2,
    IBV_WR_RDMA_WRITE=0,
    IBV_WR_RDMA_READ=4,
    IBV_QPS_RESET=0,
    IBV_QPS_INIT=1,
    IBV_QPS_RTR=2,
    IBV_QPS_RTS=3,
    IBV_QPS_ERR=6,
    IBV_QP_STATE=1,
    IBV_QP_ACCESS_FLAGS=8,
    IBV_QP_PKEY_INDEX=16,
    IBV_QP_PORT=32,
    IBV_QP_AV=128,
    IBV_QP_PATH_MTU=256,
    IBV_QP_TIMEOUT=512,
    IBV_QP_RETRY_CNT=1024,
    IBV_QP_RNR_RETRY=2048,
    IBV_QP_RQ_PSN=4096,
    IBV_QP_MAX_QP_RD_ATOMIC=8192,
    IBV_QP_MIN_RNR_TIMER=32768,
    IBV_QP_SQ_PSN=65536,
    IBV_QP_MAX_DEST_RD_ATOMIC=131072,
    IBV_QP_DEST_QPN=1048576,
    IBV_ACCESS_LOCAL_WRITE=1,
    IBV_ACCESS_REMOTE_WRITE=2,
    IBV_ACCESS_REMOTE_READ=4,
    IBV_PORT_ACTIVE=4,
    IBV_LINK_LAYER_ETHERNET=2,
    IBV_WC_SUCCESS=0,
    IBV_WC_WR_FLUSH_ERR=5,
    IBV_WC_REM_ACCESS_ERR=10,
    IBV_WC_RETRY_EXC_ERR=12,
)


class VerbsError(RuntimeError):
    pass


@dataclass
class _Region:
    addr: int
    length: int
    access: int
    lkey: int
    rkey: int
    closed: bool = False
    pid: int = field(default_factory=os.getpid)

    def covers(self, addr: int, length: int) -> bool:
        return not self.closed and self.addr <= addr and addr + length <= self.addr + self.length


@dataclass
class Fabric:
    """Every memory region and queue pair of this process, and what the tests inject or inspect."""

    max_msg: int = 1 << 30
    max_qp_wr: int = 4096
    shared: Path | None = None  # the directory every process's fabric shares (None: this process only)
    regions: dict[int, _Region] = field(default_factory=dict)  # rkey -> region
    qps: dict[int, "FakeQP"] = field(default_factory=dict)
    fail_next: bool = False  # the next request posted fails (and its queue pair with it)
    completion_delay_s: float = 0.0  # completions reach the CQ this long after the post, in order (a NIC's latency)
    posted: int = 0  # requests executed
    most_outstanding: int = 0  # the deepest any send queue got
    errors: list[str] = field(default_factory=list)  # requests the fabric refused (bad key, too long), and why
    _keys: itertools.count = field(default_factory=lambda: itertools.count(0x100))
    _qpns: itertools.count = field(default_factory=lambda: itertools.count(0x10))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def open_regions(self) -> int:
        return sum(not r.closed for r in self.regions.values())

    def _unique(self, kind: str, counter: itertools.count, bits: int, record: dict) -> int:
        """A new key or queue-pair number; across processes, one no other process holds (its file made exclusively)."""
        if self.shared is None:
            return next(counter)
        while True:
            value = random.randrange(1, 1 << bits)
            try:
                fd = os.open(self.shared / f"{kind}-{value:x}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            return value

    def _forget(self, kind: str, value: int) -> None:
        if self.shared is not None:
            (self.shared / f"{kind}-{value:x}").unlink(missing_ok=True)

    def remote_region(self, rkey: int) -> _Region | None:
        """The region an rkey names: this process's, or (shared) another's, read from its file each time (a
        deregistered region's file is gone, so its key stops working at once, as on a NIC)."""
        region = self.regions.get(rkey)
        if region is not None or self.shared is None:
            return region
        try:
            r = json.loads((self.shared / f"mr-{rkey:x}").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return _Region(r["addr"], r["length"], r["access"], rkey, rkey, pid=r["pid"])

    def qp_owner(self, num: int) -> int | None:
        """The process holding queue pair ``num`` (None: there is none)."""
        if num in self.qps:
            return os.getpid()
        if self.shared is None:
            return None
        try:
            return json.loads((self.shared / f"qp-{num:x}").read_text())["pid"]
        except (FileNotFoundError, ValueError):
            return None

    def modules(self) -> dict:
        fabric = self

        class Context:
            def __init__(self, name: str) -> None:
                self.name = name

            def query_device(self):
                return SimpleNamespace(phys_port_cnt=1, max_qp_wr=fabric.max_qp_wr, max_qp_rd_atom=16)

            def query_port(self, port: int):
                return SimpleNamespace(
                    state=E.IBV_PORT_ACTIVE,
                    link_layer=E.IBV_LINK_LAYER_ETHERNET,
                    lid=0,
                    active_mtu=5,
                    max_msg_sz=fabric.max_msg,
                )

            def query_gid(self, port: int, index: int):
                return SimpleNamespace(gid="fe80:0000:0000:0000:0000:0000:0000:0001")

            def close(self) -> None:
                pass

        class PD:
            def __init__(self, ctx) -> None:
                self.ctx = ctx

            def close(self) -> None:
                pass

        class MR:
            def __init__(self, pd, length: int, access: int, address: int) -> None:
                record = dict(pid=os.getpid(), addr=address, length=length, access=access)
                key = fabric._unique("mr", fabric._keys, 32, record)
                self._region = _Region(address, length, access, key, key)
                fabric.regions[key] = self._region
                self.lkey = self.rkey = key

            def close(self) -> None:
                self._region.closed = True
                fabric._forget("mr", self.rkey)

        class CQ:
            def __init__(self, ctx, cqe, cq_context, channel, vector) -> None:
                self.capacity = cqe
                self.entries: list = []
                self.lock = threading.Lock()

            def push(self, wc) -> None:
                with self.lock:
                    if len(self.entries) >= self.capacity:  # a NIC raises an async CQ error: every QP on it is lost
                        fabric.errors.append(f"CQ overflow: {self.capacity} entries")
                        return
                    self.entries.append(wc)

            def poll(self, n: int = 1):
                with self.lock:
                    got, self.entries = self.entries[:n], self.entries[n:]
                for wc in got:  # polling a signalled completion frees the slots it covers
                    qp = fabric.qps.get(wc.qp_num)
                    if qp is not None:
                        qp.outstanding -= wc.covers
                return len(got), got

            def close(self) -> None:
                pass

        class QPCap:
            def __init__(self, max_send_wr: int, max_recv_wr: int, max_send_sge: int, max_recv_sge: int) -> None:
                self.max_send_wr = max_send_wr

        class QPInitAttr:
            def __init__(self, qp_type, scq, rcq, cap, sq_sig_all) -> None:
                self.scq, self.cap = scq, cap

        class QPAttr:
            def __init__(self, qp_state: int) -> None:
                self.qp_state = qp_state

        class QP(FakeQP):
            def __init__(self, pd, init) -> None:
                num = fabric._unique("qp", fabric._qpns, 24, dict(pid=os.getpid()))
                super().__init__(fabric, num, init.scq, init.cap.max_send_wr)

        class SGE:
            def __init__(self, addr: int, length: int, lkey: int) -> None:
                self.addr, self.length, self.lkey = addr, length, lkey

        class SendWR:
            def __init__(self, wr_id, opcode, num_sge, sg, send_flags, next_wr) -> None:
                self.wr_id, self.opcode, self.sg, self.send_flags, self.next_wr = wr_id, opcode, sg, send_flags, next_wr
                self.num_sge = num_sge

            def set_wr_rdma(self, rkey: int, addr: int) -> None:
                self.rkey, self.remote_addr = rkey, addr

        ns = SimpleNamespace
        return dict(
            cq=ns(CQ=CQ),
            device=ns(get_device_list=lambda: [ns(name=b"fake0")], Context=Context),
            e=E,
            mr=ns(MR=MR),
            pd=ns(PD=PD),
            qp=ns(QP=QP, QPAttr=QPAttr, QPCap=QPCap, QPInitAttr=QPInitAttr),
            wr=ns(SGE=SGE, SendWR=SendWR),
            GID=lambda s: s,
            AHAttr=lambda **kw: ns(**kw),
            GlobalRoute=lambda **kw: ns(**kw),
        )


class FakeQP:
    def __init__(self, fabric: Fabric, num: int, cq, depth: int) -> None:
        self.fabric, self.qp_num, self.cq, self.depth = fabric, num, cq, depth
        self.state = E.IBV_QPS_RESET
        self.dest: int | None = None
        self.outstanding = 0
        self.unsignalled = 0  # requests since the last signalled one (covered by the next)
        self._due: deque = deque()  # (time due, completion), in posting order (completion_delay_s)
        self._delivering = False
        fabric.qps[num] = self

    def modify(self, attr, mask: int) -> None:
        order = [E.IBV_QPS_RESET, E.IBV_QPS_INIT, E.IBV_QPS_RTR, E.IBV_QPS_RTS]
        if attr.qp_state == E.IBV_QPS_ERR:
            self.state = E.IBV_QPS_ERR
            return
        if order.index(attr.qp_state) != order.index(self.state) + 1:
            raise VerbsError(f"QP {self.qp_num}: {self.state} -> {attr.qp_state} is not a transition")
        if attr.qp_state == E.IBV_QPS_RTR:
            if not mask & E.IBV_QP_DEST_QPN or not mask & E.IBV_QP_AV:
                raise VerbsError("RTR needs the destination QP and an address vector")
            self.dest = attr.dest_qp_num
        self.state = attr.qp_state

    def post_send(self, head) -> None:
        chain = []
        while head is not None:
            chain.append(head)
            head = head.next_wr
        if self.outstanding + len(chain) > self.depth:
            raise VerbsError(f"send queue full: {self.outstanding} outstanding + {len(chain)} > {self.depth}")
        if self.state not in (E.IBV_QPS_RTS, E.IBV_QPS_ERR):
            raise VerbsError(f"QP {self.qp_num} posts in state {self.state}")
        self.outstanding += len(chain)
        self.fabric.most_outstanding = max(self.fabric.most_outstanding, self.outstanding)
        for wr in chain:
            status = E.IBV_WC_SUCCESS
            if self.state == E.IBV_QPS_ERR:
                status = E.IBV_WC_WR_FLUSH_ERR
            elif self.fabric.fail_next:
                self.fabric.fail_next = False
                self.state = E.IBV_QPS_ERR
                status = E.IBV_WC_RETRY_EXC_ERR
            else:
                try:
                    self._execute(wr)
                except VerbsError as err:  # what a NIC reports as a protection or length error completion
                    self.fabric.errors.append(str(err))
                    self.state = E.IBV_QPS_ERR
                    status = E.IBV_WC_REM_ACCESS_ERR
            self.unsignalled += 1
            if wr.send_flags & E.IBV_SEND_SIGNALED or status != E.IBV_WC_SUCCESS:
                self._complete(
                    SimpleNamespace(
                        wr_id=wr.wr_id, status=status, qp_num=self.qp_num, vendor_err=0, covers=self.unsignalled
                    )
                )
                self.unsignalled = 0

    def _complete(self, wc) -> None:
        if not self.fabric.completion_delay_s:
            self.cq.push(wc)
            return
        with self.fabric.lock:
            self._due.append((time.monotonic() + self.fabric.completion_delay_s, wc))
            start, self._delivering = not self._delivering, True
        if start:
            threading.Thread(target=self._deliver, daemon=True).start()

    def _deliver(self) -> None:
        """Push each due completion in posting order (one deliverer per queue pair at a time)."""
        while True:
            with self.fabric.lock:
                if not self._due:
                    self._delivering = False
                    return
                due, wc = self._due.popleft()
            time.sleep(max(0.0, due - time.monotonic()))
            self.cq.push(wc)

    def _execute(self, wr) -> None:
        (sge,) = wr.sg
        if sge.length > self.fabric.max_msg:
            raise VerbsError(f"a {sge.length}-byte request past the port's {self.fabric.max_msg}-byte max message")
        local = self.fabric.regions.get(sge.lkey)
        remote = self.fabric.remote_region(wr.rkey)
        read = wr.opcode == E.IBV_WR_RDMA_READ
        if local is None or not local.covers(sge.addr, sge.length):
            raise VerbsError(f"lkey {sge.lkey} does not cover [{sge.addr:#x}, +{sge.length})")
        if remote is None or not remote.covers(wr.remote_addr, sge.length):
            raise VerbsError(f"rkey {wr.rkey} does not cover [{wr.remote_addr:#x}, +{sge.length})")
        if not remote.access & (E.IBV_ACCESS_REMOTE_READ if read else E.IBV_ACCESS_REMOTE_WRITE):
            raise VerbsError(f"rkey {wr.rkey} does not allow remote {'reads' if read else 'writes'}")
        if self.fabric.qp_owner(self.dest) != remote.pid:  # an rkey works only on its own PD, through a QP to it
            raise VerbsError(f"rkey {wr.rkey} belongs to pid {remote.pid}, not to the peer of QP {self.qp_num}")
        if remote.pid == os.getpid():
            ctypes.memmove(sge.addr, wr.remote_addr, sge.length) if read else ctypes.memmove(
                wr.remote_addr, sge.addr, sge.length
            )
        else:
            _copy_between_processes(remote.pid, sge.addr, wr.remote_addr, sge.length, read)
        self.fabric.posted += 1

    def close(self) -> None:
        self.fabric.qps.pop(self.qp_num, None)
        self.fabric._forget("qp", self.qp_num)


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
for _name in ("process_vm_readv", "process_vm_writev"):
    getattr(_libc, _name).argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    getattr(_libc, _name).restype = ctypes.c_ssize_t


def _copy_between_processes(pid: int, local: int, remote: int, length: int, read: bool) -> None:
    """Move ``length`` bytes between our ``local`` address and ``remote`` in process ``pid`` (the owner runs
    nothing)."""
    done = 0
    while done < length:
        here, there = _IOVec(local + done, length - done), _IOVec(remote + done, length - done)
        call = _libc.process_vm_readv if read else _libc.process_vm_writev
        n = call(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
        if n <= 0:
            err = ctypes.get_errno()
            raise VerbsError(f"pid {pid} {'gone' if err == errno.ESRCH else 'refused'}: {os.strerror(err)}")
        done += n
