"""spec.podTemplate and Kueue on a real API server: what the stored pods carry (after the API server's own
validation and defaulting), how a clash with the operator's fields is reported, and the Kueue contract
(plain pod groups per attempt, suspension by an outside admission controller). Kueue itself cannot run
here; its contract is the labels/annotations of the stored pods and spec.suspend.
"""

from __future__ import annotations

import pytest
from kubetron_operator.build import build_pod
from kubetron_operator.model import Job, SpecError

from tests.kube.cluster import set_running
from tests.operator.jobs import job_body, tj

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]
KUEUE_FINALIZER = "kueue.x-k8s.io/managed"  # Kueue's on the pods it manages

TEMPLATE = {
    "metadata": {"labels": {"team": "nlp", "sidecar.istio.io/inject": "false"},
                 "annotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net",
                                 "kueue.x-k8s.io/podset-required-topology": "cloud.provider.com/topology-rack"}},
    "spec": {
        "volumes": [{"name": "cache", "emptyDir": {}}],
        "initContainers": [{"name": "warm", "image": "busybox", "command": ["true"]}],
        "containers": [
            {"name": "trainer", "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}],
             "envFrom": [{"configMapRef": {"name": "nccl"}}],
             "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
             "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}},
            {"name": "exporter", "image": "busybox", "command": ["sleep", "inf"]},
        ],
    },
}


def test_pod_template_and_queue_reach_the_stored_pods(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    with kube.operator(ns):
        api.create(kube.jobs(ns), tj(ns, podTemplate=TEMPLATE, queueName="team-a"))
        pods = kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        for name, p in pods.items():
            meta, spec = p["metadata"], p["spec"]
            assert meta["labels"]["team"] == "nlp" and meta["labels"]["kubetron.dev/job"] == "gpt"
            assert meta["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
            # A Kueue topology request of the user's: Kueue's TAS reads it from every pod of the group.
            assert meta["annotations"]["kueue.x-k8s.io/podset-required-topology"] == "cloud.provider.com/topology-rack"
            # Kueue's plain pod group: one group per attempt, its size, the LocalQueue.
            assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
            assert meta["labels"]["kueue.x-k8s.io/pod-group-name"] == "gpt-1"
            assert meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"
            assert [c["name"] for c in spec["containers"]] == ["trainer", "exporter"]
            assert [c["name"] for c in spec["initContainers"]] == ["warm"]
            assert {"name": "cache", "emptyDir": {}} in spec["volumes"]
            trainer = spec["containers"][0]
            assert {"name": "cache", "mountPath": "/cache"} in trainer["volumeMounts"]
            assert trainer["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"], "drop": ["ALL"]}
            assert trainer["envFrom"] == [{"configMapRef": {"name": "nccl"}}]
            env = {v["name"]: v.get("value") for v in trainer["env"]}
            assert env["NCCL_IB_HCA"] == "mlx5" and env["NODE_RANK"] == name[-1]

        # Kueue suspends (preempts) a workload through spec.suspend: the pods go, and come back as a new group.
        # Kueue's finalizer holds each pod until Kueue is done with it: the ended group must be marked
        # retriable-in-group=false, or Kueue keeps its Workload (and quota) for replacements that never come.
        for name in pods:
            api.patch(f"/api/v1/namespaces/{ns}/pods/{name}", {"metadata": {"finalizers": [KUEUE_FINALIZER]}})
            set_running(api, ns, name)
        kube.wait_status(ns, "gpt", "Running", lambda s: s.get("phase") == "Running")
        assert all("kueue.x-k8s.io/retriable-in-group" not in p["metadata"]["annotations"]
                   for p in kube.pods(ns).values())  # a running group is left alone
        api.patch(f"{kube.jobs(ns)}/gpt", {"spec": {"suspend": True}})
        kube.wait_status(ns, "gpt", "Suspended", lambda s: s.get("phase") == "Suspended")
        kube.wait_for("the ended group deleted and marked not retriable", lambda: all(
            p["metadata"].get("deletionTimestamp")
            and p["metadata"]["annotations"].get("kueue.x-k8s.io/retriable-in-group") == "false"
            for p in kube.pods(ns).values()))
        for name in pods:  # Kueue finishes the Workload and lets the pods go
            api.patch(f"/api/v1/namespaces/{ns}/pods/{name}", {"metadata": {"finalizers": None}})
        kube.wait_pods(ns, set())
        api.patch(f"{kube.jobs(ns)}/gpt", {"spec": {"suspend": False}})
        pods = kube.wait_pods(ns, {"gpt-2-0", "gpt-2-1"})
        assert {p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for p in pods.values()} == {"gpt-2"}
        st = kube.wait_status(ns, "gpt", "attempt 2", lambda s: s.get("attempt") == 2)
        assert st["restarts"]["total"] == 0


def test_deleting_a_queued_job_releases_its_pod_group(kube, kube_ns):
    """The job is deleted while its pods are held by Kueue's finalizer: they are marked not retriable, so
    Kueue finishes the Workload instead of keeping quota for replacements."""
    ns, api = kube_ns, kube.admin
    with kube.operator(ns):
        api.create(kube.jobs(ns), tj(ns, queueName="team-a"))
        pods = kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        for name in pods:
            api.patch(f"/api/v1/namespaces/{ns}/pods/{name}", {"metadata": {"finalizers": [KUEUE_FINALIZER]}})
        kube.wait_status(ns, "gpt", "Pending", lambda s: s.get("phase") == "Pending")
        # A queued job (only such a one) is held by the operator's finalizer until its pods are let go.
        assert kube.job(ns, "gpt")["metadata"]["finalizers"] == ["kubetron.dev/operator"]
        api.delete(f"{kube.jobs(ns)}/gpt")
        kube.wait_for("the pods deleted and marked not retriable", lambda: kube.pods(ns) and all(
            p["metadata"].get("deletionTimestamp")
            and p["metadata"].get("annotations", {}).get("kueue.x-k8s.io/retriable-in-group") == "false"
            for p in kube.pods(ns).values()))
        for name in pods:
            api.patch(f"/api/v1/namespaces/{ns}/pods/{name}", {"metadata": {"finalizers": None}})
        kube.wait_pods(ns, set())


def test_template_clash_fails_the_job_before_any_pod(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    clash = {"spec": {"containers": [{"name": "trainer", "env": [{"name": "MASTER_ADDR", "value": "x"}]}]}}
    with kube.operator(ns):
        api.create(kube.jobs(ns), tj(ns, podTemplate=clash))
        st = kube.wait_status(ns, "gpt", "Failed", lambda s: s.get("phase") == "Failed")
        assert st["reason"] == "InvalidSpec"
        assert st["message"] == "spec.podTemplate.spec.containers[0].env[0].name: MASTER_ADDR is set by the operator"
        assert kube.pods(ns) == {}
        kube.wait_for("an InvalidSpec Warning event", lambda: any(  # posted just after the status write
            e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in kube.events(ns)))
        # The queue label on the job itself means spec.queueName.
        labeled = tj(ns, "labeled")
        labeled["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-b"}
        api.create(kube.jobs(ns), labeled)
        pods = kube.wait_pods(ns, {"labeled-1-0", "labeled-1-1"})
        assert {p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] for p in pods.values()} == {"team-b"}


GATE = "kueue.x-k8s.io/admission"
MAP = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies"


def gate_queued_pods(kube, ns: str) -> None:
    """What Kueue's pod webhook does, as a MutatingAdmissionPolicy of the real API server: every pod of `ns`
    with a queue label is created with Kueue's admission scheduling gate."""
    api = kube.admin
    api.create(MAP, {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicy",
                     "metadata": {"name": f"gate-{ns}"}, "spec": {
        "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                                                "resources": ["pods"]}]},
        "matchConditions": [{"name": "queued", "expression":
                             "has(object.metadata.labels) && 'kueue.x-k8s.io/queue-name' in object.metadata.labels"}],
        "failurePolicy": "Fail", "reinvocationPolicy": "Never",
        "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression":
                       f"[JSONPatch{{op: 'add', path: '/spec/schedulingGates', value: [{{'name': '{GATE}'}}]}}]"}}],
    }})
    api.create(MAP.replace("policies", "policybindings"), {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicyBinding",
        "metadata": {"name": f"gate-{ns}"}, "spec": {"policyName": f"gate-{ns}", "matchResources": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}}})
    probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe", "labels": {
        "kueue.x-k8s.io/queue-name": "q"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    kube.wait_for("the gating policy in force", lambda: api.create(
        f"/api/v1/namespaces/{ns}/pods", probe, query={"dryRun": "All"})["spec"].get("schedulingGates"), 30)


def test_pods_gated_by_kueue_wait_queued_past_the_startup_timeout(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    gate_queued_pods(kube, ns)
    with kube.operator(ns):
        api.create(kube.jobs(ns), tj(ns, queueName="team-a", startupTimeoutSeconds=2))
        pods = kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        assert all(p["spec"]["schedulingGates"] == [{"name": GATE}] for p in pods.values())
        st = kube.wait_status(ns, "gpt", "Queued", lambda s: s.get("reason") == "Queued")
        assert st["phase"] == "Pending" and "waiting for admission" in st["message"]
        kube.wait_for("the startup timeout (2 s) long past", lambda: api.get(f"{kube.jobs(ns)}/gpt")["status"]
                      .get("attemptStartTime") and _seconds_since(st["attemptStartTime"]) > 5, 30)
        st = kube.job(ns, "gpt")["status"]
        assert st["attempt"] == 1 and st["reason"] == "Queued" and st["restarts"]["total"] == 0
        # Admitted: Kueue removes the gate; the pods then run as any others.
        for name in pods:
            api.patch(f"/api/v1/namespaces/{ns}/pods/{name}", {"spec": {"schedulingGates": None}})
            set_running(api, ns, name)
        st = kube.wait_status(ns, "gpt", "Running", lambda s: s.get("phase") == "Running")
        assert st["attempt"] == 1 and st["restarts"]["total"] == 0
    api.delete(f"{MAP}/gate-{ns}")
    api.delete(f"{MAP.replace('policies', 'policybindings')}/gate-{ns}")


def _seconds_since(iso: str) -> float:
    from datetime import UTC, datetime

    return (datetime.now(UTC) - datetime.fromisoformat(iso.replace("Z", "+00:00"))).total_seconds()


def test_unknown_template_fields_are_rejected_by_the_api_server(kube, kube_ns):
    from tests.kube.cluster import ApiError

    body = tj(kube_ns, podTemplate={"spec": {"nodeName": "n1"}})
    with pytest.raises(ApiError) as err:
        kube.admin.create(kube.jobs(kube_ns), body, query={"fieldValidation": "Strict"})  # kubectl's default
    assert err.value.status == 400 and 'unknown field "spec.podTemplate.spec.nodeName"' in str(err.value)


# -- pure: the merge and its rules ---------------------------------------------------------------------


def job(**spec) -> Job:
    return Job.from_body(job_body(**spec))


def test_host_network_keeps_cluster_dns():
    pod = build_pod(job(podTemplate={"spec": {"hostNetwork": True}}), 1, 0)
    assert pod["spec"]["hostNetwork"] is True and pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "hostNetwork" not in build_pod(job(), 1, 0)["spec"]


def test_no_queue_no_kueue_labels():
    pod = build_pod(job(), 1, 0)
    assert not [k for k in pod["metadata"]["labels"] if k.startswith("kueue")]
    assert set(pod["metadata"]["annotations"]) == {"kubetron.dev/config"}  # the trainer's config only


@pytest.mark.parametrize(("template", "field"), [
    ({"metadata": {"labels": {"kubetron.dev/job": "x"}}}, "spec.podTemplate.metadata.labels[kubetron.dev/job]"),
    ({"metadata": {"annotations": {"kueue.x-k8s.io/pod-group-total-count": "9"}}},
     "spec.podTemplate.metadata.annotations[kueue.x-k8s.io/pod-group-total-count]"),
    ({"metadata": {"annotations": {"kueue.x-k8s.io/retriable-in-group": "true"}}},
     "spec.podTemplate.metadata.annotations[kueue.x-k8s.io/retriable-in-group]"),
    ({"metadata": {"annotations": {"kubetron.dev/config": "model: {}"}}},
     "spec.podTemplate.metadata.annotations[kubetron.dev/config]"),
    ({"metadata": {"labels": {"kueue.x-k8s.io/pod-group-name": "mine"}}},
     "spec.podTemplate.metadata.labels[kueue.x-k8s.io/pod-group-name]"),
    ({"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "q"}}},
     "spec.podTemplate.metadata.labels[kueue.x-k8s.io/queue-name]"),
    ({"spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}, "spec.podTemplate.spec.volumes[0].name"),
    ({"spec": {"volumes": [{"name": "x", "emptyDir": {}}, {"name": "peers", "emptyDir": {}}]}},
     "spec.podTemplate.spec.volumes[1].name"),  # the peer token's (build.job_objects)
    ({"spec": {"containers": [{"name": "trainer", "volumeMounts": [
        {"name": "c", "mountPath": "/var/run/kubetron/peers/"}]}]}},
     "spec.podTemplate.spec.containers[0].volumeMounts[0].mountPath"),
    ({"spec": {"containers": [{"name": "trainer", "image": "evil"}]}}, "spec.podTemplate.spec.containers[0].image"),
    ({"spec": {"containers": [{"name": "trainer", "volumeMounts": [{"name": "c", "mountPath": "/dev/shm"}]}]}},
     "spec.podTemplate.spec.containers[0].volumeMounts[0].mountPath"),
    ({"spec": {"containers": [{"name": "trainer", "securityContext": {"privileged": True}}]}},
     "spec.podTemplate.spec.containers[0].securityContext.privileged"),
    ({"spec": {"initContainers": [{"name": "trainer", "image": "x"}]}}, "spec.podTemplate.spec.initContainers[0].name"),
    ({"spec": {"containers": [{"name": "a", "image": "x"}, {"name": "a", "image": "y"}]}},
     "spec.podTemplate.spec.containers[1].name"),
    ({"spec": {"dnsPolicy": "None"}}, "spec.podTemplate.spec.dnsPolicy"),
])
def test_template_clashes_name_the_field(template, field):
    with pytest.raises(SpecError) as err:
        job(podTemplate=template)
    assert err.value.field == field


def test_queue_label_and_spec_must_agree():
    body = job_body(queueName="a")
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "b"}
    with pytest.raises(SpecError, match="spec.queueName: 'a' disagrees"):
        Job.from_body(body)
