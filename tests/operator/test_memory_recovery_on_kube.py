"""Recovery from memory on the real control plane (docs/recovery.md), as users run jobs: one 2-pod job of the tiny
GPT with memory snapshots (its pods' exact commands run as local processes; the test plays the kubelet,
tests/operator/local_pods.py: each pod's memory volume is a directory that outlives its processes and goes with
the pod), through three recoveries in one run:

1. rank 1's trainer SIGKILLed: the gang restarts in place from the pods' own memory (status.lastRecovery
   loadedFrom memory, kind inPlace);
2. pod 1 deleted at once (grace 0, as a lost node leaves it): the operator creates it again in the same attempt and
   the gang resumes, rank 1 from the copy pod 0's agent holds (loadedFrom peer, kind podReplaced);
3. another job's token (drawn as the operator draws every job's), and no token at all, against both pods'
   agents: refused, to read a copy or the list of them as to write a copy, and the copy is not written;
4. every snapshot of rank 1, its own and the copies pod 0 holds, corrupted (bytes flipped in the newest, the older
   cut short), then rank 1's trainer SIGKILLed: the gang resumes in place from the store's checkpoint (loadedFrom
   store, the reason naming the snapshot and what is wrong with it), and a Warning event RecoveredFromStore on the
   job says why;
each time the iterations between the state resumed from and the kill run again to the losses they had the first
time (the uninterrupted run's). Each kill comes while rank 1's trainer is stopped (SIGSTOP: the gang waits for it,
nothing new is saved) at a moment the snapshots to be loaded are at least as new as the store's checkpoint (every
SAVE_INTERVAL iterations; the tiny GPT runs dozens a second): a snapshot older than the store is never loaded.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import re
import secrets
import time
from pathlib import Path

import psutil
import pytest
from kubetron.checkpoint.layout import committed_iterations
from kubetron.contract.errors import CheckpointError
from kubetron.contract.recovery import PEER_TOKEN_KEY
from kubetron.storage import open_store
from kubetron.storage import snapshot_files as sf
from kubetron.supervisor import peers

from tests.kube.cluster import free_port, pod_path
from tests.operator.jobs import PVC_JOB, job_body
from tests.operator.local_pods import ProcessKubelet, pinned, pool, pvc, tiny_config
from tests.trainer_utils import ITER_RE, LOSS_RE

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]
RANK1 = "gpt-1-1"  # attempt 1's pod 1
SAVE_INTERVAL = 50  # the store's (a snapshot's iteration is a multiple of 3: 50 and 100 are the store's alone)
AGENT_RE = re.compile(r"kubetron\.peers: serving this pod's snapshots .* on (\S+:\d+) ")
FORGED = 9_999_999  # the iteration of the copy another job's pod tries to write


def losses(lines: list[str]) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for m in map(LOSS_RE.search, lines) if m]


def newest(lines: list[str]) -> int:
    return max([int(m.group(1)) for m in map(ITER_RE.search, lines) if m] or [0])


def ran_again_the_same(lines: list[str], resumed: int, reached: int) -> None:
    """Every iteration after the snapshot resumed from, up to where the gang was at the kill, logged twice, the
    second time to the loss of the first."""
    first: dict[int, str] = {}
    again: set[int] = set()
    for it, loss in losses(lines):
        if it in first:
            assert first[it] == loss, f"iteration {it}: loss {loss}, the first time {first[it]}"
            again.add(it)
        first.setdefault(it, loss)
    assert set(range(resumed + 1, reached + 1)) <= again, (resumed, reached, sorted(again))


def ahead_of_store(durable, *dirs: Path) -> int | None:
    """The newest iteration every one of `dirs` holds a snapshot of, when it is not older than the store's newest
    checkpoint (what the gang would load from memory), else None."""
    common = set.intersection(*(set(sf.iterations(d)) for d in dirs))
    newest_common = max(common, default=-1)
    return newest_common if newest_common >= max(committed_iterations(durable), default=0) else None


def token(api, ns: str, job: str) -> str:
    """The job's peer token, from the Secret the operator drew it into (as its pods' env holds it)."""
    secret = api.get(f"/api/v1/namespaces/{ns}/secrets/{job}-peers")
    return base64.b64decode(secret["data"][PEER_TOKEN_KEY]).decode()


def agent(lines: list[str]) -> str:
    """host:port of the pod's agent, as its log says where it serves the pod's snapshots."""
    found = [m.group(1) for m in map(AGENT_RE.search, lines) if m]
    assert found, "no line of the pod's agent saying where it serves"
    return found[-1]


def ask(address: str, method: str, path: str, bearer: str | None) -> int:
    """The HTTP status an agent answers a request (no body) with."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {bearer}"} if bearer is not None else {})
        return conn.getresponse().status
    finally:
        conn.close()


def forged_copy(where: Path) -> Path:
    """A snapshot of rank 1 of a gang of 2, at iteration FORGED: what another job's pod would slip in."""
    def manifest(written: dict) -> sf.Manifest:
        return sf.Manifest(FORGED, 1, 2, written)
    return sf.write_snapshot(where, manifest, lambda w: w.write_bytes(sf.COMMON_FILE, b"forged"), FORGED)


def corrupt(parent: Path) -> list[int]:
    """Every complete snapshot in `parent` spoiled where its checks must find it: bytes flipped in the newest's
    files, the older ones' files cut to half; the iterations spoiled."""
    its = sf.iterations(parent)
    for it in its:
        for f in (parent / sf.snap_name(it)).rglob("*"):
            if f.is_file() and f.name != sf.MANIFEST:
                with contextlib.suppress(FileNotFoundError):  # a copy of pod 0's pruned by one arriving
                    data = f.read_bytes()
                    f.write_bytes(bytes(b ^ 0xFF for b in data[:64]) + data[64:] if it == its[-1]
                                  else data[:len(data) // 2])
    return its


def test_a_killed_rank_resumes_from_memory_and_a_lost_pod_from_its_peers_copy(kube, kube_ns, tmp_path):
    ns, api = kube_ns, kube.admin
    store = tmp_path / "pvc"
    store.mkdir()
    pvc(kube, ns, store)
    body = job_body(PVC_JOB, nodes=2, config=tiny_config(train_iters=100_000, save_interval=SAVE_INTERVAL),
                    storage={"pvc": {"claimName": "ckpt", "mountPath": str(store)}},
                    statusPort=free_port(), masterPort=free_port(), maxInPlaceRestarts=3,
                    overrides=["checkpoint.non_persistent_save_interval=3"], **pinned(ns))
    body["metadata"] = {"name": "gpt"}
    durable = open_store(store / "gpt")  # the job's store on the PVC (checkpoint.save)
    t_start = time.monotonic()
    with pool(api, ns, 2) as names, kube.operator(ns), ProcessKubelet(api, ns, tmp_path / "pods", nodes=names) as pods:
        api.create(kube.jobs(ns), body)

        def explain() -> str:
            (tmp_path / "pods.log").write_text("\n".join(f"--- {n}\n" + "".join(c.lines) for n, c in
                                                         pods.containers.items()))
            return f"(every pod's log: {tmp_path / 'pods.log'})\n" + "\n".join(
                f"--- {n}\n" + "".join(c.lines[-25:]) for n, c in pods.containers.items())

        def recovery(what: str, pred) -> dict:
            return kube.wait_for(what, lambda: (r := ((kube.job(ns, "gpt") or {}).get("status") or {}).get(
                "lastRecovery")) and pred(r) and r, 240, explain)

        def stopped_when(ready, what: str) -> psutil.Process:
            """Rank 1's trainer, stopped at a moment `ready()` holds."""
            while True:
                kube.wait_for(what, ready, 120, explain)
                trainer = psutil.Process(pods.containers[RANK1].trainer_pid())
                trainer.suspend()
                if ready():
                    return trainer
                trainer.resume()

        # 1. rank 1's trainer SIGKILLed once both pods hold a snapshot: in place, from every pod's own memory
        kube.wait_for("rank 1's own snapshots past iteration 9", lambda: (c := pods.containers.get(RANK1)) is not None
                      and c.memory is not None and max(sf.iterations(sf.own_dir(c.memory, 1)), default=0) >= 9,
                      240, explain)
        first, pod0 = pods.containers[RANK1], pods.containers["gpt-1-0"]
        trainer = stopped_when(lambda: ahead_of_store(durable, sf.own_dir(first.memory, 1), sf.own_dir(pod0.memory, 0)),
                               "a snapshot of both ranks as new as the store's checkpoint")
        reached = newest(first.lines)
        trainer.kill()
        rec = recovery("a recovery from memory", lambda r: r.get("loadedFrom") == "memory")
        assert rec["kind"] == "inPlace" and rec["attempt"] == 1 and 0 < rec["iteration"] <= reached, rec
        assert rec["iteration"] % 3 == 0, rec  # a snapshot's
        kube.wait_for("rank 1 past where it was", lambda: newest(first.lines) > reached + 3, 120, explain)
        ran_again_the_same(first.lines, rec["iteration"], reached)

        # 2. pod 1 gone at once (no grace: a lost node's pod) once pod 0 holds a copy of its newer snapshot
        copies = sf.peer_dir(pod0.memory, 1)
        stopped_when(lambda: (ahead_of_store(durable, copies, sf.own_dir(pod0.memory, 0)) or -1) > rec["iteration"],
                     "pod 0 holding a copy of rank 1's snapshot past the first recovery")
        reached = newest(first.lines)
        api.request("DELETE", pod_path(ns, RANK1), {"gracePeriodSeconds": 0}, ok=(200, 404))
        rec = recovery("a recovery from a peer's copy", lambda r: r.get("loadedFrom") == "peer")
        assert rec["kind"] == "podReplaced" and rec["attempt"] == 1 and rec["iteration"] % 3 == 0, rec
        st = kube.job(ns, "gpt")["status"]
        assert st["attempt"] == 1 and st["restarts"]["podsReplaced"] == 1 and st["restarts"]["total"] == 0, st
        replaced = pods.containers[RANK1]
        assert replaced is not first and not first.memory.exists()  # its memory volume went with the pod
        kube.wait_for("the new pod 1 past where the old one was", lambda: newest(replaced.lines) > reached + 3,
                      120, explain)
        ran_again_the_same(first.lines + replaced.lines, rec["iteration"], reached)

        # 3. another job's pod (its token) and anything outside the job's pods (no token) can neither read nor
        # write this job's copies, on either pod's agent; the job's own token reads them (the address is right)
        holding = sf.iterations(copies)
        # another job's token: drawn as the operator draws each job's (apply.py), into that job's own Secret once
        # one of its pods is placed (a job whose pods wait has none yet)
        mine, theirs = token(api, ns, "gpt"), secrets.token_urlsafe(32)
        assert theirs != mine
        for address in (agent(pod0.lines), agent(replaced.lines)):
            assert ask(address, "GET", "/v1/index", mine) == 200
            for bearer in (theirs, None, ""):
                assert ask(address, "GET", "/v1/index", bearer) == 403
                assert ask(address, "GET", f"/v1/copy/1/{holding[-1]}", bearer) == 403
                assert ask(address, "GET", f"/v1/copy/0/{holding[-1]}", bearer) == 403
        with sf.OpenSnapshot(forged_copy(tmp_path / "forged"), rank=1) as forged:
            with pytest.raises(CheckpointError, match="refused the copy: 403"):
                peers.push(agent(pod0.lines), theirs, forged)
        assert not list(copies.glob(f"*{sf.snap_name(FORGED)}*")), "another job's copy was written"

        # 4. every snapshot of rank 1, its own and the copies pod 0 holds, corrupted, then rank 1 SIGKILLed: the gang
        # resumes in place from the store, and says why
        own = sf.own_dir(replaced.memory, 1)
        trainer = stopped_when(lambda: committed_iterations(durable) and ahead_of_store(
            durable, own, sf.own_dir(pod0.memory, 0)), "a checkpoint in the store, the snapshots as new")
        saved = committed_iterations(durable)[-1]
        reached = newest(replaced.lines)
        spoiled = corrupt(own)
        corrupt(copies)
        trainer.kill()
        rec = recovery("a recovery from the store", lambda r: r.get("loadedFrom") == "store")
        resumed = rec["iteration"]  # the store's newest (one committed after the stop would be newer still)
        assert rec["kind"] == "inPlace" and rec["attempt"] == 1 and resumed >= saved, (rec, saved, spoiled)
        assert resumed in committed_iterations(durable), (rec, committed_iterations(durable))
        assert re.search(r"do not match their checksum \(a torn or corrupted snapshot\)|its manifest says \d+: a "
                         r"torn write", rec["reason"]) and any(sf.snap_name(it) in rec["reason"] for it in spoiled), rec
        kube.wait_for("rank 1 past where it was", lambda: newest(replaced.lines) > reached + 3, 120, explain)
        ran_again_the_same(first.lines + replaced.lines, resumed, reached)
        event = kube.wait_for("a RecoveredFromStore event", lambda: [
            e for e in kube.events(ns) if e["reason"] == "RecoveredFromStore"
            and e["involvedObject"]["name"] == "gpt"], 30, explain)[0]
        assert event["type"] == "Warning" and rec["reason"] in event["message"], event
        assert f"at iteration {resumed}" in event["message"] and mine not in event["message"], event
    print(f"scenario: {time.monotonic() - t_start:.1f} s")
