"""A pool node's Prometheus metrics: usage, hits and evictions per tier (read from the store on each scrape)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.store import BlockStore


class StoreCollector:
    """Reports ``store.stats()`` as metrics labelled by node and tier."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store

    def collect(self):
        s = self.store.stats()
        used = GaugeMetricFamily("mooncake_pool_used_blocks", "blocks stored, by tier", labels=["node", "tier"])
        capacity = GaugeMetricFamily("mooncake_pool_capacity_blocks", "tier size in blocks", labels=["node", "tier"])
        reserved = GaugeMetricFamily(
            "mooncake_pool_reserved_blocks", "slots reserved by uncommitted puts", labels=["node", "tier"]
        )
        hits = CounterMetricFamily("mooncake_pool_hits", "blocks read, by tier", labels=["node", "tier"])
        evictions = CounterMetricFamily("mooncake_pool_evictions", "blocks evicted, by tier", labels=["node", "tier"])
        for name, t in (("dram", s.dram), ("ssd", s.ssd)):
            used.add_metric([s.node, name], t.used_blocks)
            capacity.add_metric([s.node, name], t.capacity_blocks)
            reserved.add_metric([s.node, name], t.reserved_blocks)
            hits.add_metric([s.node, name], t.hits)
            evictions.add_metric([s.node, name], t.evictions)
        leases = GaugeMetricFamily("mooncake_pool_leases", "read leases held", labels=["node"])
        leases.add_metric([s.node], s.leases)
        corrupt = CounterMetricFamily(
            "mooncake_pool_corrupt_blocks", "blocks that failed their checksum", labels=["node"]
        )
        corrupt.add_metric([s.node], s.corrupt_blocks)
        block = GaugeMetricFamily("mooncake_pool_block_bytes", "bytes of one block", labels=["node"])
        block.add_metric([s.node], s.block_bytes)
        yield from (used, capacity, reserved, hits, evictions, leases, corrupt, block)


def store_registry(store: BlockStore) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    return registry
