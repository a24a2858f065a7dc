"""The Conductor's Prometheus metrics (served on --metrics-port): its decisions, per tenant and priority too, how its
predictions came out part by part, the index, the instances, the learnt hand-off."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from conductor.types import Measured, Prediction

PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 4.0)
MIN_SCORED_PART_S = 0.05  # a part shorter than this, predicted and measured, is not scored (its ratio is noise)
MAX_TENANT_LABELS = 64  # tenants beyond these are counted as "other" (a label per tenant of a tenants file)


class Metrics:
    """The Conductor's Prometheus metrics, in a registry of its own (served on --metrics-port)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.quote_held = Gauge(
            "mooncake_conductor_quote_held_ratio",
            "Share of the last 1,000 quotes measured that held: within 25% of what came out (conductor.quotes)",
            ["part"],
            registry=r,
        )
        self.ttft_margin = Gauge(
            "mooncake_conductor_ttft_margin",
            "The factor admission takes a predicted TTFT at against the SLO: the 80th percentile of measured over "
            "predicted TTFT of the last 200 predictions near the SLO (conductor.learning.Calibration; 1 before 20)",
            registry=r,
        )
        self.decisions = Counter("mooncake_conductor_decisions", "Schedule outcomes", ["policy", "outcome"], registry=r)
        self.decision_seconds = Histogram(
            "mooncake_conductor_decision_seconds",
            "Time to decide one Schedule",
            registry=r,
            buckets=(2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
        )
        self.ttft_error = Histogram(
            "mooncake_conductor_ttft_abs_error_seconds",
            "|predicted - measured| TTFT",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.prediction_ratio = Histogram(
            "mooncake_conductor_prediction_ratio",
            "Predicted over measured, per part of a TTFT prediction: ttft, and where the decode worker measured them, "
            "queue (the prefill worker's), prefill (its own), worker (the two) and transfer (the rest: prefix transfer "
            "and hand-off); within 25% is [0.75, 1.25]",
            ["part"],
            registry=r,
            buckets=PREDICTION_RATIO_BUCKETS,
        )
        self.admissions = Counter(
            "mooncake_conductor_admissions",
            "Schedule outcomes per tenant and priority (outcome: scheduled, wait, or the rejection's reason)",
            ["tenant", "priority", "outcome"],
            registry=r,
        )
        self.waiting = Gauge(
            "mooncake_conductor_waiting_requests",
            "Requests told to wait at their gateway (early_wait), per priority",
            ["priority"],
            registry=r,
        )
        self._tenants: set[str] = set()  # the tenants labelled so far (MAX_TENANT_LABELS at most)
        self.match_blocks = Histogram(
            "mooncake_conductor_reused_blocks",
            "Prefix blocks reused (local + fetched) per placement",
            registry=r,
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096),
        )
        self.index_blocks = Gauge(
            "mooncake_conductor_index_blocks", "Distinct blocks in the global KV index", registry=r
        )
        self.instances = Gauge("mooncake_conductor_instances", "Registered instances", ["role", "state"], registry=r)
        self.placements = Counter(
            "mooncake_conductor_placements",
            "Placements by where the prompt is computed: prefill_worker or decode_worker (conductor.local)",
            ["kind"],
            registry=r,
        )
        self.narrow_handoffs = Counter(
            "mooncake_conductor_narrow_handoffs",
            "Placements whose prompt KV moves to decode in the pool's narrower dtype (--narrow-handoff)",
            registry=r,
        )
        self.transfer_rate = Gauge(
            "mooncake_conductor_transfer_bytes_per_second",
            "The pool network's bandwidth as the Conductor has learnt it (prefix fetches and hand-offs across hosts)",
            registry=r,
        )
        self.handoff = Gauge(
            "mooncake_conductor_handoff_seconds",
            "The hand-off from a prefill worker to a decode worker, as "
            "the Conductor has learnt it (decode workers report each)",
            registry=r,
        )
        # the capacity planner (conductor.planning): what KEDA or an HPA scales on when the planner only advises
        self.planner_desired = Gauge(
            "mooncake_planner_desired_instances", "The planner's count for each pool", ["role"], registry=r
        )
        self.planner_devices = Gauge(
            "mooncake_planner_desired_devices",
            "The devices the planner's count takes in each pool (instances x their tensor-parallel size)",
            ["role"],
            registry=r,
        )
        self.planner_forecast = {  # what the last plan forecast for the next interval
            name: Gauge(f"mooncake_planner_forecast_{name}", text, registry=r)
            for name, text in (
                ("rate", "Requests a second"),
                ("prompt_tokens", "A prompt's mean tokens"),
                ("uncached_tokens", "A prompt's mean tokens not in the pool (what prefill computes)"),
                ("output_tokens", "An answer's mean tokens"),
            )
        }
        self.planner_twin_attainment = Gauge(
            "mooncake_planner_twin_attainment",
            "The share of the window's requests within both SLOs on the twin, with the planned counts",
            registry=r,
        )

    def admitted(self, tenant: str, priority: int, outcome: str) -> None:
        """One Schedule outcome (scheduled, wait, or a refusal's reason) of ``tenant`` at ``priority``."""
        self.admissions.labels(self._label(tenant), str(priority), outcome).inc()

    def _label(self, tenant: str) -> str:
        """A tenant's metric label: its name, for the first MAX_TENANT_LABELS seen ("" for none)."""
        if tenant in self._tenants or len(self._tenants) < MAX_TENANT_LABELS:
            self._tenants.add(tenant)
            return tenant
        return "other"

    def score(self, predicted: Prediction, measured: Measured) -> None:
        """A prediction against what came out, part by part (``mooncake_conductor_prediction_ratio``)."""
        self.ttft_error.observe(abs(predicted.ttft_s - measured.ttft_s))
        ratio = self.prediction_ratio
        ratio.labels("ttft").observe(predicted.ttft_s / max(measured.ttft_s, 1e-6))
        if measured.parts:
            for part, p, m in (
                ("queue", predicted.queue_s, measured.queue_s),
                ("prefill", predicted.prefill_s, measured.prefill_s),
                # the two together: where a prompt shares steps with others, the worker's split between them is not
                # the packed model's (its queue ends at its first step, the model's at the step before it)
                ("worker", predicted.queue_s + predicted.prefill_s, measured.queue_s + measured.prefill_s),
                ("transfer", predicted.transfer_s, measured.transfer_s),
            ):
                if max(p, m) >= MIN_SCORED_PART_S:
                    ratio.labels(part).observe(p / m if m > 0 else float("inf"))
