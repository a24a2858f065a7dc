"""The launcher's control endpoint: how the Conductor's ``local`` pool provider starts and stops workers.

    POST /add     {"role": "prefill" | "decode", "count": n}  -> {"started": [names]}  (returns at once)
    POST /remove  {"id": "decode-1"}                          -> {"stopped": "decode-1"} (after it drained)
    GET  /components                                          -> {name: {"alive", "pid", "restarts"}}

https with the cluster's certificates (mooncake.tls) unless --insecure. Loopback only by
default (``mooncake up`` binds it to its --host); errors are JSON with a 4xx status. The
pool logic (what to drain, when it is idle) is the Conductor's; this only runs processes.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mooncake import tls

log = logging.getLogger(__name__)


def start_control_server(cluster, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path == "/add":
                    self._send(200, {"started": cluster.add(str(body.get("role")), int(body.get("count", 1)))})
                elif self.path == "/remove":
                    cluster.remove(str(body.get("id")))
                    self._send(200, {"stopped": body.get("id")})
                else:
                    self._send(404, {"error": f"no {self.path}"})
            except (ValueError, TypeError) as e:
                self._send(400, {"error": str(e)})

        def do_GET(self) -> None:  # noqa: N802
            if self.path != "/components":
                self._send(404, {"error": f"no {self.path}"})
                return
            comps = dict(cluster.components)
            self._send(
                200,
                {
                    n: {"alive": c.alive, "pid": c.proc.pid if c.proc else None, "restarts": c.restarts}
                    for n, c in comps.items()
                },
            )

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

        def setup(self) -> None:
            if isinstance(self.request, ssl.SSLSocket):  # the handshake on this request's thread, not the accept loop's
                self.request.settimeout(tls.HANDSHAKE_TIMEOUT_S)
                self.request.do_handshake()
            super().setup()

    server = ThreadingHTTPServer((host, port), Handler)
    ident = tls.identity()
    if ident is not None:  # https, and only for a caller with the cluster's certificate (the Conductor)
        server.socket = ident.server_context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="cluster-control", daemon=True).start()
    return server
