"""The operator's pods, listed and watched outside kopf: (namespace, controller owner UID) -> that job's pods
(what decide reads of each, observe.pod_essentials). A pod belongs to a job only in the job's own namespace:
an owner reference names no namespace (owners are always in their dependent's), so a pod elsewhere that
names a job's UID as its controller is not that job's.

kopf's machinery per watch event (its per-object worker, handler invocation, body views, loggers) cost
more than everything else the operator does for a pod, and a job start brings several pod events (created,
seen by the scheduler, bound). Here one thread per scope (each watched namespace, or the whole cluster)
LISTs the pods carrying the job label, then WATCHes from that list's resourceVersion (bookmarks keep it
fresh): a stream the server ends is watched again from the last version seen; one it refuses as too old
(410 Gone), or an error, is listed anew (after a backoff on errors). Every change wakes the pod's job
(`wake(namespace, owner_uid)`, which must be thread-safe); a new listing wakes every job whose pods it changed.

start() returns once every scope holds its first listing, so no job is ever decided from a half-filled
view of its pods (which would look like pods that vanished): the operator calls it before kopf starts
watching TrainingJobs (main.run's startup handler).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from kubetron_operator.api_calls import ApiError, Kube, controller_uid
from kubetron_operator.observe import pod_essentials

log = logging.getLogger("kubetron.pods")

Owner = tuple[str, str]
"""(namespace, controller owner UID): whose pod it is."""

BACKOFF = (0.5, 30.0)  # seconds before listing again after an error: the first, doubling up to the cap
WATCH_SECONDS = 300  # the server ends each watch after this long (timeoutSeconds); it is resumed at once


class Gone(Exception):
    """The server no longer has the version the watch asked to resume from (410): list anew."""


class PodCache:
    """Pods by (namespace, controller owner UID), kept current by list + watch threads (see the module
    docstring). `namespaces`: the scopes (empty: the whole cluster); `selector`: the label selector of our pods."""

    def __init__(self, kube: Kube, namespaces: Iterable[str], selector: str, wake: Callable[[str, str], None]):
        self.kube, self.selector, self.wake = kube, selector, wake
        self.scopes: list[str | None] = list(namespaces) or [None]
        self._lock = threading.Lock()
        self._pods: dict[Owner, dict[str, dict[str, Any]]] = {}  # (namespace, owner UID) -> pod UID -> essentials
        self._owner: dict[str, Owner] = {}  # pod UID -> (namespace, owner UID)
        self._scope_of: dict[str, str | None] = {}  # pod UID -> the scope that listed it
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- reading ----------------------------------------------------------------------------------------

    def pods(self, namespace: str, owner: str) -> list[dict[str, Any]]:
        """The pods of `namespace` that `owner` controls, as last seen (shared: never change them)."""
        with self._lock:
            return list((self._pods.get((namespace, owner)) or {}).values())

    # -- running ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """List every scope (raises ApiError when one cannot be listed), then watch each from a thread."""
        versions = [self._relist(scope) for scope in self.scopes]
        for scope, version in zip(self.scopes, versions, strict=True):
            thread = threading.Thread(target=self._run, args=(scope, version), daemon=True,
                                      name=f"pods-{scope or 'cluster'}")
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()

    def _run(self, scope: str | None, version: str) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if not version:
                    version = self._relist(scope)
                version = self._watch(scope, version)
                failures = 0
            except Gone:
                version = ""  # list anew, at once
            except Exception as exc:  # noqa: BLE001 - the API server is away or refused: list again later
                delay = min(BACKOFF[1], BACKOFF[0] * 2 ** failures)
                failures += 1
                log.warning("watching pods%s failed (%s); listing again in %.1fs",
                            f" in namespace {scope}" if scope else "", exc, delay)
                version = ""
                self._stop.wait(delay)

    def _watch(self, scope: str | None, version: str) -> str:
        """Apply a watch stream's events until the server ends it; returns the last version seen."""
        try:
            lines = self.kube.watch_pods(scope, self.selector, version, WATCH_SECONDS)
        except ApiError as exc:
            if exc.status == 410:
                raise Gone(str(exc)) from None
            raise
        for line in lines:
            if self._stop.is_set():
                break
            event = json.loads(line)
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise Gone(obj.get("message") or "resource version too old")
                raise ApiError(int(obj.get("code") or 500), obj.get("message") or "watch error")
            version = (obj.get("metadata") or {}).get("resourceVersion") or version
            if kind in ("ADDED", "MODIFIED"):
                self._put(scope, obj)
            elif kind == "DELETED":
                self._drop((obj.get("metadata") or {}).get("uid") or "")
        return version

    def _relist(self, scope: str | None) -> str:
        """Replace what `scope` holds with a fresh listing; wakes every job whose pods that changed."""
        items, version = self.kube.list_pods_in(scope, self.selector)
        fresh = {(p.get("metadata") or {}).get("uid") or "": p for p in items}
        with self._lock:
            held = [uid for uid, s in self._scope_of.items() if s == scope]
        changed = {self._drop(uid, wake=False) for uid in held if uid not in fresh}
        changed |= {self._put(scope, pod, wake=False) for pod in fresh.values()}
        for owner in changed:
            if owner is not None:
                self.wake(*owner)
        return version

    def _put(self, scope: str | None, pod: dict[str, Any], wake: bool = True) -> Owner | None:
        meta = pod.get("metadata") or {}
        uid, owner_uid = meta.get("uid") or "", controller_uid(pod)
        if not uid or not owner_uid:
            return None
        owner = (meta.get("namespace") or "", owner_uid)
        view = pod_essentials(pod)
        with self._lock:
            before = self._owner.get(uid)
            if before is not None and before != owner:
                self._pods.get(before, {}).pop(uid, None)
            self._pods.setdefault(owner, {})[uid] = view
            self._owner[uid], self._scope_of[uid] = owner, scope
        if wake:
            self.wake(*owner)
        return owner

    def _drop(self, uid: str, wake: bool = True) -> Owner | None:
        with self._lock:
            owner = self._owner.pop(uid, None)
            self._scope_of.pop(uid, None)
            if owner is None:
                return None
            mine = self._pods.get(owner) or {}
            mine.pop(uid, None)
            if not mine:
                self._pods.pop(owner, None)
        if wake:
            self.wake(*owner)
        return owner

