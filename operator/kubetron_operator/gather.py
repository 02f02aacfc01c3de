"""What one wake-up of a job's daemon reads: `gather` what the job's pods and store serve (outside the
reconcile pool, each read bounded in time and size: trainer_reports/), then `observe` what decide() needs
(the job's status and pods as watched, its nodes only once a pod has failed) as kubetron_operator.observe's
typed views. When to read the store again is policy/reads.py's call; a read that failed is not tried again
for RETRY_AFTER seconds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from kubetron.contract.live import LiveStatus
from kubetron.contract.progress import ProgressSummary
from kubetron.contract.resource import FINISHED, LABEL_JOB
from kubetron.contract.times import parse_stamp

from kubetron_operator.api_calls import Kube, controller_uid
from kubetron_operator.deps import Deps
from kubetron_operator.job_status import JobStatus
from kubetron_operator.model import Job, S3Storage
from kubetron_operator.node_view import NodeView
from kubetron_operator.observe import Observed, PodView, job_status, node_trouble
from kubetron_operator.policy.nodes import placing_due
from kubetron_operator.policy.reads import RETRY_AFTER, log_read_due
from kubetron_operator.trainer_reports.status_endpoint import LiveRead, read_live
from kubetron_operator.trainer_reports.store_log import ProgressRead


@dataclasses.dataclass(frozen=True)
class Reads:
    """What `gather` read for one wake-up, outside the reconcile pool."""

    progress: ProgressSummary | None = None  # the S3 progress log's summary; None: unread
    live: LiveStatus | None = None  # rank 0's status endpoint; None: unread
    store_unread: tuple[str, str] | None = None  # (reason, message): why the S3 log could not be read
    warnings: tuple[str, ...] = ()  # payloads ignored as hostile


def gather(deps: Deps, body: dict[str, Any], pods_in: list[dict[str, Any]]) -> Reads:
    """Read what the job's pods and store serve: rank 0's status endpoint and the S3 progress log (each
    bounded in time and size; one that failed is left alone for RETRY_AFTER seconds)."""
    job, _ = deps.view.job(body)
    status = job_status(body)
    if job is None or status.get("phase") in FINISHED:
        return Reads()
    now, meta = deps.clock(), body["metadata"]
    pods = [PodView.from_pod(p, now) for p in owned(meta, pods_in)]
    attempt = int(status.get("attempt") or 0)
    quiet_until = deps.live_quiet.get(job.uid, 0.0)
    got = read_live(pods, attempt, job.spec.status_port, deps.fetch_live, max_in_place=job.spec.max_in_place_restarts,
                    now=now) if time.monotonic() >= quiet_until else LiveRead()
    if got.problem:
        deps.live_quiet[job.uid] = time.monotonic() + RETRY_AFTER
    read = _progress(deps, job, status, pods, now) if isinstance(job.spec.storage, S3Storage) else ProgressRead()
    return Reads(progress=read.summary, live=got.status, store_unread=read.unread,
                 warnings=(*read.warnings, *((got.problem,) if got.problem else ())))


def _progress(deps: Deps, job: Job, status: JobStatus, pods: list[PodView], now: datetime) -> ProgressRead:
    """The S3 progress log, read when policy/reads.py says it is due, else as last read."""
    key = f"{job.namespace}/{job.name}"
    cached = deps.last_progress.get(key)
    age = (now - cached[0]).total_seconds() if cached else None
    if cached and not log_read_due(job, status, pods, age, cached[1].unread is not None):
        return cached[1]
    read = deps.read_progress(job, deps.kube)
    deps.last_progress[key] = (now, read)
    return read


def observe(deps: Deps, body: dict[str, Any], pods_in: list[dict[str, Any]] | None = None,
            reads: Reads | None = None) -> tuple[Observed, Job | None]:
    """What decide needs. `pods_in`: the job's pods as watched (None: list them from the API); `reads`:
    what gather() read of its pods and store (None: nothing)."""
    kube, now = deps.kube, deps.clock()
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    job, error = deps.view.job(body)
    status = job_status(body)
    # Only pods this job controls, in its namespace: a foreign pod with our label is never counted, nor deleted.
    if pods_in is None:
        pods_in = kube.list_pods(namespace, {LABEL_JOB: name})
    pods = [PodView.from_pod(p, now) for p in owned(meta, pods_in)]
    trouble, problems, nodes = _nodes(kube, status, pods, now)
    reads = reads or Reads()
    return Observed(now=now, status=status, pods=tuple(pods), progress=reads.progress, live=reads.live,
                    spec_error=error, node_trouble=trouble, node_problems=problems, nodes=nodes,
                    service=meta.get("uid") in deps.view.services,
                    store_unread=reads.store_unread, created=parse_stamp(meta.get("creationTimestamp"))), job


def _nodes(kube: Kube, status: JobStatus, pods: list[PodView], now: datetime) -> tuple[
        dict[str, str], dict[str, str], tuple[NodeView, ...] | None]:
    """The nodes, listed only when decide asks: once a pod of the current attempt has failed (which of its
    nodes are not Ready or gone, which report a problem of their own: a dead node is a preemption, a sick one
    evidence), and before an attempt that would avoid nodes (policy.nodes.plan_avoidance). A healthy job
    never lists nodes."""
    attempt = int(status.get("attempt") or 0)
    current = [p for p in pods if p.role == "worker" and p.attempt == attempt]
    failed = status.get("phase") not in FINISHED and any(p.phase == "Failed" for p in current)
    placing = placing_due(status, now) and not any(p.attempt <= attempt for p in pods)
    if not failed and not placing:
        return {}, {}, None
    listed = kube.list_nodes()
    views = tuple(NodeView.from_node(n) for n in listed)
    if not failed:
        return {}, {}, views
    wanted = {p.node for p in current if p.node}
    problems = {v.name: "; ".join(v.problems) for v in views if v.name in wanted and v.problems}
    return node_trouble(listed, wanted), problems, None


def owned(meta: Mapping[str, Any], pods: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods the job controls, in its own namespace only (an owner reference names no namespace)."""
    namespace = meta.get("namespace") or "default"
    return [p for p in pods if controller_uid(p) == meta.get("uid")
            and ((p.get("metadata") or {}).get("namespace") or namespace) == namespace]
