"""Kubernetes' own gang scheduling across its API versions (docs/gang.md), in-process: the operator asks the API
server which PodGroup version it serves (v1beta1 from 1.37 first, then 1.36's v1alpha2; once, cached, asked again
after a 404), and on v1beta1 an elastic job keeps one PodGroup whose minCount follows each attempt's size, where
on v1alpha2 each attempt has its own. No 1.37 API server can be built or downloaded here: the v1beta1 objects
the operator writes are validated against the pinned client's v1beta1 models (kubernetes 37.0.1) and the
published 1.37 schema (kubernetes-validate 1.37.0's JSON schema, generated from kubernetes/kubernetes'
api/openapi-spec), strictly; the API answers come from a stand-in (tests/operator/api_standin.py). The same code
against the real 1.36 control plane (v1alpha2): tests/operator/test_gang_on_kube.py."""

from __future__ import annotations

import copy
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes.client import V1beta1PodGroup
from kubetron.contract.resource import GROUP, PLURAL, VERSION
from kubetron_operator.api_calls import Kube, api_path
from kubetron_operator.apply import act
from kubetron_operator.build import attempt_objects, pod_group_resize
from kubetron_operator.decide import decide
from kubetron_operator.deps import Deps
from kubetron_operator.gather import observe
from kubetron_operator.model import Job
from kubetron_operator.trainer_reports.store_log import ProgressRead

from tests.operator.api_standin import ApiStandIn, merge
from tests.operator.jobs import S3_JOB, job_body

pytestmark = pytest.mark.unit

kv = pytest.importorskip("kubernetes_validate.utils")
LOG = logging.getLogger("test")
T0 = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)
JOB_PATH = api_path(GROUP, VERSION, PLURAL, "ml", "gpt")
V1BETA1, V1ALPHA2 = "scheduling.k8s.io/v1beta1", "scheduling.k8s.io/v1alpha2"
ELASTIC = {"nodes": 2, "minNodes": 1, "shrinkAfterSeconds": 2, "scheduling": {"gang": "kubernetes"}}


def discovery(api: ApiStandIn) -> list[str]:
    return [path for method, path in api.requests if path.count("/") == 3 and path.startswith("/apis/scheduling")]


# (versions the server serves, the one chosen, discovery requests)
SERVED = [
    (("v1beta1", "v1alpha2"), V1BETA1, 1),  # 1.37 serving both (v1alpha3 too): the beta one
    (("v1beta1",), V1BETA1, 1),
    (("v1alpha2",), V1ALPHA2, 2),  # 1.36: v1beta1 answers 404 first
    ((), None, 2),  # neither: older than 1.36, or the Workload API off
]


@pytest.mark.parametrize(("served", "chosen", "asked"), SERVED)
def test_the_served_pod_group_version_is_discovered_once(served, chosen, asked):
    api = ApiStandIn(served=served)
    kube = Kube(api)
    assert [kube.pod_group_api("kubernetes") for _ in range(3)] == [chosen] * 3  # cached after the first
    assert len(discovery(api)) == asked
    assert kube.pod_group_api("volcano") == "scheduling.volcano.sh/v1beta1" and len(discovery(api)) == asked
    assert kube.pod_group_api("none") is None
    kube.forget_pod_group_api("kubernetes")  # a PodGroup request answered 404: ask again
    assert kube.pod_group_api("kubernetes") == chosen and len(discovery(api)) == 2 * asked


def test_a_gang_the_role_does_not_grant_is_never_discovered():
    api = ApiStandIn(served=("v1beta1",))
    kube = Kube(api, gang_schedulers=("volcano",))
    assert kube.pod_group_api("kubernetes") == V1BETA1 and api.requests == []


def podgroup_of(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    (group,) = [m for m in manifests if m["kind"] == "PodGroup"]
    return group


def test_v1beta1_objects_are_valid_against_the_clients_models_and_the_1_37_schema():
    """What the operator writes on a 1.37 cluster: the PodGroup (minCount the attempt's size, disruptionMode the
    v1beta1 struct), the pods naming it, and the group after the minCount merge patch of a later, smaller attempt."""
    job = Job.from_body(job_body(S3_JOB, **ELASTIC))
    manifests = attempt_objects(job, 3, nodes=2, pod_group_api=V1BETA1)
    group = podgroup_of(manifests)
    assert group["metadata"]["name"] == "gpt" and "kubetron.dev/attempt" not in group["metadata"]["labels"]
    assert group["spec"] == {"schedulingPolicy": {"gang": {"minCount": 2}}, "disruptionMode": {"all": {}}}
    smaller = podgroup_of(attempt_objects(job, 4, nodes=1, pod_group_api=V1BETA1))
    resized = merge(copy.deepcopy(group), pod_group_resize(smaller))
    assert resized == {**group, "spec": {**group["spec"], "schedulingPolicy": {"gang": {"minCount": 1}}}}
    for obj in (group, resized):
        assert V1beta1PodGroup.model_validate(obj).model_dump(by_alias=True, exclude_none=True) == obj
        with pytest.raises(ValueError, match="disruptionMode"):  # v1alpha2's form (a string) is not v1beta1's
            V1beta1PodGroup.model_validate({**obj, "spec": {**obj["spec"], "disruptionMode": "PodGroup"}})
    pods = [m for m in manifests if m["kind"] == "Pod"]
    assert len(pods) == 2 and all(p["spec"]["schedulingGroup"] == {"podGroupName": "gpt"} for p in pods)
    for obj in (group, resized, pods[1]):
        kv.validate(obj, "1.37.0", strict=True)
    with pytest.raises(Exception, match="minMember"):  # the check reads the objects: a stray field fails it
        kv.validate({**group, "spec": {**group["spec"], "minMember": 2}}, "1.37.0", strict=True)


def test_v1alpha2_objects_are_as_before_and_valid_against_the_1_36_schema():
    job = Job.from_body(job_body(S3_JOB, **ELASTIC))
    manifests = attempt_objects(job, 3, nodes=1, pod_group_api=V1ALPHA2)
    group = podgroup_of(manifests)
    assert group["metadata"]["name"] == "gpt-3" and group["spec"] == {"schedulingPolicy": {"gang": {"minCount": 1}}}
    assert manifests == attempt_objects(job, 3, nodes=1)  # what the operator wrote before it discovered versions
    for obj in manifests:
        kv.validate(obj, "1.36.0", strict=True)


class Cluster:
    """The stand-in API with one elastic gang job, and the operator's wake-ups against it at a clock we move."""

    def __init__(self, served: tuple[str, ...]) -> None:
        self.api = ApiStandIn(served=served)
        body = job_body(S3_JOB, **ELASTIC)
        body["metadata"].update(resourceVersion="1", creationTimestamp="2026-11-22T11:59:00Z")
        self.api.add(JOB_PATH, body)
        self.now = T0
        self.deps = Deps(kube=Kube(self.api), read_progress=lambda job, kube: ProgressRead(), clock=lambda: self.now)

    @property
    def status(self) -> dict[str, Any]:
        return self.api.objects[JOB_PATH].get("status") or {}

    def wake(self, seconds: float = 1.0) -> str:
        """One wake-up `seconds` after the last: observe, decide, act. Returns the action's kind."""
        self.now += timedelta(seconds=seconds)
        body = copy.deepcopy(self.api.objects[JOB_PATH])
        obs, job = observe(self.deps, body)
        action = decide(job, obs)
        act(self.deps, body, job, obs, action, LOG)
        return action.kind

    def pod(self, name: str, **status: Any) -> None:
        self.api.objects[f"/api/v1/namespaces/ml/pods/{name}"].update(status)

    def groups(self) -> dict[str, dict[str, Any]]:
        return self.api.of_kind("PodGroup")

    def group_requests(self) -> list[tuple[str, str]]:
        return [(m, p.rsplit("/podgroups", 1)[1] or "/") for m, p in self.api.requests if "/podgroups" in p]


RUNNING = {"status": {"phase": "Running", "podIP": "10.0.0.1", "containerStatuses": [
    {"name": "trainer", "state": {"running": {"startedAt": "2026-11-22T12:00:00Z"}}}]}}
DONE = {"status": {"phase": "Succeeded", "containerStatuses": [{"name": "trainer", "state": {"terminated": {
    "exitCode": 0, "reason": "Completed", "startedAt": "2026-11-22T12:00:00Z"}}}]}}
UNSCHEDULABLE = {"status": {"phase": "Pending", "conditions": [
    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes are available"}]}}


def shrink_grow_succeed(c: Cluster, group: str) -> list[int]:
    """Attempt 1 (2 pods) does not fit and shrinks to 1 pod, whose probe for the second finds room: attempt 3 runs
    on 2 pods and succeeds. Returns the minCount of the job's PodGroup(s) after each attempt's creation."""
    sizes = []
    assert c.wake() == "create"
    sizes.append(c.groups()[group.format(attempt=1)]["spec"]["schedulingPolicy"]["gang"]["minCount"])
    c.pod("gpt-1-0", spec={**c.api.objects["/api/v1/namespaces/ml/pods/gpt-1-0"]["spec"], "nodeName": "n1"})
    c.pod("gpt-1-1", **UNSCHEDULABLE)
    assert c.wake(3) == "restart" and c.status["resizeTo"] == 1  # shrinkAfterSeconds 2
    assert c.wake() == "create" and c.status["attempt"] == 2 and c.status["nodes"] == 1
    sizes.append(c.groups()[group.format(attempt=2)]["spec"]["schedulingPolicy"]["gang"]["minCount"])
    c.pod("gpt-2-0", **RUNNING)
    c.wake()  # Running at 1 node: a probe asks for the second
    probe = "/api/v1/namespaces/ml/pods/gpt-2-probe-1"
    c.api.objects[probe]["spec"]["nodeName"] = "n2"
    c.api.objects[probe].update(RUNNING)
    assert c.wake() == "restart" and c.status["resizeTo"] == 2
    assert c.wake() == "wait" and probe not in c.api.objects  # the probe goes once the gang is gone
    assert c.wake() == "create" and c.status["attempt"] == 3 and c.status["nodes"] == 2
    sizes.append(c.groups()[group.format(attempt=3)]["spec"]["schedulingPolicy"]["gang"]["minCount"])
    for pod in ("gpt-3-0", "gpt-3-1"):
        c.pod(pod, **DONE)
    assert c.wake() == "succeed" and c.status["phase"] == "Succeeded"
    return sizes


def test_on_v1beta1_an_elastic_job_keeps_one_pod_group_whose_min_count_follows_the_attempt():
    c = Cluster(served=("v1beta1", "v1alpha2"))
    assert shrink_grow_succeed(c, "gpt") == [2, 1, 2]
    # One create; then each attempt's size as a merge patch of minCount (the create answers 409, the group is
    # read for its owner); no attempt's end deleted it, the job's end did.
    methods = [m for m, _ in c.group_requests()]
    assert methods.count("POST") == 3 and methods.count("PATCH") == 2 and methods.count("DELETE") == 1
    assert methods[-1] == "DELETE" and not c.groups()
    assert all(p == "/" or p == "/gpt" for _, p in c.group_requests())
    assert c.status["podGroup"] == {"apiVersion": V1BETA1, "name": "gpt"}
    assert {p["spec"]["schedulingGroup"]["podGroupName"] for p in c.api.of_kind("Pod").values()
            if p["metadata"]["labels"]["kubetron.dev/role"] == "worker"} == {"gpt"}


def test_on_v1alpha2_each_attempt_has_its_own_pod_group_as_before():
    c = Cluster(served=("v1alpha2",))
    assert shrink_grow_succeed(c, "gpt-{attempt}") == [2, 1, 2]
    assert [m for m, _ in c.group_requests() if m != "GET"] == ["POST", "DELETE", "POST", "DELETE", "POST", "DELETE"]
    assert c.status["podGroup"] == {"apiVersion": V1ALPHA2, "name": "gpt-3"} and not c.groups()


def test_a_404_reads_the_served_version_again():
    """The cluster was upgraded under a running operator: the version it found answers 404; it asks again, says
    so, and the retry uses what is served now."""
    c = Cluster(served=("v1alpha2",))
    c.deps.kube.pod_group_api("kubernetes")  # found v1alpha2
    c.api.served = {"v1beta1"}
    assert c.wake() == "create"
    assert c.status["reason"] == "CreateRetrying" and f"serves {V1BETA1} now" in c.status["message"]
    assert not c.api.of_kind("Pod")  # nothing of the failed try is left
    assert c.wake(30) == "create" and c.status["attempt"] == 1 and c.status["podGroup"]["apiVersion"] == V1BETA1
    assert set(c.groups()) == {"gpt"}


def test_a_cluster_serving_no_pod_group_version_fails_the_job_saying_why():
    c = Cluster(served=())
    assert c.wake() == "fail"
    assert c.status["reason"] == "CreateFailed" and V1BETA1 in c.status["message"] and V1ALPHA2 in c.status["message"]
    assert not c.api.of_kind("Pod") and not c.group_requests()
