"""The gateway's Prometheus metrics, in a registry of their own (one per app, so two apps
in one process, as in the tests, do not collide), exposed on ``/metrics``.

Latencies are seen from the gateway: TTFT runs from the request's arrival at the route
(tokenization included) to the first chunk carrying tokens; TBT is every gap between two
chunks carrying tokens; end-to-end runs to the chunk that finishes the request.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_SHED_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    """Counters and histograms of one gateway app. Updated from the event loop only."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mooncake_gateway_requests",
            "Requests by endpoint and outcome status (499: the client went away; "
            "a stream that failed midway counts under its error's status)",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "mooncake_gateway_ttft_seconds", "Arrival to the first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.tbt = Histogram(
            "mooncake_gateway_tbt_seconds", "Gap between token chunks", buckets=_TBT_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "mooncake_gateway_e2e_seconds", "Arrival to the last token", buckets=_E2E_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter(
            "mooncake_gateway_prompt_tokens", "Prompt tokens of requests that started", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "mooncake_gateway_cached_prompt_tokens",
            "Prompt tokens whose KV was reused, by where it came from",
            ["tier"],
            registry=r,
        )
        self.completion_tokens = Counter("mooncake_gateway_completion_tokens", "Tokens generated", registry=r)
        self.rejections = Counter(
            "mooncake_gateway_rejections",
            "Requests the backend turned away before generating, by reason",
            ["reason"],
            registry=r,
        )
        self.tenant_rejections = Counter(
            "mooncake_gateway_tenant_rejections",
            "Requests refused for their tenant's rate limit or concurrency cap",
            ["tenant", "reason"],
            registry=r,
        )
        self.running = Gauge("mooncake_gateway_running_requests", "Requests being generated now", registry=r)
        self.shedding = Histogram(
            "mooncake_gateway_rejection_seconds",
            "Arrival to a 429's response (how long a refused client waited to hear it)",
            buckets=_SHED_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)
