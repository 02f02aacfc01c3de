"""HTTP endpoints a hostile tenant could name (an S3 endpoint, rank 0's status port), on 127.0.0.1, each
recording every request it gets (method, path, headers) in `requests`.

    Endpoint.objects({"/bkt/key": b"..."})   a fake S3: GET of an object (a `Range: bytes=-N` suffix is
                                             honoured, 206), 404 NoSuchKey otherwise; no signature checked
    Endpoint.drip(every=2.0)                 answers one byte every `every` seconds, for ever
    Endpoint.redirect(url)                   302 to `url`
    Endpoint.serve(body)                     200 with `body` (bytes) as JSON
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = Callable[[BaseHTTPRequestHandler, "Endpoint"], None]


class Endpoint:
    def __init__(self, answer: Answer):
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.closed = threading.Event()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                with endpoint._lock:
                    endpoint.requests.append({"method": "GET", "path": self.path, "headers": dict(self.headers)})
                with contextlib.suppress(OSError):
                    answer(self, endpoint)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()

    def carrying(self, text: str) -> list[dict[str, Any]]:
        """The requests whose path (query included) or a header holds `text`."""
        with self._lock:
            return [r for r in self.requests if text in r["path"] or any(text in v for v in r["headers"].values())]

    # -- what it answers ------------------------------------------------------------------------------

    @classmethod
    def objects(cls, objects: dict[str, bytes]) -> Endpoint:
        return cls(lambda h, _: _object(h, objects))

    @classmethod
    def drip(cls, every: float = 2.0) -> Endpoint:
        return cls(lambda h, e: _drip(h, e, every))

    @classmethod
    def redirect(cls, url: str) -> Endpoint:
        return cls(lambda h, _: _send(h, 302, b"", {"Location": url}))

    @classmethod
    def serve(cls, body: bytes) -> Endpoint:
        return cls(lambda h, _: _send(h, 200, body, {"Content-Type": "application/json"}))


def _send(h: BaseHTTPRequestHandler, code: int, body: bytes, headers: dict[str, str]) -> None:
    h.send_response(code)
    for key, value in {**headers, "Content-Length": str(len(body))}.items():
        h.send_header(key, value)
    h.end_headers()
    h.wfile.write(body)


def _object(h: BaseHTTPRequestHandler, objects: dict[str, bytes]) -> None:
    data = objects.get(h.path.partition("?")[0])
    if data is None:
        _send(h, 404, b"<Error><Code>NoSuchKey</Code></Error>", {"Content-Type": "application/xml"})
        return
    suffix = re.fullmatch(r"bytes=-(\d+)", h.headers.get("Range") or "")
    if suffix is None:
        _send(h, 200, data, {})
        return
    start = max(0, len(data) - int(suffix.group(1)))
    _send(h, 206, data[start:], {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"})


def _drip(h: BaseHTTPRequestHandler, endpoint: Endpoint, every: float) -> None:
    """`HTTP/1.1 200 OK...` one byte at a time, until the client goes away or the endpoint closes."""
    for byte in b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"." * 100_000:
        if endpoint.closed.wait(every):
            return
        h.wfile.write(bytes([byte]))
        h.wfile.flush()
