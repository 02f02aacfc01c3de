"""A small fault-injecting HTTP proxy for an S3 server, on 127.0.0.1.

    with FaultProxy(s3_server.endpoint, p_503=0.1, p_reset=0.05, p_reset_after=0.05, p_delay=0.1) as px:
        store = open_store("s3://bucket/x", endpoint_url=px.endpoint)
        ...
        px.stats  # Counter: requests, forwarded, 503, reset, reset_after, delay
        px.requests  # every request: {"method", "path", "headers"}

For each request, with the given probabilities (one draw per request), the proxy
  * `p_503`: answers 503 SlowDown itself (the server never sees the request),
  * `p_reset`: reads the request, then resets the TCP connection (never forwarded),
  * `p_reset_after`: forwards it, then resets the connection instead of answering (the server DID act:
    the client cannot tell, and must cope with retrying e.g. a CompleteMultipartUpload that succeeded),
  * `p_delay`: forwards it and holds the answer for `delay_s` seconds.
`match(method, path)` restricts faults to some requests. Requests keep their signed headers (Host
included) and are forwarded byte for byte, so SigV4 signatures still verify upstream.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import random
import socket
import socketserver
import struct
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Self
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "expect", "te", "upgrade"}
_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate. (fault proxy)</Message></Error>"
)


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy

    def handle_error(self, request, client_address):
        """A client that went away (its timeout, during a held answer) is no error of the proxy's."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format, *args):
        pass

    def setup(self):
        super().setup()
        self._up: http.client.HTTPConnection | None = None

    def finish(self):
        with contextlib.suppress(OSError):
            super().finish()
        if self._up is not None:
            self._up.close()

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reset(self):
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        self.close_connection = True

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        px = self.server.proxy
        for attempt in (1, 2):  # a kept-alive upstream connection may have been closed meanwhile
            if self._up is None:
                self._up = http.client.HTTPConnection(px.upstream_host, px.upstream_port, timeout=300)
            try:
                up = self._up
                up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        up.putheader(k, v)
                if body or self.command in ("PUT", "POST"):
                    up.putheader("Content-Length", str(len(body)))
                up.endheaders(body)
                r = up.getresponse()
                data = r.read()
                return r.status, r.reason, r.getheaders(), data
            except (OSError, http.client.HTTPException):
                self._up.close()
                self._up = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _handle(self):
        px = self.server.proxy
        body = self._body()
        fault = px._draw(self.command, self.path)
        px._count("requests")
        with px._lock:
            px.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers)})
        if fault == "503":
            px._count("503")
            self.send_response_only(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(_SLOWDOWN)))
            self.end_headers()
            self.wfile.write(_SLOWDOWN)
            return
        if fault == "reset":
            px._count("reset")
            return self._reset()
        try:
            status, reason, headers, data = self._forward(body)
        except (OSError, http.client.HTTPException):
            px._count("upstream_error")
            return self._reset()
        px._count("forwarded")
        if fault == "reset_after":
            px._count("reset_after")
            return self._reset()
        if fault == "delay":
            px._count("delay")
            time.sleep(px.delay_s)
        self.send_response_only(status, reason)
        for k, v in headers:
            if k.lower() not in _HOP and not (k.lower() == "content-length" and self.command != "HEAD"):
                self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD" and data:
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        p_503: float = 0.0,
        p_reset: float = 0.0,
        p_reset_after: float = 0.0,
        p_delay: float = 0.0,
        delay_s: float = 0.3,
        seed: int = 0,
        match: Callable[[str, str], bool] | None = None,
    ):
        u = urlsplit(upstream)
        self.upstream_host, self.upstream_port = u.hostname or "127.0.0.1", u.port or 80
        self.delay_s = delay_s
        self.match = match
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.stats: collections.Counter[str] = collections.Counter()
        self.requests: list[dict[str, object]] = []
        self.set(p_503=p_503, p_reset=p_reset, p_reset_after=p_reset_after, p_delay=p_delay)
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    def set(self, **probs: float) -> None:
        """Change fault probabilities on the fly (p_503, p_reset, p_reset_after, p_delay)."""
        with self._lock:
            for k, v in probs.items():
                if k not in ("p_503", "p_reset", "p_reset_after", "p_delay"):
                    raise TypeError(k)
                setattr(self, k, float(v))
            total = self.p_503 + self.p_reset + self.p_reset_after + self.p_delay
            if total > 1.0 + 1e-9:
                raise ValueError(f"fault probabilities add up to {total} > 1")

    def _draw(self, method: str, path: str) -> str | None:
        if self.match is not None and not self.match(method, path):
            return None
        with self._lock:
            x = self._rng.random()
            for name, p in (
                ("503", self.p_503), ("reset", self.p_reset),
                ("reset_after", self.p_reset_after), ("delay", self.p_delay),
            ):  # fmt: skip
                if x < p:
                    return name
                x -= p
        return None

    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="faultproxy")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
