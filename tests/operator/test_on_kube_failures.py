"""Failure modes that only a real API server shows (quota, admission, missing CRDs, name
clashes, optimistic concurrency), with the real `kubetron operator` process (tests/kube)."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from kubernetes import client
from kubetron_operator.api_calls import Conflict, Kube, kubernetes_transport
from kubetron_operator.apply import apply
from kubetron_operator.decide import decide
from kubetron_operator.deps import Deps
from kubetron_operator.gather import observe

from tests.kube.cluster import set_exited, set_running
from tests.operator.jobs import tj

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def needs_controller_manager(kube) -> None:
    if "kube-controller-manager" not in kube.cp.procs:
        pytest.skip("needs kube-controller-manager (quota status, volume binding); KUBEBUILDER_ASSETS has none")


def warnings(kube, ns: str) -> dict[str, str]:
    return {e["reason"]: e["message"] for e in kube.events(ns) if e["type"] == "Warning"}


def children(kube, ns: str) -> set[str]:
    """Names of the Services and pods (not being deleted) in `ns` that a job's label names."""
    out = set()
    for kind in ("services", "pods"):
        for item in kube.admin.get(f"/api/v1/namespaces/{ns}/{kind}")["items"]:
            meta = item["metadata"]
            if not meta.get("deletionTimestamp") and "kubetron.dev/job" in (meta.get("labels") or {}):
                out.add(f"{kind}/{meta['name']}")
    return out


# -- 1. children that cannot be created --------------------------------------------------------------


def test_quota_exceeded_tears_down_the_partial_gang_and_retries_with_backoff(kube, kube_ns):
    """A ResourceQuota admits one pod of two: the pod that was created is deleted again (it would hold
    its GPU for nothing), status says why and when the next try is, and once quota frees up the attempt
    is created."""
    needs_controller_manager(kube)
    ns, api = kube_ns, kube.admin
    api.create(f"/api/v1/namespaces/{ns}/resourcequotas", {
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "pods"}, "spec": {"hard": {"pods": "1"}}})
    kube.wait_for("quota status", lambda: (api.get(f"/api/v1/namespaces/{ns}/resourcequotas/pods")
                                           .get("status") or {}).get("hard"))
    with kube.operator(ns):
        api.create(kube.jobs(ns), tj(ns))
        st = kube.wait_status(ns, "gpt", "CreateRetrying", lambda s: s.get("reason") == "CreateRetrying")
        assert st["phase"] == "Pending" and st["createFailures"] == 1 and st["nextCreateTime"]
        assert "exceeded quota" in st["message"] and "gpt-1-1" in st["message"] and "retry 1 in 10s" in st["message"]
        kube.wait_for("a CreateRetrying event",
                      lambda: "exceeded quota" in warnings(kube, ns).get("CreateRetrying", ""))
        kube.wait_pods(ns, set())  # rank 0 was created, then deleted again
        api.delete(f"/api/v1/namespaces/{ns}/resourcequotas/pods")
        kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"}, timeout=60)  # after the 10 s backoff
        st = kube.wait_status(ns, "gpt", "attempt 1 created", lambda s: s.get("attempt") == 1)
        assert st["reason"] == "AttemptCreated" and "createFailures" not in st and "nextCreateTime" not in st


def test_permanent_creation_errors_fail_the_job_with_the_reason(kube, kube_ns):
    """A missing PodGroup CRD (404), a PriorityClass that does not exist and a ServiceAccount that does
    not exist (admission, 403), a pod the server finds invalid (422), pods too small for their memory
    snapshots (docs/recovery.md: refused before any pod exists): Failed at once, the reason in status and a
    Warning event, nothing left running."""
    ns, api = kube_ns, kube.admin
    with kube.operator(ns):
        api.create(kube.jobs(ns), tj(ns, "gang", scheduling={"gang": "volcano"}))
        api.create(kube.jobs(ns), tj(ns, "prio", scheduling={"priorityClassName": "no-such-class"}))
        api.create(kube.jobs(ns), tj(ns, "sa", serviceAccountName="no-such-sa"))
        api.create(kube.jobs(ns), tj(ns, "invalid", resources={"requests": {"memory": "2Gi"},
                                                                "limits": {"memory": "1Gi"}}))
        api.create(kube.jobs(ns), tj(ns, "small", resources={"limits": {"memory": "20Mi"}}))
        gang = kube.wait_status(ns, "gang", "gang Failed", lambda s: s.get("phase") == "Failed")
        prio = kube.wait_status(ns, "prio", "prio Failed", lambda s: s.get("phase") == "Failed")
        sa = kube.wait_status(ns, "sa", "sa Failed", lambda s: s.get("phase") == "Failed")
        invalid = kube.wait_status(ns, "invalid", "invalid Failed", lambda s: s.get("phase") == "Failed")
        small = kube.wait_status(ns, "small", "small Failed", lambda s: s.get("phase") == "Failed")
        assert gang["reason"] == "CreateFailed" and "PodGroup" in gang["message"] and "404" in gang["message"]
        assert prio["reason"] == "CreateFailed" and "no-such-class" in prio["message"]
        assert sa["reason"] == "CreateFailed" and "no-such-sa" in sa["message"]
        assert invalid["reason"] == "CreateFailed" and "HTTP 422" in invalid["message"], invalid["message"]
        left = {c for c in children(kube, ns) if c.startswith("pods/")}
        assert not left, left
        assert small["reason"] == "InsufficientMemory" and small["message"].startswith(
            "spec.memorySnapshots: the pods' memory limit (20Mi) cannot hold their snapshots"), small["message"]
        assert "spec.resources.limits.memory" in small["message"], small["message"]
        assert all(st.get("attempt") in (None, 0) for st in (gang, prio, sa, invalid, small))
        assert not api.get(f"/api/v1/namespaces/{ns}/secrets/small-peers", ok=(404,))  # nor its peer token
        refused = kube.wait_for("an InsufficientMemory event", lambda: [  # posted just after the status
            e for e in kube.events(ns) if e["reason"] == "InsufficientMemory"])
        assert refused[0]["type"] == "Warning" and refused[0]["involvedObject"]["name"] == "small", refused
        assert refused[0]["message"] == small["message"], refused
        messages = kube.wait_for("a CreateFailed event per job", lambda: [  # posted just after the status
            e["message"] for e in kube.events(ns) if e["reason"] == "CreateFailed"] if len(
            [e for e in kube.events(ns) if e["reason"] == "CreateFailed"]) >= 4 else None)
        assert any("no-such-sa" in m for m in messages)


# -- 6. ownership ------------------------------------------------------------------------------------


def test_a_foreign_object_with_a_childs_name_is_never_adopted_nor_deleted(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    foreign = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "gpt", "labels": {"keep": "me"}},
               "spec": {"ports": [{"port": 80}]}}
    api.create(f"/api/v1/namespaces/{ns}/services", foreign)
    with kube.operator(ns) as op:
        api.create(kube.jobs(ns), tj(ns))
        st = kube.wait_status(ns, "gpt", "Failed", lambda s: s.get("phase") == "Failed")
        assert st["reason"] == "NameConflict"
        assert f"Service {ns}/gpt already exists" in st["message"], st["message"]
        kube.wait_for("a NameConflict event", lambda: "NameConflict" in warnings(kube, ns))
        kube.wait_pods(ns, set())
        api.delete(f"{kube.jobs(ns)}/gpt")
        kube.wait_for("job deleted", lambda: kube.job(ns, "gpt") is None)
        assert "Traceback" not in op.log(), op.tail()
    svc = api.get(f"/api/v1/namespaces/{ns}/services/gpt")
    assert svc["metadata"]["labels"] == {"keep": "me"} and not svc["metadata"].get("ownerReferences")


# -- 11. optimistic concurrency ----------------------------------------------------------------------


def test_a_stale_decision_never_overwrites_a_newer_status(kube, kube_ns):
    """The operator decided from one version of the job; someone wrote status in between: its status
    patch (carrying the old resourceVersion) is refused, the newer write stays."""
    ns, api = kube_ns, kube.admin
    api.create(kube.jobs(ns), tj(ns))
    configuration = client.Configuration(host=kube.cp.server)
    configuration.ssl_ca_cert = str(kube.cp.pki / "ca.crt")
    configuration.api_key = {"BearerToken": kube.operator_token}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    deps = Deps(kube=Kube(kubernetes_transport(client.ApiClient(configuration))), read_progress=lambda *_: None)
    body = deps.kube.get_job(ns, "gpt")
    obs, job = observe(deps, body)
    action = decide(job, obs)
    assert action.create_attempt == 1
    api.patch(f"{kube.jobs(ns)}/gpt/status", {"status": {"phase": "Pending", "reason": "SomeoneElse"}})
    with pytest.raises(Conflict):
        apply(deps, body, job, obs, action, logging.getLogger("test"))
    st: dict[str, Any] = kube.job(ns, "gpt")["status"]
    assert st["reason"] == "SomeoneElse" and "attempt" not in st


# -- 12. progress of PVC jobs ------------------------------------------------------------------------


def pvc_job(kube, ns: str) -> dict[str, Any]:
    """A job on a PersistentVolumeClaim (bound to a hostPath volume, so its pods can be scheduled)."""
    api = kube.admin
    api.create("/api/v1/persistentvolumes", {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"pv-{ns}"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "hostPath": {"path": f"/tmp/{ns}"}, "claimRef": {"namespace": ns, "name": "ckpt"}}})
    api.create(f"/api/v1/namespaces/{ns}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "ckpt"},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"pv-{ns}",
                 "resources": {"requests": {"storage": "1Gi"}}}})
    body = tj(ns)
    body["spec"]["storage"] = {"pvc": {"claimName": "ckpt"}}
    return body


def test_a_pvc_restart_creates_the_next_attempt_at_once_with_no_extra_pod(kube, kube_ns):
    """A whole-gang restart on a PVC store needs no pod but the next gang's. The operator
    used to create a progress-reader pod between attempts and wait up to 180 s for it (a full cluster after a
    preemption could not place it); now attempt 2 is created at once, expecting the newest checkpoint the
    ranks reported (their termination messages), and its own rank 0 resumes from the store's newest."""
    needs_controller_manager(kube)
    ns, api = kube_ns, kube.admin
    with kube.operator(ns):
        api.create(kube.jobs(ns), pvc_job(kube, ns))
        kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        set_running(api, ns, "gpt-1-0")
        set_exited(api, ns, "gpt-1-1", 75, {"exitCode": 75, "reason": "SavedOnSignal", "iteration": 14,
                                            "lastCheckpoint": 13, "trainIters": 40})
        ended = time.monotonic()
        pods = kube.wait_pods(ns, {"gpt-2-0", "gpt-2-1"}, timeout=30)
        created = time.monotonic() - ended
        assert {e["name"]: e.get("value") for e in pods["gpt-2-0"]["spec"]["containers"][0]["env"]}[
            "KUBETRON_EXPECTED_ITERATION"] == "13"
        st = kube.wait_status(ns, "gpt", "attempt 2", lambda s: s.get("attempt") == 2)
        assert st["lastCheckpoint"]["iteration"] == 13 and st["message"] == "attempt 2 created"
    # Every pod the operator ever created in the namespace is one of the two gangs'.
    creates = {c: n for c, n in kube.operator_calls(ns).items() if c[:2] == ("create", "pods")}
    assert sum(creates.values()) == 4, creates
    print(f"attempt 2's pods created {created:.1f} s after attempt 1 ended")
    assert created < 10, created


def test_two_replicas_elect_one_leader_and_the_other_takes_over(kube, kube_ns):
    """The chart's replicas > 1: both operators meet in the KopfPeering (each under its pod name, as the
    chart sets POD_ID), the one with the higher priority works, the other stands by and takes over when
    the leader goes away."""
    ns, api = kube_ns, kube.admin
    peering = f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/kubetron"
    with kube.operator(ns, "--peering=kubetron", env={"POD_ID": "op-a"}) as a, \
            kube.operator(ns, "--peering=kubetron", env={"POD_ID": "op-b"}) as b:
        peers = kube.wait_for("both operators in the KopfPeering", lambda: (
            lambda st: st if {"op-a", "op-b"} <= set(st) else None)(api.get(peering).get("status") or {}))
        leader, standby = (a, b) if peers["op-a"]["priority"] > peers["op-b"]["priority"] else (b, a)
        api.create(kube.jobs(ns), tj(ns))
        kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        kube.wait_for("the leader records attempt 1", lambda: "AttemptCreated: creating attempt 1" in leader.log())
        assert "AttemptCreated" not in standby.log() and "gpt" not in standby.log()
        leader.stop()
        set_running(api, ns, "gpt-1-0")
        set_exited(api, ns, "gpt-1-1", 75, {"exitCode": 75, "reason": "SavedOnSignal"})
        kube.wait_pods(ns, {"gpt-2-0", "gpt-2-1"}, timeout=60)
        kube.wait_for("the standby took over", lambda: "AttemptCreated: creating attempt 2" in standby.log())
