"""In-place recovery on the real API server with the real operator: a 2-pod job whose pods' exact
commands run as local processes (the test plays the kubelet, as in test_real_trainer_story.py: only the
interpreter, the mounted config, the termination log and MASTER_ADDR are rewritten). One trainer
process is SIGKILLed mid-run: the gang restarts inside the same pods, rank 0's status endpoint says so,
the operator counts `restarts.inPlace` = 1 with a `RestartedInPlace` event, and the job succeeds in
attempt 1 with the same pods (same UIDs).
"""

from __future__ import annotations

import json

import pytest

from tests.kube.cluster import free_port, set_exited, set_running
from tests.multirank.runner import fault_at
from tests.operator.jobs import PVC_JOB, job_body
from tests.operator.local_pods import Container, pvc, tiny_config

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_killed_trainer_is_restarted_in_the_same_pods(kube, kube_ns, tmp_path):
    ns, api = kube_ns, kube.admin
    store = tmp_path / "pvc"
    store.mkdir()
    pvc(kube, ns, store)
    config = tiny_config()
    body = job_body(PVC_JOB, nodes=2, config=config, storage={"pvc": {"claimName": "ckpt", "mountPath": str(store)}},
                    statusPort=free_port(), masterPort=free_port(), maxInPlaceRestarts=2)
    body["metadata"] = {"name": "gpt"}
    containers: list[Container] = []
    with kube.operator(ns):
        api.create(kube.jobs(ns), body)
        pods = kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        uids = {name: pod["metadata"]["uid"] for name, pod in pods.items()}
        try:
            for rank in (0, 1):  # rank 1's trainer (not its pod's PID 1) SIGKILLs itself after iteration 15
                containers.append(Container(pods[f"gpt-1-{rank}"], config, tmp_path / f"pod-{rank}",
                                            faults=fault_at(15, "KILL", rank=1)))
                set_running(api, ns, f"gpt-1-{rank}")

            # The operator counts the restart from rank 0's status endpoint while the gang runs, or, if it missed
            # it there (a read that timed out on a loaded machine, a run this short), from the ranks'
            # termination messages once they end: either way the job says so.
            def in_place() -> bool:
                return ((kube.job(ns, "gpt") or {}).get("status", {}).get("restarts") or {}).get("inPlace") == 1

            kube.wait_for("restarts.inPlace == 1 or both trainers ended", lambda: in_place() or all(
                c.proc.poll() is not None for c in containers), timeout=300)
            st = kube.job(ns, "gpt")["status"]
            if (st.get("restarts") or {}).get("inPlace") == 1:  # seen while it runs
                assert st["phase"] == "Running" and st["attempt"] == 1 and st["restarts"]["total"] == 0

            for rank, c in enumerate(containers):  # the kubelet reports each container's end
                assert c.proc.wait(timeout=300) == 0, "".join(c.lines[-40:])
                assert json.loads(c.termination_log.read_text())["inPlaceRestarts"] == 1
                set_exited(api, ns, f"gpt-1-{rank}", 0, c.termination_log.read_text())
            st = kube.wait_status(ns, "gpt", "Succeeded", lambda s: s.get("phase") == "Succeeded", timeout=60)
            kube.wait_for("a RestartedInPlace event", lambda: any(
                e["reason"] == "RestartedInPlace" for e in kube.events(ns)))
        finally:
            for c in containers:
                c.kill()
    assert st["attempt"] == 1 and st["restarts"]["total"] == 0 and st["restarts"]["inPlace"] == 1
    # A crash (what an OOM kill looks like) points at no node: nothing is held against rank 1's.
    assert "failingNodes" not in st and "avoidNodes" not in st, st
    assert {name: pod["metadata"]["uid"] for name, pod in kube.pods(ns).items()} == uids  # the same pods
    assert json.loads(containers[0].termination_log.read_text())["reason"] == "Completed"
    assert "restarting the gang in place" in "".join(containers[1].lines)
