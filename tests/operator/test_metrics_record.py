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


def test_a_deleted_jobs_series_go_and_a_job_made_again_under_its_name_keeps_its_own():
    def ratio() -> float | None:
        return metrics.REGISTRY.get_sample_value("kubetron_goodput_ratio", {"namespace": "team-a", "name": "x"})

    ledger = {"phase": "Running", "goodput": {"ratio": 0.5, "seconds": {}}}
    metrics.record("team-a", "x", {}, ledger, created_attempt=False, uid="old")
    metrics.forget("team-a", "x")  # the DELETED event
    metrics.record("team-a", "x", {}, ledger, created_attempt=False, uid="old")  # a reconcile that was in flight
    metrics.record("team-a", "x", {}, ledger, created_attempt=False, uid="new")  # made again, same name
    metrics.forget("team-a", "x", "old")  # the old job's daemon ends after its last act: not the new job's series
    assert ratio() == 0.5
    metrics.forget("team-a", "x", "new")
    assert ratio() is None
