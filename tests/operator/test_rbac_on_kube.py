"""The chart's RBAC and the operator's calls agree, on the real API server (tests/kube, RBAC on).

For each set of rules the chart can render (default, gangScheduling, peering, watchNamespaces and
their combinations), the test installs exactly what `helm install` would create for it (ServiceAccount,
(Cluster)Role(Binding), peering object), gets that ServiceAccount a token (TokenRequest, as a pod's
projected token), and runs the real `kubetron operator` with the arguments of the chart's Deployment.
TrainingJobs then go through their whole life: created, running, a trainer failure and the restart,
suspended, resumed, deleted. The API server's audit log is the judge: not one request of that
ServiceAccount may be refused (HTTP 403); the operator's metric and log agree. A negative control cuts
one rule from the role and sees all three notice the refused call, so the check cannot pass vacuously.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubetron_operator.api_calls import GANG_GROUPS
from prometheus_client.parser import text_string_to_metric_families

from tests.kube.cluster import GANG_API, free_port, set_exited, set_running
from tests.kube.fixtures import CHART, KubeEnv
from tests.operator.jobs import S3_JOB

helm = pytest.importorskip("kubetron_operator.helm")
pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) is not installed")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

RELEASE_NS = "kubetron-rbac"  # the release namespace: the variants' ServiceAccounts live here
NS = "<watched>"  # stands for the test's namespace in the values below
PEERING = "<release>"  # stands for the release's name
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "KopfPeering",
              "ClusterKopfPeering")

# Every set of rules the chart renders (tests/test_chart.py's VALUE_SETS render no other; see
# test_the_variants_cover_every_rule_set_of_the_chart), with the gang schedulers its jobs ask for.
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "default": ({}, ("none", "volcano")),  # a gang job without gangScheduling: a clear status, no call
    "gang": ({"gangScheduling": {"enabled": True}, "failingNodes": {"taint": True}},
             ("volcano", "coscheduling", "kubernetes", "none")),
    "peering": ({"operator": {"peering": PEERING}}, ("none",)),
    "namespaced": ({"watchNamespaces": [NS]}, ("none",)),
    "namespaced-gang": ({"watchNamespaces": [NS], "gangScheduling": {"enabled": True, "schedulers": ["volcano"]}},
                        ("volcano",)),
    "namespaced-peering": ({"watchNamespaces": [NS], "operator": {"peering": PEERING}}, ("none",)),
}

# Minimal PodGroup CRDs of Volcano and scheduler-plugins (the schedulers themselves are not needed:
# the operator only creates, reads and deletes the objects).
PODGROUP_CRDS = [{
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": f"podgroups.{group}"},
    "spec": {"group": group, "scope": "Namespaced",
             "names": {"plural": "podgroups", "singular": "podgroup", "kind": "PodGroup"},
             "versions": [{"name": version, "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
} for group, version in (("scheduling.volcano.sh", "v1beta1"), ("scheduling.x-k8s.io", "v1alpha1"))]


# -- the chart, installed for one variant -------------------------------------------------------------


def substitute(values: Any, ns: str, release: str) -> Any:
    if isinstance(values, dict):
        return {k: substitute(v, ns, release) for k, v in values.items()}
    if isinstance(values, list):
        return [substitute(v, ns, release) for v in values]
    return {NS: ns, PEERING: release}.get(values, values) if isinstance(values, str) else values


def rules(manifests: list[dict[str, Any]]) -> frozenset[tuple[str, str, str, str]]:
    """(kind, apiGroup, resource, verb) of every grant: what a set of rules allows, names aside."""
    return frozenset((m["kind"], group, resource, verb) for m in manifests if m["kind"] in ("ClusterRole", "Role")
                     for rule in m["rules"] for group in rule["apiGroups"] for resource in rule["resources"]
                     for verb in rule["verbs"])


class Release:
    """The chart rendered for `values` as release `name`: its RBAC objects and the operator's arguments."""

    def __init__(self, name: str, values: dict[str, Any]):
        self.name = name
        self.manifests = helm.template(CHART, values, name=name, namespace=RELEASE_NS)
        (deployment,) = [m for m in self.manifests if m["kind"] == "Deployment"]
        pod = deployment["spec"]["template"]["spec"]
        self.service_account = pod["serviceAccountName"]
        self.user = f"system:serviceaccount:{RELEASE_NS}:{self.service_account}"
        self.args = pod["containers"][0]["args"]
        self.rbac = [m for m in self.manifests if m["kind"] in RBAC_KINDS]

    def cut(self, resource: str, verb: str) -> None:
        """Take `verb` on `resource` out of every rule (the negative control)."""
        for m in self.rbac:
            for rule in m.get("rules") or ():
                if resource in rule["resources"]:
                    assert rule["resources"] == [resource], rule  # else the rule's other resources lose it too
                    rule["verbs"] = [v for v in rule["verbs"] if v != verb]

    def install(self, kube: KubeEnv, tmp_path) -> str:
        """Apply the RBAC objects; a kubeconfig with a token of the ServiceAccount (what the pod mounts)."""
        kube.cp.create_namespace(RELEASE_NS)
        kube.admin.apply_all(self.rbac)
        token = kube.admin.create(
            f"/api/v1/namespaces/{RELEASE_NS}/serviceaccounts/{self.service_account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}},
        )["status"]["token"]
        return str(kube.cp.kubeconfig_for(token, tmp_path / f"{self.name}.kubeconfig"))

    def operator_args(self, metrics_port: int) -> list[str]:
        """The Deployment's arguments; the test's fixture sets the liveness endpoint, and metrics go to a
        free port of this machine."""
        assert any(a.startswith("--metrics-port=") for a in self.args), self.args  # metrics.enabled: the default
        return [f"--metrics-port={metrics_port}" if a.startswith("--metrics-port=") else a
                for a in self.args if not a.startswith("--liveness=")]


@contextlib.contextmanager
def chart_operator(kube: KubeEnv, release: Release, tmp_path) -> Iterator[tuple[Any, int]]:
    """The real `kubetron operator` as the chart runs it, under the release's ServiceAccount."""
    kubeconfig = release.install(kube, tmp_path)
    port = free_port()
    with kube.operator(None, *release.operator_args(port), env={"KUBECONFIG": kubeconfig}) as op:
        yield op, port


@pytest.fixture(scope="module")
def podgroup_crds(kube):
    """The PodGroup CRDs for this module only (elsewhere a gang job finds none: a 404 CreateFailed)."""
    for crd in PODGROUP_CRDS:
        kube.cp.install_crd_object(crd)
    yield
    for crd in PODGROUP_CRDS:
        kube.admin.delete(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}",
                          ok=(404,))


# -- what the operator did, three ways ----------------------------------------------------------------


def refused(kube: KubeEnv, user: str) -> list[tuple[str, str, str, str]]:
    """The requests of `user` the API server refused (403): (verb, apiGroup, resource, namespace)."""
    out = []
    for e in kube.cp.audit(user):
        decision = (e.get("annotations") or {}).get("authorization.k8s.io/decision")
        if (e.get("responseStatus") or {}).get("code") == 403 or decision == "forbid":
            ref = e.get("objectRef") or {}
            resource = "/".join(filter(None, (ref.get("resource"), ref.get("subresource"))))
            out.append((e["verb"], ref.get("apiGroup", ""), resource, ref.get("namespace", "")))
    return out


def requested(kube: KubeEnv, user: str) -> set[tuple[str, str, str]]:
    """(verb, apiGroup, resource) of every request `user` made."""
    return {(e["verb"], (e.get("objectRef") or {}).get("apiGroup", ""), (e.get("objectRef") or {}).get("resource"))
            for e in kube.cp.audit(user) if e.get("objectRef")}


def podgroups(kube: KubeEnv, user: str, ns: str) -> set[tuple[str, str]]:
    """(apiGroup, job) of the PodGroup requests of `user` in `ns` (a PodGroup is named <job>-<attempt>; a
    cluster-wide operator also reconciles the jobs other tests left in their namespaces)."""
    refs = [e.get("objectRef") or {} for e in kube.cp.audit(user)]
    return {(ref.get("apiGroup", ""), ref.get("name", "?").rsplit("-", 1)[0]) for ref in refs
            if ref.get("resource") == "podgroups" and ref.get("namespace") == ns}


def forbidden_metric(port: int) -> float:
    """kubetron_api_errors_total{code="403"} from the operator's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kubetron_api_errors_total" and s.labels.get("code") == "403")


def forbidden_log_lines(op) -> list[str]:
    return [line for line in op.log().splitlines()
            if re.search(r"\bWARNING\b.*API call forbidden \(HTTP 403\)", line)]


# -- the jobs' life -----------------------------------------------------------------------------------


def create_jobs(kube: KubeEnv, ns: str, s3_server, gangs: tuple[str, ...]) -> list[str]:
    """A job per gang scheduler (a fresh bucket each; one Secret with the keys); their names."""
    kube.admin.create(f"/api/v1/namespaces/{ns}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
        "data": {"AWS_ACCESS_KEY_ID": base64.b64encode(s3_server.access_key.encode()).decode(),
                 "AWS_SECRET_ACCESS_KEY": base64.b64encode(s3_server.secret_key.encode()).decode()}})
    for gang in gangs:
        body = copy.deepcopy(S3_JOB)
        body["metadata"] = {"name": gang, "namespace": ns}
        body["spec"]["scheduling"] = {"gang": gang}
        body["spec"]["storage"]["s3"].update(bucket=s3_server.new_bucket(), endpoint=s3_server.endpoint)
        kube.admin.create(kube.jobs(ns), body)
    return list(gangs)


def pods_of(name: str, attempt: int) -> set[str]:
    return {f"{name}-{attempt}-0", f"{name}-{attempt}-1"}


def live_through(kube: KubeEnv, ns: str, names: list[str]) -> None:
    """Running, a pod's failure (rank 1 preempted: the restart's calls without a failure's backoff),
    suspended, resumed, deleted: the jobs side by side."""
    api, jobs = kube.admin, kube.jobs(ns)
    kube.wait_pods(ns, set().union(*(pods_of(n, 1) for n in names)))
    for name in names:
        for pod in sorted(pods_of(name, 1)):
            set_running(api, ns, pod)
    for name in names:
        kube.wait_status(ns, name, "Running", lambda s: s.get("phase") == "Running")
        set_exited(api, ns, f"{name}-1-1", 75, {"exitCode": 75, "reason": "SavedOnSignal"},
                   conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}])
    kube.wait_pods(ns, set().union(*(pods_of(n, 2) for n in names)))
    for name in names:
        st = kube.wait_status(ns, name, "attempt 2", lambda s: s.get("attempt") == 2)
        assert st["restarts"]["preemptions"] == 1, st
        api.patch(f"{jobs}/{name}", {"spec": {"suspend": True}})
    for name in names:
        kube.wait_status(ns, name, "Suspended", lambda s: s.get("phase") == "Suspended")
    kube.wait_pods(ns, set())
    for name in names:
        api.patch(f"{jobs}/{name}", {"spec": {"suspend": False}})
    kube.wait_pods(ns, set().union(*(pods_of(n, 3) for n in names)))
    for name in names:
        api.delete(f"{jobs}/{name}")
    kube.wait_for("jobs and their children deleted", lambda: not any(kube.job(ns, n) for n in names)
                  and not kube.pods(ns, role=None))


# -- the tests ----------------------------------------------------------------------------------------


def test_the_variants_cover_every_rule_set_of_the_chart():
    """Each set of rules the chart renders for the values tests/test_chart.py checks is one of VARIANTS
    (names and namespaces aside), so no (Cluster)Role goes untested on the server."""
    from tests.chart_values import VALUE_SETS

    ours = {rules(Release(f"rbac-{k}", substitute(v, "team-a", f"rbac-{k}")).manifests)
            for k, (v, _) in VARIANTS.items()}
    for name, values in VALUE_SETS.items():
        assert rules(Release("kubetron", values).manifests) in ours, name
    assert len(ours) == len(VARIANTS)  # no two variants test the same rules


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_no_call_is_forbidden_through_a_jobs_life(kube, s3_server, podgroup_crds, tmp_path, variant):
    values, gangs = VARIANTS[variant]
    gangs = tuple(g for g in gangs if g != "kubernetes" or kube.cp.serves(GANG_API))  # 1.36+ with its gates
    ns = kube.namespace("rbac")
    release = Release(f"rbac-{variant}", substitute(values, ns, f"rbac-{variant}"))
    gang_values = values.get("gangScheduling") or {}
    enabled = set(gang_values.get("schedulers", GANG_GROUPS)) if gang_values.get("enabled") else set()
    granted = [g for g in gangs if g == "none" or g in enabled]
    with chart_operator(kube, release, tmp_path) as (op, port):
        create_jobs(kube, ns, s3_server, gangs)
        for name in set(gangs) - set(granted):  # the chart does not grant its PodGroups: no call, a status
            st = kube.wait_status(ns, name, "Failed", lambda s: s.get("phase") == "Failed")
            assert st["reason"] == "CreateFailed" and "gangScheduling.enabled=true" in st["message"], st
            kube.admin.delete(f"{kube.jobs(ns)}/{name}")
        live_through(kube, ns, granted)
        kube.wait_for("every job deleted", lambda: not any(kube.job(ns, n) for n in gangs))
        assert forbidden_metric(port) == 0
    assert not forbidden_log_lines(op), forbidden_log_lines(op)
    assert refused(kube, release.user) == [], op.tail(80)
    calls = requested(kube, release.user)
    assert {("create", "", "pods"), ("delete", "", "pods"), ("get", "", "secrets"), ("list", "", "nodes"),
            ("patch", "kubetron.dev", "trainingjobs")} <= calls, calls  # the whole life went through
    # Each job's PodGroup, of its gang scheduler's kind: none asked for a job without one.
    assert podgroups(kube, release.user, ns) == {(GANG_GROUPS[g], g) for g in granted if g != "none"}


def test_a_call_the_role_does_not_grant_is_seen(kube, s3_server, tmp_path):
    """The negative control: without `create services` in the role, creating an attempt is refused. The audit
    log, the metric and a warning naming the call all show it, and the job says why."""
    ns = kube.namespace("rbac")
    release = Release("rbac-cut", {"watchNamespaces": [ns]})
    release.cut("services", "create")
    with chart_operator(kube, release, tmp_path) as (op, port):
        create_jobs(kube, ns, s3_server, ("none",))
        st = kube.wait_status(ns, "none", "Failed", lambda s: s.get("phase") == "Failed")
        assert st["reason"] == "CreateFailed" and "forbidden" in st["message"], st
        kube.wait_for("the refusal in the audit log", lambda: refused(kube, release.user))
        assert forbidden_metric(port) >= 1
        kube.admin.delete(f"{kube.jobs(ns)}/none")
        kube.wait_for("job deleted", lambda: kube.job(ns, "none") is None)
    assert set(refused(kube, release.user)) == {("create", "", "services", ns)}
    (line, *_) = forbidden_log_lines(op)
    assert f"create services in namespace {ns}" in line, line


def test_gang_schedulers_flag_names_only_known_schedulers():
    kubetron = str(Path(sys.executable).with_name("kubetron"))
    out = subprocess.run([kubetron, "operator", "--gang-schedulers=volcano,kueue"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr.strip() == (
        "kubetron: error: --gang-schedulers: kueue: must be volcano, coscheduling, kubernetes or none")


def test_a_namespace_pattern_is_refused_in_one_line():
    """The pods are watched per named namespace (pod_cache): a kopf-style pattern would leave them unwatched."""
    kubetron = str(Path(sys.executable).with_name("kubetron"))
    out = subprocess.run([kubetron, "operator", "--namespace=ml", "--namespace=team-*"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip() == (
        "kubetron: error: --namespace: 'team-*' is a pattern; name each namespace to watch (or none: every namespace)")
