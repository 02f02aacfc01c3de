"""Every Kubernetes API call the operator makes, declared in one place, behind one small wrapper.

`OPERATOR_CALLS` lists (apiGroup, resource, verb) for the calls our code makes through `Kube`;
`KOPF_CALLS` those the kopf framework makes itself (watching, patching the job, events, peering).
The chart's ClusterRole is derived from `ALL_CALLS` (`cluster_role_rules()`), and `Kube` refuses any
call that is not declared, so the role and the code cannot drift apart.

Which version of Kubernetes' own PodGroup API the cluster serves (scheduling.k8s.io v1beta1 from 1.37, v1alpha2
in 1.36) is read by discovery (`Kube.pod_group_api`: GET /apis/<group>/<version>, once, cached until a PodGroup
request answers 404). Discovery is no RBAC rule of the chart: Kubernetes' default `system:discovery`
ClusterRole grants it to every authenticated user (kopf discovers the same way).

Calls the chart grants only with some values (the PodGroups of `gangScheduling`) are made only when
the operator is told they are granted (`Kube(gang_schedulers=...)`, `kubetron operator
--gang-schedulers`, set by the chart): otherwise `NotGranted`, with no request sent. A call the server
refuses with 403 is logged at warning level naming the call (verb, resource, namespace), counted in
`kubetron_api_errors_total{code="403"}` and raised as `Forbidden`.

Request paths are built by one function, `api_path`, which refuses (InvalidName, no request sent) a
namespace that is not a DNS label, a name that is not a Kubernetes name and an unknown subresource: a
name from a spec (a Secret's, in a job stored before the CRD's schema said so) never walks the path
elsewhere (`../../other-namespace/secrets/x`).

Idempotence and ownership: creating something that exists (409) is success only when the existing
object's controller owner is the same TrainingJob (its UID); otherwise `NameConflict`, and nothing
foreign is ever adopted. Deleting something absent (404) is success; `delete_owned` deletes only what
the given job owns. Status patches carry the resourceVersion they were computed from (`Conflict`).
"""

from __future__ import annotations

import base64
import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode
from uuid import uuid4

from kubetron.contract.resource import GROUP, PLURAL, VERSION

from kubetron_operator import metrics
from kubetron_operator.model import POD_GROUP_APIS, is_name, shown

log = logging.getLogger("kubetron.api")


@dataclass(frozen=True, order=True)
class Call:
    group: str  # "" for the core API
    resource: str  # plural, with "/subresource" where one is used
    verb: str


def _calls(group: str, resource: str, *verbs: str) -> set[Call]:
    return {Call(group, resource, verb) for verb in verbs}


OPERATOR_CALLS: frozenset[Call] = frozenset(
    _calls("", "pods", "create", "get", "list", "watch", "delete", "patch")  # watch: pod_cache; patch: Kueue's
    | _calls("", "services", "create", "get", "delete")  # get: whose is an existing one (409)?
    | _calls("", "secrets", "get")  # the S3 credentials of a job, to read its progress log
    | _calls("", "events", "create")
    | _calls("", "nodes", "list")  # is a pod's node still Ready (node trouble is a preemption, not a failure)
    | _calls("", "nodes", "get", "patch")  # taint a node that keeps failing jobs (chart failingNodes.taint only)
    | _calls(GROUP, PLURAL, "get", "delete")  # delete: ttlSecondsAfterFinished
    | _calls(GROUP, f"{PLURAL}/status", "get", "patch")
    | _calls(GROUP, f"{PLURAL}/finalizers", "update")  # blockOwnerDeletion on the children
    | _calls("scheduling.volcano.sh", "podgroups", "create", "get", "delete")
    | _calls("scheduling.x-k8s.io", "podgroups", "create", "get", "delete")
    | _calls("scheduling.k8s.io", "podgroups", "create", "get", "delete", "patch")  # patch: v1beta1's minCount
)

KOPF_CALLS: frozenset[Call] = frozenset(
    _calls(GROUP, PLURAL, "list", "watch", "patch")  # watching; kopf's finalizer (the daemon's)
    | _calls(GROUP, f"{PLURAL}/status", "patch")
    | _calls("", "events", "create")
    | _calls("", "namespaces", "list", "watch")  # namespace patterns (`--namespace 'team-*'`)
    | _calls("apiextensions.k8s.io", "customresourcedefinitions", "list", "watch")  # resource discovery
    | _calls("kopf.dev", "clusterkopfpeerings", "list", "watch", "patch", "get")  # --peering (HA), cluster-wide
    | _calls("kopf.dev", "kopfpeerings", "list", "watch", "patch", "get")  # --peering, namespaced
)

ALL_CALLS: frozenset[Call] = OPERATOR_CALLS | KOPF_CALLS
TAINT_CALLS: frozenset[Call] = frozenset(_calls("", "nodes", "get", "patch"))
"""Made only by an operator told its role grants them (`Kube(taint_nodes=True)`, `--taint-failing-nodes`)."""

# spec.scheduling.gang -> the API group of its PodGroup (the chart's gangScheduling.schedulers).
GANG_GROUPS: dict[str, str] = {gang: versions[0].partition("/")[0] for gang, versions in POD_GROUP_APIS.items()}

# apiVersion, kind -> (group, version, plural) for everything the operator creates or deletes.
KINDS: dict[tuple[str, str], tuple[str, str, str]] = {
    ("v1", "Pod"): ("", "v1", "pods"),
    ("v1", "Service"): ("", "v1", "services"),
    ("v1", "Event"): ("", "v1", "events"),
    **{(av, "PodGroup"): (av.partition("/")[0], av.partition("/")[2], "podgroups")
       for versions in POD_GROUP_APIS.values() for av in versions},
}


def cluster_role_rules(calls: Iterable[Call] = ALL_CALLS) -> list[dict[str, Any]]:
    """RBAC rules (one per group+resource, sorted) that allow exactly `calls`."""
    verbs: dict[tuple[str, str], set[str]] = {}
    for call in calls:
        verbs.setdefault((call.group, call.resource), set()).add(call.verb)
    return [{"apiGroups": [group], "resources": [resource], "verbs": sorted(v)}
            for (group, resource), v in sorted(verbs.items())]


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class NameConflict(ApiError):
    """A child's name is taken by an object this job does not control."""

    def __init__(self, kind: str, namespace: str, name: str, owner: str):
        super().__init__(409, f"{kind} {namespace}/{name} already exists and is {owner}, not this job's; "
                         "rename the job or delete that object")
        self.kind, self.name = kind, name


class Conflict(ApiError):
    """The object changed since it was read (optimistic concurrency): decide again from a fresh read."""


class Forbidden(ApiError):
    """403: the operator's role does not grant the call, or admission refused it (quota, PodSecurity)."""


class TaintNotGranted(ApiError):
    """A node taint by an operator not told its role allows one (the chart's failingNodes.taint); never sent."""

    def __init__(self, call: Call):
        super().__init__(403, f"tainting failing nodes is off for this operator, so it may not {call.verb} "
                         "nodes: install the chart with failingNodes.taint=true (`kubetron operator "
                         "--taint-failing-nodes`)")


class NotGranted(ApiError):
    """A declared call this operator is configured not to make (the chart does not grant it); never sent."""

    def __init__(self, call: Call, gang: str):
        super().__init__(403, f"gang scheduling with {gang} is not enabled for this operator, so it may not "
                         f"{call.verb} {call.group} {call.resource}: install the chart with "
                         f"gangScheduling.enabled=true and {gang} in gangScheduling.schedulers "
                         f"(`kubetron operator --gang-schedulers`), or remove spec.scheduling.gang")


def controller_uid(obj: Mapping[str, Any] | None) -> str | None:
    """The UID of the object's controller owner reference, if any."""
    for ref in ((obj or {}).get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller"):
            return ref.get("uid")
    return None


class InvalidName(ApiError):
    """A namespace, name or subresource api_path refuses; no request was sent."""

    def __init__(self, what: str, value: Any):
        super().__init__(400, f"{what} {shown(value)} is not a Kubernetes name (lowercase letters, digits, '-' "
                              "and '.'); no request was made")


SUBRESOURCES = frozenset({"status"})


def api_path(group: str, version: str, plural: str, namespace: str | None, name: str = "", sub: str = "") -> str:
    """The request path of a namespaced collection or object (namespace None: the cluster's collection),
    or InvalidName for anything in it that is not a name."""
    base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    if namespace is None:
        return f"{base}/{plural}"
    if not is_name(namespace, 63) or "." in namespace:
        raise InvalidName("namespace", namespace)
    path = f"{base}/namespaces/{namespace}/{plural}"
    if name or sub:
        if not is_name(name):
            raise InvalidName(f"{plural[:-1]} name", name)
        path += f"/{name}"
    if sub:
        if sub not in SUBRESOURCES:
            raise InvalidName("subresource", sub)
        path += f"/{sub}"
    return path


class UndeclaredCall(AssertionError):
    """The code tried an API call that OPERATOR_CALLS does not declare (the RBAC role would refuse it)."""


Transport = Callable[[str, str, Mapping[str, str], Any, str], tuple[int, bytes]]
"""(method, path, query, body, content_type) -> (HTTP status, response body)."""
Stream = Callable[[str, Mapping[str, str]], tuple[int, Iterable[bytes]]]
"""(path, query) of a GET whose answer streams (a watch) -> (HTTP status, the answer's non-empty lines)."""


def kubernetes_transport(api_client: Any, timeout: float = 30.0) -> Transport:
    """A Transport over a `kubernetes.client.ApiClient` (its auth, TLS and token refresh)."""

    def send(method: str, path: str, query: Mapping[str, str], body: Any, content_type: str) -> tuple[int, bytes]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        request = api_client.param_serialize(
            method, path, query_params=list(query.items()), header_params=headers, body=body,
            auth_settings=["BearerToken"],
        )
        response = api_client.call_api(*request, _request_timeout=timeout)
        response.read()
        return response.status, response.data or b""

    return send


def kubernetes_stream(api_client: Any, read_timeout: float) -> Stream:
    """A Stream over a `kubernetes.client.ApiClient`'s connection pool (its TLS, credentials and token
    refresh). `read_timeout`: seconds the answer may stay silent (a watch's timeoutSeconds, and some)."""
    import urllib3

    configuration, pool = api_client.configuration, api_client.rest_client.pool_manager

    def stream(path: str, query: Mapping[str, str]) -> tuple[int, Iterable[bytes]]:
        headers = {"Accept": "application/json", "User-Agent": api_client.user_agent}
        token = configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        if token:
            headers["Authorization"] = token
        response = pool.request("GET", f"{configuration.host}{path}?{urlencode(dict(query))}", headers=headers,
                                preload_content=False, retries=False,
                                timeout=urllib3.Timeout(connect=10.0, read=read_timeout))
        return response.status, _lines(response)

    return stream


def _lines(response: Any) -> Iterator[bytes]:
    """The non-empty lines of a streamed answer; its connection goes back to the pool once read to the end,
    and is closed when the reader stops early."""
    finished, rest = False, b""
    try:
        for chunk in response.stream(1 << 16):
            *lines, rest = (rest + chunk).split(b"\n")
            yield from (line for line in lines if line.strip())
        if rest.strip():
            yield rest
        finished = True
    finally:
        if not finished:
            response.close()
        response.release_conn()


class Kube:
    """The operator's only way to the API server. Raw dicts in and out; declared calls only.
    `gang_schedulers`: the gang schedulers whose PodGroups the operator's role grants (GANG_GROUPS keys)."""

    def __init__(self, transport: Transport, gang_schedulers: Iterable[str] = tuple(GANG_GROUPS),
                 stream: Stream | None = None, taint_nodes: bool = False):
        self._send, self._stream = transport, stream
        self._not_granted = {group: gang for gang, group in GANG_GROUPS.items() if gang not in set(gang_schedulers)}
        self.taint_nodes = taint_nodes  # the role grants nodes get and patch (TAINT_CALLS)
        self._served: dict[str, bool] = {}  # "group/version/resource" -> served (discovery, until forgotten)
        self._served_lock = threading.Lock()

    # -- plumbing --------------------------------------------------------------------------------------

    def _check(self, call: Call) -> None:
        if call not in OPERATOR_CALLS:
            raise UndeclaredCall(f"{call} is not in api_calls.OPERATOR_CALLS")
        if call.group in self._not_granted:
            raise NotGranted(call, self._not_granted[call.group])
        if call in TAINT_CALLS and not self.taint_nodes:
            raise TaintNotGranted(call)

    def _request(self, call: Call, method: str, path: str, *, query: Mapping[str, str] | None = None,
                 body: Any = None, content_type: str = "application/json", ok: Iterable[int] = (),
                 answer: bool = True) -> Any:
        self._check(call)
        status, data = self._send(method, path, dict(query or {}), body, content_type)
        if 200 <= status < 300:
            if not answer:  # the caller needs only the success (a created pod's body is kilobytes of JSON)
                return True
            return json.loads(data) if data[:1] in (b"{", b"[") else data.decode("utf-8", "replace")
        if status in ok:
            return None
        raise _refused(call, path, status, data)

    _path = staticmethod(api_path)

    @classmethod
    def _pods_path(cls, namespace: str | None) -> str:
        """The pods of `namespace`, or of every namespace (None)."""
        return cls._path("", "v1", "pods", namespace or None)

    # -- children --------------------------------------------------------------------------------------

    def create(self, manifest: Mapping[str, Any]) -> bool:
        """Create; False when it already exists and has the same controller owner (names are
        deterministic: a restarted operator recreates what it made). NameConflict when someone else's."""
        group, version, plural = KINDS[(manifest["apiVersion"], manifest["kind"])]
        meta = manifest["metadata"]
        ns, name = meta["namespace"], meta["name"]
        created = self._request(Call(group, plural, "create"), "POST", self._path(group, version, plural, ns),
                                body=dict(manifest), ok=(409,), answer=False)
        if created is not None:
            return True
        existing = self.get(manifest["apiVersion"], manifest["kind"], ns, name)
        owner = controller_uid(existing)
        if existing is not None and owner != controller_uid(manifest):
            raise NameConflict(manifest["kind"], ns, name, f"controlled by {owner}" if owner else "not controlled")
        return False

    def create_or_patch(self, manifest: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
        """Create `manifest`; when it exists and the same job controls it, merge `patch` into it instead
        (unless it holds those values already): v1beta1's PodGroup keeps its name and changes minCount.
        True when created; NameConflict when someone else's."""
        group, version, plural = KINDS[(manifest["apiVersion"], manifest["kind"])]
        meta = manifest["metadata"]
        ns, name = meta["namespace"], meta["name"]
        if self.create(manifest):
            return True
        existing = self.get(manifest["apiVersion"], manifest["kind"], ns, name)
        if existing is None:  # deleted since: make it anew
            return self.create(manifest)
        if not _holds(existing, patch):
            self._request(Call(group, plural, "patch"), "PATCH", self._path(group, version, plural, ns, name),
                          body=dict(patch), content_type="application/merge-patch+json", answer=False)
        return False

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        group, version, plural = KINDS[(api_version, kind)]
        return self._request(Call(group, plural, "get"), "GET", self._path(group, version, plural, namespace, name),
                             ok=(404,))

    def delete_owned(self, api_version: str, kind: str, namespace: str, name: str, owner_uid: str) -> bool:
        """Delete only if `owner_uid` controls it (the UID precondition guards a delete-and-recreate in
        between); False when absent or not ours."""
        obj = self.get(api_version, kind, namespace, name)
        if obj is None or not owner_uid or controller_uid(obj) != owner_uid:
            return False
        return self.delete(api_version, kind, namespace, name, uid=obj["metadata"].get("uid"))

    def delete(self, api_version: str, kind: str, namespace: str, name: str,
               grace_seconds: int | None = None, uid: str | None = None) -> bool:
        """Delete (background propagation); False when it was already gone (404) or, with `uid`, is
        another object by now (409)."""
        group, version, plural = KINDS[(api_version, kind)]
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        if uid:
            body["preconditions"] = {"uid": uid}
        gone = self._request(Call(group, plural, "delete"), "DELETE",
                             self._path(group, version, plural, namespace, name), body=body, ok=(404, 409),
                             answer=False)
        return gone is not None

    def delete_pod(self, namespace: str, name: str, force: bool = False) -> bool:
        return self.delete("v1", "Pod", namespace, name, grace_seconds=0 if force else None)

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> bool:
        """Merge `annotations` into a pod's metadata (one that is being deleted too); False when it is gone."""
        done = self._request(Call("", "pods", "patch"), "PATCH", self._path("", "v1", "pods", namespace, name),
                             body={"metadata": {"annotations": dict(annotations)}},
                             content_type="application/merge-patch+json", ok=(404,))
        return done is not None

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Pods matching all `labels` (filtered here too, in case a server ignores the selector)."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        data = self._request(Call("", "pods", "list"), "GET", self._path("", "v1", "pods", namespace),
                             query={"labelSelector": selector})
        items = (data or {}).get("items") or []
        return [p for p in items
                if all(((p.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in labels.items())]

    def list_pods_in(self, namespace: str | None, selector: str) -> tuple[list[dict[str, Any]], str]:
        """Pods matching label `selector` in `namespace` (None: every namespace), and the resourceVersion
        of that listing (where a watch resumes)."""
        path = self._pods_path(namespace)
        data = self._request(Call("", "pods", "list"), "GET", path, query={"labelSelector": selector}) or {}
        return data.get("items") or [], str((data.get("metadata") or {}).get("resourceVersion") or "")

    def watch_pods(self, namespace: str | None, selector: str, version: str, seconds: int) -> Iterable[bytes]:
        """The watch events (JSON lines) of pods matching `selector` after `version`, with bookmarks, until
        the server ends the stream after `seconds`. An error answer raises ApiError (410: `version` is gone)."""
        call = Call("", "pods", "watch")
        self._check(call)
        if self._stream is None:
            raise UndeclaredCall("this Kube was made without a stream transport: it cannot watch")
        path = self._pods_path(namespace)
        status, lines = self._stream(path, {"watch": "1", "labelSelector": selector, "resourceVersion": version,
                                            "allowWatchBookmarks": "true", "timeoutSeconds": str(seconds)})
        if status != 200:
            raise _refused(call, path, status, b"".join(lines))
        return lines

    def list_nodes(self) -> list[dict[str, Any]]:
        data = self._request(Call("", "nodes", "list"), "GET", api_path("", "v1", "nodes", None))
        return (data or {}).get("items") or []

    def edit_node(self, name: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> bool:
        """Read node `name` and merge-patch it with what `change(node)` returns (None: nothing), at the read's
        resourceVersion, so a concurrent change is read again; True when patched. For a taint (its list is
        replaced as read) and its annotation."""
        if not is_name(name):  # a node's name from a pod's spec.nodeName: still checked before it is a path
            raise InvalidName("node name", name)
        path = f"{api_path('', 'v1', 'nodes', None)}/{name}"
        for _ in range(3):
            node = self._request(Call("", "nodes", "get"), "GET", path, ok=(404,))
            patch = change(node) if node else None
            if patch is None:
                return False
            patch["metadata"] = {**patch.get("metadata", {}),
                                 "resourceVersion": (node.get("metadata") or {}).get("resourceVersion")}
            if self._request(Call("", "nodes", "patch"), "PATCH", path, body=patch, ok=(409,),
                             content_type="application/merge-patch+json", answer=False):
                return True
        return False

    def secret_data(self, namespace: str, name: str) -> dict[str, str]:
        """A Secret's data, decoded. Callers must never log or store these values."""
        data = self._request(Call("", "secrets", "get"), "GET", self._path("", "v1", "secrets", namespace, name))
        out = {k: base64.b64decode(v).decode() for k, v in ((data or {}).get("data") or {}).items()}
        out.update((data or {}).get("stringData") or {})
        return out

    # -- discovery -------------------------------------------------------------------------------------

    def pod_group_api(self, gang: str) -> str | None:
        """The PodGroup apiVersion a job with spec.scheduling.gang `gang` uses: the first of POD_GROUP_APIS[gang]
        the API server serves (discovery, cached), or the only one there is (a scheduler's CRD: asked for as
        it is). None: "none", or the server serves none of them. A gang the role does not grant is never
        discovered (its first version is returned: the create is then refused, NotGranted, without a request)."""
        versions = POD_GROUP_APIS.get(gang, ())
        if len(versions) < 2 or GANG_GROUPS[gang] in self._not_granted:
            return versions[0] if versions else None
        return next((av for av in versions if self._serves(*KINDS[(av, "PodGroup")])), None)

    def forget_pod_group_api(self, gang: str) -> None:
        """A PodGroup request answered 404: discover again next time (the cluster may have been upgraded)."""
        with self._served_lock:
            for av in POD_GROUP_APIS.get(gang, ()):
                self._served.pop("/".join(KINDS[(av, "PodGroup")]), None)

    def _serves(self, group: str, version: str, plural: str) -> bool:
        """Whether the server serves `plural` in group/version (GET /apis/group/version, once; 404: not)."""
        key = f"{group}/{version}/{plural}"
        with self._served_lock:
            if key in self._served:
                return self._served[key]
        path = f"/apis/{group}/{version}"  # our own constants (KINDS), never a name from a spec
        status, data = self._send("GET", path, {}, None, "application/json")
        if status == 404:
            served = False
        elif 200 <= status < 300:
            resources = (json.loads(data) if data[:1] == b"{" else {}).get("resources") or ()
            served = any(r.get("name") == plural for r in resources)
        else:
            raise _refused(Call(group, "(discovery)", "get"), path, status, data)
        with self._served_lock:
            self._served[key] = served
        return served

    # -- the TrainingJob -------------------------------------------------------------------------------

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._request(Call(GROUP, PLURAL, "get"), "GET",
                             self._path(GROUP, VERSION, PLURAL, namespace, name), ok=(404,))

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any],
                     resource_version: str | None = None) -> dict[str, Any] | None:
        """JSON merge patch of .status (the status subresource); None values remove keys. With
        `resource_version` the server refuses it (Conflict) if the job changed since that version.
        Returns the job as the server holds it now."""
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            return self._request(Call(GROUP, f"{PLURAL}/status", "patch"), "PATCH",
                          self._path(GROUP, VERSION, PLURAL, namespace, name, "status"),
                          body=body, content_type="application/merge-patch+json")
        except ApiError as exc:
            if exc.status == 409:
                raise Conflict(409, str(exc)) from None
            raise

    def delete_job(self, namespace: str, name: str) -> bool:
        gone = self._request(Call(GROUP, PLURAL, "delete"), "DELETE",
                             self._path(GROUP, VERSION, PLURAL, namespace, name),
                             body={"propagationPolicy": "Background"}, ok=(404,))
        return gone is not None

    def post_event(self, involved: Mapping[str, Any], type_: str, reason: str, message: str, now: str) -> None:
        """A core/v1 Event on the job (what `kubectl describe tj` shows)."""
        meta = involved["metadata"]
        ns = meta.get("namespace") or "default"
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid4().hex[:16]}", "namespace": ns},
            "involvedObject": {"apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"),
                               "name": meta["name"], "namespace": ns, "uid": meta.get("uid")},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": "kubetron-operator"}, "reportingComponent": "kubetron-operator",
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        self._request(Call("", "events", "create"), "POST", self._path("", "v1", "events", ns), body=event)


def _holds(obj: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """Whether `obj` already has every value the merge patch `patch` sets."""
    return all(_holds(obj.get(k) or {}, v) if isinstance(v, Mapping) else obj.get(k) == v for k, v in patch.items())


def _refused(call: Call, path: str, status: int, data: bytes) -> ApiError:
    """The error for a refused call (counted; a 403 is logged naming the call)."""
    metrics.api_error(status)
    message = _error_message(data)
    if status == 403:
        log.warning("API call forbidden (HTTP 403): %s %s in %s: %s", call.verb,
                    f"{call.group}/{call.resource}" if call.group else call.resource, _where(path), message)
        return Forbidden(status, message)
    return ApiError(status, message)


def _where(path: str) -> str:
    """"namespace NS" (or "the cluster") from a request path; the object's name is in the server's message."""
    found = re.search(r"/namespaces/([^/]+)/", path)
    return f"namespace {found.group(1)}" if found else "the cluster"


def _error_message(data: bytes) -> str:
    try:
        return str(json.loads(data).get("message", ""))[:500]
    except (ValueError, AttributeError):
        return data[:500].decode("utf-8", "replace")


__all__ = ["ALL_CALLS", "GANG_GROUPS", "KOPF_CALLS", "OPERATOR_CALLS", "TAINT_CALLS", "ApiError", "Call", "Conflict",
           "Forbidden", "InvalidName", "Kube", "NameConflict", "NotGranted", "TaintNotGranted", "UndeclaredCall",
           "api_path", "cluster_role_rules", "controller_uid", "kubernetes_transport"]
