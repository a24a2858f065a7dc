"""How one request outlives the failure of a component: its progress as explicit states, and what to do next.

The gateway's ClusterBackend drives one ``RequestProgress`` per request:

    SCHEDULING --placed--> PREFILLING --first token--> STREAMING --finish--> FINISHED
        ^                      |                           |
        |  fault before the    |                           |  the decode worker dies mid-stream:
        +--first token: RETRY -+                           |  RESUME = a new placement for the
        +--------------------------------------------------+  prompt + the tokens streamed so far
                                                              (its prefix comes from the pool)
    any state --budget spent / not retryable--> FAILED (the client sees 503 with Retry-After)

Faults and what they cost:

    CONDUCTOR    the Conductor does not answer (restarting, or a standby taking over):
                 the request waits, backing off, up to ``hold_s`` after it arrived
    NO_INSTANCE  no prefill or decode instance is schedulable (the only one restarting):
                 waits the same way
    PREFILL      the prefill worker failed it (died, unreachable, its pool node gone):
    DECODE       the decode worker failed it:
                 placed again at once, the failed instance reported to the Conductor
                 (which marks it suspect, so no other request goes there either), for
                 up to ``retry_budget_s`` after the failure
    BUSY         a new placement for a request that already outlived a failure was turned
                 away (429: the survivors crowd the instances left): backs off, as above;
                 a request that met no failure gets its 429 as it is

Pure: no sockets and no clock (``now`` is an argument), so tests drive every path.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from mooncake.runtime.channels import DETECT_S
from mooncake.serving.types import Quote


class Phase(enum.Enum):
    SCHEDULING = "scheduling"  # asking the Conductor for a placement
    PREFILLING = "prefilling"  # placed; the decode worker has the request, no token came back yet
    STREAMING = "streaming"  # tokens went to the client
    FINISHED = "finished"
    FAILED = "failed"


class Fault(enum.Enum):
    CONDUCTOR = "conductor"
    NO_INSTANCE = "no_instance"
    PREFILL = "prefill"
    DECODE = "decode"
    BUSY = "busy"


class Action(enum.Enum):
    RETRY = "retry"  # place it again from the start (nothing was sent)
    RESUME = "resume"  # place prompt + the tokens sent, and go on streaming
    GIVE_UP = "give_up"


class RecoveryConfig(BaseModel):
    """How long a request may wait for the cluster to recover (``mooncake up`` and the gateway's flags set it)."""

    hold_s: float = Field(
        10.0,
        ge=0,
        description="a request arriving while the Conductor (or every worker of a role) is "
        "away waits this long, from its arrival, before it gets 503 with Retry-After",
    )
    retry_budget_s: float = Field(
        30.0,
        ge=0,
        description="after a worker fails a request, how long placing it again may "
        "take (set it to the TTFT SLO: a retry must still meet it)",
    )
    max_attempts: int = Field(4, ge=1, description="most placements one request gets")
    detect_s: float = Field(
        DETECT_S,
        gt=0,
        description="a decode worker (or the Conductor) silent this long (no answer to a "
        "keepalive ping: a host off the network) is taken for dead, about a second later",
    )
    backoff_s: float = Field(0.2, gt=0, description="first wait before asking again; doubles to backoff_max_s")
    backoff_max_s: float = Field(
        1.0,
        gt=0,
        description="longest wait between two tries (a restarted component is "
        "back within about a second of registering)",
    )


@dataclass
class Step:
    """What to do after a fault: the action, how long to wait first, and why (for logs and the client's error)."""

    action: Action
    delay_s: float = 0.0
    reason: str = ""


@dataclass
class RequestProgress:
    """One request's way through the cluster: what the client has, who failed it, how much patience is left."""

    arrival: float
    config: RecoveryConfig = field(default_factory=RecoveryConfig)
    phase: Phase = Phase.SCHEDULING
    attempts: int = 0  # placements so far
    maybe_placed: bool = False  # the Conductor may hold a placement of it (a Schedule was sent and not answered "no")
    output_token_ids: list[int] = field(default_factory=list)  # tokens the client has
    text_shown: int = 0  # characters of their text the client has
    failed: list[str] = field(default_factory=list)  # instances that failed it
    faults: list[tuple[Fault, str, float]] = field(default_factory=list)  # (fault, instance, when): what it survived
    resumed: int = 0  # placements that went on mid-stream
    loaded_tokens: int = 0  # resumes: KV of prompt + output loaded from the pool
    recomputed_tokens: int = 0  # resumes: computed again
    quote: Quote | None = None  # the Conductor's prediction for its first placement (TTFT from its arrival there)
    _failed_at: float | None = None  # start of the current outage (None: the last placement is going well)
    _unreported: list[str] = field(default_factory=list)  # failed instances the Conductor has not heard of from us
    _waits: int = 0  # back-offs in the current outage

    def report_failed(self) -> list[str]:
        """The failed instances to tell the Conductor of with the next Schedule: each failure once (reported
        again and again, a worker that restarted would be suspect again at every retry, and never be used)."""
        out, self._unreported = list(dict.fromkeys(self._unreported)), []
        return out

    def placed(self) -> None:
        """A placement was made: the decode worker prefills (or, resuming, re-prefills) it now."""
        self.attempts += 1
        if self.phase is Phase.STREAMING:
            self.resumed += 1
        self.phase = Phase.PREFILLING if not self.output_token_ids else Phase.STREAMING

    def resumed_prefill(self, sequence_tokens: int, cached_tokens: int) -> None:
        """A resumed placement's prefill of ``sequence_tokens`` (prompt + output) loaded ``cached_tokens`` of them."""
        self.loaded_tokens += cached_tokens
        self.recomputed_tokens += sequence_tokens - cached_tokens

    def received(self, token_ids: list[int], text: str, finished: bool) -> None:
        """A chunk went to the client."""
        self.output_token_ids.extend(token_ids)
        self.text_shown += len(text)
        if token_ids:
            self.phase, self._failed_at, self._waits = Phase.STREAMING, None, 0
        if finished:
            self.phase = Phase.FINISHED

    def failure(self, fault: Fault, now: float, instance: str = "") -> Step:
        """A fault happened to the current attempt: retry, resume, or give up (and how long to wait first)."""
        first_in_outage = self._failed_at is None
        if first_in_outage or self.faults[-1][:2] != (fault, instance):  # one entry per outage, not per try
            self.faults.append((fault, instance, now))
        if first_in_outage:
            self._failed_at = now
        if instance and fault in (Fault.PREFILL, Fault.DECODE):
            if instance not in self.failed:
                self.failed.append(instance)
            self._unreported.append(instance)
        placed_before = self.attempts > 0
        deadline = (
            (self._failed_at + self.config.retry_budget_s) if placed_before else (self.arrival + self.config.hold_s)
        )
        if self.attempts >= self.config.max_attempts and fault in (Fault.PREFILL, Fault.DECODE):
            return self._give_up(f"{self.attempts} placements failed")
        if now >= deadline:
            return self._give_up(
                "the cluster did not recover within "
                f"{deadline - (self._failed_at if placed_before else self.arrival):.0f} s"
            )
        delay = 0.0
        if fault in (Fault.CONDUCTOR, Fault.NO_INSTANCE, Fault.BUSY) or not first_in_outage:
            delay = min(self.config.backoff_max_s, self.config.backoff_s * 2**self._waits, max(0.0, deadline - now))
            self._waits += 1
        action = Action.RESUME if self.output_token_ids else Action.RETRY
        self.phase = Phase.SCHEDULING if action is Action.RETRY else Phase.STREAMING
        return Step(action, delay, f"{fault.value} fault{f' ({instance})' if instance else ''}")

    def _give_up(self, why: str) -> Step:
        self.phase = Phase.FAILED
        return Step(Action.GIVE_UP, 0.0, why)

    @property
    def retry_after_s(self) -> float:
        """What a client that was given up on should wait before trying again: two of the longest back-offs (at least
        1 s, at most ``hold_s``), a guess at how long a restart still takes, not a measurement."""
        return max(1.0, min(self.config.hold_s, self.config.backoff_max_s * 2))
