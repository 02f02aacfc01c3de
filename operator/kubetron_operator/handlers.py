"""The kopf layer: gather observations, call decide(), apply the action. No policy lives here.

Event-driven: the operator watches its pods (pod_cache.PodCache, outside kopf, keyed by the controller
owner's UID) and its TrainingJobs (kopf). One daemon per TrainingJob sleeps until a change to the job or to one
of its pods wakes it (coalesced for DEBOUNCE seconds), or until the next moment time itself matters
(`next_due`: backoff, deadlines, startup timeout, TTL, a live-progress read while running) plus jitter.
A finished or suspended job is never revisited by itself. Each wake-up decides from the freshest body
known, the watched one or the one our own last status patch returned (whichever is newer: a lagging
watch never brings back a status we already replaced), and acts on it with no read of the job: every
status patch carries that body's resourceVersion, so a decision someone else's write made stale is
refused (Conflict) and taken again, and counters in status are never applied twice.
No finalizer on an ordinary job (a kopf daemon asks for one; ours stops itself on the job's DELETED
event): deleting a job leaves its children to the garbage collector (owner references), as for a
Kubernetes Job, and kopf writes nothing to a job at all (NoDiffBase: no diff-base annotation either).
A job queued in Kueue (spec.queueName, or the queue label) does get kopf's finalizer: its deletion waits
for cleanup_on_delete to mark its pods not retriable (else Kueue keeps the group's quota for
replacements); such a job is acted on only once the finalizer is on it (acting before races that patch).
The action is applied in crash-safe order: a new attempt's pods are created before status names the
attempt; an ended attempt is recorded in status before its pods are deleted. Pods this operator has
just created are remembered until the watch shows them, so a lagging watch is never taken for a
preemption. Status is patched only when a field changed, and a change of live progress alone
(iteration, ETA, tokens/s) at most every `2 * interval` seconds.

What a job's pods and store serve is read outside the reconcile pool (`gather`: rank 0's status endpoint,
the S3 progress log), in a pool of its own with at most IO_PER_NAMESPACE reads of one namespace at a time,
each bounded in time and size (trainer_reports/): a tenant whose endpoints are slow delays only its
own jobs. A read that failed is not tried again for RETRY_AFTER seconds. /healthz fails while work has
waited more than STARVED_AFTER seconds for a thread of either pool (PoolWatch). A payload refused as
hostile (a termination message nested too deep, a number beyond int64) is a Warning event, once; text
from pods reaches status, Events and the log only with its control characters escaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import kopf
from kubetron.contract.live import LiveStatus
from kubetron.contract.progress import ProgressSummary
from kubetron.contract.resource import FINISHED, GROUP, LABEL_JOB, PLURAL, VERSION
from kubetron.contract.times import parse_stamp, stamp

from kubetron_operator import metrics
from kubetron_operator.api_calls import ApiError, Conflict, Kube, NameConflict, controller_uid, pod_group_api_version
from kubetron_operator.build import (
    attempt_objects,
    build_probe_pod,
    build_service,
    pod_group_name,
    service_name,
)
from kubetron_operator.decide import decide
from kubetron_operator.job_status import JobStatus
from kubetron_operator.model import (
    KUEUE_GROUP_LABEL,
    KUEUE_RETRIABLE_ANNOTATION,
    QUEUE_LABEL,
    Job,
    S3Storage,
    SpecError,
)
from kubetron_operator.observe import Observed, PodView, job_status, json_copy, node_trouble
from kubetron_operator.pod_cache import PodCache
from kubetron_operator.policy.action import Action
from kubetron_operator.policy.elastic import attempt_size, shrink_due
from kubetron_operator.policy.lifecycle import FORCE_DELETE_AFTER
from kubetron_operator.policy.nodes import TAINT_KEY
from kubetron_operator.policy.start import (
    ENDING_PHASES,
    NOT_SCHEDULED_AFTER,
    create_failed,
    service_failed,
)
from kubetron_operator.trainer_reports import status_endpoint as live
from kubetron_operator.trainer_reports.store_log import ProgressRead, read_s3_progress
from kubetron_operator.untrusted import clean, clean_all

PROGRESS_REFRESH = 30.0  # seconds between progress-log reads while an attempt runs quietly
DEBOUNCE = 0.2  # seconds: a burst of watch events (a gang of pods starting) becomes one reconcile
RESYNC = 300.0  # seconds: an unfinished, unsuspended job is re-decided at least this often (no API request)
UNSEEN_FOR = 60.0  # seconds a pod we created may stay unseen by the watch before we stop vouching for it
RECONCILE_THREADS = 16  # jobs reconciled at once (each mostly waits for the API server)
PROGRESS_KEYS = frozenset({"iteration", "progress", "eta", "tokensPerSecond", "goodput"})  # throttled status fields
FINALIZER = "kubetron.dev/operator"  # kopf's (settings.persistence.finalizer), on Kueue-queued jobs only
FINALIZER_WAIT = 1.0  # seconds a new queued job waits for kopf's finalizer at most before looking again
SERVICE_RETRY = 10.0  # seconds until a Service that could not be created (a transient error) is tried again
EVENT_QUIET = 0.1  # seconds without an action in flight before a held-back Event goes out
EVENT_HOLD = 10.0  # seconds an Event waits at most for the operator to be quiet
IO_THREADS = 16  # reads of what pods and stores serve, at once (gather)
IO_PER_NAMESPACE = 2  # of them, for one namespace
RETRY_AFTER = 30.0  # seconds before a store or status endpoint that failed a read is read again
STARVED_AFTER = 60.0  # seconds work may wait for a thread before /healthz says the operator is stuck


class View:
    """What the watches told the daemons: a wake-up per job UID, the freshest job bodies (watched, or
    returned by our own status patch), the pods we created that the watch has not delivered yet, and
    when each job's status was last patched."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # bodies and _created are written from worker threads too
        self.wakes: dict[str, asyncio.Event] = {}
        self.bodies: dict[str, dict[str, Any]] = {}
        self._created: dict[str, dict[str, tuple[float, dict[str, Any]]]] = {}
        self._jobs: dict[str, tuple[str, Job | None, str]] = {}
        self.patched: dict[str, float] = {}
        self.gone: set[str] = set()  # jobs whose DELETED event came: their daemons stop
        self.services: set[str] = set()  # jobs whose Service this operator created or found (Observed.service)
        self.namespaces: dict[str, str] = {}  # job UID -> its namespace (a pod wakes a job only from there)
        self.warned: dict[str, set[str]] = {}  # job UID -> the ignored-payload warnings already posted

    def wake(self, uid: str | None, namespace: str | None = None) -> None:
        """Wake the job `uid`; with `namespace` (a pod's), only when the job lives there."""
        if uid and uid in self.wakes and (namespace is None or self.namespaces.get(uid) == namespace):
            self.wakes[uid].set()

    def saw(self, uid: str, body: dict[str, Any]) -> None:
        """Hold `body` as the job's freshest, unless the one held is newer: the watch may still deliver
        versions older than the one our own status patch returned."""
        with self._lock:
            held = self.bodies.get(uid)
            if held is None or not _older(body, held):
                self.bodies[uid] = body

    def drop(self, uid: str) -> None:
        with self._lock:
            self.bodies.pop(uid, None)

    def job(self, body: dict[str, Any]) -> tuple[Job | None, str]:
        """Job.from_body (or its SpecError's message), kept per job until its name, labels or spec
        change: parsing checks the trainer config (milliseconds), and a job wakes many times unchanged."""
        meta = body.get("metadata") or {}
        uid = meta.get("uid") or ""
        key = json.dumps([meta.get("name"), meta.get("namespace"), meta.get("labels"), body.get("spec")],
                         sort_keys=True)
        with self._lock:
            held = self._jobs.get(uid)
        if held is not None and held[0] == key:
            return held[1], held[2]
        try:
            job, error = Job.from_body(body), ""
        except SpecError as exc:
            job, error = None, str(exc)
        with self._lock:
            self._jobs[uid] = (key, job, error)
        return job, error

    def created(self, uid: str, manifests: list[dict[str, Any]]) -> None:
        with self._lock:
            mine = self._created.setdefault(uid, {})
            for m in manifests:
                if m["kind"] == "Pod":
                    mine[m["metadata"]["name"]] = (time.monotonic(), m)

    def pods(self, uid: str, watched: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """The watched pods of a job plus the ones we created and the watch has not shown yet."""
        pods = list(watched)
        seen = {p["metadata"]["name"] for p in pods}
        now = time.monotonic()
        with self._lock:
            mine = self._created.get(uid, {})
            for name in [n for n, (t, _) in mine.items() if n in seen or now - t > UNSEEN_FOR]:
                del mine[name]
            return pods + [m for _, m in mine.values()]

    def forget(self, uid: str) -> None:
        for table in (self.wakes, self.patched, self.namespaces, self.warned):
            table.pop(uid, None)
        self.gone.discard(uid)
        self.services.discard(uid)
        with self._lock:
            self.bodies.pop(uid, None)
            self._jobs.pop(uid, None)
            self._created.pop(uid, None)


def _older(body: dict[str, Any], than: dict[str, Any]) -> bool:
    """Whether `body` is an older version of the object than `than`. etcd's revisions are numbers; an
    API server that says otherwise gets no comparison (the status patch's precondition still holds)."""
    mine, other = (str((b.get("metadata") or {}).get("resourceVersion") or "") for b in (body, than))
    return mine.isdigit() and other.isdigit() and int(mine) < int(other)


class Activity:
    """How many actions are being applied right now, and when the last one ended (EventPoster waits
    for a quiet moment)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._acting = 0
        self._ended = float("-inf")

    @contextlib.contextmanager
    def acting(self) -> Iterator[None]:
        with self._lock:
            self._acting += 1
        try:
            yield
        finally:
            with self._lock:
                self._acting -= 1
                self._ended = time.monotonic()

    def busy(self, quiet: float = EVENT_QUIET) -> bool:
        """An action is in flight, or one ended less than `quiet` seconds ago."""
        with self._lock:
            return self._acting > 0 or time.monotonic() - self._ended < quiet


class EventPoster:
    """Posts the jobs' Events from one background thread, in order. An event is best effort (a failed post
    is logged, never retried) and never holds a reconcile. While the operator is acting (`activity`: a
    burst of new jobs whose pods and status go first) an event waits, at most EVENT_HOLD seconds from
    when it was handed over; its time is the moment it was decided, so a late post says the same."""

    def __init__(self, kube: Kube, activity: Activity | None = None):
        self.kube = kube
        self.activity = activity or Activity()
        self._queue: queue.SimpleQueue[tuple[float, tuple[dict[str, Any], str, str, str, str, kopf.Logger]]] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def post(self, body: Mapping[str, Any], type_: str, reason: str, message: str, now: str,
             logger: kopf.Logger) -> None:
        meta = body["metadata"]
        involved = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                    "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid")}}
        self._queue.put((time.monotonic(), (involved, type_, reason, clean(message), now, logger)))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="events", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            handed, (involved, type_, reason, message, now, logger) = self._queue.get()
            while self.activity.busy() and time.monotonic() - handed < EVENT_HOLD:
                time.sleep(EVENT_QUIET)
            try:
                self.kube.post_event(involved, type_, reason, message, now)
            except Exception as exc:  # noqa: BLE001 - an event is nice to have, never worth a retry
                logger.warning("could not post event %s: %s", reason, exc)


class PoolWatch:
    """How long work handed to the thread pools has waited for a thread: `oldest()` is the longest wait of
    what waits now (0 when nothing waits). /healthz fails beyond STARVED_AFTER (pool_health)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[object, float] = {}

    async def run(self, executor: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in `executor`, its wait for a thread watched."""
        ticket, loop = object(), asyncio.get_running_loop()
        with self._lock:
            self._waiting[ticket] = time.monotonic()

        def started() -> Any:
            with self._lock:
                self._waiting.pop(ticket, None)
            return fn(*args)

        try:
            return await loop.run_in_executor(executor, started)
        finally:
            with self._lock:
                self._waiting.pop(ticket, None)

    def oldest(self) -> float:
        now = time.monotonic()
        with self._lock:
            return max((now - t for t in self._waiting.values()), default=0.0)


@dataclasses.dataclass(frozen=True)
class Reads:
    """What `gather` read for one wake-up, outside the reconcile pool."""

    progress: ProgressSummary | None = None  # the S3 progress log's summary; None: unread
    live: LiveStatus | None = None  # rank 0's status endpoint; None: unread
    store_unread: tuple[str, str] | None = None  # (reason, message): why the S3 log could not be read
    warnings: tuple[str, ...] = ()  # payloads ignored as hostile


@dataclasses.dataclass
class Deps:
    """What the handlers use, injectable for tests (passed to kopf as its `memo`)."""

    kube: Kube
    interval: float = 5.0  # seconds between live-progress reads of a running job
    read_progress: Callable[[Job, Kube], ProgressRead] = read_s3_progress
    fetch_live: live.Fetch = live.http_fetch
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)
    last_progress: dict[str, tuple[datetime, ProgressRead]] = dataclasses.field(default_factory=dict)
    live_quiet: dict[str, float] = dataclasses.field(default_factory=dict)  # job UID -> no live read before
    view: View = dataclasses.field(default_factory=View)
    # Reconciles wait on the API server, not the CPU: more threads than asyncio's default (cores + 4).
    executor: ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: ThreadPoolExecutor(RECONCILE_THREADS, thread_name_prefix="reconcile"))
    io_executor: ThreadPoolExecutor = dataclasses.field(  # what pods and stores serve (gather)
        default_factory=lambda: ThreadPoolExecutor(IO_THREADS, thread_name_prefix="read"))
    io_slots: dict[str, asyncio.Semaphore] = dataclasses.field(default_factory=dict)  # namespace -> its reads
    pools: PoolWatch = dataclasses.field(default_factory=PoolWatch)
    activity: Activity = dataclasses.field(default_factory=Activity)  # actions in flight
    poster: EventPoster = dataclasses.field(init=False)  # the jobs' Events, through `kube`
    namespaces: tuple[str, ...] = ()  # the watched namespaces (empty: the whole cluster)
    pods: PodCache | None = None  # the jobs' pods, once listed (start_pod_cache)

    def __post_init__(self) -> None:
        self.poster = EventPoster(self.kube, self.activity)


def register(registry: kopf.OperatorRegistry) -> kopf.OperatorRegistry:
    """Attach the TrainingJob handlers to `registry` (main.run and the tests each bring their own)."""
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
    _needs_no_finalizer(registry, reconcile_daemon)
    # Only a Kueue-queued job's deletion waits (kopf's finalizer) for its pods to be let go; kopf is blind
    # to every other job's changes (no handler matches them), so it spends nothing on their events.
    kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry, when=queued)(cleanup_on_delete)  # type: ignore[arg-type]
    return registry


def _needs_no_finalizer(registry: kopf.OperatorRegistry, fn: Callable[..., Any]) -> None:
    """kopf.daemon always asks for a finalizer (to stop the daemon before its object goes), which costs a
    patch and a watch event per new job and makes every deletion wait for the operator. `fn` stops by
    itself on the job's DELETED event (View.gone); kopf stops it as before on shutdown and when a peer
    takes over. kopf offers no argument for this: the handler kopf.daemon registered is replaced by a copy
    with requires_finalizer=False (kopf is pinned; tests/operator/test_on_kube_events.py sees no patch)."""
    spawning = registry._spawning._handlers
    matching = [i for i, h in enumerate(spawning) if h.fn is fn]
    if len(matching) != 1:
        raise RuntimeError(f"kopf registered {len(matching)} daemons for {fn.__name__}, not one")
    spawning[matching[0]] = dataclasses.replace(spawning[matching[0]], requires_finalizer=False)


def queued(body: Mapping[str, Any], **_: Any) -> bool:
    """The job is queued in Kueue (spec.queueName or the queue label): its pods form Kueue pod groups."""
    labels = (body.get("metadata") or {}).get("labels") or {}
    return bool((body.get("spec") or {}).get("queueName") or labels.get(QUEUE_LABEL))


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's record of the spec it last handled, kept for change handlers' diffs (on.create/update),
    would cost an annotation patch on every new or edited job; the one change handler here is on.delete,
    which needs no diff. With none stored, every change of a live job is a "creation" without handlers.
    Nor is the essence built (a deep copy of every watched job and pod, for those diffs and for daemons'
    idle timeouts, unused here)."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


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
    uid = (body.get("metadata") or {}).get("uid")
    if not uid:
        return
    if type == "DELETED":
        view.drop(uid)
        view.gone.add(uid)  # no finalizer held it: its daemon stops by itself
        meta = body.get("metadata") or {}
        metrics.forget(meta.get("namespace") or "default", meta.get("name") or "")
    else:
        view.saw(uid, json_copy(body))
    view.wake(uid)


async def reconcile_daemon(name: str, namespace: str, uid: str, body: kopf.Body, stopped: kopf.DaemonStopped,
                           memo: Any, logger: kopf.Logger, **_: Any) -> None:
    """Decide whenever the job or one of its pods changes, or when the next deadline is due."""
    deps: Deps = memo.deps
    view = deps.view
    wake = view.wakes.setdefault(uid, asyncio.Event())
    view.namespaces[uid] = namespace
    try:
        while not stopped and uid not in view.gone:
            wake.clear()
            current = view.bodies.get(uid) or json_copy(body)
            pods = view.pods(uid, deps.pods.pods(namespace, uid) if deps.pods is not None else ())
            try:
                reads = await _gather_outside(deps, namespace, current, pods)
                due = await deps.pools.run(deps.executor, react, deps, current, pods, logger, reads)
            except Exception:  # one bad round must not kill the job's reconciler
                logger.exception("reconcile of %s/%s failed; retrying in %.0fs", namespace, name, deps.interval)
                due = deps.interval
            await _sleep(wake, stopped, due)
            await asyncio.sleep(DEBOUNCE)
    finally:
        view.forget(uid)
        deps.last_progress.pop(f"{namespace}/{name}", None)
        deps.live_quiet.pop(uid, None)


async def _gather_outside(deps: Deps, namespace: str, body: dict[str, Any], pods: list[dict[str, Any]]) -> Reads:
    """gather() in the read pool, at most IO_PER_NAMESPACE of one namespace at a time (waiting here costs
    no thread); nothing for a finished job."""
    if (body.get("status") or {}).get("phase") in FINISHED:
        return Reads()
    slot = deps.io_slots.setdefault(namespace, asyncio.Semaphore(IO_PER_NAMESPACE))
    async with slot:
        if (body.get("metadata") or {}).get("uid") in deps.view.gone:  # deleted while it waited for its turn
            return Reads()
        reads: Reads = await deps.pools.run(deps.io_executor, gather, deps, body, pods)
        return reads


def gather(deps: Deps, body: dict[str, Any], pods_in: list[dict[str, Any]]) -> Reads:
    """Read what the job's pods and store serve: rank 0's status endpoint and the S3 progress log (each
    bounded in time and size; one that failed is left alone for RETRY_AFTER seconds)."""
    job, _ = deps.view.job(body)
    status = job_status(body)
    if job is None or status.get("phase") in FINISHED:
        return Reads()
    now, meta = deps.clock(), body["metadata"]
    pods = [PodView.from_pod(p, now) for p in _owned(meta, pods_in)]
    attempt = int(status.get("attempt") or 0)
    quiet_until = deps.live_quiet.get(job.uid, 0.0)
    got = live.read_live(pods, attempt, job.spec.status_port, deps.fetch_live) if time.monotonic() >= quiet_until \
        else live.LiveRead()
    if got.problem:
        deps.live_quiet[job.uid] = time.monotonic() + RETRY_AFTER
    read = _progress(deps, job, status, pods, now) if isinstance(job.spec.storage, S3Storage) else ProgressRead()
    return Reads(progress=read.summary, live=got.status, store_unread=read.unread,
                 warnings=(*read.warnings, *((got.problem,) if got.problem else ())))


def _owned(meta: Mapping[str, Any], pods: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods the job controls, in its own namespace only (an owner reference names no namespace)."""
    namespace = meta.get("namespace") or "default"
    return [p for p in pods if controller_uid(p) == meta.get("uid")
            and ((p.get("metadata") or {}).get("namespace") or namespace) == namespace]


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
    obs, job = observe(deps, body, pods, reads)
    _warn_once(deps, body, obs, reads, logger)
    action, held = _throttle(deps, meta.get("uid") or "", decide(job, obs))
    if not _idle(action):
        with metrics.RECONCILE.time(), deps.activity.acting():
            act(deps, body, job, obs, action, logger)
    due = next_due(job, obs, deps.interval)
    if held:  # a progress patch was held back: look again when it may go out
        due = min(due if due is not None else float("inf"), 2 * deps.interval)
    if action.create_service and meta.get("uid") not in deps.view.services:  # a transient error: try again
        due = min(due if due is not None else float("inf"), SERVICE_RETRY)
    return due


def _warn_once(deps: Deps, body: dict[str, Any], obs: Observed, reads: Reads | None, logger: kopf.Logger) -> None:
    """A Warning event (TrainerOutputIgnored) for each payload newly ignored as hostile: a pod's termination
    message, rank 0's status endpoint, lines of the progress log."""
    uid = body["metadata"].get("uid") or ""
    found = [*(reads.warnings if reads else ()), *(f"pod {p.name}: {p.refused}" for p in obs.pods if p.refused)]
    posted = deps.view.warned.setdefault(uid, set())
    for message in (m for m in found if m not in posted):
        posted.add(message)
        logger.warning("TrainerOutputIgnored: %s", message)
        deps.poster.post(body, "Warning", "TrainerOutputIgnored", message, stamp(obs.now), logger)


def _idle(action: Action) -> bool:
    return not (action.status or action.delete_pods or action.force_delete_pods or action.events or action.release_pods
                or action.create_attempt is not None or action.delete_job
                or action.create_probes or action.create_service or action.taint_nodes)


def _throttle(deps: Deps, uid: str, action: Action) -> tuple[Action, bool]:
    """Hold back a status patch that only moves live progress when the last patch was recent.
    Returns the action to apply and whether something was held back."""
    if not action.status or not set(action.status) <= PROGRESS_KEYS:
        return action, False
    if time.monotonic() - deps.view.patched.get(uid, float("-inf")) >= 2 * deps.interval:
        return action, False
    return dataclasses.replace(action, status={}), True


def next_due(job: Job | None, obs: Observed, interval: float) -> float | None:
    """Seconds until decide() could answer differently with nothing but time passing (None: never);
    changes to the job or its pods wake the daemon anyway. Jittered, so jobs applied together spread."""
    st, now, phase = obs.status, obs.now, obs.status.get("phase")
    if job is None:
        return None
    waits: list[float] = []
    if phase in FINISHED:
        done = parse_stamp(st.get("completionTime"))
        if job.spec.ttl_seconds_after_finished is not None and done:
            waits.append((done - now).total_seconds() + job.spec.ttl_seconds_after_finished)
    elif job.spec.suspend or phase == "Suspended":
        waits += [FORCE_DELETE_AFTER - p.deleting_for for p in obs.pods if p.deleting_for is not None]
    else:
        waits.append(RESYNC)
        if phase == "Running":
            waits.append(interval)  # live progress (rank 0's endpoint) and the store's log
        for key in ("nextAttemptTime", "nextCreateTime"):
            if when := parse_stamp(st.get(key)):
                waits.append((when - now).total_seconds())
        start, deadline = parse_stamp(st.get("startTime")), job.spec.active_deadline_seconds
        if start and deadline:
            waits.append((start - now).total_seconds() + deadline)
        began = parse_stamp(st.get("admittedTime")) or parse_stamp(st.get("attemptStartTime"))  # Kueue: from admission
        if began and phase == "Pending":
            waits.append((began - now).total_seconds() + job.spec.startup_timeout_seconds)
            current = [p for p in obs.pods if p.role == "worker" and str(p.attempt) == str(st.get("attempt"))]
            shrink_in = shrink_due(job, obs, current, began)
            if shrink_in is not None:
                waits.append(shrink_in)
        for p in obs.pods:
            if p.deleting_for is not None:
                waits.append(FORCE_DELETE_AFTER - p.deleting_for)
            elif p.role == "worker" and not p.scheduler_seen:
                waits.append(NOT_SCHEDULED_AFTER - p.created_for)
    future = [w for w in waits if w > 0]
    if not future:
        return None
    soonest = min(future)
    return soonest + 0.05 + random.uniform(0, min(1.0, 0.1 * soonest))  # past the strict `>` in decide


def cleanup_on_delete(name: str, namespace: str, uid: str, spec: Any, status: Any, memo: Any,
                      logger: kopf.Logger, **_: Any) -> None:
    """Delete the children now rather than waiting for the garbage collector (owner references); only
    those this job controls, never a foreign object that happens to carry a child's name or label."""
    kube: Kube = memo.deps.kube
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


def act(deps: Deps, body: dict[str, Any], job: Job | None, obs: Observed, action: Action,
        logger: kopf.Logger) -> Action | None:
    """Apply `action`, decided from `body` (its resourceVersion guards every status patch): what was
    applied, or None when it waits (creation backoff) or the job changed meanwhile (decide again)."""
    namespace, name = body["metadata"].get("namespace") or "default", body["metadata"]["name"]
    if action.create_attempt is not None:
        # After a transient creation failure: the torn-down pods of that attempt go first (their names are
        # about to be reused), and the retry waits until status.nextCreateTime.
        leftovers = _creation_leftovers(obs, action)
        for pod in leftovers:
            if pod.deleting_for is None:
                deps.kube.delete_pod(namespace, pod.name)
        if leftovers or _backing_off(obs):
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


def _creation_leftovers(obs: Observed, action: Action) -> list[PodView]:
    """After a transient creation failure (status.nextCreateTime set): the pods of the attempt to create
    that are still there (the failed try tore them down, or is tearing them down)."""
    if not obs.status.get("nextCreateTime"):
        return []
    return [p for p in obs.pods if p.attempt == action.create_attempt]


def _backing_off(obs: Observed) -> bool:
    """A creation retry is not due yet (status.nextCreateTime is in the future)."""
    retry_at = parse_stamp(obs.status.get("nextCreateTime"))
    return retry_at is not None and obs.now < retry_at


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
    owned = _owned(meta, pods_in)
    pods = [PodView.from_pod(p, now) for p in owned]
    trouble = _node_trouble(kube, status, pods)
    reads = reads or Reads()
    return Observed(now=now, status=status, pods=tuple(pods), progress=reads.progress, live=reads.live,
                    spec_error=error, node_trouble=trouble, service=meta.get("uid") in deps.view.services,
                    store_unread=reads.store_unread, created=parse_stamp(meta.get("creationTimestamp"))), job


def _node_trouble(kube: Kube, status: JobStatus, pods: list[PodView]) -> dict[str, str]:
    """Nodes under the current attempt that are not Ready or gone; only asked for once a pod has failed
    (decide then tells a dead node from a trainer error), so a healthy job never lists nodes."""
    attempt = int(status.get("attempt") or 0)
    current = [p for p in pods if p.role == "worker" and p.attempt == attempt]
    if status.get("phase") in FINISHED or not any(p.phase == "Failed" for p in current):
        return {}
    return node_trouble(kube.list_nodes(), {p.node for p in current if p.node})


def _progress(deps: Deps, job: Job, status: JobStatus, pods: list[PodView], now: datetime) -> ProgressRead:
    """The S3 progress log: read whenever an attempt ends or starts, else at most every 30 s; after a
    failed read, not before RETRY_AFTER seconds."""
    key = f"{job.namespace}/{job.name}"
    cached = deps.last_progress.get(key)
    attempt = int(status.get("attempt") or 0)
    eventful = status.get("phase") in (None, "Restarting", "Suspended") or any(
        p.attempt == attempt and (p.terminated or p.deleting_for is not None or p.phase == "Unknown") for p in pods
    ) or len([p for p in pods if p.attempt == attempt and p.role == "worker"]) < attempt_size(job, status)
    age = (now - cached[0]).total_seconds() if cached else 0.0
    if cached and cached[1].unread and age < RETRY_AFTER:
        return cached[1]
    if cached and not eventful and (status.get("phase") != "Running" or age < PROGRESS_REFRESH):
        return cached[1]  # between events only a running attempt moves the log
    read = deps.read_progress(job, deps.kube)
    deps.last_progress[key] = (now, read)
    return read


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
        manifests = attempt_objects(job, attempt, action.expected_iteration, action.avoid_nodes, action.nodes)
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
        if job is not None and _attempt_ended(obs, action):
            delete_attempt_children(kube, job, int(obs.status["attempt"]), job.spec.scheduling.gang, logger)
    for pod in action.force_delete_pods:
        kube.delete_pod(namespace, pod, force=True)
    taint_nodes(kube, action.taint_nodes, name, logger)
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


def taint_nodes(kube: Kube, nodes: Iterable[str], job: str, logger: kopf.Logger) -> None:
    """Nodes the job just left out (policy/nodes.py), tainted cluster-wide when the chart allows it
    (`--taint-failing-nodes`); best effort: the job's own avoid list holds either way."""
    for node in nodes if kube.taint_nodes else ():
        try:
            if kube.taint_node(node, TAINT_KEY, job):
                logger.warning("tainted node %s %s=%s:NoSchedule (it failed job %s twice)", node, TAINT_KEY, job, job)
        except ApiError as exc:
            logger.warning("cannot taint node %s: %s", node, exc)


def create_children(kube: Kube, job: Job, manifests: list[dict[str, Any]],
                    logger: kopf.Logger) -> tuple[str, str, bool] | None:
    """Create an attempt's objects in order. On an API error delete what this call created (a partial
    gang must not hold GPUs) and return (reason, message, transient) for policy.start.create_failed."""
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
            transient = exc.status == 429 or exc.status >= 500 or (exc.status == 403 and "exceeded quota" in str(exc))
            return ("CreateRetrying" if transient else "CreateFailed"), f"cannot create {what}: {exc}", transient
    return None


def _attempt_ended(obs: Observed, action: Action) -> bool:
    """The running attempt just ended (restart, success, failure, suspension)."""
    return (int(obs.status.get("attempt") or 0) > 0 and obs.status.get("phase") in ("Pending", "Running")
            and action.phase in ENDING_PHASES)


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
