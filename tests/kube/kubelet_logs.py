"""A Node whose kubelet port serves container logs, so `pods/log` works on the test control plane.

The API server answers `GET /api/v1/namespaces/NS/pods/POD/log` by proxying to the pod's node: the node's
address (its InternalIP here, 127.0.0.1) and `status.daemonEndpoints.kubeletEndpoint.Port`, path
`/containerLogs/NS/POD/CONTAINER` (`?follow=true` streams). This stand-in serves that path over TLS (the API
server does not verify a kubelet's certificate unless told to) from what the test writes:

    with LogNode(cp, "log-node") as node:           # a Ready Node (tests/kube/cluster.Kubelet) + the log port
        node.write(ns, pod, "iteration 1 | loss 2.0")   # what the container printed so far
        node.end(ns, pod)                            # the container exited: a followed log ends
"""

from __future__ import annotations

import ssl
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.kube.cluster import ControlPlane, Kubelet


class LogNode:
    """A Ready Node named `name` whose kubelet serves the logs written with write()."""

    def __init__(self, cp: ControlPlane, name: str):
        self.cp, self.name = cp, name
        self.lines: dict[tuple[str, str], list[str]] = defaultdict(list)
        self.ended: set[tuple[str, str]] = set()
        self.requests: list[str] = []  # the paths the API server asked for
        self.changed = threading.Condition()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(str(cp.pki / "server.crt"), str(cp.pki / "server.key"))
        self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.kubelet = Kubelet(cp.admin, name=name)

    def __enter__(self) -> LogNode:
        threading.Thread(target=self.server.serve_forever, name=f"kubelet-logs-{self.name}", daemon=True).start()
        self.kubelet.start()
        # Only an InternalIP: the API server would try a Hostname address first, and none resolves here.
        self.cp.admin.patch(f"/api/v1/nodes/{self.name}/status", {"status": {
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.server.server_address[1]}}}})
        return self

    def __exit__(self, *exc: object) -> None:
        self.end_all()
        self.kubelet.stop()
        self.cp.admin.delete(f"/api/v1/nodes/{self.name}", ok=(404,))
        self.server.shutdown()
        self.server.server_close()

    def write(self, ns: str, pod: str, *lines: str) -> None:
        with self.changed:
            self.lines[(ns, pod)].extend(lines)
            self.changed.notify_all()

    def end(self, ns: str, pod: str) -> None:
        with self.changed:
            self.ended.add((ns, pod))
            self.changed.notify_all()

    def end_all(self) -> None:
        with self.changed:
            self.ended.update(self.lines)
            self.ended.add(("*", "*"))
            self.changed.notify_all()

    def _follow(self, key: tuple[str, str], sent: int) -> tuple[list[str], bool]:
        """The lines after the first `sent` once there are any (or the log ended), and whether it ended."""
        with self.changed:
            self.changed.wait_for(lambda: len(self.lines[key]) > sent or key in self.ended
                                  or ("*", "*") in self.ended, timeout=60)
            return self.lines[key][sent:], key in self.ended or ("*", "*") in self.ended

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        node = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends when the connection closes: it can stream

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urlsplit(self.path)
                node.requests.append(url.path)
                parts = url.path.split("/")
                if len(parts) != 5 or parts[1] != "containerLogs":
                    self.send_error(404)
                    return
                key = (parts[2], parts[3])
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                follow = parse_qs(url.query).get("follow") == ["true"]
                sent, ended = 0, not follow
                lines = list(node.lines[key])
                while True:
                    self.wfile.write("".join(f"{line}\n" for line in lines).encode())
                    self.wfile.flush()
                    sent += len(lines)
                    if ended:
                        return
                    lines, ended = node._follow(key, sent)

            def log_message(self, *_: Any) -> None:
                pass

        return Handler
