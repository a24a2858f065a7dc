"""Who waits, who goes first, and who shares with whom: early_wait's queue, priorities and tenants' fair shares.

Pure (time is passed in); the Conductor consults both on every Schedule:

    queue = WaitQueue(max_per_priority=64)
    until = queue.ahead_until(req, now)    # a waiter this request may not overtake comes back then (0: none)
    queue.hold(req, until, now)            # it waits at its gateway until ``until`` (False: the queue is full)
    queue.release(request_id)              # it asked again, or left

    shares = FairShare()
    shares.admitted(req, now); shares.finished(request_id)
    why = shares.over_share(req)           # "": within its tenant's share of its priority

**The queue** lives at the gateways: a waiting request is held there and asks again
when told (``Wait.wait_s``). What the Conductor keeps is the order between priorities: a
request may not be placed while a request of a higher priority waits; it waits until just
after the last of them has asked again. Within a priority a request that can be placed
now is placed: only requests that would be refused wait (holding every request of the
priority behind its first waiter made the queue a convoy: in the simulator, at the
paper's scale, 3,823 of 12,031 requests found it full, against 3,389 refused in all
without waiting). A waiter that does not come back (its client left, its gateway died)
stops counting ``WAIT_GRACE_S`` after its time.

**Fair shares.** Requests are counted per (priority, tenant) from placement to the end
of their decode. A request is refused when its tenant would hold more than its weighted
share of its priority's requests in flight, while the cluster is under pressure (the
request's predicted load, prefill or decode, at least ``FAIR_SHARE_LOAD`` of its SLO) and
another tenant of its priority wants more (was refused for capacity in the last
``PRESSED_WINDOW_S``). So a tenant sending three times its share takes what the others
leave, and gives back its excess when they need it. In the simulator (benchmarks.sim.tenants,
one tenant sending a quarter of the trace at twice the cluster's capacity, early_wait), the
small tenant keeps 94% of what it gets alone (90% unlabelled) for 3% fewer requests served
within the SLOs in all. Capping a tenant at its share whenever the load was high wasted what
the other did not use (6,267 refusals for fair share, 43% fewer served within the SLOs, and
the small tenant gained nothing); counting waits as wanting more, or a window of 5 s, cost
10 to 15%.

**Priorities.** A request below priority 0 (sheddable) is judged against
``SHEDDABLE_LOAD`` of its SLO while a request of a higher priority wants more (as above),
so it is refused first; otherwise as any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from conductor.types import ScheduleRequest

WAIT_GAP_S = 0.01  # a request behind a waiter asks again this long after it
WAIT_GRACE_S = 1.0  # a waiter this late to ask again is taken to have left
FAIR_SHARE_LOAD = 0.7  # from this load (share of the SLO) on, tenants of one priority share by weight
SHEDDABLE_LOAD = 0.8  # a request of priority below 0 is admitted only while its loads stay under this share of the SLO
PRESSED_WINDOW_S = 1.0  # a tenant refused for capacity this recently still wants more


@dataclass(slots=True)
class Waiter:
    priority: int
    until: float  # when it asks again


class WaitQueue:
    """The requests told to wait, by priority."""

    def __init__(self, max_per_priority: int = 64) -> None:
        if max_per_priority < 1:
            raise ValueError(f"a wait queue holds at least 1 request, got {max_per_priority}")
        self.max_per_priority = max_per_priority
        self.waiters: dict[str, Waiter] = {}

    def __len__(self) -> int:
        return len(self.waiters)

    def _expire(self, now: float) -> None:
        late = [rid for rid, w in self.waiters.items() if now > w.until + WAIT_GRACE_S]
        for rid in late:
            del self.waiters[rid]

    def ahead_until(self, req: ScheduleRequest, now: float) -> float:
        """When the last waiter ``req`` may not overtake (one of a higher priority) asks again (0.0: none is
        waiting)."""
        if not self.waiters:
            return 0.0
        self._expire(now)
        latest = 0.0
        for rid, w in self.waiters.items():
            if rid != req.request_id and w.priority > req.priority:
                latest = max(latest, w.until)
        return latest if latest > now else 0.0

    def hold(self, req: ScheduleRequest, until: float, now: float) -> bool:
        """``req`` waits until ``until`` (keeping its place if it waited before). False: its priority's queue is
        full."""
        w = self.waiters.get(req.request_id)
        if w is not None:
            w.until = until
            return True
        self._expire(now)
        if sum(1 for x in self.waiters.values() if x.priority == req.priority) >= self.max_per_priority:
            return False
        self.waiters[req.request_id] = Waiter(req.priority, until)
        return True

    def release(self, request_id: str) -> None:
        self.waiters.pop(request_id, None)

    def by_priority(self) -> dict[int, int]:
        """Requests waiting, per priority (metrics)."""
        out: dict[int, int] = {}
        for w in self.waiters.values():
            out[w.priority] = out.get(w.priority, 0) + 1
        return out


class FairShare:
    """Requests in flight per (priority, tenant), from placement to the end of their decode, and the tenants'
    weights."""

    def __init__(self) -> None:
        self._flights: dict[str, tuple[int, str, float]] = {}  # request id -> (priority, tenant, placed at)
        self._count: dict[tuple[int, str], int] = {}
        self.weights: dict[str, float] = {}  # tenant -> its weight, as its requests last said
        self._pressed: dict[tuple[int, str], float] = {}  # (priority, tenant) -> when it was last refused or held

    def pressed(self, req: ScheduleRequest, now: float) -> None:
        """``req`` was refused for capacity: its tenant (and priority) wants more than it gets."""
        self._pressed[(req.priority, req.tenant)] = now

    def contended(self, req: ScheduleRequest, now: float) -> bool:
        """Whether another tenant of ``req``'s priority wants more (pressed within PRESSED_WINDOW_S)."""
        return any(
            p == req.priority and t != req.tenant and now - at <= PRESSED_WINDOW_S
            for (p, t), at in self._pressed.items()
        )

    def outranked(self, priority: int, now: float) -> bool:
        """Whether requests of a higher priority than ``priority`` want more (pressed within PRESSED_WINDOW_S)."""
        return any(p > priority and now - at <= PRESSED_WINDOW_S for (p, _), at in self._pressed.items())

    def admitted(self, req: ScheduleRequest, now: float) -> None:
        if not req.tenant:
            return
        self.finished(req.request_id)  # a request placed again (a retry) counts once
        self.weights[req.tenant] = req.tenant_weight
        key = (req.priority, req.tenant)
        self._flights[req.request_id] = (req.priority, req.tenant, now)
        self._count[key] = self._count.get(key, 0) + 1

    def finished(self, request_id: str) -> None:
        flight = self._flights.pop(request_id, None)
        if flight is not None:
            key = flight[:2]
            self._count[key] -= 1
            if not self._count[key]:
                del self._count[key]

    def expire(self, now: float, max_age_s: float) -> None:
        """Forget flights older than ``max_age_s`` (a lost FINISHED must not hold a tenant's share forever)."""
        for rid in [rid for rid, (_, _, at) in self._flights.items() if now - at > max_age_s]:
            self.finished(rid)

    def in_flight(self, tenant: str, priority: int = 0) -> int:
        return self._count.get((priority, tenant), 0)

    def over_share(self, req: ScheduleRequest) -> str:
        """Why ``req`` would take its tenant over its weighted share of its priority's requests in flight ("": it would
        not, or it has no tenant, or its tenant is alone at its priority)."""
        if not req.tenant:
            return ""
        counts = {t: n for (p, t), n in self._count.items() if p == req.priority}
        mine = counts.get(req.tenant, 0) + 1
        counts[req.tenant] = mine
        if len(counts) < 2:
            return ""
        weights = {t: (req.tenant_weight if t == req.tenant else self.weights.get(t, 1.0)) for t in counts}
        share = weights[req.tenant] / sum(weights.values()) * sum(counts.values())
        if mine <= max(1.0, share):
            return ""
        return (
            f"tenant {req.tenant} would hold {mine} of the {sum(counts.values())} requests in flight at priority "
            f"{req.priority}, over its weighted share of {share:.1f}"
        )
