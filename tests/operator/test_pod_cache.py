"""PodCache: the operator's pods listed, then watched, outside kopf (a scripted API; the real one is in every
*_on_kube test: each job's pods reach its daemon only through this cache)."""

from __future__ import annotations

import json
import queue
import threading
import time

import pytest
from kubetron_operator import pod_cache
from kubetron_operator.api_calls import ApiError
from kubetron_operator.pod_cache import PodCache

pytestmark = pytest.mark.unit


def pod(name: str, owner: str, version: int, namespace: str = "ml", **status: str) -> dict:
    return {"metadata": {"name": name, "namespace": namespace, "uid": f"pod-{namespace}-{name}",
                         "resourceVersion": str(version),
                         "ownerReferences": [{"uid": owner, "controller": True}],
                         "annotations": {"kubetron.dev/config": "model: {}\n", "keep": "me"},
                         "managedFields": [{"manager": "x"}]},
            "spec": {"nodeName": "n1", "containers": [{"name": "trainer", "image": "big"}]},
            "status": dict(status)}


def line(kind: str, obj: dict) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode()


class ScriptedApi:
    """list_pods_in answers the next listing; watch_pods the next script: a list of lines, or an exception."""

    def __init__(self, listings: list[tuple[list[dict], str]]):
        self.listings, self.watches = listings, queue.Queue()
        self.asked: list[tuple[str, str]] = []

    def list_pods_in(self, namespace, selector):
        self.asked.append(("list", ""))
        return self.listings.pop(0)

    def watch_pods(self, namespace, selector, version, seconds):
        self.asked.append(("watch", version))
        script = self.watches.get(timeout=10)
        if isinstance(script, BaseException):
            raise script
        return iter(script)


class Woken:
    def __init__(self):
        self.uids: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, namespace: str, uid: str) -> None:
        with self.lock:
            self.uids.append(uid if namespace == "ml" else f"{namespace}/{uid}")


def until(check, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.fixture
def quick_backoff(monkeypatch):
    monkeypatch.setattr(pod_cache, "BACKOFF", (0.01, 0.05))


def test_listing_then_events_keep_each_jobs_pods_and_wake_it(quick_backoff):
    api, woken = ScriptedApi([([pod("a-1-0", "A", 5)], "10")]), Woken()
    cache = PodCache(api, ["ml"], "kubetron.dev/job", woken)
    cache.start()
    (held,) = cache.pods("ml", "A")
    # What decide reads, not what it does not: no managedFields, no trainer config, no containers.
    assert held["metadata"]["annotations"] == {"keep": "me"} and "managedFields" not in held["metadata"]
    assert held["spec"] == {"nodeName": "n1"}
    api.watches.put([line("ADDED", pod("b-1-0", "B", 11)), line("MODIFIED", pod("a-1-0", "A", 12, phase="Running")),
                     line("BOOKMARK", {"metadata": {"resourceVersion": "15"}}), line("DELETED", pod("b-1-0", "B", 16))])
    until(lambda: woken.uids[-3:] == ["B", "A", "B"])
    assert cache.pods("ml", "A")[0]["status"] == {"phase": "Running"} and cache.pods("ml", "B") == []
    until(lambda: ("watch", "16") in api.asked)  # the stream ended: watched again from the last version
    assert api.asked[:2] == [("list", ""), ("watch", "10")]
    cache.stop()
    api.watches.put([])


def test_a_version_too_old_lists_anew_and_wakes_jobs_whose_pods_went_meanwhile(quick_backoff):
    api = ScriptedApi([([pod("a-1-0", "A", 5), pod("b-1-0", "B", 6)], "10"), ([pod("b-1-0", "B", 20)], "30")])
    woken = Woken()
    cache = PodCache(api, [], "kubetron.dev/job", woken)
    cache.start()
    api.watches.put([line("ERROR", {"kind": "Status", "code": 410, "message": "too old resource version"})])
    until(lambda: ("watch", "30") in api.asked)
    assert cache.pods("ml", "A") == [] and "A" in woken.uids  # deleted while nobody watched: its job hears of it
    assert [p["metadata"]["resourceVersion"] for p in cache.pods("ml", "B")] == ["20"]
    cache.stop()
    api.watches.put([])


def test_a_failing_watch_is_listed_again_after_a_backoff(quick_backoff):
    api = ScriptedApi([([], "10"), ([pod("a-1-0", "A", 12)], "12")])
    woken = Woken()
    cache = PodCache(api, ["ml"], "kubetron.dev/job", woken)
    cache.start()
    api.watches.put(ApiError(500, "etcd leader changed"))
    until(lambda: cache.pods("ml", "A") != [])
    assert woken.uids == ["A"]
    until(lambda: ("watch", "12") in api.asked)
    cache.stop()
    api.watches.put([])


def test_start_fails_loudly_when_the_pods_cannot_be_listed():
    class Refused(ScriptedApi):
        def list_pods_in(self, namespace, selector):
            raise ApiError(403, "pods is forbidden")

    with pytest.raises(ApiError, match="forbidden"):
        PodCache(Refused([]), ["ml"], "kubetron.dev/job", Woken()).start()


def test_a_pod_is_its_owners_only_in_the_owners_namespace(quick_backoff):
    """An owner reference names no namespace: a pod in another namespace that names job A's UID as its
    controller is not A's (it would end A's attempt), and it wakes A's namesake there, not A."""
    api, woken = ScriptedApi([([pod("a-1-0", "A", 5)], "10")]), Woken()
    cache = PodCache(api, [], "kubetron.dev/job", woken)
    cache.start()
    api.watches.put([line("ADDED", pod("a-1-1", "A", 11, namespace="team-b", phase="Failed"))])
    until(lambda: woken.uids == ["A", "team-b/A"])
    assert [p["metadata"]["name"] for p in cache.pods("ml", "A")] == ["a-1-0"]
    assert [p["metadata"]["name"] for p in cache.pods("team-b", "A")] == ["a-1-1"]
    cache.stop()
    api.watches.put([])
