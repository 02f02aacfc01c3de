"""The real `kubetron operator` process serves Prometheus metrics (`--metrics-port`): scraped over HTTP and
parsed with prometheus-client's own parser, while it reconciles jobs on a real API server. The chart's
dashboard reads only metrics it serves (tests/dashboard.py)."""

from __future__ import annotations

import time
import urllib.request

import pytest
from kubetron.contract.goodput import BUCKETS as GOODPUT_BUCKETS
from prometheus_client.parser import text_string_to_metric_families

from tests import dashboard
from tests.kube.cluster import free_port, set_exited, set_running
from tests.operator.jobs import tj

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(scrape_text(port)) for s in family.samples}


def test_operator_metrics(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    port = free_port()
    with kube.operator(ns, f"--metrics-port={port}"):
        api.create(kube.jobs(ns), tj(ns))
        kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        set_running(api, ns, "gpt-1-0")
        set_running(api, ns, "gpt-1-1")
        kube.wait_status(ns, "gpt", "Running", lambda s: s.get("phase") == "Running")
        # The ledger counts whole seconds (status.goodput.asOf): on a fast machine the preemption below came
        # within the second the job was created, and every bucket said 0 (CI).
        time.sleep(1.1)
        # A preemption: rank 1 is preempted and saves on SIGTERM; the job restarts for free.
        set_exited(api, ns, "gpt-1-1", 75, {"exitCode": 75, "reason": "SavedOnSignal"},
                   conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}])
        kube.wait_pods(ns, {"gpt-2-0", "gpt-2-1"}, timeout=60)
        # A job whose pods the API server refuses (no such PriorityClass): API errors, by status code.
        api.create(kube.jobs(ns), tj(ns, "nopc", scheduling={"priorityClassName": "does-not-exist"}))
        kube.wait_status(ns, "nopc", "Failed", lambda s: s.get("phase") == "Failed", timeout=60)

        def settled():
            m = scrape(port)
            return m if m.get(("kubetron_trainingjobs", (("phase", "Failed"),))) == 1 and m.get(
                ("kubetron_trainingjobs", (("phase", "Pending"),))) == 1 else None
        m = kube.wait_for("metrics: one job Pending, one Failed", settled, 30)
        assert m[("kubetron_trainingjobs", (("phase", "Running"),))] == 0
        assert m[("kubetron_attempts_total", ())] >= 2  # gpt's two attempts (nopc's first, if it got that far)
        assert m[("kubetron_restarts_total", (("reason", "preemptions"),))] == 1
        assert ("kubetron_restarts_total", (("reason", "failures"),)) not in m
        # Event-driven: a reconcile (read, decide, apply) runs only when there is something to do: gpt's
        # attempt 1, Running, the restart, attempt 2; nopc's failed creation.
        assert m[("kubetron_reconcile_duration_seconds_count", ())] >= 5
        assert m[("kubetron_api_errors_total", (("code", "403"),))] >= 1
        # The goodput ledger of each job (status.goodput): gauges per bucket and the ratio, as status says.
        ledger = kube.job(ns, "gpt")["status"]["goodput"]  # gpt waits for attempt 2's pods: nothing moves
        job = (("name", "gpt"), ("namespace", ns))
        gauges = {b: m[("kubetron_goodput_seconds", tuple(sorted((*job, ("bucket", b)))))] for b in GOODPUT_BUCKETS}
        assert gauges == pytest.approx(ledger["seconds"]) and sum(gauges.values()) > 0
        assert m[("kubetron_goodput_ratio", job)] == pytest.approx(ledger["ratio"])
        # Every operator metric a dashboard query reads is served (each has samples by now).
        assert dashboard.read_by("operator") and dashboard.missing("operator", scrape_text(port)) == set()
        # ... with the labels its panel filters and groups by (the goodput gauges say name=, not trainingjob=)
        assert dashboard.unserved_labels("operator", scrape_text(port)) == set()

        api.delete(f"{kube.jobs(ns)}/nopc")
        kube.wait_for("the deleted job no longer counted", lambda: scrape(port).get(
            ("kubetron_trainingjobs", (("phase", "Failed"),))) == 0, 30)
        assert not [k for k in scrape(port) if k[0].startswith("kubetron_goodput") and ("name", "nopc") in k[1]]
