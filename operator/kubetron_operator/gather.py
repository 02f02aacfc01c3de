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
from kubetron_operator.view import JobMemory


@dataclasses.dataclass(frozen=True)
class Reads:
    """What one wake-up read: `gather` fills it outside the reconcile pool, observe() hands it to decide."""

    now: datetime | None = None  # when the pods were looked at (their ages count from here); None: not gathered
    pods: tuple[PodView, ...] | None = None  # the job's pods, parsed once per wake-up; None: not gathered
    progress: ProgressSummary | None = None  # the S3 progress log's summary; None: unread
    live: LiveStatus | None = None  # rank 0's status endpoint; None: unread
    store_unread: tuple[str, str] | None = None  # (reason, message): why the S3 log could not be read
    warnings: tuple[str, ...] = ()  # payloads ignored as hostile


def gather(deps: Deps, body: dict[str, Any], pods_in: list[dict[str, Any]]) -> Reads:
    """The job's pods as views, and what they and the store serve: rank 0's status endpoint and the S3
    progress log (each bounded in time and size; one that failed is left alone for RETRY_AFTER seconds)."""
    job, _ = deps.view.job(body)
    status = job_status(body)
    now, meta = deps.clock(), body["metadata"]
    pods = pod_views(meta, pods_in, now)
    if job is None or status.get("phase") in FINISHED:
        return Reads(now=now, pods=pods)
    memory = deps.view.get(job.uid) or JobMemory(job.namespace, job.name)  # a job no daemon holds: no memory
    attempt = int(status.get("attempt") or 0)
    got = read_live(pods, attempt, job.spec.status_port, deps.fetch_live, max_in_place=job.spec.max_in_place_restarts,
                    now=now) if time.monotonic() >= memory.live_quiet_until else LiveRead()
    if got.problem:
        memory.live_quiet_until = time.monotonic() + RETRY_AFTER
    read = _progress(deps, memory, job, status, pods, now) if isinstance(job.spec.storage, S3Storage) \
        else ProgressRead()
    return Reads(now=now, pods=pods, progress=read.summary, live=got.status, store_unread=read.unread,
                 warnings=(*read.warnings, *((got.problem,) if got.problem else ())))


def _progress(deps: Deps, memory: JobMemory, job: Job, status: JobStatus, pods: tuple[PodView, ...],
              now: datetime) -> ProgressRead:
    """The S3 progress log, read when policy/reads.py says it is due, else as last read."""
    cached = memory.progress
    age = (now - cached[0]).total_seconds() if cached else None
    if cached and not log_read_due(job, status, pods, age, cached[1].unread is not None):
        return cached[1]
    read = deps.read_progress(job, deps.kube)
    memory.progress = (now, read)
    return read


def observe(deps: Deps, body: dict[str, Any], pods_in: list[dict[str, Any]] | None = None,
            reads: Reads | None = None) -> tuple[Observed, Job | None]:
    """What decide needs. `reads`: what gather() read of the job's pods and store (its pods and clock are
    used as they are: a wake-up parses its pods once); without them `pods_in`, the job's pods as watched
    (None: list them from the API), are parsed now."""
    kube = deps.kube
    reads = reads or Reads()
    now = reads.now or deps.clock()
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    job, error = deps.view.job(body)
    status = job_status(body)
    pods = reads.pods
    if pods is None:
        if pods_in is None:
            pods_in = kube.list_pods(namespace, {LABEL_JOB: name})
        pods = pod_views(meta, pods_in, now)
    trouble, problems, nodes = _nodes(kube, status, pods, now)
    gang = job.spec.scheduling.gang if job is not None and status.get("phase") not in FINISHED else "none"
    return Observed(now=now, status=status, pods=pods, progress=reads.progress, live=reads.live,
                    spec_error=error, node_trouble=trouble, node_problems=problems, nodes=nodes,
                    job_objects=deps.view.has_job_objects(meta.get("uid")),
                    store_unread=reads.store_unread, created=parse_stamp(meta.get("creationTimestamp")),
                    pod_group_api=kube.pod_group_api(gang)), job


def pod_views(meta: Mapping[str, Any], pods: Iterable[dict[str, Any]], now: datetime) -> tuple[PodView, ...]:
    """The views of the pods the job controls (owned), their ages measured at `now`: only pods in its namespace,
    a foreign pod with our label is never counted, nor deleted."""
    return tuple(PodView.from_pod(p, now) for p in owned(meta, pods))


def _nodes(kube: Kube, status: JobStatus, pods: Iterable[PodView], now: datetime) -> tuple[
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
