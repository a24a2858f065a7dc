"""What a restarted Conductor recovers: the registry and the configuration, kept in Redis.

With ``--redis-url`` every registration, deregistration, drain and policy change is
written through to Redis (a hash of instances, a hash of settings); a Conductor that
starts against the same Redis reloads them, gives every instance a fresh heartbeat
deadline, and rebuilds its KV index from the kvstore nodes' snapshots (the nodes hold the
truth; the index is derived from it). Without Redis, :class:`MemoryStore` keeps nothing.
"""

from __future__ import annotations

import json
import logging

import redis

from conductor.types import Instance, InstanceState, Role

log = logging.getLogger(__name__)

INSTANCES_KEY = "mooncake:conductor:instances"
SETTINGS_KEY = "mooncake:conductor:settings"


def instance_to_json(inst: Instance) -> str:
    return json.dumps(
        {
            "id": inst.id,
            "role": inst.role.value,
            "address": inst.address,
            "node": inst.node,
            "model": inst.model,
            "capacity": inst.capacity,
            "state": inst.state.value,
            "fingerprint": inst.fingerprint.hex(),
            "engine": inst.engine,
            "token": inst.token.hex(),
            "block_bytes": inst.block_bytes,
            "kv_blocks": inst.kv_blocks,
            "kv_shared": inst.kv_shared,
            "block_size": inst.block_size,
            "kv_dtype": inst.kv_dtype,
            "pool_kv_dtype": inst.pool_kv_dtype,
        }
    )


def instance_from_json(text: str | bytes) -> Instance:
    d = json.loads(text)
    return Instance(
        d["id"],
        Role(d["role"]),
        d["address"],
        d["node"],
        d.get("model", ""),
        int(d.get("capacity", 0)),
        InstanceState(d.get("state", "alive")),
        fingerprint=bytes.fromhex(d.get("fingerprint", "")),
        engine=d.get("engine", ""),
        token=bytes.fromhex(d.get("token", "")),
        block_bytes=int(d.get("block_bytes", 0)),
        kv_blocks=int(d.get("kv_blocks", 0)),
        kv_shared=bool(d.get("kv_shared", False)),
        block_size=int(d.get("block_size", 0)),
        kv_dtype=d.get("kv_dtype", ""),
        pool_kv_dtype=d.get("pool_kv_dtype", ""),
    )


class MemoryStore:
    """No persistence: the embedded default."""

    def save_instance(self, inst: Instance) -> None:
        pass

    def delete_instance(self, instance_id: str) -> None:
        pass

    def save_settings(self, settings: dict[str, str]) -> None:
        pass

    def load(self) -> tuple[list[Instance], dict[str, str]]:
        return [], {}


class RedisStore(MemoryStore):
    def __init__(self, url: str) -> None:
        self.url = url
        self._redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self.client = self._redis  # the leader lease (conductor/leader.py) uses the same connection pool
        try:
            self._redis.ping()
        except redis.RedisError as e:
            raise ConnectionError(f"cannot reach Redis at {url}: {e}") from e

    def save_instance(self, inst: Instance) -> None:
        self._redis.hset(INSTANCES_KEY, inst.id, instance_to_json(inst))

    def delete_instance(self, instance_id: str) -> None:
        self._redis.hdel(INSTANCES_KEY, instance_id)

    def save_settings(self, settings: dict[str, str]) -> None:
        self._redis.hset(SETTINGS_KEY, mapping=settings)

    def load(self) -> tuple[list[Instance], dict[str, str]]:
        instances = []
        for raw in self._redis.hvals(INSTANCES_KEY):
            try:
                instances.append(instance_from_json(raw))
            except (ValueError, KeyError) as e:
                log.warning("skipping an unreadable instance record in Redis: %s", e)
        settings = {k.decode(): v.decode() for k, v in self._redis.hgetall(SETTINGS_KEY).items()}
        return instances, settings


def make_store(url: str | None) -> MemoryStore:
    return RedisStore(url) if url else MemoryStore()
