"""A job's daemon (handlers.reconcile_daemon) in this process, against a stand-in API (tests/operator/api_standin.py):
what the operator holds per job (view.JobMemory) is one record, made when its daemon starts (or when its deletion
comes first) and dropped when the daemon ends, so a deleted job leaves nothing behind, in any order of its DELETED
event and its daemon; one wake-up parses each of its pods once; a starting attempt's news wait while other
attempts are being created and go out once they are."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pytest
from kubetron.contract.resource import GROUP, PLURAL, VERSION
from kubetron.contract.times import stamp
from kubetron_operator import handlers, metrics
from kubetron_operator.api_calls import Kube, api_path
from kubetron_operator.deps import Deps
from kubetron_operator.events import EVENT_QUIET
from kubetron_operator.gather import gather
from kubetron_operator.observe import PodView
from kubetron_operator.trainer_reports.store_log import ProgressRead

from tests.operator.api_standin import ApiStandIn
from tests.operator.jobs import S3_JOB

pytestmark = pytest.mark.unit

LOG = logging.getLogger("test")
JOB_PATH = api_path(GROUP, VERSION, PLURAL, "ml", "gpt")


class Stop:
    """kopf's `stopped` flag as a daemon sees it: false until set; `await stopped.wait()`."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    def wait(self) -> Any:
        return self.event.wait()


def new_job() -> dict[str, Any]:
    body = copy.deepcopy(S3_JOB)
    body["metadata"].update(resourceVersion="1", creationTimestamp="2026-11-22T11:59:00Z")
    return body


class Memo:
    def __init__(self, deps: Deps) -> None:
        self.deps = deps


@pytest.fixture
def cluster() -> Iterator[tuple[ApiStandIn, Deps]]:
    api = ApiStandIn(created=stamp(datetime.now(UTC)))  # the daemon's clock is the real one
    api.add(JOB_PATH, new_job())
    deps = Deps(kube=Kube(api), read_progress=lambda job, kube: ProgressRead(), interval=60.0,
                executor=ThreadPoolExecutor(2), io_executor=ThreadPoolExecutor(2))
    yield api, deps
    deps.executor.shutdown()
    deps.io_executor.shutdown()


def held_for(deps: Deps, *keys: str) -> list[str]:
    """Where anything reachable from the operator's state (its Deps, the view, the metrics registry's per-job
    tables) still names one of `keys` (a job's UID, or its namespace and name)."""
    found, seen = [], set()

    def walk(obj: Any, where: str) -> None:
        if id(obj) in seen or isinstance(obj, (ThreadPoolExecutor, asyncio.AbstractEventLoop)):
            return
        seen.add(id(obj))
        if isinstance(obj, str):
            if obj in keys:
                found.append(where)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(k, f"{where}[key]")
                walk(v, f"{where}[{k!r}]")
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for i, v in enumerate(obj):
                walk(v, f"{where}[{i}]")
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("kubetron_operator"):
            walk(vars(obj), f"{where}.{type(obj).__name__}")

    walk(deps, "deps")
    walk(metrics._phases, "metrics._phases")  # noqa: SLF001 - the per-job tables behind its gauges
    walk(metrics._goodput, "metrics._goodput")  # noqa: SLF001
    return found


def deleted_event(body: dict[str, Any], finalized: bool = False) -> dict[str, Any]:
    gone = copy.deepcopy(body)
    if finalized:  # deleted through kopf's finalizer: kopf stopped the daemon when deletion began
        gone["metadata"]["deletionTimestamp"] = "2026-11-22T12:01:00Z"
    return gone


async def daemon_life(api: ApiStandIn, deps: Deps, *, deleted_first: bool = False, finalized: bool = False) -> None:
    """Start the job's daemon, let it create the attempt, then delete the job (its DELETED event, or kopf's stop
    and then the event for a job held by kopf's finalizer) and wait for the daemon to end."""
    loop, memo, stop = asyncio.get_running_loop(), Memo(deps), Stop()
    patched, mark = asyncio.Event(), deps.view.patched
    deps.view.patched = lambda uid: (mark(uid), loop.call_soon_threadsafe(patched.set))  # type: ignore[method-assign]
    body = api.objects[JOB_PATH]
    if deleted_first:  # the DELETED event reached the operator before kopf started the job's daemon
        await handlers.job_event(body=deleted_event(body), type="DELETED", memo=memo)
    daemon = asyncio.ensure_future(handlers.reconcile_daemon(
        name="gpt", namespace="ml", uid="uid-123", body=copy.deepcopy(body), stopped=stop, memo=memo, logger=LOG))
    if not deleted_first:
        await asyncio.wait_for(patched.wait(), 30)  # attempt 1 created: pods, status, metrics, store read
        memory = deps.view.get("uid-123")
        assert memory is not None and memory.body and memory.created and memory.progress and memory.parsed
        assert held_for(deps, "uid-123")
        if finalized:
            stop.event.set()  # kopf stops a daemon once deletion begins through its finalizer
            await asyncio.wait_for(daemon, 30)
        await handlers.job_event(body=deleted_event(api.objects[JOB_PATH], finalized), type="DELETED", memo=memo)
    await asyncio.wait_for(daemon, 30)


@pytest.mark.parametrize(("deleted_first", "finalized"), [(False, False), (True, False), (False, True)],
                         ids=["deleted while its daemon runs", "deleted before its daemon started",
                              "deleted through kopf's finalizer"])
def test_a_deleted_job_leaves_nothing_behind_in_operator_memory(cluster, deleted_first, finalized):
    api, deps = cluster
    asyncio.run(daemon_life(api, deps, deleted_first=deleted_first, finalized=finalized))
    assert deps.view.jobs == {}
    assert held_for(deps, "uid-123", "gpt") == []
    if deleted_first:  # its daemon found the job gone: not one request for it
        assert api.requests == []
    else:
        assert ("POST", "/api/v1/namespaces/ml/pods") in api.requests


def test_a_wake_up_parses_each_pod_once(cluster, monkeypatch):
    api, deps = cluster
    body = api.objects[JOB_PATH]
    deps.view.enter("uid-123", "ml", "gpt")
    handlers.react(deps, body, [], LOG, gather(deps, body, []))  # attempt 1: two pods
    body, pods = api.objects[JOB_PATH], list(api.of_kind("Pod").values())
    assert len(pods) == 2
    parsed: list[str] = []
    from_pod = PodView.from_pod.__func__  # type: ignore[attr-defined]

    def counting(cls: type[PodView], pod: dict[str, Any], now: Any) -> PodView:
        parsed.append(pod["metadata"]["name"])
        return from_pod(cls, pod, now)

    monkeypatch.setattr(PodView, "from_pod", classmethod(counting))
    handlers.react(deps, body, pods, LOG, gather(deps, body, pods))  # one wake-up: gather, observe, decide, act
    assert sorted(parsed) == ["gpt-1-0", "gpt-1-1"]


class Pods:
    """deps.pods as the pod watch would hold them: the stand-in's."""

    def __init__(self, api: ApiStandIn) -> None:
        self.api = api

    def pods(self, namespace: str, uid: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(p) for p in self.api.of_kind("Pod").values()]


def test_a_starting_attempts_news_wait_while_other_attempts_are_created(cluster, monkeypatch):
    """Pods first: the status patch and the event that say why a new attempt's pods wait (Unschedulable) are held
    while other jobs' attempts are being created, and go out as soon as those are done."""
    api, deps = cluster
    deps.pods = Pods(api)  # type: ignore[assignment]

    async def life() -> None:
        loop, memo, stop = asyncio.get_running_loop(), Memo(deps), Stop()
        patched, held, mark, hold = asyncio.Event(), asyncio.Event(), deps.view.patched, handlers.hold_news
        deps.view.patched = lambda uid: (mark(uid), loop.call_soon_threadsafe(patched.set))  # type: ignore

        def hold_news(*args: Any) -> Any:
            got = hold(*args)
            if got[1] is not None:  # held
                loop.call_soon_threadsafe(held.set)
            return got

        monkeypatch.setattr(handlers, "hold_news", hold_news)
        daemon = asyncio.ensure_future(handlers.reconcile_daemon(
            name="gpt", namespace="ml", uid="uid-123", body=copy.deepcopy(api.objects[JOB_PATH]), stopped=stop,
            memo=memo, logger=LOG))
        await asyncio.wait_for(patched.wait(), 30)  # attempt 1 created
        patched.clear()
        with deps.creating.acting():  # another job's attempt is being created
            api.objects["/api/v1/namespaces/ml/pods/gpt-1-1"]["status"] = {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes"}]}
            deps.view.wake("uid-123")
            await asyncio.wait_for(held.wait(), 30)
            assert api.objects[JOB_PATH]["status"]["reason"] == "AttemptCreated"
        await asyncio.wait_for(patched.wait(), 5)  # out once no creation is in flight (not NEWS_HOLD later)
        assert api.objects[JOB_PATH]["status"]["reason"] == "Unschedulable"
        await handlers.job_event(body=deleted_event(api.objects[JOB_PATH]), type="DELETED", memo=memo)
        await asyncio.wait_for(daemon, 30)

    asyncio.run(life())


def test_a_new_attempts_status_waits_while_other_attempts_are_created_and_goes_out_once(cluster):
    """Pods first, in a burst: the status patch that says attempt 1 exists (AttemptCreated) is held while other
    jobs' attempts are being created, the job's wake-ups meanwhile decide as if it were applied (no second attempt,
    no write at all), and it goes out in one patch, with the news decided meanwhile, once the creations are done."""
    api, deps = cluster
    deps.pods = Pods(api)  # type: ignore[assignment]

    def writes() -> list[tuple[str, str]]:
        return [r for r in api.requests if r[0] != "GET"]

    async def life() -> None:
        loop, memo, stop = asyncio.get_running_loop(), Memo(deps), Stop()
        deferred, defer = asyncio.Event(), deps.view.defer
        patched, patched_mark = asyncio.Event(), deps.view.patched

        def deferring(uid: str, status: dict[str, Any]) -> bool:
            held = defer(uid, status)
            loop.call_soon_threadsafe(deferred.set)
            return held

        deps.view.defer = deferring  # type: ignore[method-assign]
        deps.view.patched = lambda uid: (patched_mark(uid), loop.call_soon_threadsafe(patched.set))  # type: ignore
        with deps.creating.acting(), deps.activity.acting():  # another job's attempt is being created, all along
            daemon = asyncio.ensure_future(handlers.reconcile_daemon(
                name="gpt", namespace="ml", uid="uid-123", body=copy.deepcopy(api.objects[JOB_PATH]), stopped=stop,
                memo=memo, logger=LOG))
            await asyncio.wait_for(deferred.wait(), 30)  # attempt 1's pods are created
            memory = deps.view.get("uid-123")
            assert memory is not None and memory.deferred is not None and memory.deferred.status["attempt"] == 1
            assert "attempt" not in (api.objects[JOB_PATH].get("status") or {})  # held back
            burst = writes()
            assert sorted(burst) == [("POST", "/api/v1/namespaces/ml/pods")] * 2
            api.objects["/api/v1/namespaces/ml/pods/gpt-1-1"]["status"] = {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes"}]}
            for _ in range(3):  # its pods change: it decides from attempt 1 (as if patched) and holds everything
                deps.view.wake("uid-123")
                await asyncio.sleep(0.5)
            assert writes() == burst and not patched.is_set()
        await asyncio.wait_for(patched.wait(), 5)  # out once no creation is in flight (not NEWS_HOLD later)
        status = api.objects[JOB_PATH]["status"]
        assert (status["attempt"], status["reason"]) == (1, "Unschedulable")
        after = [w for w in writes()[len(burst):] if not w[1].endswith("/events")]  # (its Events, posted when quiet)
        assert after == [("PATCH", f"{JOB_PATH}/status")]  # one patch: the attempt and its news
        assert deps.view.get("uid-123").deferred is None
        await handlers.job_event(body=deleted_event(api.objects[JOB_PATH]), type="DELETED", memo=memo)
        await asyncio.wait_for(daemon, 30)

    asyncio.run(life())


def test_a_held_attempt_status_survives_a_job_changed_meanwhile(cluster):
    """Someone else writes the job while attempt 1's status is held back: the held patch is refused with the old
    version (409), stays held, and goes out with the next wake-up, decided from the newer job: never a second
    attempt, nothing the other writer set undone."""
    api, deps = cluster
    deps.view.enter("uid-123", "ml", "gpt")
    body = copy.deepcopy(api.objects[JOB_PATH])
    with deps.creating.acting():  # another job's attempt is being created
        handlers.react(deps, copy.deepcopy(body), [], LOG, gather(deps, body, []))
    memory = deps.view.get("uid-123")
    assert memory is not None and memory.deferred is not None
    pods = copy.deepcopy(list(api.of_kind("Pod").values()))
    api.objects[JOB_PATH].setdefault("status", {})["note"] = "someone else's"  # a write the operator has not seen
    api.objects[JOB_PATH]["metadata"]["resourceVersion"] = "999"
    time.sleep(EVENT_QUIET)  # no creation for that long: quiet
    stale = copy.deepcopy(body)
    handlers.react(deps, stale, pods, LOG, gather(deps, stale, pods))  # the held patch goes out, refused
    assert ("PATCH", f"{JOB_PATH}/status") in api.requests
    assert memory.deferred is not None and "attempt" not in api.objects[JOB_PATH]["status"]
    fresh = copy.deepcopy(api.objects[JOB_PATH])
    handlers.react(deps, fresh, pods, LOG, gather(deps, fresh, pods))
    status = api.objects[JOB_PATH]["status"]
    assert (status["attempt"], status["note"], memory.deferred) == (1, "someone else's", None)
    assert sorted(api.of_kind("Pod")) == ["gpt-1-0", "gpt-1-1"]  # the two of attempt 1, made once
    assert [r for r in api.requests if r[0] == "POST" and r[1].endswith("/pods")] == \
        [("POST", "/api/v1/namespaces/ml/pods")] * 2
