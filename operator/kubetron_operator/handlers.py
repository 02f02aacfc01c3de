"""The kopf layer: gather observations, call decide(), apply the action. No policy lives here.

One daemon per TrainingJob reconciles every `memo.interval` seconds. Each round re-reads the job from
the API (never trusting a possibly stale watch body), so counters in status are never applied twice,
and applies the action in crash-safe order: a new attempt's pods are created before status names the
attempt; an ended attempt is recorded in status before its pods are deleted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import kopf

from kubetron_operator import live, metrics
from kubetron_operator.api_calls import ApiError, Conflict, Kube, NameConflict, controller_uid
from kubetron_operator.build import (
    LABEL_JOB,
    build,
    build_reader_pod,
    config_map_name,
    pod_group_name,
    service_name,
)
from kubetron_operator.decide import FINISHED, Action, Observed, PodView, create_failed, decide, node_trouble
from kubetron_operator.model import GROUP, PLURAL, VERSION, Job, S3Storage, SpecError
from kubetron_operator.progress_io import read_s3_progress

PROGRESS_REFRESH = 30.0  # seconds between progress-log reads while an attempt runs quietly


@dataclasses.dataclass
class Deps:
    """What the handlers use, injectable for tests (passed to kopf as its `memo`)."""

    kube: Kube
    interval: float = 5.0  # seconds between reconciles of one job
    read_progress: Callable[[Job, Kube], dict[str, Any] | None] = read_s3_progress
    fetch_live: live.Fetch = live.http_fetch
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)
    last_progress: dict[str, tuple[datetime, dict[str, Any] | None]] = dataclasses.field(default_factory=dict)


def register(registry: kopf.OperatorRegistry) -> kopf.OperatorRegistry:
    """Attach the TrainingJob handlers to `registry` (main.run and the tests each bring their own)."""
    kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, cancellation_timeout=10.0)(reconcile_daemon)
    kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry, optional=True)(cleanup_on_delete)
    return registry


async def reconcile_daemon(name: str, namespace: str, stopped: kopf.DaemonStopped, memo: Any,
                           logger: logging.Logger, **_: Any) -> None:
    deps: Deps = memo.deps
    while not stopped:
        try:
            await asyncio.to_thread(reconcile_once, deps, namespace, name, logger)
        except Exception:  # one bad round must not kill the job's reconciler
            logger.exception("reconcile of %s/%s failed; retrying in %.0fs", namespace, name, deps.interval)
        await stopped.wait(deps.interval)


def cleanup_on_delete(name: str, namespace: str, uid: str, status: Any, memo: Any, logger: logging.Logger,
                      **_: Any) -> None:
    """Delete the children now rather than waiting for the garbage collector (owner references); only
    those this job controls, never a foreign object that happens to carry a child's name or label."""
    kube: Kube = memo.deps.kube
    metrics.forget(namespace, name)
    for pod in kube.list_pods(namespace, {LABEL_JOB: name}):
        if controller_uid(pod) == uid:
            kube.delete_pod(namespace, pod["metadata"]["name"])
    fake = Job(name=name, namespace=namespace, uid=uid, spec=None)  # type: ignore[arg-type]  # names only
    for attempt in range(1, int((status or {}).get("attempt") or 0) + 1):
        delete_attempt_children(kube, fake, attempt, logger)
    kube.delete_owned("v1", "Service", namespace, service_name(fake), uid)
    logger.info("deleted the children of %s", name)


def delete_attempt_children(kube: Kube, job: Job, attempt: int, logger: logging.Logger) -> None:
    """An attempt's ConfigMap and PodGroup (pods are decide's business), if this job controls them."""
    kube.delete_owned("v1", "ConfigMap", job.namespace, config_map_name(job, attempt), job.uid)
    for api_version in ("scheduling.volcano.sh/v1beta1", "scheduling.x-k8s.io/v1alpha1"):
        try:
            kube.delete_owned(api_version, "PodGroup", job.namespace, pod_group_name(job, attempt), job.uid)
        except ApiError as exc:  # the PodGroup CRD may not be installed at all (404), or not granted (403)
            logger.debug("no %s PodGroup to delete: %s", api_version, exc)


def reconcile_once(deps: Deps, namespace: str, name: str, logger: logging.Logger) -> Action | None:
    with metrics.RECONCILE.time():
        return _reconcile_once(deps, namespace, name, logger)


def _reconcile_once(deps: Deps, namespace: str, name: str, logger: logging.Logger) -> Action | None:
    kube = deps.kube
    body = kube.get_job(namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        metrics.forget(namespace, name)
        return None
    obs, job = observe(deps, body)
    action = decide(job, obs)
    if action.create_attempt is not None and _backing_off(deps.kube, namespace, obs, action):
        return None
    try:
        apply(deps, body, job, obs, action, logger)
    except Conflict:
        # Someone wrote the job after we read it: this decision may be stale. Never undo their write;
        # the next round decides again from a fresh read.
        logger.info("%s/%s changed while reconciling; deciding again", namespace, name)
        return None
    metrics.record(namespace, name, obs.status or {}, action.status, action.create_attempt is not None)
    return action


def _backing_off(kube: Kube, namespace: str, obs: Observed, action: Action) -> bool:
    """After a transient creation failure: wait until status.nextCreateTime, and until the torn-down
    pods of that attempt are gone (their names are about to be reused)."""
    retry_at = obs.status.get("nextCreateTime")
    if not retry_at:
        return False
    leftovers = [p for p in obs.pods if p.attempt == action.create_attempt]
    for p in leftovers:
        if p.deleting_for is None:
            kube.delete_pod(namespace, p.name)
    return bool(leftovers) or obs.now < datetime.fromisoformat(retry_at)


def observe(deps: Deps, body: dict[str, Any]) -> tuple[Observed, Job | None]:
    kube, now = deps.kube, deps.clock()
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    try:
        job, error = Job.from_body(body), ""
    except SpecError as exc:
        job, error = None, str(exc)
    status = dict(body.get("status") or {})
    # Only pods this job controls: a foreign pod with our label is never counted, nor deleted.
    owned = [p for p in kube.list_pods(namespace, {LABEL_JOB: name}) if controller_uid(p) == meta.get("uid")]
    pods = [PodView.from_pod(p, now) for p in owned]
    # A progress reader reports through its termination message (no pods/log, no kubelet round trip).
    pods = [dataclasses.replace(p, log=termination_text(raw)) if p.role == "progress-reader" and p.terminated
            else p for p, raw in zip(pods, owned)]
    trouble = _node_trouble(kube, status, pods)
    progress = live_data = None
    if job is not None and status.get("phase") not in FINISHED:
        attempt = int(status.get("attempt") or 0)
        live_data = live.read_live(pods, attempt, job.spec.status_port, deps.fetch_live)
        if isinstance(job.spec.storage, S3Storage):
            progress = _progress(deps, job, status, pods, now)
    return Observed(now=now, status=status, pods=tuple(pods), progress=progress, live=live_data,
                    spec_error=error, node_trouble=trouble), job


def _node_trouble(kube: Kube, status: dict, pods: list[PodView]) -> dict[str, str]:
    """Nodes under the current attempt that are not Ready or gone; only asked for once a pod has failed
    (decide then tells a dead node from a trainer error), so a healthy job never lists nodes."""
    attempt = int(status.get("attempt") or 0)
    current = [p for p in pods if p.role == "worker" and p.attempt == attempt]
    if status.get("phase") in FINISHED or not any(p.phase == "Failed" for p in current):
        return {}
    return node_trouble(kube.list_nodes(), {p.node for p in current if p.node})


def termination_text(pod: dict[str, Any]) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or ():
        text = ((cs.get("state") or {}).get("terminated") or {}).get("message")
        if text:
            return text
    return ""


def _progress(deps: Deps, job: Job, status: dict, pods: list[PodView], now: datetime) -> dict | None:
    """The S3 progress log: read whenever an attempt ends or starts, else at most every 30 s."""
    key = f"{job.namespace}/{job.name}"
    cached = deps.last_progress.get(key)
    attempt = int(status.get("attempt") or 0)
    eventful = status.get("phase") in (None, "Restarting", "Suspended") or any(
        p.attempt == attempt and (p.terminated or p.deleting_for is not None or p.phase == "Unknown") for p in pods
    ) or len([p for p in pods if p.attempt == attempt and p.role == "worker"]) < job.spec.nodes
    if cached and not eventful and (now - cached[0]).total_seconds() < PROGRESS_REFRESH:
        return cached[1]
    summary = deps.read_progress(job, deps.kube)
    deps.last_progress[key] = (now, summary)
    return summary


def apply(deps: Deps, body: dict[str, Any], job: Job | None, obs: Observed, action: Action,
          logger: logging.Logger) -> None:
    kube = deps.kube
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    rv = meta.get("resourceVersion")
    if action.create_attempt is not None and job is not None:
        # Pods first: if we die before the status patch, the next round recreates them (409s), never
        # mistakes a not-yet-created pod for a preempted one.
        for pod in action.delete_pods:
            kube.delete_pod(namespace, pod)
        manifests = build(job, action.create_attempt, action.expected_iteration, action.avoid_nodes)
        failed = create_children(kube, job, manifests, logger)
        if failed is not None:
            action = create_failed(obs, *failed)
            _patch_status(kube, namespace, name, action.status, rv)
        else:
            retry = {"createFailures": None, "nextCreateTime": None} if obs.status.get("nextCreateTime") else {}
            _patch_status(kube, namespace, name, {**action.status, **retry}, rv)
            if action.create_attempt > 1:
                delete_attempt_children(kube, job, action.create_attempt - 1, logger)
    else:
        # Status first: an ended attempt is counted before its pods disappear.
        _patch_status(kube, namespace, name, action.status, rv)
        for pod in action.delete_pods:
            kube.delete_pod(namespace, pod)
        if job is not None and _attempt_ended(obs, action):
            delete_attempt_children(kube, job, int(obs.status["attempt"]), logger)
    for pod in action.force_delete_pods:
        kube.delete_pod(namespace, pod, force=True)
    if action.create_reader is not None and job is not None:
        kube.create(build_reader_pod(job, action.create_reader))
    now = obs.now.strftime("%Y-%m-%dT%H:%M:%SZ")
    for event in action.events:
        logger.log(logging.WARNING if event.type == "Warning" else logging.INFO, "%s: %s", event.reason, event.message)
        try:
            kube.post_event(body, event.type, event.reason, event.message, now)
        except Exception as exc:  # noqa: BLE001 - an event is nice to have, never worth a retry
            logger.warning("could not post event %s: %s", event.reason, exc)
    if action.delete_job:
        kube.delete_job(namespace, name)


def create_children(kube: Kube, job: Job, manifests: list[dict[str, Any]],
                    logger: logging.Logger) -> tuple[str, str, bool] | None:
    """Create an attempt's objects in order. On an API error delete what this call created (a partial
    gang must not hold GPUs) and return (reason, message, transient) for decide.create_failed."""
    created: list[dict[str, Any]] = []
    for manifest in manifests:
        try:
            if kube.create(manifest):
                created.append(manifest)
        except ApiError as exc:
            for done in reversed(created):
                if done["kind"] != "Service":  # per job, not per attempt: kept for the next try
                    kube.delete(done["apiVersion"], done["kind"], job.namespace, done["metadata"]["name"])
            what = f"{manifest['kind']} {job.namespace}/{manifest['metadata']['name']}"
            logger.warning("cannot create %s: %s", what, exc)
            if isinstance(exc, NameConflict):
                return "NameConflict", str(exc).removeprefix("HTTP 409: "), False
            transient = exc.status == 429 or exc.status >= 500 or (exc.status == 403 and "exceeded quota" in str(exc))
            return ("CreateRetrying" if transient else "CreateFailed"), f"cannot create {what}: {exc}", transient
    return None


def _attempt_ended(obs: Observed, action: Action) -> bool:
    """The running attempt just ended (restart, success, failure, suspension)."""
    return (int(obs.status.get("attempt") or 0) > 0 and obs.status.get("phase") in ("Pending", "Running")
            and action.phase in ("Restarting", "Succeeded", "Failed", "Suspended"))


def _patch_status(kube: Kube, namespace: str, name: str, status: dict[str, Any], resource_version: str | None) -> None:
    if status:
        kube.patch_status(namespace, name, status, resource_version)
