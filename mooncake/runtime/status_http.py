"""A worker's HTTP side door: ``/metrics`` (Prometheus) and ``/health`` (JSON; 503 when not serving).

What Kubernetes probes and Prometheus scrape on every component. A daemon thread running
a small ``ThreadingHTTPServer``; ``health()`` returns ``(ok, details)``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def start_status_server(
    host: str, port: int, registry: CollectorRegistry, health: Callable[[], tuple[bool, dict]]
) -> ThreadingHTTPServer:
    """Serve /metrics and /health on ``host:port`` (0: any free port; ``server.server_port`` says which)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path in ("/health", "/healthz", "/ready"):
                try:
                    ok, details = health()
                except Exception as e:  # noqa: BLE001 - a failing check is an unhealthy answer
                    ok, details = False, {"error": str(e)}
                body = json.dumps({"status": "ok" if ok else "unavailable", **details}).encode()
                self._send(200 if ok else 503, body, "application/json")
            else:
                self._send(404, b'{"error": "not found"}', "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # quiet: probes come every few seconds
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="status-http", daemon=True).start()
    return server
