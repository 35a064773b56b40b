"""``--metrics-port``: ``GET /metrics`` on a port of its own, as FastDeploy serves it.

A scraper can then reach the metrics on a port the firewall keeps apart from the API's (the
API's own ``/metrics`` stays). The listener runs in a thread of its own (the standard library's
threading HTTP server), so that a scrape never waits on the event loop; it serves the same
registry as the API's ``/metrics``, and nothing else (any other path is 404). With
``--metrics-require-key`` it asks for the same ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from .metrics import ServerMetrics


class MetricsListener:
    """Serves ``metrics`` at ``/metrics`` on ``sock`` (bound, not yet listening) until :meth:`close`.

    :param api_key: when given, a scrape must carry ``Authorization: Bearer <api_key>`` (else 401).
    """

    def __init__(self, sock: socket.socket, metrics: ServerMetrics, api_key: Optional[str] = None):
        expected = f"Bearer {api_key}".encode() if api_key else None

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the name http.server calls
                if self.path.split("?")[0] != "/metrics":
                    return self._answer(404, *_error("not found: only /metrics is served on this port"))
                given = (self.headers.get("Authorization") or "").encode()
                if expected is not None and not secrets.compare_digest(given, expected):
                    return self._answer(401, *_error("authorization: a missing or wrong API key; send "
                                                     "'Authorization: Bearer <key>'", "invalid_api_key"))
                self._answer(200, *metrics.render())

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes every few seconds are not news
                pass

        self.server = ThreadingHTTPServer(sock.getsockname()[:2], Handler, bind_and_activate=False)
        self.server.daemon_threads = True
        self.server.socket.close()
        self.server.socket = sock
        self.server.server_activate()
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="specdec-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _error(message: str, code: Optional[str] = None) -> tuple[bytes, str]:
    """An error body in the OpenAI schema, as the API's own errors."""
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return json.dumps(body).encode(), "application/json"
