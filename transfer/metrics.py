"""Prometheus view of a transfer engine: bytes and batches by backend (shm, tcp, rdma) and direction.

    registry.register(TransferCollector(engine))

``mooncake_transfer_bytes_total`` and ``mooncake_transfer_batches_total``, labelled
``backend`` and ``op`` (read or write), count what the engine submitted (a batch split
over two backends counts once for each). Grafana's dashboard plots the bytes by backend.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily


class TransferCollector:
    def __init__(self, engine) -> None:
        self._engine = engine

    def collect(self):
        data = CounterMetricFamily(
            "mooncake_transfer_bytes", "bytes this process moved, by transfer backend", labels=["backend", "op"]
        )
        batches = CounterMetricFamily(
            "mooncake_transfer_batches", "transfer batches, by backend", labels=["backend", "op"]
        )
        for (backend, op), (n, size) in sorted(self._engine.moved().items()):
            data.add_metric([backend, op], size)
            batches.add_metric([backend, op], n)
        yield data
        yield batches
