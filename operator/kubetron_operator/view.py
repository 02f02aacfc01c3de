"""What the operator remembers of each job between wake-ups: one record per job (JobMemory), made in one place
(View._record: when the job's daemon starts, or when its deletion comes first) and dropped in one place (View.leave,
when its daemon ends), shared between the daemons and the threads they act from.

Each wake-up decides from the freshest body known, the watched one or the one our own last status patch
returned (whichever is newer: a lagging watch never brings back a status we already replaced). Pods this
operator has just created are remembered until the watch shows them, so a lagging watch is never taken for
a preemption. Nothing here is needed to carry on after a restart: what decide() must remember is in status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from kubetron_operator import metrics
from kubetron_operator.job_status import JobStatus
from kubetron_operator.model import Job, SpecError
from kubetron_operator.observe import job_status
from kubetron_operator.trainer_reports.store_log import ProgressRead

UNSEEN_FOR = 60.0  # seconds a pod we created may stay unseen by the watch before we stop vouching for it


@dataclasses.dataclass
class JobMemory:
    """Everything the operator holds for one job (by UID), none of it needed after a restart."""

    namespace: str
    name: str
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set: decide again now
    gone: bool = False  # its DELETED event came: the daemon stops
    body: dict[str, Any] | None = None  # the freshest body known (watched, or returned by our status patch)
    parsed: tuple[str, Job | None, str] | None = None  # (what it was parsed from, Job.from_body, its error)
    created: dict[str, tuple[float, dict[str, Any]]] = dataclasses.field(default_factory=dict)  # pods not seen yet
    patched: float = float("-inf")  # time.monotonic() of our last status patch (policy/throttle.py)
    job_objects: bool = False  # its Service and peer token were made or found by this operator (Observed.job_objects)
    warned: set[str] = dataclasses.field(default_factory=set)  # ignored-payload warnings already posted
    progress: tuple[datetime, ProgressRead] | None = None  # the store's progress log as last read, and when
    live_quiet_until: float = 0.0  # time.monotonic() before which rank 0's endpoint is not read (it failed)
    news_held: float | None = None  # time.monotonic() since when a starting attempt's news wait (throttle.hold_news)
    deferred: Deferred | None = None  # a new attempt's status patch, held while other attempts are being created


@dataclasses.dataclass(frozen=True)
class Deferred:
    """A new attempt's status patch (AttemptCreated) held back while other jobs' pods are being created: a burst's
    pods go first (a status patch is the dearest write). Until it goes out, every wake-up of the job decides from
    its body with this patch applied (View.overlaid), as if the server held it; it goes out with the job's next
    action, or on its own once no attempt has been created for EVENT_QUIET seconds, at most NEWS_HOLD seconds
    late. Lost with the operator: the next one finds the attempt's pods and status without them, the path of an
    operator that died between the pods and the patch (apply.py: pods first)."""

    status: dict[str, Any]
    since: float  # time.monotonic() when it was first held


class View:
    """What the watches told the daemons, one JobMemory per job UID (`jobs`). A job is known from its daemon's
    start (enter) to its end (leave); watch events of a job not known here change nothing (the daemon starts
    from kopf's live body)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # bodies, parses and created pods are written from worker threads too
        self.jobs: dict[str, JobMemory] = {}

    def _record(self, uid: str, namespace: str, name: str) -> JobMemory:
        """The job's record, made if there is none (the one place one is made)."""
        with self._lock:
            return self.jobs.setdefault(uid, JobMemory(namespace=namespace, name=name))

    def enter(self, uid: str, namespace: str, name: str) -> JobMemory:
        """The job's daemon starts: its record (gone already when the job's deletion came first)."""
        return self._record(uid, namespace, name)

    def leave(self, uid: str) -> None:
        """The job's daemon ends: everything held for it goes, its metrics too (the one place)."""
        with self._lock:
            memory = self.jobs.pop(uid, None)
        if memory is not None:
            metrics.forget(memory.namespace, memory.name, uid)

    def get(self, uid: str | None) -> JobMemory | None:
        return self.jobs.get(uid or "")

    def wake(self, uid: str | None, namespace: str | None = None) -> None:
        """Wake the job `uid`; with `namespace` (a pod's), only when the job lives there."""
        memory = self.get(uid)
        if memory is not None and (namespace is None or memory.namespace == namespace):
            memory.wake.set()

    def deleted(self, uid: str, namespace: str, name: str, daemon_may_start: bool) -> None:
        """The job's DELETED event: no finalizer held it, so its daemon stops by itself. `daemon_may_start`:
        kopf may still start the job's daemon (it does so for a DELETED event of a job it had not started
        one for, a job not being deleted through a finalizer): that daemon finds the job gone and ends."""
        memory = self._record(uid, namespace, name) if daemon_may_start else self.get(uid)
        if memory is not None:
            memory.gone = True
            memory.body = None
            memory.wake.set()

    def gone(self, uid: str | None) -> bool:
        """The job was deleted, or its daemon has ended."""
        memory = self.get(uid)
        return memory is None or memory.gone

    def saw(self, uid: str, body: dict[str, Any]) -> None:
        """Hold `body` as the job's freshest, unless the one held is newer: the watch may still deliver
        versions older than the one our own status patch returned."""
        with self._lock:
            memory = self.jobs.get(uid)
            if memory is not None and not memory.gone and (memory.body is None or not _older(body, memory.body)):
                memory.body = body

    def statuses(self) -> list[tuple[str, JobStatus]]:
        """(namespace, status) of every job known (policy.nodes.avoiders reads which nodes they avoid)."""
        with self._lock:
            return [(m.namespace, job_status(overlaid(m.body, m.deferred))) for m in self.jobs.values()
                    if m.body is not None]

    def defer(self, uid: str, status: dict[str, Any]) -> bool:
        """Hold the job's status patch `status` back (Deferred), on top of one held already. False: the job has
        no daemon here to send it later (patch now)."""
        memory = self.get(uid)
        if memory is None or memory.gone:
            return False
        held = memory.deferred
        memory.deferred = Deferred({**held.status, **status}, held.since) if held is not None else \
            Deferred(dict(status), time.monotonic())
        return True

    def job(self, body: dict[str, Any]) -> tuple[Job | None, str]:
        """Job.from_body (or its SpecError's message), kept per job until its name, labels or spec
        change: parsing checks the trainer config (milliseconds), and a job wakes many times unchanged."""
        meta = body.get("metadata") or {}
        memory = self.get(meta.get("uid"))
        # The API server counts spec changes in metadata.generation: no need to compare the spec (the config
        # text is up to 192 KiB) but for a body without one.
        spec = meta.get("generation") or body.get("spec")
        key = json.dumps([meta.get("name"), meta.get("namespace"), meta.get("labels"), spec], sort_keys=True)
        held = memory.parsed if memory is not None else None
        if held is not None and held[0] == key:
            return held[1], held[2]
        try:
            job, error = Job.from_body(body), ""
        except SpecError as exc:
            job, error = None, str(exc)
        if memory is not None:
            memory.parsed = (key, job, error)
        return job, error

    def created(self, uid: str, manifests: list[dict[str, Any]]) -> None:
        with self._lock:
            memory = self.jobs.get(uid)
            if memory is None:
                return
            for m in manifests:
                if m["kind"] == "Pod":
                    memory.created[m["metadata"]["name"]] = (time.monotonic(), m)

    def pods(self, uid: str, watched: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """The watched pods of a job plus the ones we created and the watch has not shown yet."""
        pods = list(watched)
        seen = {p["metadata"]["name"] for p in pods}
        now = time.monotonic()
        with self._lock:
            memory = self.jobs.get(uid)
            mine = memory.created if memory is not None else {}
            for name in [n for n, (t, _) in mine.items() if n in seen or now - t > UNSEEN_FOR]:
                del mine[name]
            return pods + [m for _, m in mine.values()]

    def patched(self, uid: str) -> None:
        """Our status patch of the job just went out."""
        memory = self.get(uid)
        if memory is not None:
            memory.patched = time.monotonic()

    def since_patch(self, uid: str) -> float:
        """Seconds since our last status patch of the job (inf: none)."""
        memory = self.get(uid)
        return time.monotonic() - (memory.patched if memory is not None else float("-inf"))

    def has_job_objects(self, uid: str | None) -> bool:
        memory = self.get(uid)
        return memory is not None and memory.job_objects

    def job_objects_made(self, uid: str) -> None:
        memory = self.get(uid)
        if memory is not None:
            memory.job_objects = True


def merge_patch(target: Any, patch: Any) -> Any:
    """`target` with the JSON merge patch `patch` applied (RFC 7386: None removes a key, objects merge, the
    rest replaces), as the API server applies a status patch; neither argument is changed."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def overlaid(body: dict[str, Any] | None, deferred: Deferred | None) -> Any:
    """`body` as it will be once its held-back status patch is applied (itself when none is held)."""
    if body is None or deferred is None:
        return body
    return {**body, "status": merge_patch(body.get("status") or {}, deferred.status)}


def _older(body: dict[str, Any], than: dict[str, Any]) -> bool:
    """Whether `body` is an older version of the object than `than`. etcd's revisions are numbers; an
    API server that says otherwise gets no comparison (the status patch's precondition still holds)."""
    mine, other = (str((b.get("metadata") or {}).get("resourceVersion") or "") for b in (body, than))
    return mine.isdigit() and other.isdigit() and int(mine) < int(other)
