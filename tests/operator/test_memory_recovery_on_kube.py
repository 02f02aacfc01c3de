"""Recovery from memory on the real control plane (docs/recovery.md), as users run jobs: one 2-pod job of the tiny
GPT with memory snapshots (its pods' exact commands run as local processes; the test plays the kubelet,
tests/operator/local_pods.py: each pod's memory volume is a directory that outlives its processes and goes with
the pod), through two recoveries in one run:

1. rank 1's trainer SIGKILLed: the gang restarts in place from the pods' own memory (status.lastRecovery
   loadedFrom memory, kind inPlace);
2. pod 1 deleted at once (grace 0, as a lost node leaves it): the operator creates it again in the same attempt and
   the gang resumes, rank 1 from the copy pod 0's agent holds (loadedFrom peer, kind podReplaced);
each time the iterations between the snapshot and the kill run again to the losses they had the first time (the
uninterrupted run's). The store's checkpoints are far apart (every 500): only memory can give these iterations.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from kubetron.storage import snapshot_files as sf

from tests.kube.cluster import free_port, pod_path
from tests.operator.jobs import PVC_JOB, job_body
from tests.operator.local_pods import ProcessKubelet, pinned, pool, pvc, tiny_config
from tests.trainer_utils import ITER_RE, LOSS_RE

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]
RANK1 = "gpt-1-1"  # attempt 1's pod 1


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


def test_a_killed_rank_resumes_from_memory_and_a_lost_pod_from_its_peers_copy(kube, kube_ns, tmp_path):
    ns, api = kube_ns, kube.admin
    store = tmp_path / "pvc"
    store.mkdir()
    pvc(kube, ns, store)
    body = job_body(PVC_JOB, nodes=2, config=tiny_config(train_iters=100_000, save_interval=500),
                    storage={"pvc": {"claimName": "ckpt", "mountPath": str(store)}},
                    statusPort=free_port(), masterPort=free_port(), maxInPlaceRestarts=3,
                    overrides=["checkpoint.non_persistent_save_interval=3"], **pinned(ns))
    body["metadata"] = {"name": "gpt"}
    t_start = time.monotonic()
    with pool(api, ns, 2) as names, kube.operator(ns), ProcessKubelet(api, ns, tmp_path / "pods", nodes=names) as pods:
        api.create(kube.jobs(ns), body)

        def logged(name: str) -> list[str]:
            c = pods.containers.get(name)
            return c.lines if c else []

        def explain() -> str:
            (tmp_path / "pods.log").write_text("\n".join(f"--- {n}\n" + "".join(c.lines) for n, c in
                                                         pods.containers.items()))
            return f"(every pod's log: {tmp_path / 'pods.log'})\n" + "\n".join(
                f"--- {n}\n" + "".join(c.lines[-25:]) for n, c in pods.containers.items())

        def recovery(what: str, pred) -> dict:
            return kube.wait_for(what, lambda: (r := ((kube.job(ns, "gpt") or {}).get("status") or {}).get(
                "lastRecovery")) and pred(r) and r, 240, explain)

        # 1. rank 1's trainer SIGKILLed once both pods hold a snapshot: in place, from every pod's own memory
        kube.wait_for("a snapshot of rank 1 and rank 1 at iteration 10", lambda: (
            RANK1 in pods.containers and sf.iterations(sf.own_dir(pods.containers[RANK1].memory, 1))
            and newest(logged(RANK1)) >= 10), 240, explain)
        first = pods.containers[RANK1]
        reached = newest(first.lines)
        os.kill(first.trainer_pid(), signal.SIGKILL)
        rec = recovery("a recovery from memory", lambda r: r.get("loadedFrom") == "memory")
        assert rec["kind"] == "inPlace" and rec["attempt"] == 1 and 0 < rec["iteration"] <= reached, rec
        assert rec["iteration"] % 3 == 0, rec  # a snapshot's (the store has none before 500)
        kube.wait_for("rank 1 past where it was", lambda: newest(first.lines) > reached + 3, 120, explain)
        ran_again_the_same(first.lines, rec["iteration"], reached)

        # 2. pod 1 gone at once (no grace: a lost node's pod) once pod 0 holds a copy of its newer snapshot
        copies = sf.peer_dir(pods.containers["gpt-1-0"].memory, 1)
        kube.wait_for("pod 0 holding a copy of rank 1's snapshot past the first recovery",
                      lambda: [it for it in sf.iterations(copies) if it > rec["iteration"]], 120, explain)
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
    print(f"scenario: {time.monotonic() - t_start:.1f} s")
