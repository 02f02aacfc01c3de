"""The real `kubetron operator` command against a real API server (tests/kube): it starts as the chart's
ServiceAccount, under the chart's RBAC, and reconciles TrainingJobs. The test plays the kubelet (pod
statuses, termination messages) and the trainer (its termination messages and progress log)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.operator.jobs import S3_JOB

pytestmark = pytest.mark.timeout(180)


def tj(ns: str, name: str = "gpt", **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(S3_JOB)
    body["metadata"] = {"name": name, "namespace": ns}
    body["spec"].update(spec)
    return body


def test_operator_command_starts_and_creates_an_attempt(kube, kube_ns):
    """`kubetron operator` with today's kopf, logged in through a kubeconfig with the SA's token."""
    with kube.operator(kube_ns) as op:
        kube.admin.create(kube.jobs(kube_ns), tj(kube_ns))
        kube.wait_pods(kube_ns, {"gpt-1-0", "gpt-1-1"})
        st = kube.wait_status(kube_ns, "gpt", "Pending attempt 1",
                              lambda s: s.get("phase") == "Pending" and s.get("attempt") == 1)
        assert st["restarts"] == {"preemptions": 0, "failures": 0, "total": 0}
        kube.wait_for("pods bound by the scheduler", lambda: all(
            p["spec"].get("nodeName") for p in kube.pods(kube_ns).values()))
    assert "Traceback" not in op.log(), op.tail()
