"""A hung rank found and recovered from, in one story, on the real API server, kube-scheduler and operator, with real
trainers (the tests' kubelet runs every pod the scheduler binds to the story's three Nodes as local processes; each
Node has room for one pod): one 2-pod job of the tiny GPT on a PVC store

Every fault is the trainer's own, at its own step (kubetron.cli.chaos_from_env: `step@<r>%<m>`, armed by a file
once the test has done what must come first), never at a line the test read.

1. hangs: rank 1's trainer SIGSTOPs itself mid-interval. Its pods' watchdogs name it, its stacks and the others'
   go to the store, the gang restarts in place (status Hung naming its pod and node, restarts.hangs, an event)
   and trains again, within the goal (detection <= 60 s, training <= 120 s; with hangTimeoutSeconds 10);
2. crashes (a SIGSEGV in its second life; its one in-place restart is spent) on the same Node, which now reports
   a GPU problem itself (a condition, as node-problem-detector sets one): the attempt fails, and on the node's own
   word (the hang and the crash are the job's, no evidence against a node) the next attempt is placed on the other
   two, and the operator (--taint-failing-nodes, the chart's failingNodes.taint) taints it for the job's namespace;
3. is preempted (its rank 0 evicted; it saves on SIGTERM) and resumes;
4. completes. Its goodput ledger put each of the three in recovery (the crash also in lost work; the hang
   resumes in place from memory), and its buckets sum to every rank-second since the job was created;
   `kubetron status` shows it.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
from kubetron.contract import hang

from tests.kube.cluster import Kubelet, free_port
from tests.multirank.runner import faults_by_life
from tests.operator.cli import kubetron
from tests.operator.jobs import PVC_JOB, job_body
from tests.operator.local_pods import ITER_RE, Container, ProcessKubelet, last_checkpoint, pvc, tiny_config

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]
POOL = "kubetron.dev/hang-story"
SAVE_INTERVAL = 10
HANG_TIMEOUT = 10  # spec.hangTimeoutSeconds: short for the test (default max(45 s, 5 x the slowest iteration))
# Rank 1's trainer in attempt 1: its first life SIGSTOPs itself mid-interval, its second (restarted in place)
# SIGSEGVs, each at its first such iteration once the test armed it (the file <arm>-<life>).
HANG_THEN_CRASH = ((f"step@3%{SAVE_INTERVAL}", "STOP"), (f"step@5%{SAVE_INTERVAL}", "SEGV"))


def nodes(kube, ns: str) -> list[Kubelet]:
    """Three Nodes with room for one pod each, tainted for this story's pods only."""
    out = []
    for name in (f"{ns}-a", f"{ns}-b", f"{ns}-c"):
        node = Kubelet(kube.admin, name=name, cpu="1", gpus=0)
        node.finish_deletions = False  # the ProcessKubelet's, once the containers stopped
        node.start()
        kube.admin.patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {POOL: ns}}, "spec": {
            "taints": [{"key": POOL, "value": ns, "effect": "NoSchedule"}]}})
        out.append(node)
    kube.wait_for("the Nodes schedulable", lambda: all(
        [t["key"] for t in kube.admin.get(f"/api/v1/nodes/{n.name}")["spec"].get("taints") or []] == [POOL]
        for n in out), 120)
    return out


def iterations_after(c: Container, since: float) -> list[int]:
    return [int(m.group(1)) for t, line in list(c.stamped) if t > since and (m := ITER_RE.search(line))]


def goodput(kube, ns: str) -> dict[str, Any]:
    return ((kube.job(ns, "gpt") or {}).get("status") or {}).get("goodput") or {}


@pytest.mark.hangs_on_purpose
def test_a_hang_a_crash_and_a_preemption_each_land_where_they_belong(kube, kube_ns, tmp_path):
    ns, api = kube_ns, kube.admin
    store = tmp_path / "pvc"
    store.mkdir()
    pvc(kube, ns, store)
    body = job_body(PVC_JOB, nodes=2, config=tiny_config(train_iters=300, save_interval=SAVE_INTERVAL),
                    storage={"pvc": {"claimName": "ckpt", "mountPath": str(store)}}, statusPort=free_port(),
                    masterPort=free_port(), maxInPlaceRestarts=1, hangTimeoutSeconds=HANG_TIMEOUT, backoffLimit=3,
                    terminationGracePeriodSeconds=30, resources={"requests": {"cpu": "1"}},
                    scheduling={"nodeSelector": {POOL: ns}, "tolerations": [{"key": POOL, "operator": "Exists"}]})
    body["metadata"] = {"name": "gpt"}
    pool = nodes(kube, ns)
    try:
        with kube.operator(ns, "--taint-failing-nodes"), \
                ProcessKubelet(api, ns, tmp_path / "pods", nodes=tuple(n.name for n in pool), faults={
                    "gpt-1-1": faults_by_life(*HANG_THEN_CRASH, arm=tmp_path / "arm")}) as node:
            api.create(kube.jobs(ns), body)
            timeline = story(kube, ns, node, store / "gpt", tmp_path / "arm")
            st = kube.wait_status(ns, "gpt", "Succeeded", lambda s: s.get("phase") == "Succeeded", timeout=300)
            table = kubetron(kube, "status", "gpt", "-n", ns)
            events = {e["reason"]: e["message"] for e in kube.events(ns)}
    finally:
        for n in pool:
            n.stop()
            api.delete(f"/api/v1/nodes/{n.name}", ok=(404,))
    job = kube.job(ns, "gpt")
    assert st["attempt"] == 3 and st["restarts"]["hangs"] == 1 and st["restarts"]["failures"] == 1
    assert st["restarts"]["preemptions"] == 1 and st["restarts"]["inPlace"] == 1
    assert "node" in events["NodeAvoided"] and "Hung" in events
    # -- goodput: each event in its bucket; every rank-second since creation, once ------------------------
    g = st["goodput"]
    seconds = g["seconds"]
    assert abs(sum(seconds.values()) - g["totalSeconds"]) <= 0.01 * g["totalSeconds"]
    created = datetime.fromisoformat(job["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    done = datetime.fromisoformat(st["completionTime"].replace("Z", "+00:00"))
    assert abs(g["totalSeconds"] - 2 * (done - created).total_seconds()) <= 0.01 * g["totalSeconds"], (g, created, done)
    before = {what: timeline[f"before {what}"] for what in ("hang", "crash", "preemption")}
    after = {"hang": timeline["after hang"], "crash": timeline["after crash"], "preemption": seconds}
    for what in ("hang", "crash", "preemption"):
        assert after[what]["recovery"] > before[what]["recovery"], (what, before[what], after[what])
    # The crash (a new attempt, from the store's checkpoint, mid-interval): iterations computed, then lost. The
    # hang restarts in place from the ranks' memory snapshot (docs/recovery.md), which can lose less than the
    # second the ledger counts in.
    assert after["crash"]["lostWork"] > before["crash"]["lostWork"], (json.dumps(timeline), json.dumps(g))
    assert after["hang"]["lostWork"] >= before["hang"]["lostWork"], (json.dumps(timeline), json.dumps(g))
    assert seconds["productive"] > 0 and seconds["checkpoint"] > 0 and seconds["pending"] >= 0
    assert g["ratio"] == pytest.approx(seconds["productive"] / g["totalSeconds"], abs=1e-4) and not g["recovering"]
    head, row = table.stdout.splitlines()[:2]
    assert table.returncode == 0 and "GOODPUT" in head.split(), table.stdout
    assert f"{g['ratio']}" in row.split(), table.stdout
    print(f"\n[hang story] detected {timeline['detected']:.1f} s after the SIGSTOP, training again after "
          f"{timeline['training']:.1f} s; goodput {json.dumps(seconds)}")


def story(kube, ns: str, node: ProcessKubelet, store: Path, arm: Path) -> dict[str, Any]:
    """The hang, the crash and the preemption, each checked as it happens; the ledger around each."""
    timeline: dict[str, Any] = {}
    explain = lambda: "\n".join(f"--- {n}\n" + "".join(c.lines[-15:]) for n, c in node.containers.items())  # noqa: E731
    kube.wait_for("the ledger has read the trainer's clock", lambda: goodput(kube, ns).get("stepSeconds"), 300,
                  explain)
    kube.wait_for("a durable checkpoint (the trainer's progress log)", lambda: last_checkpoint(store), 120, explain)
    rank1 = node.containers["gpt-1-1"]
    hung_node = kube.pods(ns)["gpt-1-1"]["spec"]["nodeName"]
    timeline["before hang"] = goodput(kube, ns)["seconds"]
    trainer = psutil.Process(rank1.trainer_pid())
    Path(f"{arm}-0").touch()  # rank 1 stops itself at its next iteration 3 past a save
    kube.wait_for("rank 1's trainer stopped itself", lambda: trainer.status() == psutil.STATUS_STOPPED, 120, explain)
    stopped = time.time()

    # 1. the hang: named, stacks stored, restarted in place, training again
    st = kube.wait_status(ns, "gpt", "Hung", lambda s: (s.get("restarts") or {}).get("hangs") == 1
                          and s.get("lastHang"), timeout=180)
    last = st["lastHang"]
    assert (last["pod"], last["node"], last["rank"], last["state"]) == ("gpt-1-1", hung_node, 1, hang.STOPPED)
    assert last["restartedInPlace"] and last["stacks"] == f"{store}/hangs/1-1/"
    assert st["restarts"]["inPlace"] == 1 and st["attempt"] == 1 and st["phase"] == "Running"
    assert {c["type"]: c["status"] for c in st["conditions"]}["Hung"] == "True"
    folder = store / "hangs" / "1-1"
    assert json.loads((folder / "report.json").read_text())["rank"] == 1
    assert hang.classify((folder / "rank-0.txt").read_text()) == hang.COLLECTIVE  # rank 0 waited for rank 1
    line = min(t for c in node.containers.values() for t, text in list(c.stamped) if "the gang hung" in text)
    timeline["detected"] = line - stopped
    kube.wait_for("training again", lambda: iterations_after(rank1, line), 120, explain)
    timeline["training"] = min(t for t, text in list(rank1.stamped) if t > line and ITER_RE.search(text)) - stopped
    assert timeline["detected"] <= 60 and timeline["training"] <= 120, timeline
    kube.wait_status(ns, "gpt", "the Hung condition over", lambda s: {c["type"]: c["status"] for c in s.get(
        "conditions") or []}.get("Hung") == "False", timeout=60)
    timeline["after hang"] = goodput(kube, ns)["seconds"]
    timeline["hang status"] = {k: st.get(k) for k in ("iteration", "lastCheckpoint", "lostIterations", "lastHang")}

    assert "failingNodes" not in kube.job(ns, "gpt")["status"]  # a hang is the job's: no evidence against a node

    # 2. a crash on the same Node, which reports a GPU problem: no in-place restart left; the Node is avoided
    held = kube.admin.get(f"/api/v1/nodes/{hung_node}")["status"]["conditions"]
    kube.admin.patch(f"/api/v1/nodes/{hung_node}/status", {"status": {"conditions": [
        *held, {"type": "GpuXidError", "status": "True", "reason": "Xid79", "message": "GPU has fallen off the bus",
                "lastTransitionTime": held[0]["lastTransitionTime"]}]}})
    timeline["before crash"] = goodput(kube, ns)["seconds"]
    Path(f"{arm}-1").touch()  # rank 1's second life crashes at its next iteration 5 past a save
    st = kube.wait_status(ns, "gpt", "attempt 2 created", lambda s: s.get("attempt") == 2, timeout=120)
    (avoided,) = st["avoidNodes"]
    assert avoided["node"] == hung_node and avoided["reason"] == "NodeProblem", avoided
    assert "reports condition GpuXidError=True (Xid79: GPU has fallen off the bus)" in avoided["evidence"], avoided
    kube.wait_for("the node tainted (--taint-failing-nodes)", lambda: {"key": "kubetron.dev/failing-node",
                  "value": ns, "effect": "NoSchedule"} in kube.admin.get(f"/api/v1/nodes/{hung_node}")["spec"].get(
                  "taints", []), 30)
    pods = kube.wait_for("attempt 2 placed", lambda: (p := kube.pods(ns)) and {"gpt-2-0", "gpt-2-1"} <= set(p) and all(
        p[n]["spec"].get("nodeName") for n in ("gpt-2-0", "gpt-2-1")) and p, 120)
    assert hung_node not in {pods[n]["spec"]["nodeName"] for n in ("gpt-2-0", "gpt-2-1")}
    crashed_at = last_checkpoint(store)
    kube.wait_for("attempt 2 saved a checkpoint of its own", lambda: last_checkpoint(store) > crashed_at, 180,
                  explain)
    timeline["after crash"] = goodput(kube, ns)["seconds"]

    # 3. a preemption: rank 0 evicted; the trainers save on SIGTERM, attempt 3 resumes
    timeline["before preemption"] = timeline["after crash"]
    kube.admin.create(f"/api/v1/namespaces/{ns}/pods/gpt-2-0/eviction", {
        "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "gpt-2-0", "namespace": ns}})
    kube.wait_status(ns, "gpt", "attempt 3", lambda s: s.get("attempt") == 3, timeout=120)
    return timeline

