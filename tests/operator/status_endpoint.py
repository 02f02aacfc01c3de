"""A stand-in for rank 0's status endpoint, for the operator tests on a real API server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.kube.cluster import free_port


class StatusEndpoint:
    """Rank 0's `GET /status` (docs/CONTRACT.md) on 127.0.0.1: `live` is served, None refuses."""

    def __init__(self) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if endpoint.live is None:
                    self.send_error(503)
                    return
                data = json.dumps(endpoint.live).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: Any) -> None:
                pass

        self.live: dict[str, Any] | None = None
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
