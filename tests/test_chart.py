"""The Helm chart: lints, renders valid Kubernetes objects for default and non-default values, ships the
same CRD as crds/, grants exactly the API calls the operator makes, and runs the operator locked down.

Helm runs in-process through helm-python-sdk (kubetron_operator.helm); no cluster, no helm binary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chart_values import VALUE_SETS

pytestmark = pytest.mark.unit

helm = pytest.importorskip("kubetron_operator.helm")
pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) is not installed")
kv = pytest.importorskip("kubernetes_validate.utils")

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "kubetron"
RELEASE_NS = "kubetron-system"

# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest bundled schema.
KUBE_VERSIONS = ["1.27", kv.latest_version()]


def render(values: dict) -> list[dict]:
    return helm.template(CHART, values, namespace=RELEASE_NS, include_crds=True)


@pytest.fixture(scope="module", params=list(VALUE_SETS), ids=list(VALUE_SETS))
def rendered(request) -> tuple[dict, list[dict]]:
    values = VALUE_SETS[request.param]
    return values, render(values)


def of_kind(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind]


def peering_name(values: dict) -> str:
    """kopf peering: operator.peering, else leader election under the release name with replicas > 1."""
    return values.get("operator", {}).get("peering") or ("kubetron" if values.get("replicas", 1) > 1 else "")


# ------------------------------------------------------------------------------------------------ lint


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_strict_is_clean(name):
    assert helm.lint(CHART, VALUE_SETS[name] or None) == []


def test_values_schema_rejects_a_typo_and_names_it():
    problems = helm.lint(CHART, {"watchNamespace": ["a"]})
    assert problems and any("watchNamespace" in p for p in problems)


@pytest.mark.parametrize("values, field", [
    ({"watchNamespaces": ["Team_A"]}, "watchNamespaces"),
    ({"gangScheduling": {"enabled": True, "schedulers": ["kueue"]}}, "schedulers"),
    ({"operator": {"healthPort": 80}}, "healthPort"),
    ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
])
def test_values_schema_rejects_bad_values(values, field):
    import helm_python

    with pytest.raises(helm_python.HelmValuesError, match=field):
        render(values)


def test_package(tmp_path):
    archive = helm.package(CHART, tmp_path / "dist")
    assert archive.name == "kubetron-0.1.0.tgz" and archive.is_file()


def test_notes_say_how_to_watch_jobs():
    notes = helm.notes(CHART, {"watchNamespaces": ["team-a"]})
    assert "kubectl get tj -w" in notes and "team-a" in notes


# ----------------------------------------------------------------------------------- manifest validity


def test_rendered_manifests_validate_strictly(rendered):
    _, manifests = rendered
    assert manifests
    crds = {(m["spec"]["group"], m["spec"]["names"]["kind"]): m for m in manifests
            if m["kind"] == "CustomResourceDefinition"}
    for manifest in manifests:
        group = manifest["apiVersion"].partition("/")[0]
        if (group, manifest["kind"]) in crds:  # the chart's own custom resources: their CRD's schema
            import jsonschema

            (version,) = crds[(group, manifest["kind"])]["spec"]["versions"]
            jsonschema.validate(manifest, version["schema"]["openAPIV3Schema"])
            assert manifest["apiVersion"] == f"{group}/{version['name']}" and manifest["metadata"]["name"]
            continue
        for version in KUBE_VERSIONS:
            kv.validate(manifest, version, strict=True)


def test_chart_crd_is_the_top_level_crd():
    chart_crd = CHART / "crds" / "trainingjob.yaml"
    top_crd = ROOT / "crds" / "trainingjob.yaml"
    assert chart_crd.read_bytes() == top_crd.read_bytes(), (
        "charts/kubetron/crds/trainingjob.yaml drifted from crds/trainingjob.yaml: "
        "cp crds/trainingjob.yaml charts/kubetron/crds/"
    )


def test_everything_namespaced_goes_to_the_release_namespace(rendered):
    values, manifests = rendered
    for m in of_kind(manifests, "Deployment") + of_kind(manifests, "ServiceAccount"):
        assert m["metadata"]["namespace"] == RELEASE_NS
    assert {m["metadata"]["namespace"] for m in of_kind(manifests, "Role")} == set(
        values.get("watchNamespaces", []))


# -------------------------------------------------------------------------------------------- the pod


def deployment(manifests: list[dict]) -> dict:
    (dep,) = of_kind(manifests, "Deployment")
    return dep


def test_operator_pod_is_locked_down(rendered):
    _, manifests = rendered
    pod = deployment(manifests)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not sc.get("privileged")
    # The read-only root needs a writable /tmp.
    tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert len(tmp) == 1
    (volume,) = [v for v in pod["volumes"] if v["name"] == tmp[0]["name"]]
    assert "emptyDir" in volume
    assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]


def test_probes_hit_kopfs_health_endpoint(rendered):
    values, manifests = rendered
    (container,) = deployment(manifests)["spec"]["template"]["spec"]["containers"]
    port = values.get("operator", {}).get("healthPort", 8080)
    assert container["command"] == ["kubetron", "operator"]
    assert f"--liveness=http://0.0.0.0:{port}/healthz" in container["args"]
    (named,) = [p for p in container["ports"] if p["name"] == "health"]
    assert named["containerPort"] == port
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_operator_watches_the_configured_namespaces(rendered):
    values, manifests = rendered
    (container,) = deployment(manifests)["spec"]["template"]["spec"]["containers"]
    namespaces = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--namespace=")]
    if values.get("watchNamespaces"):
        assert namespaces == values["watchNamespaces"]
    else:
        assert namespaces == []  # `kubetron operator` with no --namespace watches every namespace


def test_extra_args_come_last_verbatim():
    (container,) = deployment(render({"operator": {"extraArgs": ["--x=1", "y"]}}))["spec"]["template"]["spec"][
        "containers"]
    assert container["args"][-2:] == ["--x=1", "y"]


def test_operator_reads_with_its_own_identity_only_the_buckets_listed():
    """operatorS3Buckets becomes --s3-operator-buckets; none listed, no flag (the operator reads no store with
    its own identity); a name that is no bucket is refused at install."""
    import helm_python

    def args(values: dict) -> list[str]:
        return deployment(render(values))["spec"]["template"]["spec"]["containers"][0]["args"]

    assert not [a for a in args({}) if a.startswith("--s3-operator-buckets")]
    assert "--s3-operator-buckets=ml-ckpt,shared.runs" in args({"operatorS3Buckets": ["ml-ckpt", "shared.runs"]})
    with pytest.raises(helm_python.HelmValuesError, match="operatorS3Buckets"):
        render({"operatorS3Buckets": ["a/b"]})


def test_pod_runs_as_the_service_account_the_bindings_name(rendered):
    _, manifests = rendered
    sa = deployment(manifests)["spec"]["template"]["spec"]["serviceAccountName"]
    bindings = of_kind(manifests, "ClusterRoleBinding") + of_kind(manifests, "RoleBinding")
    assert bindings
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": RELEASE_NS}]
    created = of_kind(manifests, "ServiceAccount")
    assert [m["metadata"]["name"] for m in created] in ([sa], [])


# ----------------------------------------------------------------------------------------------- RBAC


def rules_of(manifests: list[dict], kind: str, namespace: str | None = None) -> list[dict]:
    return [rule for m in of_kind(manifests, kind)
            if namespace is None or m["metadata"].get("namespace") == namespace
            for rule in m["rules"]]


def granted(rules: list[dict]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples the rules allow."""
    return {(group, resource, verb) for rule in rules for group in rule.get("apiGroups", [])
            for resource in rule.get("resources", []) for verb in rule["verbs"]}


def test_rbac_has_no_wildcards(rendered):
    _, manifests = rendered
    for kind in ("ClusterRole", "Role"):
        for rule in rules_of(manifests, kind):
            for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                assert not any("*" in item for item in rule.get(key, [])), (kind, rule)
            assert "nonResourceURLs" not in rule


def test_rbac_covers_exactly_the_operators_api_calls(rendered):
    """Every call the operator can make with these values is allowed where it makes it; nothing else is."""
    values, manifests = rendered
    required = operator_api_calls(values)
    cluster_calls = {c for c in required if (c[0], c[1]) in CLUSTER_SCOPED}
    namespaced_calls = required - cluster_calls
    cluster_rules = granted(rules_of(manifests, "ClusterRole"))
    if not values.get("watchNamespaces"):
        assert not of_kind(manifests, "Role")
        assert_same_rules(cluster_rules, required, "ClusterRole")
    else:
        # Namespaced rights only through a Role in each watched namespace; the ClusterRole holds the
        # cluster-scoped calls alone.
        assert_same_rules(cluster_rules, cluster_calls, "ClusterRole")
        for ns in values["watchNamespaces"]:
            assert_same_rules(granted(rules_of(manifests, "Role", ns)), namespaced_calls, f"Role in {ns}")


def assert_same_rules(granted_: set, required: set, where: str) -> None:
    missing, extra = sorted(required - granted_), sorted(granted_ - required)
    assert not missing and not extra, (
        f"{where}: missing {missing} (add to charts/kubetron/templates/_rules.tpl), "
        f"not used by the operator {extra}")


def test_podgroup_rules_only_with_gang_scheduling():
    def groups(values):
        return {g for g, _, _ in granted(rules_of(render(values), "ClusterRole"))}

    assert not set(GANG_GROUPS) & groups({})
    assert set(GANG_GROUPS) <= groups({"gangScheduling": {"enabled": True}})


def test_operator_asks_only_for_the_podgroups_the_role_grants(rendered):
    """`--gang-schedulers` names exactly the schedulers whose PodGroup rules the chart renders: the
    operator never calls the others' API (a job asking for one fails with a status saying why)."""
    _, manifests = rendered
    (container,) = deployment(manifests)["spec"]["template"]["spec"]["containers"]
    (flag,) = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--gang-schedulers=")]
    groups = {g for g, resource, _ in granted(rules_of(manifests, "ClusterRole") + rules_of(manifests, "Role"))
              if resource == "podgroups"}
    assert set(flag.split(",")) - {"none"} == {name for group, name in GANG_GROUPS.items() if group in groups}
    assert (flag == "none") == (not groups)


def test_nodes_are_patched_only_with_failing_nodes_taint():
    """Off by default: the role may only list nodes, and the operator is not told to taint any."""
    def node_verbs_and_args(values):
        manifests = render(values)
        (container,) = deployment(manifests)["spec"]["template"]["spec"]["containers"]
        verbs = {v for g, r, v in granted(rules_of(manifests, "ClusterRole")) if (g, r) == ("", "nodes")}
        return verbs, "--taint-failing-nodes" in container["args"]

    assert node_verbs_and_args({}) == ({"list"}, False)
    assert node_verbs_and_args({"failingNodes": {"taint": True}}) == ({"list", "get", "patch"}, True)
    assert node_verbs_and_args({"failingNodes": {"taint": True}, "watchNamespaces": ["team-a"]}) == (
        {"list", "get", "patch"}, True)  # nodes are cluster-scoped: the ClusterRole, also when namespaced


def test_rbac_off_renders_no_roles():
    manifests = render({"rbac": {"create": False}})
    assert not {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} & {m["kind"] for m in manifests}


# --------------------------------------------------------------------------- the operator's registry

# Resources without a namespace: their rules can only live in a ClusterRole.
CLUSTER_SCOPED = {("", "namespaces"), ("apiextensions.k8s.io", "customresourcedefinitions"),
                  ("kopf.dev", "clusterkopfpeerings"), ("", "nodes"), ("", "persistentvolumes"),
                  ("scheduling.k8s.io", "priorityclasses"), ("storage.k8s.io", "storageclasses")}
GANG_GROUPS = {"scheduling.volcano.sh": "volcano", "scheduling.x-k8s.io": "coscheduling",
               "scheduling.k8s.io": "kubernetes"}


def operator_api_calls(values: dict) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every Kubernetes API call the operator can make with these values.

    Read from the operator's own registry (kubetron_operator.api_calls.ALL_CALLS), never written out
    here, so a new call in the operator without a chart rule fails the RBAC test. Calls that only
    happen in some configurations are kept only in those (see charts/kubetron/templates/_rules.tpl).
    """
    api_calls = pytest.importorskip(
        "kubetron_operator.api_calls", reason="the operator's API-call registry does not exist yet")
    gang = values.get("gangScheduling", {})
    schedulers = gang.get("schedulers", ["volcano", "coscheduling", "kubernetes"]) if gang.get("enabled") else []
    namespaced = bool(values.get("watchNamespaces"))
    peering = bool(peering_name(values))
    calls = set()
    for call in api_calls.ALL_CALLS:
        if call.group in GANG_GROUPS and GANG_GROUPS[call.group] not in schedulers:
            continue
        if (call.group, call.resource) == ("", "namespaces") and not namespaced:
            continue  # kopf observes namespaces only when it is not cluster-wide
        if call.group == "kopf.dev" and (
                not peering or call.resource != ("kopfpeerings" if namespaced else "clusterkopfpeerings")):
            continue  # standalone kopf never touches peering objects
        if call in api_calls.TAINT_CALLS and not (values.get("failingNodes") or {}).get("taint"):
            continue  # failing nodes are tainted only with failingNodes.taint
        calls.add((call.group, call.resource, call.verb))
    return calls


def test_every_declared_call_is_granted_in_some_configuration():
    """No registry entry is silently dropped by the conditions above."""
    api_calls = pytest.importorskip("kubetron_operator.api_calls")
    everything = {"gangScheduling": {"enabled": True}, "operator": {"peering": "kubetron"},
                  "failingNodes": {"taint": True}}
    granted_somewhere = set()
    for extra in ({}, {"watchNamespaces": ["team-a"]}):
        manifests = render({**everything, **extra})
        granted_somewhere |= granted(rules_of(manifests, "ClusterRole") + rules_of(manifests, "Role"))
    assert {(c.group, c.resource, c.verb) for c in api_calls.ALL_CALLS} <= granted_somewhere


# ------------------------------------------------------------------------------------ leader election


def test_more_than_one_replica_elects_a_leader(rendered):
    """replicas > 1 turns kopf peering on (one active operator, the others standing by): the flag, the
    peering object(s) it meets in, and a rolling update (a standalone operator must be Recreated)."""
    values, manifests = rendered
    dep = deployment(manifests)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    flags = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--peering=")]
    name = peering_name(values)
    assert dep["spec"]["replicas"] == values.get("replicas", 1)
    assert flags == ([name] if name else [])
    peerings = of_kind(manifests, "KopfPeering") + of_kind(manifests, "ClusterKopfPeering")
    if not name:
        assert dep["spec"]["strategy"] == {"type": "Recreate"} and not peerings
    elif values.get("watchNamespaces"):
        assert {(p["metadata"]["name"], p["metadata"]["namespace"]) for p in peerings} == {
            (name, ns) for ns in values["watchNamespaces"]}
        assert all(p["kind"] == "KopfPeering" for p in peerings)
    else:
        assert [(p["kind"], p["metadata"]["name"]) for p in peerings] == [("ClusterKopfPeering", name)]
    if name:
        assert "strategy" not in dep["spec"]
    pod_id = [e for e in container["env"] if e["name"] == "POD_ID"]
    assert pod_id == ([{"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}] if name else [])


def test_chart_ships_kopfs_peering_crds():
    crds = {m["metadata"]["name"]: m for m in render({}) if m["kind"] == "CustomResourceDefinition"}
    assert crds["clusterkopfpeerings.kopf.dev"]["spec"]["scope"] == "Cluster"
    assert crds["kopfpeerings.kopf.dev"]["spec"]["scope"] == "Namespaced"


def test_metrics_port_service_and_optional_service_monitor():
    default = render({})
    container = of_kind(default, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "--metrics-port=8081" in container["args"]
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in container["ports"]
    (svc,) = of_kind(default, "Service")
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}]
    pod_labels = of_kind(default, "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert not of_kind(default, "ServiceMonitor")  # off by default: its CRD may not exist
    with_monitor = {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}
    assert helm.lint(CHART, with_monitor) == []
    (monitor,) = of_kind(render(with_monitor), "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s",
                                             "honorLabels": True}]
    off = render({"metrics": {"enabled": False}})
    assert not of_kind(off, "Service") and not any(a.startswith("--metrics-port") for a in of_kind(
        off, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"])


def test_only_the_monitoring_namespace_reaches_the_operators_metrics():
    """/metrics names every watched namespace's jobs: the chart's NetworkPolicy lets only
    metrics.networkPolicy.from reach its port; the health port stays open to the kubelet's probes."""
    default = render({})
    (policy,) = of_kind(default, "NetworkPolicy")
    pod_labels = of_kind(default, "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    health, metrics = policy["spec"]["ingress"]
    assert health == {"ports": [{"port": "health", "protocol": "TCP"}]}
    assert metrics == {"ports": [{"port": "metrics", "protocol": "TCP"}], "from": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}
    prom = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}}
    (mine,) = of_kind(render({"metrics": {"networkPolicy": {"from": [prom]}}}), "NetworkPolicy")
    assert mine["spec"]["ingress"][1]["from"] == [prom]
    (closed,) = of_kind(render({"metrics": {"networkPolicy": {"from": []}}}), "NetworkPolicy")
    assert closed["spec"]["ingress"] == [health]  # nobody reaches /metrics


def test_failing_node_taints_last_taint_seconds():
    args = of_kind(render({"failingNodes": {"taint": True, "taintSeconds": 600}}), "Deployment")[0]["spec"][
        "template"]["spec"]["containers"][0]["args"]
    assert "--taint-failing-nodes" in args and "--taint-seconds=600" in args
