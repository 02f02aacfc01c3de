"""The storage layer on a real filesystem and a real S3 server (SeaweedFS), faults and SIGKILLs included."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from kubetron.contract.errors import CheckpointError
from kubetron.storage import MARKER, AsyncSaver, open_store
from kubetron.storage.s3 import S3Options, S3Store

from tests.faultproxy import FaultProxy

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
PART = 5 * MiB  # the smallest S3 part size: multipart paths run on a few MB


def s3_store(srv, endpoint: str | None = None, **opts) -> S3Store:
    o = S3Options(part_size=PART, concurrency=4)
    for k, v in opts.items():
        setattr(o, k, v)
    return open_store(
        f"s3://{srv.bucket}/{uuid.uuid4().hex[:10]}",
        endpoint_url=endpoint or srv.endpoint,
        access_key=srv.access_key,
        secret_key=srv.secret_key,
        region="us-east-1",
        s3_options=o,
    )


@pytest.fixture(params=["fs", "s3"])
def store(request, tmp_path):
    if request.param == "fs":
        st = open_store(str(tmp_path / "store"))
    else:
        st = s3_store(request.getfixturevalue("s3_server"))
    yield st
    st.close()


def blob(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


# -- objects ---------------------------------------------------------------------------------------------
def test_roundtrip_small_and_multipart(store):
    store.write_bytes("a/small.bin", b"hello")
    store.write_bytes("a/empty.bin", b"")
    big = blob(1, 40 * MiB + 123)
    with store.open_write("a/big.bin") as f:  # odd-sized writes: parts fill across write() calls
        for off in range(0, len(big), 3 * MiB + 7):
            f.write(memoryview(big)[off : off + 3 * MiB + 7])
        assert f.tell() == len(big)
    assert store.read_bytes("a/small.bin") == b"hello"
    assert store.read_bytes("a/empty.bin") == b""
    assert store.read_bytes("a/big.bin") == big
    with store.open_read("a/big.bin") as r:
        r.seek(10 * MiB)
        assert r.read(100) == big[10 * MiB : 10 * MiB + 100]
        assert r.tell() == 10 * MiB + 100
        r.seek(-5, io.SEEK_END)
        assert r.read() == big[-5:]
    store.write_bytes("a/big2.bin", big)  # one write much larger than a part
    assert hashlib.sha256(store.read_bytes("a/big2.bin")).digest() == hashlib.sha256(big).digest()
    with pytest.raises(FileNotFoundError):
        store.read_bytes("a/missing")
    with pytest.raises(ValueError):
        store.write_bytes("../escape", b"x")


def test_torch_save_load(store):
    state = {"w": torch.randn(600, 1000), "b": torch.arange(10), "step": 7, "nested": {"lr": 0.1}}
    with store.open_write("iter_0000001/model.pt") as f:
        torch.save(state, f)  # ~2.4 MB... plus a multipart-sized one below
    big = {"t": torch.randn(3 * 1024 * 1024)}  # 12 MiB: three parts on S3
    with store.open_write("iter_0000001/big.pt") as f:
        torch.save(big, f)
    with store.open_read("iter_0000001/model.pt") as f:
        got = torch.load(f, weights_only=True)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert got["step"] == 7 and got["nested"] == {"lr": 0.1}
    with store.open_read("iter_0000001/big.pt") as f:
        assert torch.equal(torch.load(f, weights_only=True)["t"], big["t"])


def test_failed_write_leaves_nothing(store):
    with pytest.raises(RuntimeError, match="boom"), store.open_write("x/part.bin") as f:
        f.write(blob(2, 12 * MiB))  # two parts already uploading on S3
        raise RuntimeError("boom")
    assert not store.exists("x/part.bin")
    assert store.list() == []
    if isinstance(store, S3Store):  # the multipart upload was aborted, not left dangling
        ups = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix).get("Uploads", [])
        assert ups == []


def test_list_dirs_delete_prefix_append(store):
    for k in (
        "iter_0000001/a",
        "iter_0000001/sub/b",
        "iter_0000002/a",
        "non_persistent/iter_0000003/a",
        "top",
    ):
        store.write_bytes(k, k.encode())
    assert store.list() == sorted(
        ["iter_0000001/a", "iter_0000001/sub/b", "iter_0000002/a", "non_persistent/iter_0000003/a", "top"]
    )
    assert store.list("iter_0000001") == ["iter_0000001/a", "iter_0000001/sub/b"]
    assert store.list("iter_0000001/") == store.list("iter_0000001")
    assert store.list_dirs() == ["iter_0000001", "iter_0000002", "non_persistent"]
    assert store.list_dirs("non_persistent/") == ["iter_0000003"]
    assert store.list_dirs("nothing") == [] and store.list("nothing") == []
    store.delete_prefix("iter_0000001/")
    store.delete_prefix("top")
    store.delete_prefix("not/there")
    assert store.list() == ["iter_0000002/a", "non_persistent/iter_0000003/a"]
    with pytest.raises(ValueError):
        store.delete_prefix("")
    for i in range(3):
        store.append_line("progress.txt", f"line {i}")
    assert store.read_bytes("progress.txt").decode().splitlines() == ["line 0", "line 1", "line 2"]
    store.replace_tracker("latest_train_state.pt", b"one")
    store.replace_tracker("latest_train_state.pt", b"two")
    assert store.read_bytes("latest_train_state.pt") == b"two"


# -- checkpoint directories ------------------------------------------------------------------------------
def test_txn_commit_abort_and_invisible(store):
    txn = store.begin_dir("iter_0000010")
    txn.write_bytes("common.pt", b"common")
    with txn.open_write("model/rank0.pt") as f:
        f.write(blob(3, 7 * MiB))
    assert not store.committed("iter_0000010")
    if not store.is_remote:  # a filesystem txn is a hidden temp dir until commit
        assert store.list_dirs() == [] and store.list() == []
    txn.commit(b'{"iteration": 10}')
    assert store.committed("iter_0000010")
    assert store.list("iter_0000010") == [
        "iter_0000010/common.pt", f"iter_0000010/{MARKER}", "iter_0000010/model/rank0.pt",
    ]  # fmt: skip
    assert store.read_bytes("iter_0000010/model/rank0.pt") == blob(3, 7 * MiB)
    with pytest.raises(CheckpointError):
        txn.commit(b"{}")  # a txn commits once

    t2 = store.begin_dir("iter_0000020")
    t2.write_bytes("common.pt", b"x")
    t2.abort()
    assert not store.committed("iter_0000020")
    assert store.list("iter_0000020") == []
    with pytest.raises(RuntimeError), store.begin_dir("iter_0000030") as t3:  # context manager aborts
        t3.write_bytes("common.pt", b"x")
        raise RuntimeError
    assert not store.committed("iter_0000030") and store.list("iter_0000030") == []


def test_txn_with_failed_write_refuses_commit(store):
    txn = store.begin_dir("iter_0000005")
    txn.write_bytes("ok.pt", b"ok")
    with pytest.raises(RuntimeError), txn.open_write("bad.pt") as f:
        f.write(b"partial")
        raise RuntimeError("serialization failed")
    with pytest.raises(CheckpointError, match="bad.pt"):
        txn.commit(b"{}")
    assert not store.committed("iter_0000005")


def test_replace_existing_dir(store):
    t1 = store.begin_dir("iter_0000007")
    t1.write_bytes("a.pt", b"old-a")
    t1.write_bytes("only_old.pt", b"old")
    t1.commit(b"old")
    t2 = store.begin_dir("iter_0000007")
    t2.write_bytes("a.pt", b"new-a")
    if not store.is_remote:  # the old copy stays complete and visible until the new one is in place
        assert store.committed("iter_0000007") and store.read_bytes("iter_0000007/a.pt") == b"old-a"
    t2.commit(b"new")
    assert store.read_bytes(f"iter_0000007/{MARKER}") == b"new"
    assert store.list("iter_0000007") == ["iter_0000007/a.pt", f"iter_0000007/{MARKER}"]
    assert store.read_bytes("iter_0000007/a.pt") == b"new-a"
    assert store.cleanup_partial() == []


def test_multirank_txn(store):
    """Two 'ranks' share one txn id; only the primary commits, after both wrote."""
    tid = f"run-{uuid.uuid4().hex[:8]}-12"
    r0 = store.begin_dir("iter_0000012", txn_id=tid, primary=True)
    r1 = store.begin_dir("iter_0000012", txn_id=tid, primary=False)
    r1.write_bytes("model_rank1.pt", b"rank1")
    r0.write_bytes("model_rank0.pt", b"rank0")
    with pytest.raises(CheckpointError, match="primary"):
        r1.commit(b"{}")
    assert not store.committed("iter_0000012")
    r0.commit(b"{}")
    assert store.list("iter_0000012") == [
        f"iter_0000012/{MARKER}", "iter_0000012/model_rank0.pt", "iter_0000012/model_rank1.pt",
    ]  # fmt: skip


def test_a_shared_resave_keeps_every_ranks_new_files_and_drops_what_an_older_attempt_left(store):
    """A save of an iteration a killed attempt had begun: rank 1 (not the primary) wrote its files then, rank 0 never
    began. The gang started again (cleanup_partial), and saves it anew: rank 1 rewrites its files before and after
    the primary began, as the ranks' background writers happen to run. Every file of this save is there after the
    commit, and nothing else (the chaos soak once lost a shard so: the primary deleted, as old, a key that rank 1
    rewrote just after the primary listed it; every resume then failed on the missing shard)."""
    tid = "run-7f3a-60"
    killed = store.begin_dir("iter_0000060", txn_id=tid, primary=False)
    for key, data in (("rng/rank_00001.pt", b"old rng"), ("shards/rank_00001.json", b"old shard"),
                      ("shards/rank_00003.json", b"a rank of an older world size")):
        killed.write_bytes(key, data)
    store.cleanup_partial()  # what every gang's start does (it finds no pending flag on S3: rank 0 never began)
    r1 = store.begin_dir("iter_0000060", txn_id=tid, primary=False)
    r1.write_bytes("rng/rank_00001.pt", b"rng 1")
    r0 = store.begin_dir("iter_0000060", txn_id=tid, primary=True)
    r1.write_bytes("shards/rank_00001.json", b"shard 1")
    r0.write_bytes("shards/rank_00000.json", b"shard 0")
    removed = r0.sweep([*r0.written, *r1.written])  # after the barrier: every rank's writes are done
    r0.commit(b"{}")
    assert store.list("iter_0000060") == [
        f"iter_0000060/{MARKER}", "iter_0000060/rng/rank_00001.pt", "iter_0000060/shards/rank_00000.json",
        "iter_0000060/shards/rank_00001.json"]
    assert [store.read_bytes(f"iter_0000060/{k}") for k in ("rng/rank_00001.pt", "shards/rank_00001.json")] == [
        b"rng 1", b"shard 1"]
    assert removed == (["shards/rank_00003.json"] if store.is_remote else [])  # a filesystem's temp dir went whole


def test_cleanup_partial(store):
    done = store.begin_dir("iter_0000001")
    done.write_bytes("a", b"a")
    done.commit(b"{}")
    stale = store.begin_dir("iter_0000002")  # a killed save: never committed, never aborted
    stale.write_bytes("a", b"a")
    assert not store.committed("iter_0000002")
    removed = store.cleanup_partial()
    assert removed, "the stale transaction should have been removed"
    assert store.list_dirs() == ["iter_0000001"] and store.committed("iter_0000001")
    assert store.cleanup_partial() == []


def test_fs_replace_without_rename_exchange(tmp_path, monkeypatch):
    """Filesystems without renameat2(RENAME_EXCHANGE) take the two-rename path."""
    from kubetron.storage import local

    monkeypatch.setattr(local, "_exchange", lambda a, b: False)
    st = open_store(str(tmp_path))
    for content in (b"old", b"new"):
        t = st.begin_dir("iter_0000004")
        t.write_bytes("a", content)
        t.commit(content)
    assert st.read_bytes("iter_0000004/a") == b"new" and st.read_bytes(f"iter_0000004/{MARKER}") == b"new"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004"]


def test_fs_crash_mid_replace_is_recovered(tmp_path):
    """A crash between the two renames of a (fallback) replace: cleanup puts the complete copy back."""
    st = open_store(str(tmp_path))
    t = st.begin_dir("iter_0000003", txn_id="abc")
    t.write_bytes("a", b"new")
    t.commit(b"{}")
    # simulate: old copy moved away, new (complete) copy still in its temp dir, final name missing
    os.rename(tmp_path / "iter_0000003", tmp_path / ".iter_0000003.tmp-abc")
    assert st.list_dirs() == [] and not st.committed("iter_0000003")
    st.cleanup_partial()
    assert st.committed("iter_0000003") and st.read_bytes("iter_0000003/a") == b"new"


# -- async saves -----------------------------------------------------------------------------------------
def test_async_saver_order_and_errors():
    log: list[str] = []
    gate = threading.Event()
    saver = AsyncSaver(max_pending=2)

    def slow(i):
        def fn():
            gate.wait(5)
            log.append(f"fn{i}")

        return fn

    saver.schedule(slow(1), lambda: log.append("fin1"))
    saver.schedule(slow(2), lambda: log.append("fin2"))
    assert saver.maybe_finalize() == 0 and log == []  # nothing finished: the tracker must not move
    gate.set()
    deadline = time.monotonic() + 10
    while len(log) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert log == ["fn1", "fn2"]  # done in the background, but finalize waits for the caller
    assert saver.maybe_finalize() == 2 and log == ["fn1", "fn2", "fin1", "fin2"]

    def bad():
        raise CheckpointError("upload of s3://b/iter_0000003/model.pt failed")

    saver.schedule(bad, lambda: log.append("fin3"))
    saver.schedule(lambda: log.append("fn4"), lambda: log.append("fin4"))
    with pytest.raises(CheckpointError, match="iter_0000003"):
        saver.maybe_finalize(blocking=True)
    assert "fin3" not in log and saver.pending == 1  # the failed save never finalizes
    saver.maybe_finalize(blocking=True)
    assert log[-2:] == ["fn4", "fin4"]
    saver.schedule(lambda: log.append("fn5"), lambda: log.append("fin5"))
    saver.close()  # finalizes what is pending
    assert log[-2:] == ["fn5", "fin5"]


def test_async_saver_overlaps_and_bounds_pending(tmp_path):
    st = open_store(str(tmp_path))
    saver = AsyncSaver()  # max_pending=1: a second schedule first finalizes the first save
    state = {"w": torch.randn(1024 * 1024)}
    gate = threading.Event()
    done = []

    def first():
        assert gate.wait(10), "the caller was blocked by the background save"
        buf = io.BytesIO()
        torch.save(state, buf)
        st.write_bytes("a.pt", buf.getvalue())

    saver.schedule(first, lambda: done.append("a"))
    assert done == [] and saver.pending == 1  # schedule returned while the save cannot finish yet
    assert saver.maybe_finalize() == 0
    gate.set()
    saver.schedule(lambda: st.write_bytes("b.pt", b"b"), lambda: done.append("b"))
    assert done == ["a"]  # the first save was finalized to make room
    saver.close()
    assert done == ["a", "b"] and st.exists("a.pt") and st.exists("b.pt")


# -- faults ----------------------------------------------------------------------------------------------
def _save_iteration(st, it: int, sizes=(6 * MiB + 1, 1000, 11 * MiB)) -> dict[str, str]:
    txn = st.begin_dir(f"iter_{it:07d}")
    digests = {}
    for j, n in enumerate(sizes):
        data = blob(it * 100 + j, n)
        with txn.open_write(f"f{j}.bin") as f:
            f.write(data)
        digests[f"f{j}.bin"] = hashlib.sha256(data).hexdigest()
    txn.commit(json.dumps(digests).encode())
    return digests


def _assert_committed_complete(st) -> int:
    """Every committed iteration holds exactly the bytes its marker lists. Returns how many."""
    n = 0
    for d in st.list_dirs():
        if not st.committed(d):
            continue
        want = json.loads(st.read_bytes(f"{d}/{MARKER}"))
        for name, digest in want.items():
            assert hashlib.sha256(st.read_bytes(f"{d}/{name}")).hexdigest() == digest, f"{d}/{name}"
        n += 1
    return n


def test_s3_faults_retried(s3_server):
    with FaultProxy(
        s3_server.endpoint, p_503=0.05, p_reset=0.05, p_reset_after=0.05, p_delay=0.03, delay_s=1.2, seed=3
    ) as px:
        st = s3_store(s3_server, px.endpoint, read_timeout=1.0, connect_timeout=2.0)
        for it in (1, 2, 3):
            _save_iteration(st, it, sizes=(6 * MiB + 1, 1000, 300_000))
        st.replace_tracker("latest_train_state.pt", b"3")
        st.append_line("progress.txt", "saved 3")
        for it in (1, 2, 3):  # reading back through the faulty proxy too
            assert st.committed(f"iter_{it:07d}")
        n_faulty = _assert_committed_complete(st)
        faults = px.stats["503"] + px.stats["reset"] + px.stats["reset_after"] + px.stats["delay"]
    direct = s3_store(s3_server)
    direct.prefix = st.prefix  # the same objects, read without the proxy
    assert n_faulty == 3 and _assert_committed_complete(direct) == 3
    assert direct.read_bytes("latest_train_state.pt") == b"3"
    assert faults >= 2, px.stats  # ~12 expected; the point is that the saves survived them


def test_s3_lost_complete_response_is_handled(s3_server):
    """CompleteMultipartUpload succeeds but its answer is lost: the retry sees NoSuchUpload; still fine."""
    seen = []

    def first_complete(method, path):
        if method == "POST" and "uploadId=" in path and not seen:
            seen.append(path)
            return True
        return False

    with FaultProxy(s3_server.endpoint, p_reset_after=1.0, match=first_complete) as px:
        st = s3_store(s3_server, px.endpoint)
        data = blob(9, 12 * MiB)
        st.write_bytes("obj.bin", data)
        assert px.stats["reset_after"] == 1
        assert st.read_bytes("obj.bin") == data


def test_s3_store_away_for_a_while_is_waited_out_and_one_away_longer_fails_loudly(s3_server):
    """A store that answers every request 503 for longer than botocore's retries last (a restart, a failover;
    they give up after 5-20 s, at once once their retry quota is spent) is waited out for outage_seconds, as the
    chaos soak's store outage of tens of seconds during a save needs; one away longer than that fails, naming the
    object."""
    with FaultProxy(s3_server.endpoint, p_503=1.0) as px:
        st = s3_store(s3_server, px.endpoint, max_attempts=1, outer_attempts=1, outage_seconds=30)
        heal = threading.Timer(2.0, px.set, kwargs={"p_503": 0.0})
        heal.start()
        t0 = time.monotonic()
        st.write_bytes("obj.bin", b"saved")
        assert time.monotonic() - t0 >= 1.5 and px.stats["503"] >= 2
        assert st.read_bytes("obj.bin") == b"saved"
        px.set(p_503=1.0)
        short = s3_store(s3_server, px.endpoint, max_attempts=1, outer_attempts=1, outage_seconds=1.0)
        short.prefix = st.prefix
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match=r"obj\.bin: "):
            short.read_bytes("obj.bin")
        assert 1.0 <= time.monotonic() - t0 < 10


def test_s3_persistent_failure_is_loud_and_never_committed(s3_server):
    def part_uploads(method, path):
        return method == "PUT" and "partNumber=" in path

    with FaultProxy(s3_server.endpoint, p_503=1.0, match=part_uploads) as px:
        st = s3_store(s3_server, px.endpoint, max_attempts=2, outer_attempts=1, outage_seconds=0)
        _save_iteration(st, 1, sizes=(1000,))  # small objects: single PUTs, unaffected
        txn = st.begin_dir("iter_0000002")
        txn.write_bytes("small.bin", b"fine")
        with pytest.raises(CheckpointError, match=r"iter_0000002/big\.bin"), txn.open_write("big.bin") as f:
            f.write(blob(5, 12 * MiB))
        with pytest.raises(CheckpointError):
            txn.commit(b"{}")
        assert px.stats["503"] >= 2
        assert st.committed("iter_0000001") and not st.committed("iter_0000002")
        assert not st.exists("iter_0000002/big.bin")
        ups = st.client.list_multipart_uploads(Bucket=st.bucket, Prefix=st.prefix).get("Uploads", [])
        assert ups == []  # aborted
        txn.abort()
        assert st.list("iter_0000002") == []


# -- SIGKILL mid-save ------------------------------------------------------------------------------------
CHILD = r"""
import hashlib, json, random, sys, time
from kubetron.storage import open_store
from kubetron.storage.s3 import S3Options
st = open_store(sys.argv[1], s3_options=S3Options(part_size=5 << 20, concurrency=4))
for it in range(int(sys.argv[2]), 10_000):
    txn = st.begin_dir(f"iter_{it:07d}", txn_id=f"kill-{it}")
    digests = {}
    for j, n in enumerate((1 << 20, 6 << 20)):
        data = random.Random(it * 100 + j).randbytes(n)
        with txn.open_write(f"f{j}.bin") as f:
            for off in range(0, n, 1 << 20):
                f.write(data[off : off + (1 << 20)])
                print(f"write {it} {j} {off}", flush=True)
                sys.stdin.readline()  # the test's go-ahead: it kills here instead when this is its point
        digests[f"f{j}.bin"] = hashlib.sha256(data).hexdigest()
    print(f"commit {it}", flush=True)
    txn.commit(json.dumps(digests).encode())
    st.replace_tracker("latest", str(it).encode())
    print(f"committed {it}", flush=True)
"""


def _run_and_kill(url: str, env: dict, start: int, kill_at: str) -> None:
    """Run CHILD and SIGKILL it at the line `kill_at`. After each `write` line the child waits for a go-ahead,
    so a kill at a write lands exactly there however late this reader runs (a loaded machine once let the
    child commit the save it was to be killed in); `commit` lines do not wait: that point is racy on purpose."""
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, str(start)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        for line in p.stdout:
            if line.startswith(kill_at):
                os.kill(p.pid, signal.SIGKILL)
                break
            if line.startswith("write "):
                p.stdin.write("\n")
                p.stdin.flush()
            assert time.monotonic() < deadline
        else:
            pytest.fail(f"child ended before {kill_at!r}: {p.stderr.read()[-2000:]}")
    finally:
        p.kill()
        p.wait()
        for f in (p.stdin, p.stdout, p.stderr):
            f.close()


@pytest.mark.parametrize("backend", ["fs", "s3"])
@pytest.mark.process
def test_sigkill_mid_save_never_commits_partial(backend, tmp_path, request):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = str(ROOT / "trainer")
    if backend == "fs":
        url = str(tmp_path / "store")
    else:
        srv = request.getfixturevalue("s3_server")
        env.update(srv.env())
        url = f"s3://{srv.bucket}/kill-{uuid.uuid4().hex[:8]}"
    # kill points: mid-part of a multipart file; at the commit (before/in/after it: racy on purpose);
    # at the very first write of a save
    _run_and_kill(url, env, 0, "write 1 1 5242880")
    _run_and_kill(url, env, 2, "commit 2")
    _run_and_kill(url, env, 3, "write 3 0 0")

    st = (
        open_store(url)
        if backend == "fs"
        else open_store(url, endpoint_url=srv.endpoint, access_key=srv.access_key, secret_key=srv.secret_key)
    )
    assert st.committed("iter_0000000")
    assert not st.committed("iter_0000001") and not st.committed("iter_0000003")
    before = {d for d in st.list_dirs() if st.committed(d)}
    n = _assert_committed_complete(st)
    assert n in (1, 2)  # iter 2 was killed right at its commit: either outcome, never a partial one
    st.cleanup_partial()
    dirs = st.list_dirs()
    assert all(st.committed(d) for d in dirs), dirs
    # cleanup never loses a committed iteration; on a filesystem it may finish iter 2's commit when the
    # kill fell between the marker (written last, so the copy is complete) and the rename into place
    after = set(dirs)
    assert before <= after <= {"iter_0000000", "iter_0000002"}, (before, after)
    assert _assert_committed_complete(st) == len(after)
    if backend == "s3":
        assert after == before  # S3's commit is the marker itself: nothing to finish
    if backend == "fs":
        assert not [p for p in Path(url).rglob("*") if ".tmp-" in p.name]
