"""What a pod's status means, on a real API server with the real operator: the trainer
container is read by name whatever sidecars run beside it, an attempt ends when every trainer has ended
(a sidecar that still runs is stopped, not waited for), and a kubelet eviction for exceeding the pod's own
limits counts as a failure. The test plays the kubelet, writing what it would write."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.kube.cluster import now_iso, set_pod_status, set_running
from tests.operator.jobs import tj

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

SIDECAR = {"spec": {"containers": [{"name": "zz-exporter", "image": "busybox", "command": ["sleep", "inf"]}]}}
DONE = {"exitCode": 0, "reason": "Completed", "iteration": 40, "trainIters": 40, "lastCheckpoint": 40}


def running(name: str) -> dict[str, Any]:
    return {"name": name, "ready": True, "restartCount": 0, "image": "x", "imageID": "", "started": True,
            "state": {"running": {"startedAt": now_iso()}}}


def exited(name: str, code: int, message: Any = "") -> dict[str, Any]:
    now = now_iso()
    return {"name": name, "ready": False, "restartCount": 0, "image": "x", "imageID": "", "state": {"terminated": {
        "exitCode": code, "reason": "Completed" if code == 0 else "Error", "startedAt": now, "finishedAt": now,
        "message": json.dumps(message) if isinstance(message, dict) else message}}}


def set_containers(api, ns: str, pod: str, phase: str, *statuses: dict[str, Any]) -> None:
    """The kubelet's report: containerStatuses sorted by name, as the kubelet sorts them."""
    set_pod_status(api, ns, pod, {"phase": phase, "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
                                  "containerStatuses": sorted(statuses, key=lambda s: s["name"])})


def start(kube, ns: str, **spec: Any) -> None:
    kube.admin.create(kube.jobs(ns), tj(ns, **spec))
    kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
    for pod in ("gpt-1-0", "gpt-1-1"):
        set_containers(kube.admin, ns, pod, "Running", running("trainer"), running("zz-exporter"))
    kube.wait_status(ns, "gpt", "Running", lambda s: s.get("phase") == "Running")


def test_trainers_done_while_an_ordinary_sidecar_runs_end_succeeded_and_the_pods_go(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    with kube.operator(ns):
        start(kube, ns, podTemplate=SIDECAR)
        # The sidecar keeps each pod Running after its trainer exited 0 at train_iters.
        for pod in ("gpt-1-0", "gpt-1-1"):
            set_containers(api, ns, pod, "Running", exited("trainer", 0, DONE), running("zz-exporter"))
        st = kube.wait_status(ns, "gpt", "Succeeded", lambda s: s.get("phase") == "Succeeded")
        assert st["iteration"] == 40 and st["restarts"]["total"] == 0
        kube.wait_for("the pods deleted (their sidecars would run forever)", lambda: all(
            p["metadata"].get("deletionTimestamp") for p in kube.pods(ns).values()))


def test_a_sidecars_exit_code_is_never_the_trainers(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    with kube.operator(ns):
        start(kube, ns, podTemplate=SIDECAR)
        # A sidecar sorted after the trainer crashes while the trainers run: nothing ended.
        for pod in ("gpt-1-0", "gpt-1-1"):
            set_containers(api, ns, pod, "Running", running("trainer"), exited("zz-exporter", 1, "exporter died"))
        time.sleep(2.0)  # a non-event: give the operator (woken by the watch, 0.5 s interval) rounds to see it
        st = kube.job(ns, "gpt")["status"]
        assert st["phase"] == "Running" and st["attempt"] == 1 and st["restarts"]["total"] == 0, st
        # Then every trainer completes; the pods are Failed because of the sidecar, the job is not.
        for pod in ("gpt-1-0", "gpt-1-1"):
            set_containers(api, ns, pod, "Failed", exited("trainer", 0, DONE), exited("zz-exporter", 1, "exporter"))
        st = kube.wait_status(ns, "gpt", "Succeeded", lambda s: s.get("phase") in ("Succeeded", "Restarting", "Failed"))
        assert st["phase"] == "Succeeded" and st["restarts"]["total"] == 0, st


def test_an_eviction_for_the_pods_own_limit_is_a_failure_and_a_node_pressure_one_is_free(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    with kube.operator(ns):
        start(kube, ns, backoffLimit=0)
        # Node pressure: the kubelet's DisruptionTarget and its "node was low" words. Free.
        set_pod_status(api, ns, "gpt-1-1", {
            "phase": "Failed", "reason": "Evicted",
            "message": "The node was low on resource: memory. Threshold quantity: 100Mi, available: 50Mi. "
                       "Container trainer was using 30Gi, request is 16Gi, has larger consumption of memory. ",
            "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                            "lastTransitionTime": now_iso()}],
            "containerStatuses": [exited("trainer", 137)]})
        kube.wait_pods(ns, {"gpt-2-0", "gpt-2-1"})
        st = kube.wait_status(ns, "gpt", "attempt 2", lambda s: s.get("attempt") == 2)
        assert st["restarts"] == {"preemptions": 1, "failures": 0, "neverStarted": 0, "total": 1,
                                  "inPlace": 0, "hangs": 0}
        for pod in ("gpt-2-0", "gpt-2-1"):
            set_running(api, ns, pod)
        kube.wait_status(ns, "gpt", "Running", lambda s: s.get("phase") == "Running")
        # Its own ephemeral-storage limit: the job's doing; with backoffLimit 0 that fails it.
        set_pod_status(api, ns, "gpt-2-0", {
            "phase": "Failed", "reason": "Evicted",
            "message": "Pod ephemeral local storage usage exceeds the total limit of containers 1Gi. ",
            "containerStatuses": [exited("trainer", 137)]})
        st = kube.wait_status(ns, "gpt", "Failed", lambda s: s.get("phase") == "Failed")
        assert st["reason"] == "BackoffLimitExceeded", st
        assert "exceeds the total limit of containers 1Gi" in st["message"] and "ephemeral-storage" in st["message"]
        assert st["restarts"] == {"preemptions": 1, "failures": 1, "neverStarted": 0, "total": 2,
                                  "inPlace": 0, "hangs": 0}
