"""The chart's Grafana dashboard (charts/kubetron/dashboards/kubetron.json) as the tests read it: its PromQL
queries, the metric names each one reads, and whether an exporter's /metrics has them. The exporters are
checked where they run for real: the operator in tests/operator/test_metrics_on_kube.py, rank 0's trainer
in tests/operator/test_real_trainer_story.py; tests/test_dashboard.py parses every query with promtool."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "charts" / "kubetron" / "dashboards" / "kubetron.json"
TRAINER_PREFIX = "kubetron_trainer_"  # rank 0's status endpoint; every other kubetron_ metric is the operator's
# What Grafana replaces before a query reaches Prometheus, with values of the same kind.
GRAFANA_VARIABLES = {"$__rate_interval": "2m", "$__interval": "30s", "$__range": "6h", "$namespace": ".*",
                     "$trainingjob": ".*", "$operator_job": "kubetron-metrics"}
TARGET_LABELS = {"job"}  # what Prometheus adds to every series of a scrape: no exporter serves it
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a PromQL string literal
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
            "unless", "inf", "nan"}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries(board: dict[str, Any] | None = None) -> dict[str, str]:
    """`<panel title> / <refId>` -> its PromQL, Grafana's variables replaced as Grafana would."""
    out = {}
    for panel in (board or dashboard())["panels"]:
        for target in panel.get("targets") or ():
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            out[f"{panel['title']} / {target['refId']}"] = expr
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, range and
    offset durations, grouping clauses, function calls, keywords and numbers are taken out."""
    expr = STRING.sub("", expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\boffset\s+\w+", "", expr)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*(?!\s*\()(?=[^A-Za-z0-9_:(]|$)", expr))
    return {n for n in names if n.lower() not in KEYWORDS and not re.fullmatch(r"\d.*|[eE]\d*", n)}


def read_by(exporter: str) -> set[str]:
    """Every metric name the dashboard's queries read from `exporter` ("operator" or "trainer")."""
    names = set().union(*(metric_names(q) for q in queries().values()))
    return {n for n in names if n.startswith(TRAINER_PREFIX) == (exporter == "trainer")}


def samples(text: str) -> dict[str, float]:
    """A /metrics answer's samples by name (the last of a name's label sets), by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def exported(text: str) -> set[str]:
    return set(samples(text))


def missing(exporter: str, text: str) -> set[str]:
    """The names the dashboard reads from `exporter` that its /metrics answer `text` lacks."""
    return read_by(exporter) - exported(text)


def labels_read(expr: str) -> set[str]:
    """The label names a PromQL expression matches on (`{name=~"..."}`) or groups by (`by (a, b)`)."""
    matched = {m for body in re.findall(r"\{([^}]*)\}", STRING.sub('""', expr))
               for m in re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", body)}
    grouped = {g.strip() for clause in re.findall(r"\bby\s*\(([^)]*)\)", expr) for g in clause.split(",")}
    return matched | (grouped - {""})


def unserved_labels(exporter: str, text: str, board: dict[str, Any] | None = None) -> set[tuple[str, str]]:
    """(query, label) for each label a one-metric query of `exporter` filters or groups by that the
    metric's samples in `text` do not carry: a panel that would stay empty though the metric is there."""
    from prometheus_client.parser import text_string_to_metric_families

    carried: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            carried.setdefault(s.name, set()).update(s.labels)
    out = set()
    for title, expr in queries(board).items():
        names = {n for n in metric_names(expr) if n.startswith(TRAINER_PREFIX) == (exporter == "trainer")}
        if len(names) == 1 and (name := names.pop()) in carried:
            out |= {(title, label) for label in labels_read(expr) - carried[name] - TARGET_LABELS}
    return out
