"""RefusedSizes: the gateway's memory of the prompt sizes the Conductor refused a moment ago.

The Conductor's ``shed_s`` verdict (conductor.overload) covers only the case where even
the cheapest request is refused. Under a burst or an open-loop overload it is usually a
request of *this size* that is refused (its prefill would queue past the TTFT SLO, its
KV does not fit the decode workers' free slots), while a one-token request would still
pass, so every refused request used to cost the gateway its block keys and a Schedule
round trip, and the Conductor its decision. This keeps, per admission class (SLO class,
priority, tenant), the refusals of the last ``REFUSED_SIZE_S``; a new request at least as
long as one of them is refused at the gateway with the same reason and Retry-After:

    note_refused(class, 300 tokens, rejected, now)   -> requests of >= 300 tokens refused until now + 0.1 s
    note_placed(class, 400 tokens, now)              -> forgets every refusal of <= 400 tokens
    refuses(class, 350 tokens, now)                  -> Rejected | None

Longer prompts only make a request's TTFT, decode slots and context larger, so a refusal
holds for them; the exception is a prompt whose prefix the cluster has cached (cheaper
than its length says): it may be refused here for at most ``REFUSED_SIZE_S`` after the
Conductor last refused one as long. A refusal lapses after ``REFUSED_SIZE_S`` unless the
Conductor refuses that size again, so the next request of that size asks it: the gateway
never shuts a size out for longer than that on old news. Pure: time is an argument;
called from the event loop, once per new request and once per Schedule answer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mooncake.serving.types import Rejected

REFUSED_SIZE_S = 0.1  # how long a refusal of N tokens stands for requests of N tokens or more
# the Conductor's reasons that only get worse with a longer prompt (conductor.types.RejectReason); fair_share and
# queue_full are about the tenant's or the priority's requests in flight, not the prompt
SIZE_REASONS = frozenset({"ttft_slo", "tbt_slo", "overload", "decode_busy"})
MAX_CLASSES = 1024  # admission classes remembered at once (tenants are the caller's to name)

AdmissionClass = tuple[str, int, str, float, float]  # (slo_class, priority, tenant, its TTFT and TBT targets)


@dataclass(slots=True, frozen=True)
class _Refusal:
    at: float  # monotonic seconds
    tokens: int
    rejected: Rejected


class RefusedSizes:
    """The Conductor's recent size refusals by admission class; see the module docstring."""

    def __init__(self, hold_s: float = REFUSED_SIZE_S) -> None:
        self.hold_s = hold_s
        # per class, oldest first with tokens strictly rising: an older refusal of more tokens is implied by a newer
        # one of fewer (it lapses sooner and covers less), so it is dropped; the front is the live minimum
        self._refusals: dict[AdmissionClass, deque[_Refusal]] = {}

    def note_refused(self, key: AdmissionClass, tokens: int, rejected: Rejected, now: float) -> None:
        """The Conductor refused a new request of ``tokens`` prompt tokens (other reasons than SIZE_REASONS: no-op)."""
        if rejected.code not in SIZE_REASONS:
            return
        refusals = self._refusals.get(key)
        if refusals is None:
            if len(self._refusals) >= MAX_CLASSES:
                self._expire_all(now)
                if len(self._refusals) >= MAX_CLASSES:
                    return
            refusals = self._refusals[key] = deque()
        while refusals and refusals[-1].tokens >= tokens:
            refusals.pop()
        refusals.append(_Refusal(now, tokens, rejected))

    def note_placed(self, key: AdmissionClass, tokens: int) -> None:
        """The Conductor placed a request of ``tokens``: refusals of that many tokens or fewer are out of date."""
        refusals = self._refusals.get(key)
        if refusals is None:
            return
        while refusals and refusals[0].tokens <= tokens:
            refusals.popleft()
        if not refusals:
            del self._refusals[key]

    def refuses(self, key: AdmissionClass, tokens: int, now: float) -> Rejected | None:
        """A 429 for a new request of ``tokens`` when one of its class as long or shorter was refused within
        ``hold_s``; None: ask the Conductor."""
        refusals = self._refusals.get(key)
        if refusals is None:
            return None
        while refusals and now - refusals[0].at >= self.hold_s:
            refusals.popleft()
        if not refusals:
            del self._refusals[key]
            return None
        # the live refusals' tokens rise from the front, so the front is the shortest refused
        first = refusals[0]
        if tokens < first.tokens:
            return None
        r = first.rejected
        return Rejected(
            f"{r.message} (refused at the gateway: the cluster refused a request of {first.tokens} prompt tokens "
            f"{(now - first.at) * 1e3:.0f} ms ago, and this one has {tokens})",
            code=r.code,
            retry_after_s=r.retry_after_s,
        )

    def _expire_all(self, now: float) -> None:
        for key in [k for k, q in self._refusals.items() if not q or now - q[-1].at >= self.hold_s]:
            del self._refusals[key]
