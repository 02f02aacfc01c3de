"""The operator's policy on a real API server (stuck pods, admission refusals, preemptions while loading,
suspension, peer failures): one real
`kubetron operator` process for the whole module, a namespace per test, the real scheduler binding pods
(or saying why it cannot), and the test playing the kubelet (pod phases, waiting reasons, admission
rejections, node readiness).
"""

from __future__ import annotations

import base64
import copy
import time
from typing import Any

import pytest

from tests.kube.cluster import ApiError, Kubelet, set_exited, set_pod_status, set_running
from tests.operator.jobs import S3_JOB
from tests.operator.status_endpoint import StatusEndpoint

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

TESTS = ("stuck", "admission", "loading", "suspend", "node", "cel", "config", "iter")


@pytest.fixture(scope="module")
def policy(kube, s3_server):
    """One operator for the module, watching a namespace per test (made before it starts)."""
    namespaces = {key: kube.namespace(f"pol-{key}") for key in TESTS}
    for ns in namespaces.values():
        kube.admin.create(f"/api/v1/namespaces/{ns}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
            "data": {"AWS_ACCESS_KEY_ID": base64.b64encode(s3_server.access_key.encode()).decode(),
                     "AWS_SECRET_ACCESS_KEY": base64.b64encode(s3_server.secret_key.encode()).decode()}})
    args = [f"--namespace={ns}" for ns in namespaces.values()]
    with kube.operator(None, *args, interval=0.5) as op:
        yield namespaces, op
    assert "Traceback" not in op.log(), op.tail(80)


def create_job(kube, s3_server, ns: str, name: str = "gpt", **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(S3_JOB)
    body["metadata"] = {"name": name, "namespace": ns}
    body["spec"].update(spec)
    body["spec"]["storage"]["s3"].update(bucket=s3_server.new_bucket(), endpoint=s3_server.endpoint)
    return kube.admin.create(kube.jobs(ns), body)


def warnings(kube, ns: str, name: str) -> list[str]:
    """The Warning events on the TrainingJob `name` (the operator's, not the Service's or the pods')."""
    return [e["reason"] for e in kube.events(ns) if e["type"] == "Warning"
            and e["involvedObject"]["name"] == name and e["involvedObject"]["kind"] == "TrainingJob"]


def waiting(api, ns: str, pod: str, reason: str, message: str) -> None:
    """The kubelet reports the container stuck before it starts (image pull, missing Secret key)."""
    set_pod_status(api, ns, pod, {"phase": "Pending", "containerStatuses": [
        {"name": "trainer", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
         "state": {"waiting": {"reason": reason, "message": message}}}]})


def evicted(api, ns: str, pod: str) -> None:
    set_pod_status(api, ns, pod, {"phase": "Failed", "reason": "Evicted", "message": "The node was low on memory.",
                                  "conditions": [{"type": "DisruptionTarget", "status": "True",
                                                  "reason": "TerminationByKubelet",
                                                  "lastTransitionTime": "2026-11-22T12:00:00Z"}]})


def run_gang(kube, ns: str, attempt: int, name: str = "gpt") -> None:
    kube.wait_pods(ns, {f"{name}-{attempt}-0", f"{name}-{attempt}-1"})
    kube.wait_for("pods bound", lambda: all(p["spec"].get("nodeName") for p in kube.pods(ns).values()))
    for rank in (0, 1):
        set_running(kube.admin, ns, f"{name}-{attempt}-{rank}")
    kube.wait_status(ns, name, f"Running attempt {attempt}",
                     lambda s: s.get("phase") == "Running" and s.get("attempt") == attempt)


# -- 2: pods stuck before starting --------------------------------------------------------------------


def test_stuck_pods_are_surfaced_and_startup_times_out(kube, s3_server, policy):
    ns, api = policy[0]["stuck"], kube.admin
    create_job(kube, s3_server, ns, "nosel", startupTimeoutSeconds=8, maxNeverStartedAttempts=1,
               scheduling={"nodeSelector": {"pool": "does-not-exist"}})
    create_job(kube, s3_server, ns, "nosched", scheduling={"schedulerName": "nobody-scheduler"})
    create_job(kube, s3_server, ns, "pull")

    # A missing Secret key, then an image that cannot be pulled: each surfaced, each one Warning event.
    kube.wait_pods(ns, {"nosel-1-0", "nosel-1-1", "nosched-1-0", "nosched-1-1", "pull-1-0", "pull-1-1"})
    kube.wait_for("pull pods bound", lambda: all(
        kube.pods(ns)[f"pull-1-{r}"]["spec"].get("nodeName") for r in (0, 1)))
    waiting(api, ns, "pull-1-0", "CreateContainerConfigError", "couldn't find key AWS_ACCESS_KEY_ID in Secret")
    st = kube.wait_status(ns, "pull", "config error surfaced",
                          lambda s: s.get("reason") == "CreateContainerConfigError")
    assert st["phase"] == "Pending" and "AWS_ACCESS_KEY_ID" in st["message"] and "pull-1-0" in st["message"]
    set_running(api, ns, "pull-1-0")
    waiting(api, ns, "pull-1-1", "ImagePullBackOff", 'Back-off pulling image "kubetron:dev"')
    st = kube.wait_status(ns, "pull", "image pull surfaced", lambda s: s.get("reason") == "ImagePullBackOff")
    assert "kubetron:dev" in st["message"]

    # No node matches: the real scheduler's words, then the attempt ends after startupTimeoutSeconds.
    st = kube.wait_status(ns, "nosel", "Unschedulable", lambda s: s.get("reason") == "Unschedulable")
    assert st["phase"] == "Pending" and "node affinity/selector" in st["message"], st
    st = kube.wait_status(ns, "nosel", "Failed", lambda s: s.get("phase") == "Failed", timeout=40)
    assert st["reason"] == "NeverStarted" and "startupTimeoutSeconds (8s)" in st["message"], st
    assert st["restarts"]["neverStarted"] == 1 and st["restarts"]["failures"] == 0
    kube.wait_for("the partial gang's pods deleted", lambda: not any(n.startswith("nosel") for n in kube.pods(ns)))

    # Nobody serves schedulerName: said so after a while rather than Pending in silence.
    st = kube.wait_status(ns, "nosched", "NotScheduled", lambda s: s.get("reason") == "NotScheduled", timeout=60)
    assert "nobody-scheduler" in st["message"]

    # Events go out once the operator is quiet (events.EventPoster): the last may follow its status.
    kube.wait_for("the NotScheduled event", lambda: warnings(kube, ns, "nosched"))
    pull = warnings(kube, ns, "pull")
    assert pull.count("CreateContainerConfigError") == pull.count("ImagePullBackOff") == 1, [
        (e["reason"], e["message"]) for e in kube.events(ns) if e["involvedObject"]["name"] == "pull"]
    assert warnings(kube, ns, "nosel").count("Unschedulable") == 1
    assert warnings(kube, ns, "nosched") == ["NotScheduled"]


# -- 3: restart pacing after a kubelet admission rejection --------------------------------------------


def test_admission_rejection_backs_off_counts_apart_and_avoids_the_node(kube, s3_server, policy):
    ns, api = policy[0]["admission"], kube.admin
    create_job(kube, s3_server, ns, scheduling={"nodeSelector": {"kubernetes.io/hostname": "node-1"}})
    kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
    kube.wait_for("pods bound", lambda: all(p["spec"].get("nodeName") == "node-1" for p in kube.pods(ns).values()))
    set_running(api, ns, "gpt-1-0")
    set_pod_status(api, ns, "gpt-1-1", {
        "phase": "Failed", "reason": "OutOfnvidia.com/gpu",
        "message": "Pod was rejected: Node didn't have enough resource: nvidia.com/gpu, requested: 8, used: 8"})
    st = kube.wait_status(ns, "gpt", "Restarting", lambda s: s.get("phase") == "Restarting")
    ended = time.time()
    assert st["reason"] == "AdmissionRejected" and "node-1" in st["message"], st
    assert "enough resource: nvidia.com/gpu" in st["message"] and "None" not in st["message"]
    assert st["restarts"] == {"preemptions": 0, "failures": 0, "neverStarted": 1, "total": 1, "inPlace": 0, "hangs": 0}
    assert [(a["node"], a["reason"]) for a in st["avoidNodes"]] == [("node-1", "AdmissionRejected")]
    assert "enough resource: nvidia.com/gpu" in st["avoidNodes"][0]["evidence"] and st["nextAttemptTime"]

    # The next attempt waits out the backoff (10 s + jitter). It would keep off the node that rejected it, but
    # that is the only node its nodeSelector allows: avoiding it would leave it unschedulable for ever, so the
    # avoidance yields, and the condition NodesAvoided says so.
    pods = kube.wait_pods(ns, {"gpt-2-0", "gpt-2-1"}, timeout=40)
    assert time.time() - ended >= 8, "the next attempt did not wait for its backoff"
    assert "affinity" not in pods["gpt-2-0"]["spec"]
    st = kube.wait_status(ns, "gpt", "attempt 2", lambda s: s.get("attempt") == 2)
    (cond,) = [c for c in st["conditions"] if c["type"] == "NodesAvoided"]
    assert cond["reason"] == "Yielded" and "avoiding node-1 too would leave room for 0 of the 2 pod(s)" in cond[
        "message"], cond
    kube.wait_for("attempt 2 bound to node-1 again", lambda: [
        n for n in ("gpt-2-0", "gpt-2-1") if (kube.pods(ns).get(n) or {"spec": {}})["spec"].get("nodeName") == "node-1"
    ] == ["gpt-2-0", "gpt-2-1"])


# -- 4: preemptions while the model loads are not a crash loop -----------------------------------------


def test_preemptions_while_loading_do_not_fail_as_no_progress(kube, s3_server, policy):
    ns, api = policy[0]["loading"], kube.admin
    create_job(kube, s3_server, ns, maxNoProgressAttempts=3)
    for attempt in (1, 2, 3):
        run_gang(kube, ns, attempt)
        evicted(api, ns, f"gpt-{attempt}-1")  # before any checkpoint
    kube.wait_pods(ns, {"gpt-4-0", "gpt-4-1"})
    st = kube.wait_status(ns, "gpt", "attempt 4", lambda s: s.get("attempt") == 4)
    assert st["phase"] == "Pending", st
    assert st["restarts"] == {"preemptions": 3, "failures": 0, "neverStarted": 0, "total": 3, "inPlace": 0, "hangs": 0}
    assert st["noProgressAttempts"] == 0


# -- 5: activeDeadlineSeconds does not count time spent suspended -------------------------------------


def test_job_suspended_past_its_deadline_resumes_and_runs(kube, s3_server, policy):
    ns, api = policy[0]["suspend"], kube.admin
    create_job(kube, s3_server, ns, activeDeadlineSeconds=12)
    kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
    kube.wait_status(ns, "gpt", "attempt 1 started", lambda s: s.get("attempt") == 1 and s.get("startTime"))
    api.patch(f"{kube.jobs(ns)}/gpt", {"spec": {"suspend": True}})
    st = kube.wait_status(ns, "gpt", "Suspended", lambda s: s.get("phase") == "Suspended")
    assert st["attempt"] == 1
    suspended = time.monotonic()
    while time.monotonic() - suspended < 13:  # past the deadline, suspended all along
        assert kube.job(ns, "gpt")["status"]["phase"] == "Suspended"
        time.sleep(0.5)
    api.patch(f"{kube.jobs(ns)}/gpt", {"spec": {"suspend": False}})
    run_gang(kube, ns, 2)
    st = kube.job(ns, "gpt")["status"]
    assert st["phase"] == "Running" and st["restarts"]["total"] == 0
    # The clock restarted at resume: the deadline still holds for running time.
    st = kube.wait_status(ns, "gpt", "DeadlineExceeded", lambda s: s.get("phase") == "Failed", timeout=40)
    assert st["reason"] == "DeadlineExceeded"


# -- 8: a node that dies is a preemption, however its peers exit ---------------------------------------


def test_peer_failure_on_a_not_ready_node_is_a_preemption(kube, s3_server, policy):
    ns, api = policy[0]["node"], kube.admin
    node = f"node-{ns}"[:63]
    kubelet = Kubelet(api, name=node).start()
    try:
        create_job(kube, s3_server, ns, scheduling={"nodeSelector": {"kubernetes.io/hostname": node}})
        kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        kube.wait_for("pods bound to the node", lambda: all(
            p["spec"].get("nodeName") == node for p in kube.pods(ns).values()))
        set_running(api, ns, "gpt-1-0")
        set_running(api, ns, "gpt-1-1")
        kube.wait_status(ns, "gpt", "Running", lambda s: s.get("phase") == "Running")
        kubelet.lose()  # its kubelet stops: else its status sync (every 5 s) reports the node Ready again
        api.patch(f"/api/v1/nodes/{node}/status", {"status": {"conditions": [
            {"type": "Ready", "status": "False", "reason": "KubeletNotReady",
             "message": "container runtime network not ready", "lastHeartbeatTime": "2026-11-22T12:00:00Z",
             "lastTransitionTime": "2026-11-22T12:00:00Z"}]}})
        set_exited(api, ns, "gpt-1-0", 5, {"exitCode": 5, "reason": "PeerFailure", "message": "rank 1 unreachable"})
        st = kube.wait_status(ns, "gpt", "Restarting", lambda s: s.get("phase") == "Restarting")
        assert st["reason"] == "NodeNotReady" and "container runtime network not ready" in st["message"], st
        assert st["restarts"] == {"preemptions": 1, "failures": 0, "neverStarted": 0, "total": 1,
                                  "inPlace": 0, "hangs": 0}
        assert st.get("nextAttemptTime") is None  # a preemption restarts at once
    finally:
        kubelet.stop()
        api.delete(f"/api/v1/nodes/{node}", ok=(404,))


# -- 7 and 10: the API server refuses what cannot work ---------------------------------------------------


def refused(kube, s3_server, ns: str, name: str = "bad", **spec: Any) -> str:
    with pytest.raises(ApiError) as info:
        create_job(kube, s3_server, ns, name, **spec)
    assert info.value.status == 422, info.value
    return str(info.value)


def test_api_server_refuses_bad_specs_and_changes_to_immutable_fields(kube, s3_server, policy):
    ns, api = policy[0]["cel"], kube.admin
    assert "spec.statusPort must differ from spec.masterPort" in refused(kube, s3_server, ns, statusPort=29500)
    assert "disagrees with spec.gpusPerNode" in refused(
        kube, s3_server, ns, gpusPerNode=8, resources={"limits": {"nvidia.com/gpu": 4}})
    assert "may not set checkpoint.save or checkpoint.load" in refused(
        kube, s3_server, ns, overrides=["checkpoint.save=s3://elsewhere/x"])
    assert "at most 45 characters" in refused(kube, s3_server, ns, name="x" * 50)

    create_job(kube, s3_server, ns, suspend=True)
    job = f"{kube.jobs(ns)}/gpt"
    for change, field in (({"nodes": 1}, "spec.nodes"), ({"nodes": 3}, "spec.nodes"),
                          ({"config": "train:\n  train_iters: 80\n"}, "spec.config"),
                          ({"overrides": ["train.train_iters=80"]}, "spec.overrides")):
        with pytest.raises(ApiError) as info:
            api.patch(job, {"spec": change})
        assert info.value.status == 422 and f"{field} cannot change while the job exists" in str(info.value)
    api.patch(job, {"spec": {"suspend": False, "backoffLimit": 5, "activeDeadlineSeconds": 3600}})  # still mutable
    assert kube.job(ns, "gpt")["spec"]["backoffLimit"] == 5


def test_bad_trainer_config_fails_before_any_pod(kube, s3_server, policy):
    ns = policy[0]["config"]
    create_job(kube, s3_server, ns, config="train:\n  train_iters: 40\noptimizer:\n  lr: -1\n")
    st = kube.wait_status(ns, "gpt", "Failed", lambda s: s.get("phase") == "Failed")
    assert st["reason"] == "ConfigError" and st["message"].startswith("spec.config: optimizer.lr"), st
    assert not kube.pods(ns, role=None) and st.get("attempt") is None
    assert "AttemptCreated" not in {e["reason"] for e in kube.events(ns)}


# -- 13: iteration and lostIterations after restarts ---------------------------------------------------


@pytest.fixture
def live():
    endpoint = StatusEndpoint()
    yield endpoint
    endpoint.close()


def test_iteration_follows_the_new_attempt_and_lost_work_is_counted_once(kube, s3_server, policy, live):
    ns, api = policy[0]["iter"], kube.admin
    create_job(kube, s3_server, ns, statusPort=live.port)
    for attempt, reached, lost in ((1, 400, 100), (2, 320, 120)):
        live.live = {"iteration": reached, "trainIters": 1000, "lastCheckpoint": {"iteration": 300, "time": "t"}}
        run_gang(kube, ns, attempt)
        kube.wait_status(ns, "gpt", f"iteration {reached}", lambda s, r=reached: s.get("iteration") == r)
        live.live = None
        evicted(api, ns, f"gpt-{attempt}-1")  # no save: the work past iteration 300 is lost
        st = kube.wait_status(ns, "gpt", f"attempt {attempt + 1}",
                              lambda s, a=attempt: s.get("attempt") == a + 1)
        assert st["iteration"] == 300 and st["progress"] == "30%", st  # where the new attempt resumes
        assert st["lostIterations"] == lost, st
