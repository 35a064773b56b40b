"""``--metrics-port``: /metrics alone on a port of its own, with the API key when it is required."""

from __future__ import annotations

import httpx
import pytest

from specdec.server.metrics import ServerMetrics
from specdec.server.metrics_listener import MetricsListener
from specdec.server.serve import bind_socket


@pytest.mark.parametrize("api_key", [None, "k"])
def test_the_metrics_port_serves_metrics_only_and_asks_for_the_key_when_required(api_key):
    sock = bind_socket("127.0.0.1", 0, "--metrics-port")
    port = sock.getsockname()[1]
    listener = MetricsListener(sock, ServerMetrics("m"), api_key=api_key)
    try:
        headers = {"Authorization": "Bearer k"} if api_key else {}
        answer = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=headers, timeout=10)
        assert answer.status_code == 200 and "specdec_requests_in_flight" in answer.text
        other = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers, timeout=10)
        assert other.status_code == 404 and "only /metrics" in other.json()["error"]["message"]
        if api_key:
            refused = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer x"}, timeout=10)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    finally:
        listener.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
