"""The jobs' Events, posted from one background thread once the operator is quiet (EventPoster), and the
count of actions in flight it waits on (Activity). A job's Events are best effort and never hold a reconcile.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import kopf

from kubetron_operator.api_calls import Kube
from kubetron_operator.untrusted import clean

EVENT_QUIET = 0.1  # seconds without an action in flight before a held-back Event goes out
EVENT_HOLD = 10.0  # seconds an Event waits at most for the operator to be quiet
QUEUED_PER_JOB = 32  # a job's Events waiting to be posted at most; beyond, its new ones are dropped (logged)


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

    def busy(self, quiet: float = EVENT_QUIET, besides: int = 0) -> bool:
        """An action is in flight (more than `besides`: the caller's own), or one ended less than `quiet`
        seconds ago."""
        with self._lock:
            return self._acting > besides or time.monotonic() - self._ended < quiet


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
        self._waiting: dict[str | None, int] = {}  # job UID -> its events queued, not posted yet
        self._dropping: set[str | None] = set()  # jobs whose new events are being dropped (said once)

    def post(self, body: Mapping[str, Any], type_: str, reason: str, message: str, now: str,
             logger: kopf.Logger) -> None:
        meta = body["metadata"]
        involved = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                    "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid")}}
        with self._lock:  # one job's burst never queues ahead of every other job's events without bound
            uid = meta.get("uid")
            waiting = self._waiting.get(uid, 0)
            if waiting >= QUEUED_PER_JOB:
                if uid not in self._dropping:  # one line per burst, not one per event
                    self._dropping.add(uid)
                    logger.warning("events of %s/%s not posted from %s on: %d of its events wait already",
                                   meta.get("namespace"), meta.get("name"), reason, waiting)
                return
            self._waiting[uid] = waiting + 1
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
            with self._lock:
                uid = involved["metadata"]["uid"]
                self._waiting[uid] -= 1
                if not self._waiting[uid]:
                    del self._waiting[uid]
                    self._dropping.discard(uid)
