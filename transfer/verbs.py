"""The rdma backend's decisions, as pure functions: no pyverbs, no device, no threads.

transfer/rdma.py does the verbs calls; everything it decides is computed here, so that it
is tested on machines without an RDMA NIC (all of ours) and is right the first time it
meets one:

- :func:`rc_transitions`: the attributes and attribute mask of each state change of a
  reliable-connected queue pair, RESET -> INIT -> RTR -> RTS, for InfiniBand (the peer's
  LID) and RoCE v2 (the peer's GID, through a global route);
- :func:`work_requests`: a job's spans cut to the port's largest message;
- :func:`post_rounds`: work requests grouped into posts that never exceed the free send
  queue, one signalled completion per ``signal_every`` requests (and at the end of a post);
- :class:`CompletionLedger`: what a signalled completion finishes. RC completes a queue
  pair's requests in order, so a signalled completion covers every unsignalled request
  posted before it; a job is done when all of its requests are covered, and an error
  completion fails exactly the jobs still open on that queue pair.

Names of QP attributes are pyverbs' ``QPAttr`` property names; mask bits are named as in
libibverbs (``IBV_QP_<NAME>``), resolved against pyverbs' enums by transfer/rdma.py.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # ibv_mtu enum value -> bytes


class QPState(enum.Enum):
    RESET = "RESET"
    INIT = "INIT"
    RTR = "RTR"
    RTS = "RTS"
    ERR = "ERR"


@dataclass(frozen=True, slots=True)
class PortInfo:
    """What one end of a connection tells the other (through the handshake): where its queue pair is."""

    lid: int  # InfiniBand local identifier (0 on RoCE)
    gid: str  # 32 hex digits; the route on RoCE (and across IB subnets)
    qp_num: int
    psn: int  # the first packet sequence number it sends with (24 bits)
    mtu: int  # its port's active MTU, ibv_mtu enum value (1..5)
    roce: bool  # the port's link layer is Ethernet

    def __post_init__(self) -> None:
        if self.mtu not in MTU_BYTES:
            raise ValueError(f"MTU enum {self.mtu} is not one of {sorted(MTU_BYTES)}")
        if not 0 <= self.psn < 1 << 24:
            raise ValueError(f"PSN {self.psn} does not fit 24 bits")
        if len(self.gid) != 32 or any(c not in "0123456789abcdef" for c in self.gid):
            raise ValueError(f"GID {self.gid!r} is not 32 lowercase hex digits")

    def to_dict(self) -> dict:
        return {
            "lid": self.lid,
            "gid": self.gid,
            "qp_num": self.qp_num,
            "psn": self.psn,
            "mtu": self.mtu,
            "roce": self.roce,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "PortInfo":
        return cls(int(d["lid"]), str(d["gid"]), int(d["qp_num"]), int(d["psn"]), int(d["mtu"]), bool(d["roce"]))


@dataclass(frozen=True, slots=True)
class Transition:
    """One ``ibv_modify_qp``: the target state, the attributes to set, and the mask bits naming them."""

    state: QPState
    attrs: dict  # QPAttr property -> value; "ah_attr" is a dict of AHAttr fields (with "gr": GlobalRoute fields)
    mask: tuple[str, ...]  # IBV_QP_<name> for each bit


@dataclass(frozen=True, slots=True)
class QPSettings:
    """How our queue pairs are set up (TransferConfig's rdma fields)."""

    port_num: int = 1
    gid_index: int = 0
    access: tuple[str, ...] = ("LOCAL_WRITE", "REMOTE_READ", "REMOTE_WRITE")  # IBV_ACCESS_<name>
    max_rd_atomic: int = 16  # RDMA READs this side may have outstanding (clamped to the device's limit)
    timeout: int = 14  # 4.096 us * 2^14 = 67 ms per retry
    retry_cnt: int = 7
    rnr_retry: int = 7
    min_rnr_timer: int = 12
    hop_limit: int = 64
    service_level: int = 0


def rc_transitions(
    local: PortInfo, remote: PortInfo, s: QPSettings, max_rd_atomic: int | None = None
) -> list[Transition]:
    """RESET -> INIT -> RTR -> RTS for an RC queue pair from ``local`` to ``remote``.

    The path MTU is the smaller of the two ports'. On RoCE the address vector is a global
    route to the peer's GID (``is_global``); on InfiniBand its LID, with a global route too
    only if the peer's GID is in another subnet (not known here: LID routing, as on one
    fabric). ``max_rd_atomic`` is the device's limit (``max_qp_rd_atom``), which caps ours.
    """
    if local.roce != remote.roce:
        raise ValueError("one end is RoCE and the other InfiniBand: they cannot be connected")
    if not local.roce and remote.lid == 0:
        raise ValueError("an InfiniBand peer with LID 0: its port is not active or not configured by a subnet manager")
    rd_atomic = min(s.max_rd_atomic, max_rd_atomic) if max_rd_atomic else s.max_rd_atomic
    if rd_atomic < 1:
        raise ValueError("the device allows no outstanding RDMA READ: max_qp_rd_atom is 0")
    ah = {
        "dlid": remote.lid,
        "sl": s.service_level,
        "src_path_bits": 0,
        "port_num": s.port_num,
        "is_global": local.roce,
    }
    if local.roce:
        ah["gr"] = {
            "dgid": remote.gid,
            "sgid_index": s.gid_index,
            "hop_limit": s.hop_limit,
            "flow_label": 0,
            "traffic_class": 0,
        }
    return [
        Transition(
            QPState.INIT,
            {"pkey_index": 0, "port_num": s.port_num, "qp_access_flags": s.access},
            ("STATE", "PKEY_INDEX", "PORT", "ACCESS_FLAGS"),
        ),
        Transition(
            QPState.RTR,
            {
                "path_mtu": min(local.mtu, remote.mtu),
                "dest_qp_num": remote.qp_num,
                "rq_psn": remote.psn,
                "max_dest_rd_atomic": rd_atomic,
                "min_rnr_timer": s.min_rnr_timer,
                "ah_attr": ah,
            },
            ("STATE", "AV", "PATH_MTU", "DEST_QPN", "RQ_PSN", "MAX_DEST_RD_ATOMIC", "MIN_RNR_TIMER"),
        ),
        Transition(
            QPState.RTS,
            {
                "timeout": s.timeout,
                "retry_cnt": s.retry_cnt,
                "rnr_retry": s.rnr_retry,
                "sq_psn": local.psn,
                "max_rd_atomic": rd_atomic,
            },
            ("STATE", "TIMEOUT", "RETRY_CNT", "RNR_RETRY", "SQ_PSN", "MAX_QP_RD_ATOMIC"),
        ),
    ]


@dataclass(frozen=True, slots=True)
class WorkRequest:
    """One RDMA READ or WRITE: ``length`` bytes between local ``local_addr`` and remote ``remote_addr``, for ``job``."""

    job: int  # index of the job it belongs to (the caller's list)
    local_addr: int
    remote_addr: int
    length: int


def work_requests(spans: list[tuple[int, int, int]], max_msg: int) -> list[WorkRequest]:
    """Cut each job's span ``(local_addr, remote_addr, length)`` into requests of at most ``max_msg`` bytes, in
    order."""
    if max_msg <= 0:
        raise ValueError(f"the port's max message size must be positive, got {max_msg}")
    out: list[WorkRequest] = []
    for job, (la, ra, n) in enumerate(spans):
        if n <= 0:
            raise ValueError(f"job {job} has {n} bytes")
        for off in range(0, n, max_msg):
            out.append(WorkRequest(job, la + off, ra + off, min(max_msg, n - off)))
    return out


@dataclass(frozen=True, slots=True)
class Post:
    """Requests ``start`` to ``end`` (exclusive) posted as one linked list; ``signalled`` are their indices that ask
    for a completion (every ``signal_every``-th one and the last)."""

    start: int
    end: int
    signalled: tuple[int, ...]


def post_rounds(num_requests: int, free_slots: int, signal_every: int) -> list[Post]:
    """Group ``num_requests`` requests into posts of at most ``free_slots`` (what the send queue has free now).

    Each post ends with a signalled request, and no run of unsignalled requests is longer
    than ``signal_every - 1``, so the send queue drains as completions come and a
    completion never covers more than ``signal_every`` requests. Returns the posts that
    fit now (the rest waits for completions to free slots: call again with what is left).
    """
    if signal_every < 1:
        raise ValueError("signal_every must be at least 1")
    posts: list[Post] = []
    start = 0
    while start < num_requests and free_slots > 0:
        end = min(num_requests, start + free_slots)
        signalled = tuple(i for i in range(start, end) if (i - start + 1) % signal_every == 0 or i == end - 1)
        posts.append(Post(start, end, signalled))
        free_slots -= end - start
        start = end
    return posts


@dataclass(slots=True)
class _Open:
    wr_id: int
    jobs: list[int]  # the job of each request the completion covers, in posting order
    slots: int  # send-queue slots it frees


@dataclass(slots=True)
class CompletionLedger:
    """One queue pair's requests in flight, in posting order, and what each signalled completion finishes.

    ``expect(job, n)`` announces a job's ``n`` requests before any is posted (a job's
    requests may go out over several posts, as the send queue frees up);
    ``post(jobs, signalled_at)`` records a post (the job of each request; the positions
    that are signalled) and returns their wr_ids; ``complete(wr_id)`` returns (jobs now
    done, slots freed); ``fail()`` returns every job still open and empties the ledger.
    Job ids are the caller's, unique on the queue pair.
    """

    remaining: dict[int, int] = field(default_factory=dict)  # job -> requests not yet covered
    _open: deque = field(default_factory=deque)
    _next_id: int = 1
    in_flight: int = 0  # send-queue slots taken

    def expect(self, job: int, requests: int) -> None:
        if requests < 1 or job in self.remaining:
            raise ValueError(f"job {job}: {requests} requests (or announced twice)")
        self.remaining[job] = requests

    def post(self, jobs: list[int], signalled_at: tuple[int, ...]) -> list[int]:
        if not jobs or not signalled_at or signalled_at[-1] != len(jobs) - 1:
            raise ValueError("a post must end with a signalled request")
        if any(job not in self.remaining for job in jobs):
            raise ValueError("a request of a job not announced with expect()")
        ids = []
        prev = -1
        for at in signalled_at:
            covered = jobs[prev + 1 : at + 1]
            wr_id = self._next_id
            self._next_id += 1
            self._open.append(_Open(wr_id, covered, len(covered)))
            ids.append(wr_id)
            prev = at
        self.in_flight += len(jobs)
        return ids

    def complete(self, wr_id: int) -> tuple[list[int], int]:
        """A successful completion of signalled request ``wr_id``: it and every request before it are done."""
        done: list[int] = []
        freed = 0
        while self._open:
            entry = self._open.popleft()
            freed += entry.slots
            for job in entry.jobs:
                self.remaining[job] -= 1
                if self.remaining[job] == 0:
                    del self.remaining[job]
                    done.append(job)
            if entry.wr_id == wr_id:
                self.in_flight -= freed
                return done, freed
        raise RuntimeError(f"a completion for wr_id {wr_id}, which is not in flight on this queue pair")

    def fail(self) -> list[int]:
        """The queue pair broke: every job with a request still open, once each."""
        jobs = list(self.remaining)
        self.remaining.clear()
        self._open.clear()
        self.in_flight = 0
        return jobs
