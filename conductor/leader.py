"""Which of several Conductors sharing one Redis serves: the holder of a lease key, renewed while it lives.

    leader   SET mooncake:conductor:leader <id> NX PX lease      won: serves, recovering the registry
             every lease/3: extend it if it is still ours           from Redis (conductor/persistence.py)
    standby  every lease/3: SET ... NX PX lease                    answers UNAVAILABLE until it wins

A leader that is killed stops renewing; its lease lapses within ``lease_s`` and a standby
takes over at its next try, so the cluster goes without a Conductor for at most about
``lease_s * 4 / 3``. A leader that cannot renew (Redis unreachable, or the lease taken
after a pause) steps down at once: two leaders never both think they hold it. Gateways
and workers are given every Conductor's address and move to the next one when a call
fails (a standby's UNAVAILABLE included).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

log = logging.getLogger(__name__)

LEADER_KEY = "mooncake:conductor:leader"
# extend the lease only if we still hold it (a plain PEXPIRE could extend a successor's)
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"


class LeaderLease:
    """Campaigns for and holds the lease on its own thread; ``on_change(leading)`` is called on every change."""

    def __init__(self, client: redis.Redis, holder: str, lease_s: float, on_change: Callable[[bool], None]) -> None:
        if lease_s <= 0:
            raise ValueError(f"the leader lease must be positive, got {lease_s}")
        self.client, self.holder, self.lease_s, self.on_change = client, holder, lease_s, on_change
        self.leading = False
        self._renew = client.register_script(_RENEW)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conductor-leader", daemon=True)

    def start(self) -> "LeaderLease":
        self._thread.start()
        return self

    def _try(self) -> bool:
        """One round: keep or take the lease. Whether we hold it now."""
        ms = int(self.lease_s * 1000)
        if self.leading:
            return bool(self._renew(keys=[LEADER_KEY], args=[self.holder, ms]))
        return bool(self.client.set(LEADER_KEY, self.holder, nx=True, px=ms))

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
            self._stop.wait(self.lease_s / 3)

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
                if self.client.get(LEADER_KEY) == self.holder.encode():
                    self.client.delete(LEADER_KEY)
            except redis.RedisError:
                pass
            self.leading = False
