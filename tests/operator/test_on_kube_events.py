"""The operator is event-driven: a job whose pods wait costs no API request, and a pod's
failure reaches the job's status at once, not at the next `--interval`. The API server counts the
operator's requests (a FlowSchema matching only its ServiceAccount; /metrics)."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest

from tests.kube.cluster import set_exited
from tests.kube.fixtures import KubeEnv
from tests.kube.request_count import count_operator_requests, operator_requests
from tests.operator.jobs import PVC_JOB

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def quiet(env: KubeEnv, window: float = 3.0, limit: float = 60.0) -> float:
    """Wait until the operator made no request for `window` seconds; the requests of the last window."""
    t0, last = time.monotonic(), operator_requests(env)
    while True:
        time.sleep(window)
        now = operator_requests(env)
        if now == last or time.monotonic() - t0 > limit:
            return now - last
        last = now


def pvc_job(ns: str, name: str) -> dict[str, Any]:
    body = copy.deepcopy(PVC_JOB)
    body["metadata"] = {"name": name, "namespace": ns}
    return body


def test_a_start_costs_its_writes_waiting_costs_nothing_and_a_pod_failure_shows_at_once(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    count_operator_requests(kube)
    with kube.operator(ns, interval=2):  # the polling operator made a GET + a LIST per job every 2 s
        for name in ("a", "b", "c"):
            api.create(kube.jobs(ns), pvc_job(ns, name))
        kube.wait_pods(ns, {f"{j}-1-{r}" for j in "abc" for r in (0, 1)})
        kube.wait_status(ns, "c", "attempt 1", lambda s: s.get("attempt") == 1)
        assert quiet(kube) == 0, "the operator still makes API requests while nothing changes"
        # A start is its writes (pods, status, events): nothing wrote to a job but its status (no
        # finalizer, no kopf annotation), nothing read a job back (the watch and the status patch's
        # answer tell), no request was refused, and no Service nor peer token while the pods wait for a node
        # (their claim "ckpt" does not exist: the scheduler leaves them Unschedulable).
        calls = kube.operator_calls(ns)
        assert not [c for c in calls if c[:2] == ("patch", "trainingjobs")], calls
        assert not [c for c in calls if c[0] == "get" or c[2] >= 400], calls
        assert [calls[("create", kind, 201)] for kind in ("services", "secrets", "pods")] == [0, 0, 6], calls
        assert not [c for c in calls if c[1] == "configmaps"], calls  # the config travels on the pods
        r0 = operator_requests(kube)
        time.sleep(6)
        assert operator_requests(kube) - r0 == 0, "requests while three jobs wait for their pods"
        # Once a pod is placed on a node, its job's Service (rank 0's name) and peer token are created, and only
        # that job's.
        api.create(f"/api/v1/namespaces/{ns}/pods/a-1-1/binding", {
            "apiVersion": "v1", "kind": "Binding", "metadata": {"name": "a-1-1"},
            "target": {"apiVersion": "v1", "kind": "Node", "name": "node-1"}})
        svc = kube.wait_for("job a's Service", lambda: api.get(f"/api/v1/namespaces/{ns}/services/a", ok=(404,)))
        assert svc["metadata"]["ownerReferences"][0]["name"] == "a" and svc["spec"]["clusterIP"] == "None"
        token = kube.wait_for("job a's peer token", lambda: api.get(f"/api/v1/namespaces/{ns}/secrets/a-peers",
                                                                    ok=(404,)))
        assert token["metadata"]["ownerReferences"][0]["name"] == "a" and len(token["data"]["token"]) >= 40
        quiet(kube)
        calls = kube.operator_calls(ns)
        assert [calls[("create", kind, 201)] for kind in ("services", "secrets")] == [1, 1], calls

    with kube.operator(ns, interval=60):  # a restarted operator; nothing may wait for its interval
        time.sleep(1)
        t0 = time.monotonic()
        set_exited(api, ns, "b-1-1", 1, message="boom")
        st = kube.wait_status(ns, "b", "the failure counted",
                              lambda s: (s.get("restarts") or {}).get("failures") == 1, timeout=60)
        assert time.monotonic() - t0 < 10, "a pod failure waited for the next interval"
        assert st["phase"] == "Restarting"
