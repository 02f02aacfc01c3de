"""One bounded HTTP GET for what tenants serve: rank 0's status endpoint (status_endpoint.py) and the job's S3
endpoint (store_log.py), both chosen by whoever wrote the TrainingJob.

- a total deadline over everything (name lookup, connect, TLS, headers, body): a server that sends a
  byte every 2 s is cut off at the deadline, never held on to;
- at most `limit` bytes of body (TooLarge beyond);
- no redirect is followed (a 3xx is the answer), no proxy from the environment, only the host the URL
  names; `ip_only` refuses a URL whose host is not an IP address (rank 0: the pod's own IP).
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import os
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kubetron_operator.untrusted import clean


class TooLarge(OSError):
    """The body is longer than the caller's limit."""


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Mapping[str, str]
    body: bytes


def get(url: str, *, limit: int, deadline: float, headers: Mapping[str, str] | None = None,
        ip_only: bool = False) -> Answer:
    """GET `url` within `deadline` seconds, reading at most `limit` bytes of body (see the module docstring).
    Raises TimeoutError, TooLarge, ValueError (a URL it refuses) or another OSError."""
    parts = urlsplit(url)
    host, target = parts.hostname or "", (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if parts.scheme not in ("http", "https") or not host or clean(target, None) != target or " " in target:
        raise ValueError(f"not a URL the operator fetches: {clean(url, 200)}")
    if ip_only and not _is_ip(host):
        raise ValueError(f"{clean(host, 100)} is not an IP address")
    try:
        return _get(parts.scheme, host, parts.port, parts.netloc, target, limit, time.monotonic() + deadline, headers)
    except TimeoutError:
        raise TimeoutError(f"no answer within {deadline:g}s") from None


def _get(scheme: str, host: str, port: int | None, netloc: str, target: str, limit: int, end: float,
         headers: Mapping[str, str] | None) -> Answer:
    sock = _connect(host, port or (443 if scheme == "https" else 80), end)
    try:
        if scheme == "https":
            sock = _tls(sock, host, end)
        lines = [f"GET {target} HTTP/1.1", f"Host: {netloc}", "User-Agent: kubetron-operator",
                 "Accept-Encoding: identity", "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        sock.settimeout(_left(end))
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("ascii"))
        response = http.client.HTTPResponse(_Timed(sock, end))  # type: ignore[arg-type]  # makefile is all it uses
        response.begin()
        body = response.read(limit + 1)
        if len(body) > limit:
            raise TooLarge(f"the answer is longer than {limit} bytes")
        return Answer(response.status, dict(response.headers.items()), body)
    finally:
        sock.close()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _left(end: float) -> float:
    left = end - time.monotonic()
    if left <= 0:
        raise TimeoutError("no answer within the deadline")
    return left


def _connect(host: str, port: int, end: float) -> socket.socket:
    address = host if _is_ip(host) else _resolve(host, port, end)
    return socket.create_connection((address, port), timeout=_left(end))


def _resolve(host: str, port: int, end: float) -> str:
    """The first address of `host`, looked up in a thread of its own: getaddrinfo has no timeout, and a
    tenant's name server may answer slowly on purpose."""
    found: queue.Queue[Any] = queue.Queue(1)

    def lookup() -> None:
        try:
            found.put(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
        except OSError as exc:
            found.put(exc)

    threading.Thread(target=lookup, name="resolve", daemon=True).start()
    try:
        address = found.get(timeout=_left(end))
    except queue.Empty:
        raise TimeoutError(f"looking up {clean(host, 100)} took longer than the deadline") from None
    if isinstance(address, OSError):
        raise address
    return str(address)


_TLS: list[ssl.SSLContext] = []


def _tls(sock: socket.socket, host: str, end: float) -> ssl.SSLSocket:
    """The TLS handshake, without blocking past `end`. Verifies the server against the system's CAs
    (or AWS_CA_BUNDLE, as botocore would)."""
    if not _TLS:
        _TLS.append(ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None))
    tls = _TLS[0].wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    tls.setblocking(False)
    while True:
        try:
            tls.do_handshake()
            return tls
        except ssl.SSLWantReadError:
            ready = select.select([tls], [], [], _left(end))[0]
        except ssl.SSLWantWriteError:
            ready = select.select([], [tls], [], _left(end))[1]
        if not ready:
            raise TimeoutError("no TLS handshake within the deadline")


class _Timed:
    """What http.client.HTTPResponse reads from: a socket whose every read waits at most until `end`."""

    def __init__(self, sock: socket.socket, end: float):
        self.sock, self.end = sock, end

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_TimedReader(self.sock, self.end))


class _TimedReader(io.RawIOBase):
    def __init__(self, sock: socket.socket, end: float):
        self.sock, self.end = sock, end

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.sock.settimeout(_left(self.end))
        return self.sock.recv_into(buffer)
