"""The Grafana dashboard in deploy/grafana/: Grafana JSON with a data source variable, the panels an operator
looks for, and queries only of metrics the code exports (latencies as quantiles over histogram buckets)."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "mooncake.json"
# The files whose Prometheus metrics the dashboard may query.
METRIC_SOURCES = [
    "mooncake/gateway/metrics.py",
    "decode/server.py",
    "prefill/server.py",
    "kvstore/metrics.py",
    "conductor/metrics.py",
    "transfer/metrics.py",
]


def exported_series() -> set[str]:
    """Every series name the components expose: Counter -> name_total, Histogram -> _bucket, _sum, _count."""
    pattern = re.compile(
        r"\b(Counter|Gauge|Histogram|Summary|CounterMetricFamily|GaugeMetricFamily)\(\s*\"(mooncake_\w+)\""
    )
    series = set()
    for source in METRIC_SOURCES:
        for kind, name in pattern.findall((REPO / source).read_text()):
            if kind.startswith("Counter"):
                series.add(name.removesuffix("_total") + "_total")
            elif kind == "Histogram":
                series |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            elif kind == "Summary":
                series |= {name, f"{name}_sum", f"{name}_count"}
            else:
                series.add(name)
    return series


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    return [t["expr"] for p in panels for t in p["targets"]]


def test_dashboard_is_grafana_json_with_a_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    titles = []
    for panel in dashboard["panels"]:
        titles.append(panel["title"])
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel[
            "title"
        ]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    wanted = {
        "TTFT (gateway)",
        "TBT (gateway)",
        "Rejections by reason (gateway)",
        "Prompt tokens served from cache, by tier",
        "KV bytes moved",
        "Prefill queue",
        "Running batch and cap",
        "Pool usage by tier",
        "Instances alive",
    }
    assert wanted <= set(titles), sorted(wanted - set(titles))


def test_dashboard_queries_only_metrics_the_code_exports():
    exported = exported_series()
    assert {"mooncake_gateway_ttft_seconds_bucket", "mooncake_pool_used_blocks", "mooncake_kv_bytes_total"} <= exported
    queried = {name for expr in dashboard_queries() for name in re.findall(r"\bmooncake_\w+", expr)}
    assert queried, "the dashboard queries nothing"
    assert queried <= exported, f"not exported by the code: {sorted(queried - exported)}"


def test_dashboard_latency_panels_take_quantiles_over_histogram_buckets():
    exprs = dashboard_queries()
    for metric in (
        "mooncake_gateway_ttft_seconds",
        "mooncake_gateway_tbt_seconds",
        "mooncake_gateway_rejection_seconds",
    ):
        quantiles = {
            q for e in exprs if f"{metric}_bucket" in e for q in re.findall(r"histogram_quantile\((0\.\d+)", e)
        }
        assert quantiles == {"0.5", "0.9", "0.99"}, metric
