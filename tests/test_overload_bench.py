"""overload_bench's reading of the gateway's own 429 latency: its Prometheus histogram, fetched over HTTP and
differenced between two reads, gives the bucket that holds the p99."""

from __future__ import annotations

import http.server
import threading

from benchmarks.overload_bench import bucket_quantile, gateway_shedding
from mooncake.gateway.metrics import GatewayMetrics


def test_the_p99_bucket_of_what_the_gateway_observed_between_two_reads():
    metrics = GatewayMetrics()
    for s in (0.002, 0.003, 0.004):  # before the phase: not counted
        metrics.shedding.observe(s)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the standard library's name)
            body = metrics.render() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        before = gateway_shedding(url)
        assert before[0.005] == 3 and before[float("inf")] == 3
        # the phase: 98 fast refusals, 2 slow ones; the p99 is the 99th of 100, in the (0.05, 0.1] bucket
        for _ in range(98):
            metrics.shedding.observe(0.004)
        metrics.shedding.observe(0.07)
        metrics.shedding.observe(0.3)
        after = gateway_shedding(url)
        assert bucket_quantile(before, after, 0.99) == 0.1
        assert bucket_quantile(before, after, 0.5) == 0.005
        assert bucket_quantile(before, after, 1.0) == 0.5
        assert bucket_quantile(after, after, 0.99) is None  # nothing observed between the two reads
    finally:
        server.shutdown()
    assert gateway_shedding(url) == {}  # no server there: nothing, not an error
