"""Copies of memory snapshots on peer pods (kubetron.supervisor.peers, docs/recovery.md), in process: two pods' agents'
servers on localhost. A copy arrives whole and checked or not at all; only the job's token reads or writes;
a pod takes copies only of the ranks it holds copies of, and never more than its memory volume holds."""

from __future__ import annotations

import http.client
import json
import os

import pytest
from kubetron.contract.errors import CheckpointError
from kubetron.storage import snapshot_files as sf
from kubetron.supervisor import peers

from tests.ckpt_utils import write_snapshot as write

pytestmark = pytest.mark.unit

TOKEN = "job-a-token"


@pytest.fixture
def pods(tmp_path):
    """Two pods of a 2-pod, 2-rank gang (one rank each): pod 1 holds pod 0's copies and pod 0 pod 1's."""
    servers = []
    for pod in (0, 1):
        server = peers.PeerServer(tmp_path / f"pod{pod}", TOKEN, limit=1 << 20, host="127.0.0.1").start()
        server.node = peers.Node(pod, 2, [pod], 2)
        servers.append(server)
    yield servers
    for server in servers:
        server.stop()


def request(server, method: str, path: str, token: str | None = TOKEN, body: bytes = b"") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def stream(snap_dir) -> bytes:
    with sf.OpenSnapshot(snap_dir) as snap:
        return peers._frame_head(snap.manifest) + b"".join(peers._file_chunks(snap))


def test_a_snapshot_pushed_to_its_holder_arrives_whole_and_reads_back(tmp_path, pods):
    src = write(sf.own_dir(tmp_path / "pod0", 0), 20, payload=os.urandom(5000))
    with sf.OpenSnapshot(src) as snap:
        peers.push(f"127.0.0.1:{pods[1].port}", TOKEN, snap)
    copy = sf.peer_dir(tmp_path / "pod1", 0) / "snap_0000020"
    with sf.OpenSnapshot(copy, rank=0, world_size=2) as snap:
        snap.verify()
    assert (copy / "shards/rank_00000.bin").read_bytes() == (src / "shards/rank_00000.bin").read_bytes()
    assert request(pods[1], "GET", "/v1/copy/0/20") == (200, stream(src))
    assert json.loads(request(pods[1], "GET", "/v1/index")[1]) == {"0": [20]}


def test_only_the_jobs_token_reads_or_writes_a_copy(tmp_path, pods):
    src = write(sf.own_dir(tmp_path / "pod0", 0), 20)
    body = stream(src)
    for token in (None, "job-b-token", TOKEN + "x", ""):
        assert request(pods[1], "PUT", "/v1/copy/0/20", token, body)[0] == 403
        assert request(pods[1], "GET", "/v1/index", token)[0] == 403
        assert request(pods[0], "GET", "/v1/copy/0/20", token)[0] == 403
    with sf.OpenSnapshot(src) as snap, pytest.raises(CheckpointError, match="403"):
        peers.push(f"127.0.0.1:{pods[1].port}", "job-b-token", snap)
    assert not sf.peer_dir(tmp_path / "pod1", 0).exists()


def test_a_copy_that_is_not_whole_and_right_is_never_visible(tmp_path, pods):
    src = write(sf.own_dir(tmp_path / "pod0", 0), 20, payload=b"a" * 3000)
    body = bytearray(stream(src))
    body[-20] ^= 1  # a byte changed in transit: its chunk's digest differs
    assert request(pods[1], "PUT", "/v1/copy/0/20", TOKEN, bytes(body))[0] == 400
    assert request(pods[1], "PUT", "/v1/copy/0/30", TOKEN, stream(src))[0] == 400  # the manifest says 20
    conn = http.client.HTTPConnection("127.0.0.1", pods[1].port, timeout=10)  # a sender that dies half-way
    conn.putrequest("PUT", "/v1/copy/0/20")
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders()
    conn.send(bytes(body[:len(body) // 2]))
    conn.close()
    assert pods[1].wait_idle(timeout=30)  # the server has seen that request end
    assert sf.iterations(sf.peer_dir(tmp_path / "pod1", 0)) == []
    assert [p.name for p in sf.peer_dir(tmp_path / "pod1", 0).iterdir()] == []


def test_a_pod_takes_only_its_peers_copies_within_its_memory_volume(tmp_path, pods):
    own = write(sf.own_dir(tmp_path / "pod1", 1), 20, rank=1)
    assert request(pods[1], "PUT", "/v1/copy/1/20", TOKEN, stream(own))[0] == 403  # its own rank: not a copy
    big = write(sf.own_dir(tmp_path / "pod0", 0), 30, payload=b"z" * (2 << 20))
    status, text = request(pods[1], "PUT", "/v1/copy/0/30", TOKEN, stream(big))
    assert status == 507 and b"no room" in text
    assert sf.iterations(sf.peer_dir(tmp_path / "pod1", 0)) == []


def test_the_agent_sends_each_new_snapshot_once_to_the_pods_that_hold_its_copies(tmp_path, pods):
    lines: list[str] = []
    agent = peers.Peers(tmp_path / "pod0", TOKEN, pods[0], "127.0.0.1", say=lines.append)
    agent.node = peers.Node(0, 2, [0], 2)
    agent.addresses = {1: f"127.0.0.1:{pods[1].port}"}
    write(sf.own_dir(tmp_path / "pod0", 0), 10)
    write(sf.own_dir(tmp_path / "pod0", 0), 20)
    agent.poll()
    assert sf.iterations(sf.peer_dir(tmp_path / "pod1", 0)) == [20] and agent.sent == {(0, 1): 20}
    assert sf.copied(sf.own_dir(tmp_path / "pod0", 0)) == 20  # the rank may take its next snapshot
    (sf.peer_dir(tmp_path / "pod1", 0) / "snap_0000020" / "rng.pt").write_bytes(b"gone")
    agent.poll()  # nothing new: not sent again
    assert (sf.peer_dir(tmp_path / "pod1", 0) / "snap_0000020" / "rng.pt").read_bytes() == b"gone"
    write(sf.own_dir(tmp_path / "pod0", 0), 30)
    agent.poll()
    assert sf.iterations(sf.peer_dir(tmp_path / "pod1", 0)) == [20, 30] and not lines
    agent.addresses = {1: "127.0.0.1:1"}  # a holder that is gone: one line, retried at the next poll
    write(sf.own_dir(tmp_path / "pod0", 0), 40)
    agent.sent.clear()
    agent.poll()
    assert len(lines) == 1 and "copy of rank 0's snapshot 40 to pod 1 failed" in lines[0] and TOKEN not in lines[0]


def test_a_peer_gone_mid_request_leaves_no_traceback_in_the_pods_log(pods, capsys, caplog):
    """A pod deleted while it sent a copy resets its connection: the holder's agent says so in one debug line, and
    prints no traceback into its pod's log (the log is the trainer's)."""
    import socket
    import struct
    import threading

    server = pods[1].httpd
    handled = threading.Event()
    original = server.handle_error

    def handle_error(request, client_address):
        try:
            original(request, client_address)
        finally:
            handled.set()

    server.handle_error = handle_error
    with caplog.at_level("DEBUG", logger="kubetron.peers"):
        with socket.create_connection(("127.0.0.1", pods[1].port)) as sock:
            sock.sendall(b"PUT /v1/copy/0/20 HTT")  # the request line not even whole
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # closed with a reset
        assert handled.wait(10)
    assert capsys.readouterr().err == ""
    assert "ended early: ConnectionResetError" in caplog.text
