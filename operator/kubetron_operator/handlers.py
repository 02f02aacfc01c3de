"""The kopf layer, glue only: register the handlers, wake a job's daemon, gather, decide, act.

Event-driven: the operator watches its pods (pod_cache.PodCache, outside kopf, keyed by the controller
owner's UID) and its TrainingJobs (kopf). One daemon per TrainingJob sleeps until a change to the job or to one
of its pods wakes it (coalesced for DEBOUNCE seconds), or until the next moment time itself matters
(policy/wake.py) plus jitter. A finished or suspended job is never revisited by itself. Each wake-up:
`gather` reads what the job's pods and store serve (the read pool, at most IO_PER_NAMESPACE reads of one
namespace at a time: a tenant whose endpoints are slow delays only its own jobs), `observe` builds decide()'s
view from the freshest body known (view.py), decide() answers, and `act` applies the action (apply.py) with
no read of the job. A payload refused as hostile is a Warning event, once (events.py). /healthz fails while
work has waited more than STARVED_AFTER seconds for a thread of either pool (deps.PoolWatch).
No finalizer on an ordinary job (compat_kopf drops the one kopf's daemons ask for; ours stops itself on the
job's DELETED event): deleting a job leaves its children to the garbage collector (owner references), as for
a Kubernetes Job, and kopf writes nothing to a job at all (compat_kopf.NoDiffBase: no diff-base annotation).
A job queued in Kueue (spec.queueName, or the queue label) does get kopf's finalizer: its deletion waits
for cleanup_on_delete to mark its pods not retriable (else Kueue keeps the group's quota for
replacements); such a job is acted on only once the finalizer is on it (acting before races that patch).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from typing import Any

import kopf
import urllib3
from kubetron.contract.resource import FINISHED, GROUP, LABEL_JOB, PLURAL, VERSION
from kubetron.contract.times import stamp

from kubetron_operator import metrics
from kubetron_operator.apply import act, delete_children
from kubetron_operator.decide import decide
from kubetron_operator.deps import Deps
from kubetron_operator.events import EVENT_QUIET
from kubetron_operator.gather import Reads, gather, observe
from kubetron_operator.observe import Observed, json_copy
from kubetron_operator.pod_cache import PodCache
from kubetron_operator.policy.action import Action
from kubetron_operator.policy.kueue import queued
from kubetron_operator.policy.throttle import NEWS_HOLD, hold_news, hold_until, throttle
from kubetron_operator.policy.wake import JOB_OBJECTS_RETRY, at_most, next_due
from kubetron_operator.view import View, overlaid

DEBOUNCE = 0.2  # seconds: a burst of watch events (a gang of pods starting) becomes one reconcile
FINALIZER = "kubetron.dev/operator"  # kopf's (settings.persistence.finalizer), on Kueue-queued jobs only
FINALIZER_WAIT = 1.0  # seconds a new queued job waits for kopf's finalizer at most before looking again
IO_PER_NAMESPACE = 2  # reads of what pods and stores serve (gather) at once, for one namespace
STARVED_AFTER = 60.0  # seconds work may wait for a thread before /healthz says the operator is stuck


def register(registry: kopf.OperatorRegistry) -> kopf.OperatorRegistry:
    """Attach the TrainingJob handlers to `registry` (main.run then adapts kopf: compat_kopf.install)."""
    # The pods are watched outside kopf (pod_cache), listed before kopf watches any job: no daemon ever
    # decides from a half-filled view of its pods (which would look like pods that vanished).
    kopf.on.startup(registry=registry)(start_pod_cache)
    kopf.on.cleanup(registry=registry)(stop_pod_cache)
    kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)(job_event)
    kopf.on.probe(id="pools", registry=registry)(pool_health)
    # kopf's handler protocols type `namespace` as str | None (for cluster-wide resources; a TrainingJob is
    # namespaced): hence the ignores.
    kopf.daemon(GROUP, VERSION, PLURAL, registry=registry,
                cancellation_timeout=10.0)(reconcile_daemon)  # type: ignore[arg-type]
    # Only a Kueue-queued job's deletion waits (kopf's finalizer) for its pods to be let go; kopf is blind
    # to every other job's changes (no handler matches them), so it spends nothing on their events.
    kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry, when=queued)(cleanup_on_delete)  # type: ignore[arg-type]
    return registry


async def start_pod_cache(memo: Any, **_: Any) -> None:
    """List the pods of every watched namespace, then watch them (PodCache); each change wakes its job."""
    deps: Deps = memo.deps
    loop = asyncio.get_running_loop()

    def wake(namespace: str, uid: str) -> None:
        loop.call_soon_threadsafe(deps.view.wake, uid, namespace)

    cache = PodCache(deps.kube, deps.namespaces, LABEL_JOB, wake)
    try:
        await loop.run_in_executor(deps.executor, cache.start)
    except Exception as exc:  # noqa: BLE001 - the API server is away or refuses: kopf tries again (one line)
        raise kopf.TemporaryError(f"cannot list the pods to watch: {exc}", delay=2.0) from None
    deps.pods = cache


async def pool_health(memo: Any, **_: Any) -> dict[str, float]:
    """/healthz (kopf's probe): fails while work has waited for a thread longer than STARVED_AFTER."""
    waited = memo.deps.pools.oldest()
    if waited > STARVED_AFTER:
        raise kopf.PermanentError(f"work has waited {waited:.0f}s for a thread (reconcile or read pool starved)")
    return {"oldestWaitSeconds": round(waited, 1)}


async def stop_pod_cache(memo: Any, **_: Any) -> None:
    if memo.deps.pods is not None:
        memo.deps.pods.stop()


async def job_event(body: kopf.Body, type: str | None, memo: Any, **_: Any) -> None:  # noqa: A002 - kopf's kwarg
    view: View = memo.deps.view
    meta = body.get("metadata") or {}
    uid = meta.get("uid")
    if not uid:
        return
    if type == "DELETED":  # its daemon stops by itself (kopf stops it only through a finalizer), its memory with it
        view.deleted(uid, meta.get("namespace") or "default", meta.get("name") or "",
                     daemon_may_start=not meta.get("deletionTimestamp"))
    else:
        view.saw(uid, json_copy(body))
        view.wake(uid)


async def reconcile_daemon(name: str, namespace: str, uid: str, body: kopf.Body, stopped: kopf.DaemonStopped,
                           memo: Any, logger: kopf.Logger, **_: Any) -> None:
    """Decide whenever the job or one of its pods changes, or when the next deadline is due. What the operator
    holds for the job (view.JobMemory) lives as long as this daemon."""
    deps: Deps = memo.deps
    view = deps.view
    memory = view.enter(uid, namespace, name)
    try:
        while not stopped and not memory.gone:
            memory.wake.clear()
            current = memory.body or json_copy(body)
            pods = view.pods(uid, deps.pods.pods(namespace, uid) if deps.pods is not None else ())
            try:
                reads = await _gather_outside(deps, namespace, overlaid(current, memory.deferred), pods)
                due = await deps.pools.run(deps.executor, react, deps, current, pods, logger, reads)
            except (OSError, urllib3.exceptions.HTTPError) as exc:  # the API server away (restarting): one line
                logger.warning("reconcile of %s/%s: the API server did not answer (%s); retrying in %.1fs", namespace,
                               name, " ".join(str(exc).split())[:300], deps.interval)
                due = deps.interval
            except Exception:  # one bad round must not kill the job's reconciler
                logger.exception("reconcile of %s/%s failed; retrying in %.1fs", namespace, name, deps.interval)
                due = deps.interval
            if memory.news_held is not None or memory.deferred is not None:  # they wait for the creations to end
                _release_news_when_quiet(deps)
            await _sleep(memory.wake, stopped, due)
            await asyncio.sleep(DEBOUNCE)
    finally:
        view.leave(uid)


async def _gather_outside(deps: Deps, namespace: str, body: dict[str, Any], pods: list[dict[str, Any]]) -> Reads:
    """gather() in the read pool, at most IO_PER_NAMESPACE of one namespace at a time (waiting here costs
    no thread); nothing for a finished job."""
    if (body.get("status") or {}).get("phase") in FINISHED:
        return Reads()
    slot = deps.io_slots.setdefault(namespace, asyncio.Semaphore(IO_PER_NAMESPACE))
    async with slot:
        if deps.view.gone((body.get("metadata") or {}).get("uid")):  # deleted while it waited for its turn
            return Reads()
        reads: Reads = await deps.pools.run(deps.io_executor, gather, deps, body, pods)
        return reads


async def _sleep(wake: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float | None) -> None:
    async def until_stopped() -> None:
        await stopped.wait()

    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(until_stopped())]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def react(deps: Deps, body: dict[str, Any], pods: list[dict[str, Any]], logger: kopf.Logger,
          reads: Reads | None = None) -> float | None:
    """One wake-up: decide from the freshest known body, the watched pods and what `gather` read, and act
    when that calls for something. Returns the seconds until time itself matters (None: never)."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return None
    if FINALIZER not in (meta.get("finalizers") or ()) and queued(body):
        return FINALIZER_WAIT  # kopf's finalizer patch is under way; its watch event wakes us
    uid = meta.get("uid") or ""
    memory = deps.view.get(uid)
    deferred = memory.deferred if memory is not None else None  # our status patch held back: decide as if applied
    obs, job = observe(deps, overlaid(body, deferred), pods, reads)
    _warn_once(deps, body, obs, reads, logger)
    action = decide(job, obs)
    action, held = throttle(action, deps.view.since_patch(uid), deps.interval)
    action, news_due = _hold_news(deps, uid, action)
    if deferred is not None and memory is not None:
        held_for = time.monotonic() - deferred.since
        if action.idle and deps.creating.busy() and held_for < NEWS_HOLD:
            news_due = at_most(news_due, NEWS_HOLD - held_for)
        else:  # it goes out now, with what this round patches (decided from the status it makes)
            action = dataclasses.replace(action, status={**deferred.status, **action.status})
            memory.deferred = None
    if not action.idle:
        creating = deps.creating.acting() if action.create_attempt is not None else contextlib.nullcontext()
        with metrics.RECONCILE.time(), deps.activity.acting(), creating:
            applied = act(deps, body, job, obs, action, logger)
        if applied is None and deferred is not None and memory is not None and memory.deferred is None:
            memory.deferred = deferred  # the job changed meanwhile: still held, decided again from the newer one
    if action.why:
        logger.debug("waiting: %s", action.why)
    due = next_due(job, obs, deps.interval, random.random())
    if held:  # a progress patch was held back: look again when it may go out
        due = at_most(due, hold_until(deps.interval))
    if news_due is not None:  # so were a starting attempt's news
        due = at_most(due, news_due)
    if action.create_job_objects and not deps.view.has_job_objects(meta.get("uid")):  # a transient error: try again
        due = at_most(due, JOB_OBJECTS_RETRY)
    return due


def _release_news_when_quiet(deps: Deps) -> None:
    """Wake every job whose news or new attempt's status wait (JobMemory.news_held, .deferred) once no attempt
    has been created for EVENT_QUIET seconds (one task for all of them; NEWS_HOLD bounds the wait anyway)."""

    async def wake_when_quiet() -> None:
        while deps.creating.busy():
            await asyncio.sleep(EVENT_QUIET)
        for memory in list(deps.view.jobs.values()):
            if memory.news_held is not None or memory.deferred is not None:
                memory.wake.set()

    if deps.news_waker is None or deps.news_waker.done():
        deps.news_waker = asyncio.ensure_future(wake_when_quiet())


def _hold_news(deps: Deps, uid: str, action: Action) -> tuple[Action, float | None]:
    """throttle.hold_news, with when the job's news were first held (JobMemory.news_held)."""
    memory = deps.view.get(uid)
    since = memory.news_held if memory is not None else None
    action, due = hold_news(action, deps.creating.busy(), None if since is None else time.monotonic() - since)
    if memory is not None:
        memory.news_held = (since or time.monotonic()) if due is not None else None
    return action, due


def _warn_once(deps: Deps, body: dict[str, Any], obs: Observed, reads: Reads | None, logger: kopf.Logger) -> None:
    """A Warning event (TrainerOutputIgnored) for each payload newly ignored as hostile: a pod's termination
    message, rank 0's status endpoint, lines of the progress log."""
    uid = body["metadata"].get("uid") or ""
    found = [*(reads.warnings if reads else ()), *(f"pod {p.name}: {p.refused}" for p in obs.pods if p.refused)]
    memory = deps.view.get(uid)
    posted = memory.warned if memory is not None else set()
    for message in (m for m in found if m not in posted):
        posted.add(message)
        logger.warning("TrainerOutputIgnored: %s", message)
        deps.poster.post(body, "Warning", "TrainerOutputIgnored", message, stamp(obs.now), logger)


def cleanup_on_delete(name: str, namespace: str, uid: str, spec: Any, status: Any, memo: Any,
                      logger: kopf.Logger, **_: Any) -> None:
    """A Kueue-queued job is being deleted: its children go now (apply.delete_children), so Kueue frees
    its pod groups' quota; kopf then lifts its finalizer."""
    delete_children(memo.deps.kube, name, namespace, uid, spec, status, logger)
