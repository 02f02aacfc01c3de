"""Carrying out decide()'s Action against the API server (`act`), and deleting a job's children (`delete_children`).

The action is applied in crash-safe order: a new attempt's pods are created before status names the
attempt; an ended attempt is recorded in status before its pods are deleted. Every status patch carries the
resourceVersion of the body it was decided from, so a decision someone else's write made stale is refused
(Conflict) and taken again, and counters in status are never applied twice. A failed creation tears down
what it created (a partial gang must not hold GPUs) and is retried as policy/create_retry.py says.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import kopf
from kubetron.contract.resource import LABEL_JOB
from kubetron.contract.times import stamp

from kubetron_operator import metrics
from kubetron_operator.api_calls import ApiError, Conflict, Kube, NameConflict, controller_uid, pod_group_api_version
from kubetron_operator.build import (
    attempt_objects,
    build_pod,
    build_probe_pod,
    build_service,
    pod_group_name,
    service_name,
    with_token,
)
from kubetron_operator.deps import Deps
from kubetron_operator.model import KUEUE_GROUP_LABEL, KUEUE_RETRIABLE_ANNOTATION, Job
from kubetron_operator.observe import Observed, json_copy
from kubetron_operator.policy.action import Action
from kubetron_operator.policy.create_retry import backing_off, create_failed, leftovers, retriable
from kubetron_operator.policy.elastic import attempt_size
from kubetron_operator.policy.nodes import TAINT_KEY, avoided
from kubetron_operator.policy.start import attempt_ended, service_failed
from kubetron_operator.untrusted import clean_all


def act(deps: Deps, body: dict[str, Any], job: Job | None, obs: Observed, action: Action,
        logger: kopf.Logger) -> Action | None:
    """Apply `action`, decided from `body` (its resourceVersion guards every status patch): what was
    applied, or None when it waits (creation backoff) or the job changed meanwhile (decide again)."""
    namespace, name = body["metadata"].get("namespace") or "default", body["metadata"]["name"]
    if action.create_attempt is not None:
        # After a transient creation failure: the torn-down pods of that attempt go first (their names are
        # about to be reused), and the retry waits until status.nextCreateTime.
        left = leftovers(obs, action)
        for pod in left:
            if pod.deleting_for is None:
                deps.kube.delete_pod(namespace, pod.name)
        if left or backing_off(obs):
            return None
    try:
        action = apply(deps, body, job, obs, action, logger)
    except Conflict:
        # Someone wrote the job after the version we decided from: never undo their write; the next
        # round decides again from the newer version (read by _patch_status, or the watch's).
        logger.info("%s/%s changed while reconciling; deciding again", namespace, name)
        return None
    metrics.record(namespace, name, obs.status or {}, action.status, action.create_attempt is not None)
    return action


def apply(deps: Deps, body: dict[str, Any], job: Job | None, obs: Observed, action: Action,
          logger: kopf.Logger) -> Action:
    """Carry out `action`; returns what was applied (a failed creation applies create_failed instead)."""
    kube = deps.kube
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    rv = meta.get("resourceVersion")
    if action.create_service and job is not None:
        failed = create_children(kube, job, [build_service(job)], logger)
        if failed is None:
            deps.view.services.add(job.uid)
        else:
            action = service_failed(obs, action, *failed)
    attempt = action.create_attempt  # `action` may be replaced by create_failed below
    if attempt is not None and job is not None:
        # Pods first: if we die before the status patch, the next round recreates them (409s), never
        # mistakes a not-yet-created pod for a preempted one.
        release_groups(kube, namespace, action.release_pods, logger)
        for pod in action.delete_pods:
            kube.delete_pod(namespace, pod)
        manifests = [with_token(m) for m in
                     attempt_objects(job, attempt, action.expected_iteration, action.avoid_nodes, action.nodes)]
        failed = create_children(kube, job, manifests, logger)
        if failed is not None:
            action = create_failed(obs, *failed)
            _patch_status(deps, body, action.status, rv)
        else:
            deps.view.created(job.uid, manifests)  # until the watch shows them, never "vanished"
            retry = {"createFailures": None, "nextCreateTime": None} if obs.status.get("nextCreateTime") else {}
            _patch_status(deps, body, {**action.status, **retry}, rv)
            if attempt > 1:
                delete_attempt_children(kube, job, attempt - 1, job.spec.scheduling.gang, logger)
    else:
        # Status first: an ended attempt is counted before its pods disappear.
        _patch_status(deps, body, action.status, rv)
        release_groups(kube, namespace, action.release_pods, logger)
        for pod in action.delete_pods:
            kube.delete_pod(namespace, pod)
        if job is not None and attempt_ended(obs, action):
            delete_attempt_children(kube, job, int(obs.status["attempt"]), job.spec.scheduling.gang, logger)
    for pod in action.force_delete_pods:
        kube.delete_pod(namespace, pod, force=True)
    taint_nodes(kube, action.taint_nodes, name, logger)
    if action.replace_ranks and job is not None:  # a lost pod of the running attempt, again (policy/recovery.py)
        attempt_now = int(obs.status["attempt"])
        again = [build_pod(job, attempt_now, rank, obs.status.get("attemptStartCheckpoint") or 0,
                           avoided(obs.status), attempt_size(job, obs.status)) for rank in action.replace_ranks]
        for manifest in again:
            kube.create(manifest)
        deps.view.created(job.uid, again)
    if action.create_probes and job is not None:
        probes = [build_probe_pod(job, int(obs.status["attempt"]), rank, attempt_size(job, obs.status))
                  for rank in action.create_probes]
        for probe in probes:
            kube.create(probe)
        deps.view.created(job.uid, probes)
    now = stamp(obs.now)
    for event in action.events:
        logger.log(logging.WARNING if event.type == "Warning" else logging.INFO, "%s: %s", event.reason, event.message)
        deps.poster.post(body, event.type, event.reason, event.message, now, logger)
    if action.delete_job:
        kube.delete_job(namespace, name)
    return action


def _patch_status(deps: Deps, body: dict[str, Any], status: dict[str, Any], resource_version: str | None) -> None:
    """Patch status as of `resource_version`. When only metadata moved on since (a label, an annotation)
    and status and spec are as we read them, the decision stands: patch again as of now. The job the
    server returns is the freshest known version (View.saw); a stale one is replaced by a fresh read."""
    if not status:
        return
    status = clean_all(status)  # what pods said reaches status only with its control characters escaped
    meta = body["metadata"]
    namespace, name, uid = meta.get("namespace") or "default", meta["name"], meta.get("uid") or ""
    try:
        patched = deps.kube.patch_status(namespace, name, status, resource_version)
    except Conflict:
        fresh = deps.kube.get_job(namespace, name) or {}
        fresh_meta = fresh.get("metadata") or {}
        if fresh_meta.get("uid") == uid:
            deps.view.saw(uid, json_copy(fresh))
        if (fresh.get("status") or {}) != (body.get("status") or {}) or fresh.get("spec") != body.get("spec") \
                or fresh_meta.get("deletionTimestamp") or fresh_meta.get("uid") != uid:
            raise
        patched = deps.kube.patch_status(namespace, name, status, fresh_meta.get("resourceVersion"))
    if patched:
        deps.view.saw(uid, json_copy(patched))
    deps.view.patched[uid] = time.monotonic()


def create_children(kube: Kube, job: Job, manifests: list[dict[str, Any]],
                    logger: kopf.Logger) -> tuple[str, str, bool] | None:
    """Create an attempt's objects in order. On an API error delete what this call created (a partial
    gang must not hold GPUs) and return (reason, message, transient) for policy.create_retry.create_failed."""
    created: list[dict[str, Any]] = []
    for manifest in manifests:
        try:
            if kube.create(manifest):
                created.append(manifest)
        except ApiError as exc:
            for done in reversed(created):
                kube.delete(done["apiVersion"], done["kind"], job.namespace, done["metadata"]["name"])
            what = f"{manifest['kind']} {job.namespace}/{manifest['metadata']['name']}"
            logger.warning("cannot create %s: %s", what, exc)
            if isinstance(exc, NameConflict):
                return "NameConflict", str(exc).removeprefix("HTTP 409: "), False
            retry = retriable(exc.status, str(exc))
            return ("CreateRetrying" if retry else "CreateFailed"), f"cannot create {what}: {exc}", retry
    return None


def release_groups(kube: Kube, namespace: str, pods: Iterable[str], logger: kopf.Logger) -> None:
    """Mark Kueue pod-group members `retriable-in-group: "false"` (policy.action.Action.release_pods): Kueue then
    finishes the group's Workload once its pods are gone and frees the quota. Best effort: a pod that cannot
    be marked is tried again next round (it stays in release_pods), the rest of the action goes on."""
    for pod in pods:
        try:
            kube.annotate_pod(namespace, pod, {KUEUE_RETRIABLE_ANNOTATION: "false"})
        except ApiError as exc:
            logger.warning("cannot mark pod %s/%s %s=false: %s", namespace, pod, KUEUE_RETRIABLE_ANNOTATION, exc)


def delete_attempt_children(kube: Kube, job: Job, attempt: int, gang: str, logger: kopf.Logger) -> None:
    """An attempt's `gang` PodGroup, if any (pods are decide's business), if this job controls it. Only
    the PodGroup kind the job's spec.scheduling.gang names is asked for: the chart grants PodGroups only
    with gangScheduling (one left by a since-changed spec goes with the job, by its owner reference).
    An attempt ConfigMap left by an older operator (the config is on the pods now) goes with the job."""
    api_version = pod_group_api_version(gang)
    if api_version is None:
        return
    try:
        kube.delete_owned(api_version, "PodGroup", job.namespace, pod_group_name(job, attempt), job.uid)
    except ApiError as exc:  # not granted (any more): the garbage collector deletes it with the job
        logger.warning("cannot delete PodGroup %s/%s: %s", job.namespace, pod_group_name(job, attempt), exc)


def taint_nodes(kube: Kube, nodes: Iterable[str], job: str, logger: kopf.Logger) -> None:
    """Nodes the job just left out (policy/nodes.py), tainted cluster-wide when the chart allows it
    (`--taint-failing-nodes`); best effort: the job's own avoid list holds either way."""
    for node in nodes if kube.taint_nodes else ():
        try:
            if kube.taint_node(node, TAINT_KEY, job):
                logger.warning("tainted node %s %s=%s:NoSchedule (it failed job %s twice)", node, TAINT_KEY, job, job)
        except ApiError as exc:
            logger.warning("cannot taint node %s: %s", node, exc)


def delete_children(kube: Kube, name: str, namespace: str, uid: str, spec: Mapping[str, Any] | None,
                    status: Mapping[str, Any] | None, logger: kopf.Logger) -> None:
    """Delete a deleted job's children now rather than waiting for the garbage collector (owner references);
    only those it controls, never a foreign object that happens to carry a child's name or label."""
    metrics.forget(namespace, name)
    pods = [p for p in kube.list_pods(namespace, {LABEL_JOB: name}) if controller_uid(p) == uid]
    release_groups(kube, namespace, [p["metadata"]["name"] for p in pods
                                     if (p["metadata"].get("labels") or {}).get(KUEUE_GROUP_LABEL)], logger)
    for pod in pods:
        kube.delete_pod(namespace, pod["metadata"]["name"])
    fake = Job(name=name, namespace=namespace, uid=uid, spec=None)  # type: ignore[arg-type]  # names only
    gang = ((spec or {}).get("scheduling") or {}).get("gang") or "none"
    for attempt in range(1, int((status or {}).get("attempt") or 0) + 1):
        delete_attempt_children(kube, fake, attempt, gang, logger)
    kube.delete_owned("v1", "Service", namespace, service_name(fake), uid)
    logger.info("deleted the children of %s", name)
