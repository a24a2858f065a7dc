"""The Conductor's values: instances and their load, requests, plans, decisions, rejections.

Everything here is plain data (dataclasses and enums) so the same policies run in the
gRPC server and in the cluster simulator (benchmarks/sim/).
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from mooncake.serving.reports import PREFILL_BUSY_BEAT_S as PREFILL_BUSY_BEAT_S  # (prefill/server.py reads it here)
from mooncake.serving.reports import InFlight

MAX_IN_TRANSIT = 256  # placements an instance remembers for Instance.in_transit


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    KVSTORE = "kvstore"


class InstanceState(str, enum.Enum):
    ALIVE = "alive"
    DRAINING = "draining"  # finishes what it has, gets nothing new
    DEAD = "dead"  # missed its heartbeats: out of scheduling, its blocks out of the index
    SUSPECT = "suspect"  # failed a call for some request: nothing new until a heartbeat says it lives


class RejectReason(str, enum.Enum):
    NO_PREFILL = "no_prefill_instance"
    NO_DECODE = "no_decode_instance"
    TTFT_SLO = "ttft_slo"  # the predicted time to first token is over the SLO
    TBT_SLO = "tbt_slo"  # the predicted time between tokens is over the SLO
    OVERLOAD = "overload"  # early rejection: the (predicted) load is over 1
    DECODE_BUSY = "decode_busy"  # every decode worker would refuse it now: a full batch is waiting in prefill there
    FAIR_SHARE = "fair_share"  # under pressure, its tenant holds over its weighted share of its priority's requests
    QUEUE_FULL = "queue_full"  # early_wait: it would have to wait, and its priority's waiting queue is full


@dataclass(slots=True)
class Load:
    """What an instance's heartbeat says about its load.

    Prefill instances report the prompts they hold (``prompts``); the Conductor prices them
    with its own predictor into the queue fields as the heartbeat arrives (``queued_s``: the
    sum of the predicted prefill times of what is queued and running; an older worker sends
    ``queued_s`` itself). Decode instances fill the batch fields.
    """

    queued_requests: int = 0
    queued_s: float = 0.0
    running_requests: int = 0
    context_tokens: int = 0  # decode: tokens of context over the running batch
    free_kv_blocks: int = 0
    step_s: float = 0.0  # decode: the mean step time since the last heartbeat (0: not known)
    batch_cap: int = 0  # decode: the most running requests its TBT SLO allows now (0: not reported)
    landing_blocks: int = 0  # decode: blocks its landing segment holds (0: not reported)
    received_requests: int = 0  # prefill: requests it has received since it started (Instance.in_transit)
    step_batch: float = 0.0  # decode: the mean batch of the steps step_s is the mean time of (0: not reported)
    step_context_tokens: float = 0.0  # decode: and their mean context tokens
    queued_tokens: int = 0  # prefill: prompt tokens its prefills in flight still have to compute (0: not reported)
    running_blocks: int = 0  # decode: blocks of its KV capacity (Instance.kv_blocks) its running batch holds
    landing_held_blocks: int = 0  # decode: and those held for prompts still in prefill
    prompts: tuple[InFlight, ...] = ()  # prefill: every prompt it holds, with what it has computed so far
    waiting_requests: int = 0  # decode: requests whose KV has landed, waiting for a place in its batch
    waiting_s: float = 0.0  # decode: how long the longest waiting of them has waited for its next token, now


@dataclass(slots=True)
class Instance:
    """A registered worker or pool node.

    ``node`` is the kvstore node whose pool this instance reads and writes locally
    (its own name for a kvstore instance); the index is keyed by it.
    """

    id: str
    role: Role
    address: str
    node: str
    model: str = ""
    capacity: int = 0  # prefill: tokens per step; decode: most running requests; kvstore: blocks
    state: InstanceState = InstanceState.ALIVE
    fingerprint: bytes = b""  # workers: the root of their block keys (model, dtype, engine kind)
    engine: str = ""  # workers: native or vllm
    transport: str = ""  # how its KV crosses hosts (rdma or tcp, and why), as its transfer engine chose
    last_heartbeat: float = 0.0
    suspect_until: float = 0.0  # SUSPECT: heartbeats before this do not clear it (they may predate the failure)
    load: Load = field(default_factory=Load)
    pipeline_stages: int = 1  # prefill: nodes of its chunked pipeline (1: a single worker)
    pipeline_chunk: int = 0  # prefill with stages > 1: its chunk of a prompt (tokens)
    step_tokens: int = 0  # decode: its engine's token budget per step (0: not said)
    block_bytes: int = 0  # kvstore: bytes of one block, as it registered (0: not said)
    kv_blocks: int = 0  # decode: the blocks a prompt's KV lands in (0: not said: Load.landing_blocks stands)
    kv_shared: bool = False  # decode: its running batch holds blocks of kv_blocks too (the engine's own cache)
    tensor_parallel_size: int = 1  # workers: its engine's ranks (a device each on a GPU)
    block_size: int = 0  # workers: tokens per KV block (0: not said)
    kv_dtype: str = ""  # workers: what its KV is kept in (a torch dtype's name; "": not said)
    pool_kv_dtype: str = ""  # workers: what the pool's blocks keep it in where narrower (--pool-kv-dtype; "": the same)
    token: bytes = b""  # this registration's secret (conductor.auth): it may deregister itself with it
    queue_at: float = 0.0  # prefill: when ``load.queued_s`` was last brought up to date (``drain``)
    slowdown: float = (
        1.0  # prefill: measured TTFT over predicted, learnt (Conductor.decode_started); scales its predictions
    )
    step_ratio: float = 1.0  # decode: its measured mean step over the step model's, learnt (Learning.step_sample)
    placed: deque = field(
        default_factory=deque
    )  # prefill: (request id, predicted seconds, tokens) of its latest placements
    bound: int = 0  # prefill: requests placed here since it registered, less those that ended before reaching it
    local_queue_s: float = (
        0.0  # decode: predicted seconds of the prompts it computes itself (conductor.local), as at local_at
    )
    local_at: float = 0.0

    @property
    def schedulable(self) -> bool:
        return self.state is InstanceState.ALIVE

    def place(self, request_id: str, seconds: float, tokens: int = 0) -> None:
        """A request placed here, predicted to take ``seconds`` to compute ``tokens``: its queue grows by them."""
        self.load.queued_s += seconds
        self.load.queued_tokens += tokens
        self.placed.append((request_id, seconds, tokens))
        self.bound += 1
        if len(self.placed) > MAX_IN_TRANSIT:
            self.placed.popleft()

    def lose(self, request_id: str) -> None:
        """``request_id``, placed here, ended without reaching this instance."""
        for i, (rid, *_) in enumerate(self.placed):
            if rid == request_id:
                del self.placed[i]
                self.bound -= 1
                return

    def in_transit(self) -> float:
        """Predicted seconds of the requests placed here that its last heartbeat had not received: their decode worker
        reserves their blocks, then calls. Counted as it stood at such a heartbeat, an instance just given a 1,024-token
        prompt looked idle, and the short prompts placed behind it waited seconds longer than predicted. Requests
        arrive in the order they were placed; a worker that does not count them (``received_requests`` 0) gets none."""
        n = self.bound - self.load.received_requests if self.load.received_requests else 0
        return sum(seconds for _, seconds, _ in itertools.islice(reversed(self.placed), max(n, 0)))

    def in_transit_tokens(self) -> tuple[int, int]:
        """(requests, tokens) of those ``in_transit`` counts."""
        n = max(self.bound - self.load.received_requests if self.load.received_requests else 0, 0)
        return n, sum(tokens for *_, tokens in itertools.islice(reversed(self.placed), n))

    def drain(self, now: float) -> None:
        """Take the time since ``queue_at`` off a prefill instance's queue. Between heartbeats (PREFILL_BUSY_BEAT_S
        apart while it is busy, 2.5 s when idle, and one as each prompt ends) the instance computes what it reported
        and what was placed there since, a second of predicted prefill each second: counted as it stood at the
        heartbeat, a short prompt placed behind a long one was predicted seconds later than it came. A worker slower
        than its predictions corrects this at its next heartbeat."""
        if self.load.queued_s > 0.0 and now > self.queue_at:
            left = max(0.0, self.load.queued_s - (now - self.queue_at))
            self.load.queued_tokens = int(self.load.queued_tokens * left / self.load.queued_s)  # at the same pace
            self.load.queued_s = left
        self.queue_at = max(self.queue_at, now)

    def drain_local(self, now: float) -> None:
        """The same for a decode instance's own prefills: a second of them computed each second since placed."""
        if self.local_queue_s > 0.0 and now > self.local_at:
            self.local_queue_s = max(0.0, self.local_queue_s - (now - self.local_at))
        self.local_at = max(self.local_at, now)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tbt_s: float


# the default SLO class, wherever a cluster is started (the Conductor's flags, `mooncake up`, the helm chart's values):
# a CPU decode step of a small model takes tens of milliseconds, a long prompt's prefill on a CPU tens of seconds
DEFAULT_SLO = Slo(ttft_s=30.0, tbt_s=0.5)


class KeyChain(Sequence[bytes]):
    """Block keys as one byte string of 16-byte keys: how they travel (one protobuf ``bytes``
    field, not thousands) and how the index probes them, without a Python object per key."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes) -> None:
        if len(blob) % 16:
            raise ValueError(f"a key chain is whole 16-byte keys; got {len(blob)} bytes")
        self.blob = bytes(blob)

    @classmethod
    def of(cls, keys: Sequence[bytes]) -> "KeyChain":
        if isinstance(keys, KeyChain):
            return keys
        if keys and not (min(map(len, keys)) == max(map(len, keys)) == 16):
            raise ValueError("every block key must be 16 bytes (mooncake.blocks)")
        return cls(b"".join(keys))

    def __len__(self) -> int:
        return len(self.blob) // 16

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.blob[j * 16 : j * 16 + 16] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.blob[i * 16 : i * 16 + 16]

    def __eq__(self, other) -> bool:
        return isinstance(other, KeyChain) and other.blob == self.blob

    def __repr__(self) -> str:
        return f"KeyChain({len(self)} keys)"


@dataclass(slots=True)
class ScheduleRequest:
    """One request to place: its block keys (DESIGN §4, full blocks only) and lengths."""

    request_id: str
    keys: Sequence[bytes]  # a list of 16-byte keys or a KeyChain
    prompt_tokens: int
    block_tokens: int
    expected_output_tokens: int = 0  # 0: unknown
    slo_class: str = "default"
    failed: tuple[str, ...] = ()  # a retry: instances that failed this request (suspect now, so not chosen again)
    priority: int = 0  # higher goes first under pressure; below 0: sheddable, refused before the others
    tenant: str = ""  # who sent it: under pressure, tenants of one priority share the cluster by weight
    tenant_weight: float = 1.0  # its tenant's weight (the tenants file's)
    waited_s: float = 0.0  # early_wait: how long its gateway has held it already (part of its TTFT)
    retry: bool = False  # admitted before and outlived a failure: its prefill goes ahead of the queue (Decision.ahead)
    follows: str = ""  # a request of the same prompt placed before it (Conductor.follow): its blocks are on their way
    ttft_slo_s: float = 0.0  # its own TTFT target (0: its class's); a target looser than the class's is the class's
    tbt_slo_s: float = 0.0  # and TBT target

    def validate(self) -> None:
        if not self.request_id:
            raise ValueError("request_id is empty")
        if self.prompt_tokens <= 0:
            raise ValueError(f"prompt_tokens must be positive, got {self.prompt_tokens}")
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")
        if not self.keys and self.prompt_tokens >= self.block_tokens:
            raise ValueError(
                f"empty key chain for a {self.prompt_tokens}-token prompt: send the keys of its "
                f"{self.prompt_tokens // self.block_tokens} full {self.block_tokens}-token blocks "
                "(mooncake.blocks.block_keys)"
            )
        if self.ttft_slo_s < 0 or self.tbt_slo_s < 0:
            raise ValueError(f"SLO targets must be >= 0 (0: the class's), got {self.ttft_slo_s} and {self.tbt_slo_s}")
        if self.waited_s < 0 or self.tenant_weight <= 0:
            raise ValueError(
                f"waited_s must be >= 0 and tenant_weight > 0, got {self.waited_s} and {self.tenant_weight}"
            )
        if len(self.keys) * self.block_tokens > self.prompt_tokens:
            raise ValueError(
                f"{len(self.keys)} keys of {self.block_tokens} tokens are more than the prompt's "
                f"{self.prompt_tokens} tokens"
            )
        self.keys = KeyChain.of(self.keys)  # checks every key is 16 bytes


@dataclass(frozen=True, slots=True)
class PrefixPlan:
    """Where the prompt's KV comes from: reused blocks, fetched blocks, computed tokens.

    The chosen prefill instance reuses ``local_blocks`` leading blocks from its own
    node, pulls blocks ``[local_blocks, local_blocks + fetch_blocks)`` from
    ``fetch_node`` (and keeps them there when ``keep_fetched``: hot blocks replicate),
    and computes the remaining ``compute_tokens``.
    """

    local_blocks: int
    fetch_node: str | None
    fetch_blocks: int
    compute_tokens: int
    keep_fetched: bool = True

    @property
    def reused_blocks(self) -> int:
        return self.local_blocks + self.fetch_blocks


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_s: float
    tbt_s: float
    queue_s: float = 0.0
    transfer_s: float = 0.0
    prefill_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    request_id: str
    prefill: str  # instance ids
    decode: str
    plan: PrefixPlan
    predicted: Prediction
    policy: str
    node: str | None = None  # local: the pool node its decode worker reads the prefix from and writes to
    local: bool = False  # its decode worker computes the prompt itself (conductor.local); ``prefill`` is then ""
    chunk_tokens: int = 0  # local: the most of the prompt's tokens one of its steps computes (the TBT SLO's)
    admit_at_decode: bool = False  # the decode worker asks again when the prefill ends (baseline admission only)
    ahead: bool = False  # a retry: its prefill worker runs it before the prompts waiting in its queue
    narrow: bool = False  # its KV moves to the decode worker in the pool's narrower dtype (Placement.narrow_handoff)


@dataclass(frozen=True, slots=True)
class Rejection:
    request_id: str
    reason: RejectReason
    message: str
    retry_after_s: float
    predicted: Prediction | None = None
    shed_s: float = 0.0  # every request is refused for at least this long (Conductor.shed_s)
    offer_slo_class: str = ""  # a configured SLO class whose targets its prediction meets now ("": none)


@dataclass(frozen=True, slots=True)
class Wait:
    """early_wait: hold the request ``wait_s`` and ask again (with ``waited_s``): it is predicted to meet its SLOs
    if placed later, not now. ``predicted``: its prediction for when it is predicted to be placed (``wait_s`` from
    now, or, when that is longer than MAX_WAIT_S, after it has asked again), counted from now."""

    request_id: str
    wait_s: float
    message: str
    predicted: Prediction | None = None


@dataclass(frozen=True, slots=True)
class Measured:
    """What a request's TTFT came out at, in the parts a Conductor's prediction has (0: not measured): its prefill
    worker's queue and prefill, and the rest (prefix transfer and hand-off)."""

    ttft_s: float
    queue_s: float = 0.0
    prefill_s: float = 0.0

    @property
    def parts(self) -> bool:
        return self.queue_s > 0.0 or self.prefill_s > 0.0

    @property
    def transfer_s(self) -> float:
        return max(0.0, self.ttft_s - self.queue_s - self.prefill_s)


@dataclass(frozen=True, slots=True)
class Placed:
    """What a placement predicted, and what the instance held then, awaiting the request's measured TTFT."""

    instance: str
    predicted: Prediction
    slowdown: float  # the instance's, then (``Learning.measured`` learns from it)
    at: float  # when it was placed
    prompt_tokens: int = 0
    compute_tokens: int = 0  # of them, those its prefill computes (not cached, not fetched)
    ahead_tokens: int = 0  # the tokens the instance had still to compute ahead of it (reported, in transit, placed)
    busy: int = 0  # prefill instances with work queued then, before it (counted only for ``audit``)
