"""The operator's Prometheus metrics (`kubetron operator --metrics-port PORT`, prometheus-client).

    kubetron_trainingjobs{phase}                    jobs this operator reconciles, by status.phase
    kubetron_attempts_total                         attempts created (pods of a new attempt)
    kubetron_restarts_total{reason}                 restarted attempts: preemptions | failures | neverStarted, and
                                                    hangs (gangs that hung: status.restarts.hangs, docs/recovery.md)
    kubetron_reconcile_duration_seconds             one reconcile of one job (read, decide, apply)
    kubetron_api_errors_total{code}                 Kubernetes API calls answered with an error, by HTTP status
                                                    (a 403 is also logged at warning level, naming the call)
    kubetron_goodput_seconds{namespace,name,bucket} a job's rank-seconds by goodput bucket (status.goodput,
                                                    docs/goodput.md): productive, checkpoint, lostWork, ...
    kubetron_goodput_ratio{namespace,name}          productive / all of them

The handlers report through record()/forget()/RECONCILE; api_calls through api_error(). One registry of
our own, so the process's default collectors do not mix in.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

from kubetron.contract.goodput import BUCKETS
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from kubetron_operator.job_status import PHASES

RESTART_KINDS = ("preemptions", "failures", "neverStarted", "hangs")

REGISTRY = CollectorRegistry(auto_describe=True)
ATTEMPTS = Counter("kubetron_attempts", "Attempts created.", registry=REGISTRY)
RESTARTS = Counter("kubetron_restarts", "Attempts restarted, by why the previous one ended.", ["reason"],
                   registry=REGISTRY)
RECONCILE = Histogram("kubetron_reconcile_duration_seconds", "Seconds one reconcile of one job took.",
                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=REGISTRY)
API_ERRORS = Counter("kubetron_api_errors", "Kubernetes API calls that failed, by HTTP status.", ["code"],
                     registry=REGISTRY)

_lock = threading.Lock()
_phases: dict[tuple[str, str], str] = {}
_goodput: dict[tuple[str, str], Mapping[str, Any]] = {}  # the newest status.goodput per job
_uids: dict[tuple[str, str], str] = {}  # whose series these are (a job deleted and made again has a new UID)


class _Jobs:
    """kubetron_trainingjobs{phase}, counted at scrape time from the last phase seen per job."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("kubetron_trainingjobs", "TrainingJobs by status.phase.", labels=["phase"])
        with _lock:
            phases = list(_phases.values())
        for phase in PHASES:
            family.add_metric([phase], phases.count(phase))
        yield family


REGISTRY.register(_Jobs())


class _Goodput:
    """kubetron_goodput_seconds / kubetron_goodput_ratio per job, from the newest status.goodput seen."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        seconds = GaugeMetricFamily("kubetron_goodput_seconds", "Rank-seconds (GPU-seconds on GPU jobs) since the "
                                    "job was created, by goodput bucket.", labels=["namespace", "name", "bucket"])
        ratio = GaugeMetricFamily("kubetron_goodput_ratio", "Productive rank-seconds / all since the job was "
                                  "created.", labels=["namespace", "name"])
        with _lock:
            jobs = list(_goodput.items())
        for (namespace, name), ledger in jobs:
            for bucket in BUCKETS:
                seconds.add_metric([namespace, name, bucket], float((ledger.get("seconds") or {}).get(bucket) or 0.0))
            ratio.add_metric([namespace, name], float(ledger.get("ratio") or 0.0))
        yield seconds
        yield ratio


REGISTRY.register(_Goodput())


def record(namespace: str, name: str, old_status: Mapping[str, Any], new_status: Mapping[str, Any],
           created_attempt: bool, uid: str = "") -> None:
    """After one reconcile: the job's phase now, and what the status patch counted anew."""
    phase = new_status.get("phase") or old_status.get("phase") or "Pending"
    ledger = new_status.get("goodput") or old_status.get("goodput")
    with _lock:
        _phases[(namespace, name)] = phase
        _uids[(namespace, name)] = uid
        if isinstance(ledger, Mapping):
            _goodput[(namespace, name)] = ledger
    if created_attempt:
        ATTEMPTS.inc()
    old, new = old_status.get("restarts") or {}, new_status.get("restarts") or {}
    for kind in RESTART_KINDS:
        grown = int(new.get(kind) or 0) - int(old.get(kind) or 0)
        if grown > 0 and kind in new:
            RESTARTS.labels(reason=kind).inc(grown)


def forget(namespace: str, name: str, uid: str | None = None) -> None:
    """The job is gone (deleted): it no longer counts in any phase, and its series go. With `uid`, only when
    the series are that job's (not those of a job made again under its name since)."""
    with _lock:
        if uid is None or _uids.get((namespace, name), uid) == uid:
            for table in (_phases, _goodput, _uids):
                table.pop((namespace, name), None)


def api_error(status: int) -> None:
    API_ERRORS.labels(code=str(status)).inc()


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """GET /metrics on addr:port from a daemon thread."""
    start_http_server(port, addr=addr, registry=REGISTRY)
