"""Copies of the pods' memory snapshots on their peers (docs/recovery.md), kept by each pod's torchrun agent.

Each agent serves its pod's memory volume over HTTP on a free port of the pod (published in each rendezvous
round's store, `kubetron/peers/<node rank>`), and sends the newest snapshot each of its ranks wrote to the
pods that hold its copies (`kubetron.contract.recovery.holders`: a ring by default). A pod lost and recreated
then finds its ranks' snapshots on those pods: the gang's loading (checkpoint/gang.py) reads them from there.

Guarded and bounded, as everything a pod receives is hostile until checked:
- every request carries the job's token (`Authorization: Bearer`, the per-job Secret the operator made,
  KUBETRON_PEER_TOKEN; the agent takes it out of the environment the ranks inherit); without it: 403, and no
  other job's pod (another token) nor anything outside the job's pods reads or writes a copy;
- a pod accepts copies only of the ranks of the pods it holds copies of, of this gang's world size, each
  within the memory volume's free room (KUBETRON_SNAPSHOT_LIMIT_BYTES): never more than the volume holds;
- a copy is a manifest then the files it names, checked chunk by chunk against its digests while it is
  written beside, and renamed into place only when whole (snapshot_files); at most KEEP per rank;
- every transfer has a socket timeout and a deadline, few run at once, and all of it runs in the agent's
  threads: the training loop never waits for a copy.

The wire format of one snapshot (PUT and GET `/v1/copy/<rank>/<iteration>`): 8 bytes big-endian manifest
length, the manifest (snapshot_files.Manifest's JSON), then each file it names in sorted order.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubetron.contract import recovery
from kubetron.contract.errors import CheckpointError
from kubetron.storage.snapshot_files import (
    MAX_MANIFEST,
    Manifest,
    OpenSnapshot,
    SnapshotWriter,
    copied,
    iterations,
    mark_copied,
    own_dir,
    parse_manifest,
    parse_rank_dir,
    peer_dir,
    snap_name,
    write_snapshot,
)

log = logging.getLogger("kubetron.peers")

ADDRESS_KEY = "kubetron/peers/"  # + node rank: "host:port" of that pod's agent, in each round's store
# How often an agent looks for a new snapshot of its ranks. A rank's next snapshot waits until the last one's copies
# are marked (checkpoint.snapshot.MemorySnapshots._copies_lag), so this is part of the snapshot interval in practice:
# at 0.5 s a gang of 40 ms steps snapshotting every 3 iterations took one about every 6-15 and lost that many in a
# crash. Listing the ranks' directories 20 times a second costs the agent nothing measurable.
POLL_SECONDS = 0.05
IO_TIMEOUT = 30.0  # seconds a transfer may stall
DEADLINE = 600.0  # seconds one copy may take in all
MAX_CONNECTIONS = 4  # requests served at once
PIECE = 4 << 20  # bytes read or sent at a time
_PATH_RE = re.compile(r"^/v1/copy/(\d{1,9})/(\d{1,12})$")


def _frame_head(manifest: Manifest) -> bytes:
    head = manifest.to_json()
    return len(head).to_bytes(8, "big") + head


@dataclass
class Node:
    """What an agent knows of its place in the gang (from its rendezvous round)."""

    node_rank: int
    nnodes: int
    ranks: list[int]  # the global ranks of this pod
    world_size: int
    factor: int = recovery.DEFAULT_FACTOR
    jump: int = recovery.DEFAULT_JUMP

    def ranks_of(self, pod: int) -> range:
        per = self.world_size // self.nnodes
        return range(pod * per, (pod + 1) * per)

    def may_hold(self, rank: int) -> bool:
        """Whether this pod holds copies of `rank` (a rank of a pod whose copies it holds)."""
        return any(rank in self.ranks_of(p) for p in recovery.held_by(self.node_rank, self.nnodes, self.factor,
                                                                       self.jump))


def volume_usage(root: Path) -> int:
    """Bytes of every file under `root` (the memory volume, or a part of it)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


# -- serving ----------------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A peer that went away mid-request (its pod deleted, its node lost) is one line at debug level, not a
        traceback in this pod's log."""
        log.debug("peer copies: a request from %s ended early: %r", client_address, sys.exc_info()[1])


class PeerServer:
    """This pod's memory volume over HTTP, for the job's other pods."""

    def __init__(self, root: str | Path, token: str, limit: int, host: str = "0.0.0.0"):
        self.root, self._token, self.limit = Path(root), token.encode(), limit
        self.node: Node | None = None  # known once the first round formed; until then every copy is refused
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()  # one copy written at a time (the room check and the write together)
        self.httpd = _Server((host, 0), self._handler())
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="kubetron-peers", daemon=True)

    def start(self) -> PeerServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def wait_idle(self, timeout: float) -> bool:
        """Whether every request in flight ended within `timeout` seconds (new ones wait meanwhile)."""
        held = []
        try:
            for _ in range(MAX_CONNECTIONS):
                if not self._slots.acquire(timeout=timeout):
                    return False
                held.append(1)
            return True
        finally:
            for _ in held:
                self._slots.release()

    def authorized(self, header: str | None) -> bool:
        given = (header or "").removeprefix("Bearer ").encode()
        return bool(header and header.startswith("Bearer ")) and hmac.compare_digest(given, self._token)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = IO_TIMEOUT
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's
                pass  # requests are not logged (nothing secret is in them, but a busy pod's log is for its trainer)

            def do_GET(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's names
                server.handle(self, "GET")

            def do_PUT(self) -> None:  # noqa: N802
                server.handle(self, "PUT")

        return Handler

    def handle(self, req: BaseHTTPRequestHandler, method: str) -> None:
        if not self.authorized(req.headers.get("Authorization")):
            return _reply(req, 403, "the job's token is required")
        if not self._slots.acquire(blocking=False):
            return _reply(req, 503, "busy")
        try:
            if method == "GET" and req.path == "/v1/index":
                return _reply(req, 200, _json(self.index()))
            m = _PATH_RE.match(req.path)
            if m is None:
                return _reply(req, 404, "no such path")
            rank, iteration = int(m.group(1)), int(m.group(2))
            if method == "GET":
                return self._send(req, rank, iteration)
            return self._receive(req, rank, iteration)
        except (OSError, CheckpointError, ValueError) as e:
            req.close_connection = True
            with contextlib.suppress(OSError):
                _reply(req, 400, f"{type(e).__name__}: {e}"[:300])
        finally:
            self._slots.release()

    def index(self) -> dict[str, list[int]]:
        """{rank: iterations} of the complete snapshots this pod holds (its ranks' own, and copies)."""
        out: dict[str, list[int]] = {}
        for kind in (recovery.MEMORY, recovery.PEER):
            base = self.root / ("own" if kind == recovery.MEMORY else "peers")
            with contextlib.suppress(OSError):
                for entry in sorted(base.iterdir()):
                    r = parse_rank_dir(entry.name)
                    if r is not None:
                        out.setdefault(str(r), []).extend(iterations(entry))
        return out

    def _send(self, req: BaseHTTPRequestHandler, rank: int, iteration: int) -> None:
        node = self.node
        own = node is not None and rank in node.ranks
        path = (own_dir(self.root, rank) if own else peer_dir(self.root, rank)) / snap_name(iteration)
        if not path.is_dir():
            return _reply(req, 404, f"no snapshot of rank {rank} at iteration {iteration}")
        with OpenSnapshot(path, rank=rank) as snap:
            head = _frame_head(snap.manifest)
            req.send_response(200)
            req.send_header("Content-Type", "application/octet-stream")
            req.send_header("Content-Length", str(len(head) + snap.manifest.nbytes))
            req.end_headers()
            req.wfile.write(head)
            for chunk in _file_chunks(snap):
                req.wfile.write(chunk)

    def _receive(self, req: BaseHTTPRequestHandler, rank: int, iteration: int) -> None:
        node = self.node
        if node is None or not node.may_hold(rank):
            return _reply(req, 403, f"this pod holds no copies of rank {rank}")
        length = int(req.headers.get("Content-Length") or -1)
        if length < 8:
            return _reply(req, 411, "a copy needs its Content-Length")
        body = _Body(req.rfile, length, time.monotonic() + DEADLINE)
        head_len = int.from_bytes(body.read_exact(8), "big")
        if head_len > MAX_MANIFEST:
            return _reply(req, 400, "manifest too large")
        manifest = parse_manifest(body.read_exact(head_len), f"the copy of rank {rank}")
        if (manifest.rank, manifest.iteration, manifest.world_size) != (rank, iteration, node.world_size) \
                or length != 8 + head_len + manifest.nbytes:
            return _reply(req, 400, "the manifest does not match the request (rank, iteration, world size, length)")
        with self._lock:
            parent = peer_dir(self.root, rank)
            freed = sum(volume_usage(parent / snap_name(it)) for it in iterations(parent)[:-1])  # write_snapshot's
            if volume_usage(self.root) - freed + manifest.nbytes > self.limit:
                return _reply(req, 507, f"no room for {manifest.nbytes} bytes in the memory volume")

            def receive(w: SnapshotWriter) -> None:
                for rel in sorted(manifest.files):
                    with w.open_write(rel) as f:
                        for piece in body.pieces(manifest.files[rel][0]):
                            f.write(piece)

            def check(written: dict) -> Manifest:
                if written != manifest.files:
                    raise CheckpointError(f"the copy of rank {rank} at {iteration} does not match its checksums")
                return manifest

            write_snapshot(parent, check, receive, iteration)
        _reply(req, 201, "stored")


class _Body:
    """A request body, read exactly, bounded by its length and a deadline."""

    def __init__(self, f, length: int, deadline: float):
        self.f, self.left, self.deadline = f, length, deadline

    def read_exact(self, n: int) -> bytes:
        if n > self.left:
            raise CheckpointError("the copy is shorter than its manifest says")
        out = bytearray()
        while len(out) < n:
            if time.monotonic() > self.deadline:
                raise CheckpointError("the copy took longer than its deadline")
            chunk = self.f.read(min(PIECE, n - len(out)))
            if not chunk:
                raise CheckpointError("the copy ended early")
            out += chunk
        self.left -= n
        return bytes(out)

    def pieces(self, n: int) -> Iterator[bytes]:
        while n:
            take = min(PIECE, n)
            yield self.read_exact(take)
            n -= take


def _reply(req: BaseHTTPRequestHandler, code: int, text: str) -> None:
    data = text.encode()
    req.send_response(code)
    req.send_header("Content-Type", "text/plain" if not text.startswith("{") else "application/json")
    req.send_header("Content-Length", str(len(data)))
    if code >= 400:
        req.send_header("Connection", "close")
        req.close_connection = True
    req.end_headers()
    req.wfile.write(data)


def _json(value: object) -> str:
    import json

    return json.dumps(value)


def _file_chunks(snap: OpenSnapshot) -> Iterator[bytearray]:
    for rel in sorted(snap.manifest.files):
        size, at = snap.size(rel), 0
        while at < size:
            take = min(PIECE, size - at)
            yield snap.read(rel, at, take)
            at += take


# -- sending ----------------------------------------------------------------------------------------


def push(address: str, token: str, snap: OpenSnapshot, deadline: float = DEADLINE) -> None:
    """Send `snap` to the agent at `address` (host:port). Raises OSError or CheckpointError when it fails."""
    host, _, port = address.rpartition(":")
    head = _frame_head(snap.manifest)
    m = snap.manifest
    conn = http.client.HTTPConnection(host, int(port), timeout=IO_TIMEOUT)
    end = time.monotonic() + deadline
    try:
        conn.putrequest("PUT", f"/v1/copy/{m.rank}/{m.iteration}")
        conn.putheader("Authorization", f"Bearer {token}")
        conn.putheader("Content-Length", str(len(head) + m.nbytes))
        conn.endheaders()
        try:
            conn.send(head)
            for chunk in _file_chunks(snap):
                if time.monotonic() > end:
                    raise CheckpointError(f"the copy to {address} took longer than {deadline:.0f} s")
                conn.send(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the receiver answered early (a refusal) and closed: its answer says why
        resp = conn.getresponse()
        text = resp.read(2000).decode(errors="replace")
        if resp.status != 201:
            raise CheckpointError(f"{address} refused the copy: {resp.status} {text}")
    finally:
        conn.close()


@dataclass
class Peers:
    """The agent's side of the copies: its server, and what it sends where (`new_round`, `poll`)."""

    root: Path
    token: str
    server: PeerServer
    host: str
    factor: int = recovery.DEFAULT_FACTOR
    jump: int = recovery.DEFAULT_JUMP
    node: Node | None = None
    addresses: dict[int, str] = field(default_factory=dict)
    sent: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, pod) -> newest iteration sent there
    store: Any = None
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    say: Callable[[str], None] = lambda line: print(f"kubetron.peers: {line}", file=sys.stderr, flush=True)

    def new_round(self, store: Any, node_rank: int, nnodes: int, ranks: list[int], world_size: int) -> None:
        """A rendezvous round formed: publish this agent's address, forget the previous round's."""
        self.node = self.server.node = Node(node_rank, nnodes, ranks, world_size, self.factor, self.jump)
        self.store, self.addresses = store, {}
        store.set(f"{ADDRESS_KEY}{node_rank}", f"{self.host}:{self.server.port}")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kubetron-peer-copies", daemon=True)
            self._thread.start()

    def learn_addresses(self) -> None:
        """The addresses of the pods this one sends to, once published (the agent's monitor loop calls it)."""
        node, store = self.node, self.store
        if node is None or store is None:
            return
        for pod in recovery.holders(node.node_rank, node.nnodes, self.factor, self.jump):
            key = f"{ADDRESS_KEY}{pod}"
            if pod not in self.addresses and store.check([key]):
                self.addresses[pod] = store.get(key).decode()

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            with contextlib.suppress(Exception):  # a failed copy is retried; the loop never stops for it
                self.poll()

    def poll(self) -> None:
        """Send each of this pod's ranks' newest snapshot to every pod that holds its copies and lacks it."""
        node = self.node
        if node is None:
            return
        holders = recovery.holders(node.node_rank, node.nnodes, self.factor, self.jump)
        for rank in node.ranks:
            newest = iterations(own_dir(self.root, rank))[-1:]
            if not newest:
                continue
            for pod in holders:
                address = self.addresses.get(pod)
                if address is None or self.sent.get((rank, pod), -1) >= newest[0]:
                    continue
                try:
                    with OpenSnapshot(own_dir(self.root, rank) / snap_name(newest[0]), rank=rank) as snap:
                        push(address, self.token, snap)
                    self.sent[(rank, pod)] = newest[0]
                except (OSError, CheckpointError) as e:
                    self.say(f"copy of rank {rank}'s snapshot {newest[0]} to pod {pod} failed: {e}"[:300])
            done = all(self.sent.get((rank, pod), -1) >= newest[0] for pod in holders)
            if done and (copied(own_dir(self.root, rank)) or -1) < newest[0]:
                mark_copied(own_dir(self.root, rank), newest[0])  # the rank's next snapshot may be taken

    def stop(self) -> None:
        self._stop.set()
        self.server.stop()


def from_env(env: dict[str, str] | os._Environ, nnodes: int) -> Peers | None:
    """This pod's agent side of the copies, or None: no memory volume, no token (the operator's per-job Secret),
    or a gang of one pod. Takes the token out of `env`, so the ranks the agent starts never see it."""
    token = env.pop(recovery.PEER_TOKEN_ENV, "")
    root = env.get(recovery.SNAPSHOT_DIR_ENV, "")
    if not root or not token or nnodes < 2:
        return None
    limit = int(env.get(recovery.SNAPSHOT_LIMIT_ENV) or 1 << 40)
    factor = int(env.get(recovery.REPLICATION_FACTOR_ENV) or recovery.DEFAULT_FACTOR)
    jump = int(env.get(recovery.REPLICATION_JUMP_ENV) or recovery.DEFAULT_JUMP)
    if factor < 2:
        return None
    host = env.get(recovery.POD_IP_ENV) or socket.gethostbyname(socket.gethostname())
    env[recovery.COPIES_ENV] = "1"  # its ranks pace their snapshots to the copies (checkpoint/snapshot.py)
    server = PeerServer(root, token, limit).start()
    peers = Peers(Path(root), token, server, host, factor, jump)
    peers.say(f"serving this pod's snapshots to the job's other pods on {host}:{server.port} (replication "
              f"factor {factor}, jump {jump})")
    return peers
