"""Kubernetes' own gang scheduling (`spec.scheduling.gang: kubernetes`, KEP-4671, docs/gang.md) on the real
kube-scheduler: the test control plane runs with the GenericWorkload and GangScheduling gates and serves
scheduling.k8s.io/v1alpha2 (tests/kube/cluster.py), which the operator finds by discovery. It makes one PodGroup
per attempt (minCount = the attempt's size) and links every pod to it; placement is the scheduler's own. The test
plays the kubelet of a pool of Nodes with one CPU each, so one pod (requesting one CPU) fits per Node. What a
1.37 server (v1beta1) gets: tests/operator/test_gang_versions.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubetron_operator.api_calls import Kube, kubernetes_transport

from tests.kube.cluster import GANG_API, Api, Kubelet, set_running
from tests.operator.jobs import s3_job

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
POOL = "kubetron.dev/test-pool"
PODGROUPS = f"/apis/{GANG_API}/namespaces/{{ns}}/podgroups"


@pytest.fixture(autouse=True)
def gang_api(kube) -> None:
    if not kube.cp.serves(GANG_API):
        pytest.skip(f"the test control plane does not serve {GANG_API} (Kubernetes < 1.36, or KUBETRON_K8S_GATES='')")


@contextlib.contextmanager
def pool(api: Api, ns: str) -> Iterator[Callable[[str], None]]:
    """add(name) registers a Node of the pool (one CPU, Ready, its Lease renewed); all go at the end."""
    nodes: list[Kubelet] = []

    def add(name: str) -> None:
        nodes.append(Kubelet(api, name=name, cpu="1", gpus=0).start())
        api.patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {POOL: ns}}})

    try:
        yield add
    finally:
        for node in nodes:
            node.stop()
            api.delete(f"/api/v1/nodes/{node.name}", ok=(404,))


def gang_job(kube, ns: str, s3_server, name: str = "gpt", **spec: Any) -> dict[str, Any]:
    return s3_job(kube, ns, s3_server, name, resources={"requests": {"cpu": "1"}},
                  scheduling={"gang": "kubernetes", "nodeSelector": {POOL: ns}}, **spec)


def pod_group(kube, ns: str, name: str) -> dict[str, Any] | None:
    return kube.admin.get(f"{PODGROUPS.format(ns=ns)}/{name}", ok=(404,))


def min_count(group: dict[str, Any]) -> int:
    return group["spec"]["schedulingPolicy"]["gang"]["minCount"]


def unschedulable(pod: dict[str, Any]) -> bool:
    """The scheduler has looked at the pod and not placed it."""
    return any(c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable"
               for c in (pod.get("status") or {}).get("conditions") or ())


def waiting_gang(kube, ns: str, names: set[str]) -> dict[str, dict[str, Any]]:
    """The pods `names` once the scheduler has marked every one of them Unschedulable."""
    def check() -> dict[str, dict[str, Any]] | None:
        pods = {n: p for n, p in kube.pods(ns).items() if n in names}
        return pods if set(pods) == names and all(unschedulable(p) for p in pods.values()) else None
    return kube.wait_for(f"{sorted(names)} Unschedulable", check, 60)


def bound(kube, ns: str, names: set[str], timeout: float = 60) -> dict[str, str]:
    """pod -> node once each of `names` is bound."""
    def check() -> dict[str, str] | None:
        pods = kube.pods(ns)
        nodes = {n: (pods.get(n) or {}).get("spec", {}).get("nodeName") for n in names}
        return nodes if all(nodes.values()) else None
    return kube.wait_for(f"{sorted(names)} bound to nodes", check, timeout)


def owned_by(obj: dict[str, Any], job: dict[str, Any]) -> bool:
    return any(ref.get("controller") and ref["uid"] == job["metadata"]["uid"]
               for ref in obj["metadata"].get("ownerReferences") or ())


def test_gang_binds_no_pod_until_all_fit_and_a_deleted_job_leaves_no_pod_group(kube, kube_ns, s3_server):
    ns, api = kube_ns, kube.admin
    with pool(api, ns) as add_node:
        add_node(f"{ns}-a")  # room for one pod of the two
        with kube.operator(ns):
            api.create(kube.jobs(ns), gang_job(kube, ns, s3_server))
            group = kube.wait_for("PodGroup gpt-1", lambda: pod_group(kube, ns, "gpt-1"))
            assert min_count(group) == 2 and owned_by(group, kube.job(ns, "gpt"))
            pods = waiting_gang(kube, ns, {"gpt-1-0", "gpt-1-1"})
            time.sleep(2)  # the scheduler retries meanwhile: still all or nothing
            pods = kube.pods(ns)
            assert {n: p["spec"].get("nodeName") for n, p in pods.items()} == {"gpt-1-0": None, "gpt-1-1": None}
            assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "gpt-1"} for p in pods.values())
            (cond,) = pod_group(kube, ns, "gpt-1")["status"]["conditions"]
            assert (cond["type"], cond["status"], cond["reason"]) == ("PodGroupScheduled", "False", "Unschedulable")
            st = kube.wait_status(ns, "gpt", "Unschedulable", lambda s: s.get("reason") == "Unschedulable")
            assert st["phase"] == "Pending", st
            assert st["podGroup"] == {"apiVersion": GANG_API, "name": "gpt-1"}  # the version the server serves

            t0 = time.monotonic()
            add_node(f"{ns}-b")  # now the gang fits: both pods at once
            nodes = bound(kube, ns, {"gpt-1-0", "gpt-1-1"})
            joined = time.monotonic() - t0
            assert sorted(nodes.values()) == [f"{ns}-a", f"{ns}-b"]
            for pod in nodes:
                set_running(api, ns, pod)
            kube.wait_status(ns, "gpt", "Running", lambda s: s.get("phase") == "Running")

            # A second job finds the pool full: its gang waits, no pod bound.
            api.create(kube.jobs(ns), gang_job(kube, ns, s3_server, "late"))
            waiting_gang(kube, ns, {"late-1-0", "late-1-1"})
            late = kube.job(ns, "late")
            assert owned_by(pod_group(kube, ns, "late-1"), late)
        # With no operator running, deleting the waiting job leaves its PodGroup and pods to the garbage
        # collector (their owner references).
        api.delete(f"{kube.jobs(ns)}/late")
        kube.wait_for("late's PodGroup and pods gone", lambda: pod_group(kube, ns, "late-1") is None
                      and not {"late-1-0", "late-1-1"} & set(kube.pods(ns)), 60)
        assert pod_group(kube, ns, "gpt-1") is not None and {"gpt-1-0", "gpt-1-1"} <= set(kube.pods(ns))
        api.delete(f"{kube.jobs(ns)}/gpt")  # no gang job left for a cluster-wide operator of a later test
    print(f"\n[gang] both pods bound {joined:.1f}s after the second node joined")


def test_elastic_job_shrinks_and_grows_with_a_pod_group_per_attempt(kube, kube_ns, s3_server):
    """nodes: 2, minNodes: 1 on one Node: the 2-pod gang waits, the job shrinks to a 1-pod gang (minCount 1)
    that runs; a probe (no PodGroup) asks for the second pod's room; once a Node joins, a 2-pod gang runs."""
    ns, api = kube_ns, kube.admin
    with pool(api, ns) as add_node, kube.operator(ns):
        add_node(f"{ns}-a")
        api.create(kube.jobs(ns), gang_job(kube, ns, s3_server, nodes=2, minNodes=1, shrinkAfterSeconds=2))
        assert min_count(kube.wait_for("PodGroup gpt-1", lambda: pod_group(kube, ns, "gpt-1"))) == 2
        st = kube.wait_status(ns, "gpt", "shrunk to 1 node", lambda s: s.get("attempt") == 2 and s.get("nodes") == 1,
                              60)
        assert st["podGroup"] == {"apiVersion": GANG_API, "name": "gpt-2"}  # v1alpha2: a PodGroup per attempt
        assert min_count(kube.wait_for("PodGroup gpt-2", lambda: pod_group(kube, ns, "gpt-2"))) == 1
        assert bound(kube, ns, {"gpt-2-0"}) == {"gpt-2-0": f"{ns}-a"}
        set_running(api, ns, "gpt-2-0")
        kube.wait_status(ns, "gpt", "Running at 1 node", lambda s: s.get("phase") == "Running" and s["nodes"] == 1)
        probe = kube.wait_for("a probe for rank 1", lambda: kube.pods(ns, role="probe").get("gpt-2-probe-1"))
        assert "schedulingGroup" not in probe["spec"]  # a probe asks for room, it is no member of the gang
        kube.wait_for("PodGroup gpt-1 deleted", lambda: pod_group(kube, ns, "gpt-1") is None)

        add_node(f"{ns}-b")
        kube.wait_status(ns, "gpt", "grown to 2 nodes", lambda s: s.get("attempt") == 3 and s.get("nodes") == 2, 60)
        assert min_count(kube.wait_for("PodGroup gpt-3", lambda: pod_group(kube, ns, "gpt-3"))) == 2
        nodes = bound(kube, ns, {"gpt-3-0", "gpt-3-1"})
        assert sorted(nodes.values()) == [f"{ns}-a", f"{ns}-b"]
        for pod in nodes:
            set_running(api, ns, pod)
        st = kube.wait_status(ns, "gpt", "Running at 2 nodes", lambda s: s.get("phase") == "Running")
        assert st["resizes"] == {"shrinks": 1, "grows": 1} and st["restarts"]["total"] == 0, st
        kube.wait_for("PodGroup gpt-2 deleted", lambda: pod_group(kube, ns, "gpt-2") is None)
        api.delete(f"{kube.jobs(ns)}/gpt")


def test_the_operator_discovers_the_pod_group_version_the_real_api_server_serves(kube):
    """With the chart's ServiceAccount token (discovery needs no rule of the chart's: system:discovery), once:
    v1beta1 first (not served by 1.36: 404), then v1alpha2; asked again only after it is forgotten (a 404)."""
    configuration = client.Configuration(host=kube.cp.server)
    configuration.ssl_ca_cert = str(kube.cp.pki / "ca.crt")
    configuration.api_key = {"BearerToken": kube.operator_token}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    send = kubernetes_transport(client.ApiClient(configuration))
    asked: list[tuple[str, int]] = []

    def transport(method: str, path: str, query: Any, body: Any, content_type: str) -> tuple[int, bytes]:
        status, data = send(method, path, query, body, content_type)
        asked.append((path, status))
        return status, data

    operator = Kube(transport)
    assert [operator.pod_group_api("kubernetes") for _ in range(3)] == [GANG_API] * 3
    assert asked == [("/apis/scheduling.k8s.io/v1beta1", 404), ("/apis/scheduling.k8s.io/v1alpha2", 200)]
    operator.forget_pod_group_api("kubernetes")
    assert operator.pod_group_api("kubernetes") == GANG_API and len(asked) == 4
