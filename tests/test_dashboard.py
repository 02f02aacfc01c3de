"""The Grafana dashboard the chart ships (charts/kubetron/dashboards/kubetron.json) and its alerts: every
query parses (promtool, Prometheus' own parser), the panels cover what an operator of training jobs looks
at, and the chart installs it as Grafana's dashboard sidecar expects. That each metric name a query reads is
exported: the operator's in tests/operator/test_metrics_on_kube.py, rank 0's in
tests/operator/test_real_trainer_story.py (both scrape the real processes)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml
from kubetron_operator.build import build
from kubetron_operator.model import Job

from tests.dashboard import DASHBOARD, ROOT, dashboard, labels_read, metric_names, queries, read_by, unserved_labels
from tests.operator.jobs import PVC_JOB

pytestmark = pytest.mark.unit

helm = pytest.importorskip("kubetron_operator.helm")
pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) is not installed")

CHART = ROOT / "charts" / "kubetron"
PROMTOOL = shutil.which("promtool")
NO_PROMTOOL = "promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)"


def render(values: dict) -> list[dict]:
    return helm.template(CHART, values, namespace="kubetron-system")


def of_kind(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind]


def promtool_check_rules(tmp_path, groups: list[dict]) -> subprocess.CompletedProcess:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
@pytest.mark.process
def test_every_query_and_alert_parses_with_promtool(tmp_path):
    rules = [{"record": f"kubetron:panel_{i}", "expr": expr} for i, expr in enumerate(queries().values())]
    checked = promtool_check_rules(tmp_path, [{"name": "dashboard", "rules": rules}])
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules)} rules found" in checked.stdout
    (rule,) = of_kind(render({"metrics": {"prometheusRule": {"enabled": True}}}), "PrometheusRule")
    checked = promtool_check_rules(tmp_path, rule["spec"]["groups"])
    assert checked.returncode == 0 and "SUCCESS: 6 rules found" in checked.stdout, checked.stdout + checked.stderr
    # ... and promtool refuses what is not PromQL, so the checks above can fail
    assert promtool_check_rules(tmp_path, [{"name": "x", "rules": [{"record": "x:y", "expr": "sum by (a"}]}]).returncode


def test_the_panels_cover_jobs_restarts_speed_loss_checkpoints_goodput_and_the_operator():
    titles = [p["title"] for p in dashboard()["panels"]]
    assert {"Jobs by phase", "Restarts by kind", "Iterations per second", "Tokens per second", "Loss",
            "Checkpoint save time", "Goodput", "Where the time went", "Operator reconcile latency",
            "Operator API errors"} <= set(titles)
    assert len(titles) == len(set(titles)) and all(p["targets"] for p in dashboard()["panels"])
    assert read_by("operator") == {"kubetron_trainingjobs", "kubetron_restarts_total", "kubetron_attempts_total",
                                   "kubetron_reconcile_duration_seconds_bucket", "kubetron_api_errors_total",
                                   "kubetron_goodput_ratio", "kubetron_goodput_seconds"}
    assert {"kubetron_trainer_iteration", "kubetron_trainer_tokens_per_second", "kubetron_trainer_loss",
            "kubetron_trainer_checkpoint_save_seconds"} <= read_by("trainer")
    for name, expr in queries().items():  # every name read is one of ours: nothing the parse missed
        assert metric_names(expr) and all(n.startswith("kubetron_") for n in metric_names(expr)), name


def test_metric_names_are_read_from_promql():
    assert metric_names('histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="y{z}"}[5m])))') == {"a_bucket"}
    assert metric_names("max by (ns) (a{b=~\"c\"}) / on (ns) group_left b offset 1h > 2e3") == {"a", "b"}


def test_the_chart_installs_it_for_grafanas_sidecar():
    assert not of_kind(render({}), "ConfigMap")  # off by default
    values = {"grafanaDashboard": {"enabled": True, "namespace": "monitoring", "labels": {"team": "ml"},
                                   "annotations": {"grafana_folder": "Training"}}}
    (cm,) = of_kind(render(values), "ConfigMap")
    meta = cm["metadata"]
    assert meta["labels"]["grafana_dashboard"] == "1" and meta["labels"]["team"] == "ml"
    assert meta["namespace"] == "monitoring" and meta["annotations"] == {"grafana_folder": "Training"}
    assert json.loads(cm["data"]["kubetron.json"]) == json.loads(DASHBOARD.read_text())
    assert (CHART / "dashboards" / "kubetron.json") == DASHBOARD


def test_the_pod_monitor_scrapes_rank_0_of_every_job_and_names_the_job():
    (monitor,) = of_kind(render({"metrics": {"podMonitor": {"enabled": True}}}), "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("status", "/metrics")
    assert endpoint["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_pod_label_kubetron_dev_job"],
                                        "targetLabel": "trainingjob"}]  # the label the dashboard groups by
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    selector = monitor["spec"]["selector"]["matchLabels"]
    pods = [m for m in build(Job.from_body(PVC_JOB), 1) if m["kind"] == "Pod"]  # the pods the operator makes
    chosen = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
    assert [p["metadata"]["name"] for p in chosen] == ["gpt-1-0"]
    assert {"name": "status", "containerPort": 8080} in chosen[0]["spec"]["containers"][0]["ports"]
    namespaced = render({"metrics": {"podMonitor": {"enabled": True}}, "watchNamespaces": ["team-a"]})
    assert of_kind(namespaced, "PodMonitor")[0]["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}


def test_the_labels_a_query_reads_are_found_so_a_mislabelled_panel_is_caught():
    assert labels_read('sum by (bucket) (g{namespace=~"$ns", name=~"a{b}"})') == {"bucket", "namespace", "name"}
    assert labels_read("histogram_quantile(0.5, sum by (le) (rate(x_bucket[5m])))") == {"le"}
    text = 'kubetron_goodput_ratio{namespace="a",name="b"} 0.5\n'
    mislabelled = {"panels": [{"title": "Goodput", "targets": [
        {"refId": "A", "expr": 'max by (namespace, trainingjob) (kubetron_goodput_ratio{trainingjob=~".*"})'}]}]}
    assert unserved_labels("operator", text, mislabelled) == {("Goodput / A", "trainingjob")}
    assert not unserved_labels("operator", text)  # the shipped dashboard's goodput panels


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
@pytest.mark.process
def test_the_hung_and_goodput_alerts_fire_on_the_operators_series(tmp_path):
    """promtool's rule unit tests: the operator's own series (as it exports them) over time fire the alerts."""
    values = {"metrics": {"prometheusRule": {"enabled": True, "goodputBelow": 0.6, "goodputFor": "30m"}}}
    (rule,) = of_kind(render(values), "PrometheusRule")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    job = f'job="{operator_job(values)}"'  # the scrape job the ServiceMonitor names after the metrics Service
    low = f'kubetron_goodput_ratio{{namespace="team-a",name="gpt",{job}}}'
    fine = f'kubetron_goodput_ratio{{namespace="team-a",name="ok",{job}}}'
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": low, "values": "0.5x60"}, {"series": fine, "values": "0.9x60"},
                         {"series": f'kubetron_restarts_total{{reason="hangs",{job}}}', "values": "0 0 1 1 1"}],
        "alert_rule_test": [
            {"alertname": "KubetronGoodputLow", "eval_time": "20m", "exp_alerts": []},  # not for 30m yet
            {"alertname": "KubetronGoodputLow", "eval_time": "45m", "exp_alerts": [{
                "exp_labels": {"severity": "info", "namespace": "team-a", "name": "gpt"},
                "exp_annotations": {
                    "summary": "TrainingJob team-a/gpt spends under 0.6 of its rank-seconds training",
                    "description": rule_annotation(rule, "KubetronGoodputLow", "description")}}]},
            {"alertname": "KubetronJobHung", "eval_time": "4m", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "reason": "hangs"},
                "exp_annotations": {k: rule_annotation(rule, "KubetronJobHung", k)
                                    for k in ("summary", "description")}}]},
        ]}]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    ran = subprocess.run([PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    # ... and the same test fails when the threshold does not hold: the check can fail
    (rule,) = of_kind(render({"metrics": {"prometheusRule": {"enabled": True, "goodputBelow": 0.4}}}), "PrometheusRule")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    assert subprocess.run([PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True,
                          timeout=60).returncode


def operator_job(values: dict) -> str:
    """The `job` label of the operator's series: the name of its metrics Service (what a ServiceMonitor sets)."""
    (svc,) = [m for m in of_kind(render(values), "Service") if m["metadata"]["name"].endswith("-metrics")]
    return svc["metadata"]["name"]


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_series_a_trainer_serves_under_the_operators_names_fire_no_alert(tmp_path):
    """A tenant's rank 0 serves /metrics, and the PodMonitor scrapes it. Had it kept a series named like
    the operator's, `kubetron_restarts_total{reason="hangs"}` from a trainer would fire KubetronJobHung: the alerts
    read only the operator's own scrape job, and the PodMonitor keeps only kubetron_trainer_* series."""
    values = {"metrics": {"prometheusRule": {"enabled": True}}}
    (rule,) = of_kind(render(values), "PrometheusRule")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    forged = 'job="team-a/kubetron-trainers",namespace="team-a",trainingjob="evil"'  # what the PodMonitor adds
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": f'kubetron_restarts_total{{reason="hangs",{forged}}}', "values": "0+5x120"},
            {"series": f'kubetron_restarts_total{{reason="failures",{forged}}}', "values": "0+50x120"},
            {"series": f'kubetron_api_errors_total{{code="403",{forged}}}', "values": "0+60x120"},
            {"series": f'kubetron_goodput_ratio{{name="x",{forged}}}', "values": "0x120"}],
        "alert_rule_test": [{"alertname": name, "eval_time": "90m", "exp_alerts": []} for name in (
            "KubetronJobHung", "KubetronTrainerFailuresFrequent", "KubetronOperatorForbidden", "KubetronGoodputLow")],
    }]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    ran = subprocess.run([PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr


def test_a_tenants_series_reach_neither_the_alerts_nor_the_operators_panels():
    """What the chart ships keeps a trainer's /metrics to its own series (rendered; the rules' behaviour:
    test_series_a_trainer_serves_under_the_operators_names_fire_no_alert)."""
    values = {"metrics": {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True},
                          "serviceMonitor": {"enabled": True}}}
    rendered = render(values)
    (endpoint,) = of_kind(rendered, "PodMonitor")[0]["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is False  # a trainer's `namespace` or `trainingjob` never replaces the target's
    assert endpoint["metricRelabelings"] == [{"sourceLabels": ["__name__"], "regex": "kubetron_trainer_.*",
                                              "action": "keep"}]
    (monitor,) = of_kind(rendered, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True  # the operator's own namespace/name labels
    job = f'job="{operator_job(values)}"'
    for r in of_kind(rendered, "PrometheusRule")[0]["spec"]["groups"][0]["rules"]:
        operator_series = {n for n in metric_names(r["expr"]) if not n.startswith("kubetron_trainer_")}
        assert not operator_series or r["expr"].count(job) == len(operator_series), r["expr"]
    for title, expr in queries().items():
        operator_series = {n for n in metric_names(expr) if not n.startswith("kubetron_trainer_")}
        assert not operator_series or 'job="kubetron-metrics"' in expr, title
    (variable,) = [v for v in dashboard()["templating"]["list"] if v["name"] == "operator_job"]
    assert variable["query"] == operator_job({})


def rule_annotation(rule: dict, alert: str, key: str) -> str:
    (found,) = [r for g in rule["spec"]["groups"] for r in g["rules"] if r.get("alert") == alert]
    return found["annotations"][key]
