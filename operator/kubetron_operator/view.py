"""What the watches told the job daemons (handlers.py), shared between them and the threads they act from.

Each wake-up decides from the freshest body known, the watched one or the one our own last status patch
returned (whichever is newer: a lagging watch never brings back a status we already replaced). Pods this
operator has just created are remembered until the watch shows them, so a lagging watch is never taken for
a preemption.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterable
from typing import Any

from kubetron_operator.job_status import JobStatus
from kubetron_operator.model import Job, SpecError
from kubetron_operator.observe import job_status

UNSEEN_FOR = 60.0  # seconds a pod we created may stay unseen by the watch before we stop vouching for it


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

    def statuses(self) -> list[tuple[str, JobStatus]]:
        """(namespace, status) of every job known (policy.nodes.avoiders reads which nodes they avoid)."""
        with self._lock:
            return [((b.get("metadata") or {}).get("namespace") or "", job_status(b)) for b in self.bodies.values()]

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
