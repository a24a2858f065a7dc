"""Which of several Conductors sharing one Redis serves: the holder of a lease key, renewed while it lives.

    leader   SET mooncake:conductor:leader <id> NX PX lease      won: serves, recovering the registry
             every lease/3: extend it if it is still ours           from Redis (conductor/persistence.py)
    standby  every STANDBY_TRY_S: SET ... NX PX lease              answers UNAVAILABLE until it wins

A leader that is killed stops renewing; its lease lapses within ``lease_s`` and a standby
takes over at its next try, so the cluster goes without a Conductor for at most about
``lease_s + STANDBY_TRY_S``. (A standby that tried every lease/3, as before, added up to a
second: the survivors of a leader's death at x2 waited 5.3 s, chaos_standby_x2.json.) A
leader that cannot renew (Redis unreachable, or the lease taken after a pause) steps down at
once: two leaders never both think they hold it. Gateways and workers are given every
Conductor's address and move to the next one when a call fails (a standby's UNAVAILABLE
included).

The lease is redis-py's ``Lock`` (non-blocking acquire with the holder's id as the token,
``reacquire`` to extend it only while the token is still ours, ``release`` to hand it over),
so the compare-and-extend is the library's, not ours.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis
import redis.lock

log = logging.getLogger(__name__)

LEADER_KEY = "mooncake:conductor:leader"
STANDBY_TRY_S = 0.25  # a standby's tries for the lease: one SET NX to Redis each, four a second


class LeaderLease:
    """Campaigns for and holds the lease on its own thread; ``on_change(leading)`` is called on every change."""

    def __init__(self, client: redis.Redis, holder: str, lease_s: float, on_change: Callable[[bool], None]) -> None:
        if lease_s <= 0:
            raise ValueError(f"the leader lease must be positive, got {lease_s}")
        self.client, self.holder, self.lease_s, self.on_change = client, holder, lease_s, on_change
        self.leading = False
        # thread_local=False: acquired on the campaign thread, released from close()'s
        self._lock = redis.lock.Lock(client, LEADER_KEY, timeout=lease_s, thread_local=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conductor-leader", daemon=True)

    def start(self) -> "LeaderLease":
        self._thread.start()
        return self

    def _try(self) -> bool:
        """One round: keep or take the lease. Whether we hold it now."""
        if self.leading:
            try:
                return self._lock.reacquire()
            except redis.exceptions.LockError:  # LockNotOwnedError: it lapsed and another took it
                return False
        return self._lock.acquire(blocking=False, token=self.holder)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                holds = self._try()
            except redis.RedisError as e:
                if self.leading:
                    log.error("cannot renew the leader lease (%s): stepping down", e)
                holds = False
            if holds != self.leading:
                self.leading = holds
                log.warning("%s is now %s", self.holder, "the leader" if holds else "a standby")
                try:
                    self.on_change(holds)
                except Exception:
                    log.exception("taking over as %s failed", "leader" if holds else "standby")
            self._stop.wait(self.lease_s / 3 if self.leading else min(self.lease_s / 3, STANDBY_TRY_S))

    def current(self) -> str | None:
        """The holder of the lease now (None: nobody), as Redis says."""
        try:
            value = self.client.get(LEADER_KEY)
        except redis.RedisError:
            return None
        return value.decode() if value else None

    def close(self) -> None:
        """Stop campaigning; a leader gives the lease up so a standby takes over at once."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self.leading:
            try:
                self._lock.release()  # only if the token is still ours
            except (redis.exceptions.LockError, redis.RedisError):
                pass
            self.leading = False
