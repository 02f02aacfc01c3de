"""A stand-in for the few API server answers the in-process operator tests need (api_calls.Transport): objects kept in
a dict, created (409 when there), read, merge-patched (409 when not the version the patch names), deleted (404 when
gone), pods listed by label, and discovery of scheduling.k8s.io. Only for what the real 1.36 API server in
tests/kube cannot show: a server that serves scheduling.k8s.io/v1beta1 (Kubernetes 1.37), and a daemon's life
without a cluster. Every request is recorded (`requests`: method and path)."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

DISCOVERED = "/apis/scheduling.k8s.io/"


def merge(into: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch (None deletes)."""
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
    return into


class ApiStandIn:
    """`served`: the scheduling.k8s.io versions whose podgroups discovery lists (and whose paths answer)."""

    def __init__(self, served: tuple[str, ...] = ("v1beta1",), on_request: Callable[[str, str], None] | None = None,
                 created: str = "2026-11-22T12:00:00Z"):
        self.served = set(served)
        self.created = created  # the creationTimestamp of what it creates
        self.objects: dict[str, dict[str, Any]] = {}  # object path -> object
        self.requests: list[tuple[str, str]] = []
        self.on_request = on_request
        self._lock = threading.Lock()
        self._version = 100

    def add(self, path: str, obj: dict[str, Any]) -> None:
        self.objects[path] = copy.deepcopy(obj)

    def __call__(self, method: str, path: str, query: Mapping[str, str], body: Any, content_type: str
                 ) -> tuple[int, bytes]:
        with self._lock:
            self.requests.append((method, path))
            answer = self._answer(method, path, dict(query), body)
        if self.on_request is not None:
            self.on_request(method, path)
        status, obj = answer
        return status, json.dumps(obj).encode()

    def _answer(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        if path.startswith(DISCOVERED) and path.count("/") == 3:  # /apis/scheduling.k8s.io/<version>
            version = path.rsplit("/", 1)[1]
            return (200, {"kind": "APIResourceList", "resources": [{"name": "podgroups"}]}) if version in self.served \
                else (404, {"message": "not found"})
        if path.startswith(DISCOVERED) and path.split("/")[3] not in self.served:
            return 404, {"message": "the server could not find the requested resource"}
        if method == "POST" and path.endswith("/events"):
            return 201, {}
        if method == "POST":
            return self._create(path, body)
        if method == "GET" and path.endswith("/pods"):
            wanted = dict(kv.split("=", 1) for kv in query.get("labelSelector", "").split(",") if kv)
            items = [o for p, o in self.objects.items() if p.startswith(path + "/") and
                     all((o["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())]
            return 200, {"items": copy.deepcopy(items), "metadata": {"resourceVersion": str(self._version)}}
        held = self.objects.get(path.removesuffix("/status"))
        if held is None:
            return 404, {"message": "not found"}
        if method == "GET":
            return 200, copy.deepcopy(held)
        if method == "PATCH":
            wanted = ((body or {}).get("metadata") or {}).get("resourceVersion")
            if wanted and wanted != held["metadata"].get("resourceVersion"):  # the precondition a status patch sends
                return 409, {"message": "the object has been modified"}
            merge(held, {k: v for k, v in body.items() if k != "metadata"})
            self._version += 1
            held["metadata"]["resourceVersion"] = str(self._version)
            return 200, copy.deepcopy(held)
        if method == "DELETE":
            del self.objects[path]
            return 200, {}
        return 405, {"message": method}

    def _create(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        name = body["metadata"]["name"]
        if f"{path}/{name}" in self.objects:
            return 409, {"message": f"{name} already exists"}
        self._version += 1
        obj = copy.deepcopy(body)
        obj["metadata"].update(uid=f"uid-{name}-{self._version}", resourceVersion=str(self._version),
                               creationTimestamp=self.created)
        self.objects[f"{path}/{name}"] = obj
        return 201, obj

    def of_kind(self, kind: str) -> dict[str, dict[str, Any]]:
        """name -> object of every `kind` held."""
        return {o["metadata"]["name"]: o for o in self.objects.values() if o.get("kind") == kind}
