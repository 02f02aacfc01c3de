"""The API server counts the operator's requests: a FlowSchema that matches only the operator's
ServiceAccount, and its dispatched-requests counter on /metrics."""

from __future__ import annotations

from tests.kube.fixtures import OPERATOR_NS, OPERATOR_SA, KubeEnv

FLOW_SCHEMA = "kubetron-test-operator"
METRIC = "apiserver_flowcontrol_dispatched_requests_total"


def count_operator_requests(env: KubeEnv) -> None:
    """A FlowSchema that matches only the operator's identity, so /metrics counts its requests apart."""
    env.admin.create("/apis/flowcontrol.apiserver.k8s.io/v1/flowschemas", {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
        "metadata": {"name": FLOW_SCHEMA},
        "spec": {"priorityLevelConfiguration": {"name": "workload-high"}, "matchingPrecedence": 100,
                 "distinguisherMethod": {"type": "ByUser"},
                 "rules": [{"subjects": [{"kind": "ServiceAccount",
                                          "serviceAccount": {"namespace": OPERATOR_NS, "name": OPERATOR_SA}}],
                            "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                               "clusterScope": True, "namespaces": ["*"]}],
                            "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]},
    }, ok=(409,))


def operator_requests(env: KubeEnv) -> float:
    """Requests the API server dispatched for the operator's ServiceAccount so far."""
    text = env.admin.get("/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(METRIC + "{") and f'flow_schema="{FLOW_SCHEMA}"' in line)
