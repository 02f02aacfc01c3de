"""Carrying out decide()'s Action against the API server (`act`), and deleting a job's children (`delete_children`).

The action is applied in crash-safe order: a new attempt's pods are created before status names the
attempt (while other attempts' pods are being created, that status patch is held back: view.Deferred); an
ended attempt is recorded in status before its pods are deleted. Every status patch carries the
resourceVersion of the body it was decided from, so a decision someone else's write made stale is refused
(Conflict) and taken again, and counters in status are never applied twice. A failed creation tears down
what it created (a partial gang must not hold GPUs) and is retried as policy/create_retry.py says.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

import kopf
from kubetron.contract import recovery
from kubetron.contract.resource import FINISHED, LABEL_JOB
from kubetron.contract.times import stamp

from kubetron_operator import metrics
from kubetron_operator.api_calls import ApiError, Conflict, Kube, NameConflict, controller_uid
from kubetron_operator.build import (
    attempt_objects,
    build_pod,
    build_probe_pod,
    job_objects,
    pod_group_name,
    pod_group_resize,
    service_name,
)
from kubetron_operator.deps import Deps
from kubetron_operator.job_status import PodGroupRef
from kubetron_operator.model import (
    KUEUE_GROUP_LABEL,
    KUEUE_RETRIABLE_ANNOTATION,
    POD_GROUP_APIS,
    RESIZABLE_POD_GROUP_APIS,
    Job,
)
from kubetron_operator.observe import Observed, json_copy
from kubetron_operator.policy.action import Action
from kubetron_operator.policy.create_retry import create_failed, retriable
from kubetron_operator.policy.elastic import attempt_size
from kubetron_operator.policy.nodes import avoided
from kubetron_operator.policy.start import attempt_ended, job_objects_failed
from kubetron_operator.untrusted import STATUS_TEXT_LIMIT, clean_all


def with_token(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with a fresh random token when it is build.build_peer_secret's (the builders stay deterministic
    and pure: the token is drawn only where the Secret is created)."""
    if manifest["kind"] != "Secret" or "stringData" in manifest:
        return manifest
    return {**manifest, "stringData": {recovery.PEER_TOKEN_KEY: secrets.token_urlsafe(32)}}


def act(deps: Deps, body: dict[str, Any], job: Job | None, obs: Observed, action: Action,
        logger: kopf.Logger) -> Action | None:
    """Apply `action`, decided from `body` (its resourceVersion guards every status patch): what was
    applied, or None when the job changed meanwhile (decide again)."""
    namespace, name = body["metadata"].get("namespace") or "default", body["metadata"]["name"]
    try:
        action = apply(deps, body, job, obs, action, logger)
    except Conflict:
        # Someone wrote the job after the version we decided from: never undo their write; the next
        # round decides again from the newer version (read by _patch_status, or the watch's).
        logger.info("%s/%s changed while reconciling; deciding again", namespace, name)
        return None
    metrics.record(namespace, name, obs.status or {}, action.status, action.create_attempt is not None,
                   uid=body["metadata"].get("uid") or "")
    return action


def apply(deps: Deps, body: dict[str, Any], job: Job | None, obs: Observed, action: Action,
          logger: kopf.Logger) -> Action:
    """Carry out `action`; returns what was applied (a failed creation applies create_failed instead)."""
    kube = deps.kube
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    rv = meta.get("resourceVersion")
    if action.create_job_objects and job is not None:
        failed = create_children(kube, job, [with_token(m) for m in job_objects(job)], logger)
        if failed is None:
            deps.view.job_objects_made(job.uid)
        else:
            action = job_objects_failed(obs, action, *failed)
    attempt = action.create_attempt  # `action` may be replaced by create_failed below
    if attempt is not None and job is not None:
        # Pods first: if we die before the status patch, the next round recreates them (409s), never
        # mistakes a not-yet-created pod for a preempted one.
        release_groups(kube, namespace, action.release_pods, logger)
        for pod in action.delete_pods:
            kube.delete_pod(namespace, pod)
        manifests = attempt_objects(job, attempt, action.expected_iteration, action.avoid_nodes, action.nodes,
                                    obs.pod_group_api)
        failed = create_children(kube, job, manifests, logger)
        if failed is not None:
            action = create_failed(obs, *failed)
            _patch_status(deps, body, action.status, rv)
        else:
            deps.view.created(job.uid, manifests)  # until the watch shows them, never "vanished"
            # Other attempts' pods are being created: theirs go first (view.Deferred says when this goes out).
            if not (deps.creating.busy(besides=1) and deps.view.defer(job.uid, action.status)):
                _patch_status(deps, body, action.status, rv)
            old = attempt_pod_group(job, obs.status)  # the last attempt's, unless the new one is the same
            if old is not None and old != action.status.get("podGroup"):
                delete_pod_group(kube, job, old, logger)
    else:
        # Status first: an ended attempt is counted before its pods disappear.
        _patch_status(deps, body, action.status, rv)
        release_groups(kube, namespace, action.release_pods, logger)
        for pod in action.delete_pods:
            kube.delete_pod(namespace, pod)
        group = attempt_pod_group(job, obs.status) if job is not None and attempt_ended(obs, action) else None
        if job is not None and group is not None and (
                group["apiVersion"] not in RESIZABLE_POD_GROUP_APIS or action.phase in FINISHED):
            delete_pod_group(kube, job, group, logger)  # a resizable one serves the next attempt too
    for pod in action.force_delete_pods:
        kube.delete_pod(namespace, pod, force=True)
    if deps.taints is not None and action.taint_nodes:  # policy/nodes.py says when; node_taints.py does it
        deps.taints.taint(action.taint_nodes, namespace, name, deps.view.statuses(), obs.now)
    if action.replace_ranks and job is not None:  # a lost pod of the running attempt, again (policy/recovery.py)
        attempt_now = int(obs.status["attempt"])
        again = [build_pod(job, attempt_now, rank, obs.status.get("attemptStartCheckpoint") or 0,
                           avoided(obs.status, obs.now), attempt_size(job, obs.status), obs.pod_group_api)
                 for rank in action.replace_ranks]
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
    status = clean_all(status, STATUS_TEXT_LIMIT)  # what pods said: control characters escaped, cut short
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
    deps.view.patched(uid)


def create_children(kube: Kube, job: Job, manifests: list[dict[str, Any]],
                    logger: kopf.Logger) -> tuple[str, str, bool] | None:
    """Create an attempt's or the job's objects in order (a resizable PodGroup that exists gets the attempt's
    minCount). On an API error delete what this call created but the job's peer token (a partial gang must not hold
    GPUs) and return (reason, message, transient) for policy.create_retry.create_failed."""
    created: list[dict[str, Any]] = []
    for manifest in manifests:
        try:
            if kube.create_or_patch(manifest, pod_group_resize(manifest)) if manifest["apiVersion"] in \
                    RESIZABLE_POD_GROUP_APIS else kube.create(manifest):
                created.append(manifest)
        except ApiError as exc:
            for done in reversed(created):
                if done["kind"] != "Secret":  # the job's peer token serves every attempt (deleted with the job)
                    kube.delete(done["apiVersion"], done["kind"], job.namespace, done["metadata"]["name"])
            what = f"{manifest['kind']} {job.namespace}/{manifest['metadata']['name']}"
            logger.warning("cannot create %s: %s", what, exc)
            if isinstance(exc, NameConflict):
                return "NameConflict", str(exc).removeprefix("HTTP 409: "), False
            served = _served_now(kube, job, manifest, exc)
            if served:  # the cluster serves another PodGroup version now (upgraded): the next try uses it
                return "CreateRetrying", f"cannot create {what}: {exc}; the API server serves {served} now", True
            retry = retriable(exc.status, str(exc))
            return ("CreateRetrying" if retry else "CreateFailed"), f"cannot create {what}: {exc}", retry
    return None


def _served_now(kube: Kube, job: Job, manifest: Mapping[str, Any], exc: ApiError) -> str | None:
    """After a 404 for a PodGroup of a version found by discovery: discover again; the version served now when
    it differs from the one asked for (else None: the 404 stands)."""
    gang = job.spec.scheduling.gang
    if exc.status != 404 or manifest["kind"] != "PodGroup" or len(POD_GROUP_APIS.get(gang, ())) < 2:
        return None
    kube.forget_pod_group_api(gang)
    served = kube.pod_group_api(gang)
    return served if served not in (None, manifest["apiVersion"]) else None


def release_groups(kube: Kube, namespace: str, pods: Iterable[str], logger: kopf.Logger) -> None:
    """Mark Kueue pod-group members `retriable-in-group: "false"` (policy.action.Action.release_pods): Kueue then
    finishes the group's Workload once its pods are gone and frees the quota. Best effort: a pod that cannot
    be marked is tried again next round (it stays in release_pods), the rest of the action goes on."""
    for pod in pods:
        try:
            kube.annotate_pod(namespace, pod, {KUEUE_RETRIABLE_ANNOTATION: "false"})
        except ApiError as exc:
            logger.warning("cannot mark pod %s/%s %s=false: %s", namespace, pod, KUEUE_RETRIABLE_ANNOTATION, exc)


def attempt_pod_group(job: Job, status: Mapping[str, Any]) -> PodGroupRef | None:
    """The current attempt's PodGroup as status names it; a job an older operator started, which wrote no
    status.podGroup: `<job>-<attempt>` in its gang's oldest version (what that operator made)."""
    attempt, gang = int(status.get("attempt") or 0), job.spec.scheduling.gang
    if status.get("podGroup") or attempt < 1 or gang == "none":
        return status.get("podGroup")
    return {"apiVersion": POD_GROUP_APIS[gang][-1], "name": pod_group_name(job, attempt)}


def delete_pod_group(kube: Kube, job: Job, group: PodGroupRef, logger: kopf.Logger) -> None:
    """A PodGroup of the job (pods are decide's business), if this job controls it. Only a kind the job's
    spec.scheduling.gang names is asked for: the chart grants PodGroups only with gangScheduling (one left by a
    since-changed spec goes with the job, by its owner reference)."""
    try:
        kube.delete_owned(group["apiVersion"], "PodGroup", job.namespace, group["name"], job.uid)
    except ApiError as exc:  # not granted (any more): the garbage collector deletes it with the job
        logger.warning("cannot delete PodGroup %s/%s: %s", job.namespace, group["name"], exc)


def delete_children(kube: Kube, name: str, namespace: str, uid: str, spec: Mapping[str, Any] | None,
                    status: Mapping[str, Any] | None, logger: kopf.Logger) -> None:
    """Delete a deleted job's children now rather than waiting for the garbage collector (owner references);
    only those it controls, never a foreign object that happens to carry a child's name or label."""
    pods = [p for p in kube.list_pods(namespace, {LABEL_JOB: name}) if controller_uid(p) == uid]
    release_groups(kube, namespace, [p["metadata"]["name"] for p in pods
                                     if (p["metadata"].get("labels") or {}).get(KUEUE_GROUP_LABEL)], logger)
    for pod in pods:
        kube.delete_pod(namespace, pod["metadata"]["name"])
    fake = Job(name=name, namespace=namespace, uid=uid, spec=None)  # type: ignore[arg-type]  # names only
    gang = ((spec or {}).get("scheduling") or {}).get("gang") or "none"
    held = (status or {}).get("podGroup")
    groups: list[PodGroupRef] = [held] if held else [
        {"apiVersion": POD_GROUP_APIS[gang][-1], "name": pod_group_name(fake, attempt)}
        for attempt in range(1, int((status or {}).get("attempt") or 0) + 1) if gang in POD_GROUP_APIS]
    for group in groups:  # the current one (an older operator's job: every attempt's, as it named them)
        delete_pod_group(kube, fake, group, logger)
    kube.delete_owned("v1", "Service", namespace, service_name(fake), uid)
    logger.info("deleted the children of %s", name)
