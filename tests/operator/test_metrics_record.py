"""What one reconcile adds to the operator's metrics (kubetron_operator.metrics.record), read back from its registry
as Prometheus would scrape it; the real operator's /metrics on a real API server: test_metrics_on_kube.py."""

from __future__ import annotations

import pytest
from kubetron_operator import metrics

pytestmark = pytest.mark.unit


def restarts(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("kubetron_restarts_total", {"reason": reason}) or 0.0


def test_hangs_count_as_restarts_by_reason_as_the_alert_reads_them():
    before = {r: restarts(r) for r in metrics.RESTART_KINDS}
    old = {"phase": "Running", "restarts": {"total": 1, "failures": 1, "hangs": 0}}
    new = {"phase": "Running", "restarts": {"total": 1, "failures": 1, "hangs": 2}}
    metrics.record("team-a", "gpt", old, new, created_attempt=False)
    assert restarts("hangs") - before["hangs"] == 2  # KubetronJobHung: increase(..{reason="hangs"}) > 0
    assert restarts("failures") == before["failures"]  # unchanged counts add nothing
    metrics.record("team-a", "gpt", new, new, created_attempt=False)
    assert restarts("hangs") - before["hangs"] == 2
    metrics.forget("team-a", "gpt")
