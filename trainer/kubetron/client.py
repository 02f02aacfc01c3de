"""Drive TrainingJobs from Python: a notebook, a pipeline step, a script (docs/client.md).

    from kubetron.client import Client
    c = Client()                                     # the kubeconfig's cluster and namespace, as kubectl
    c.create("job.yaml")                             # a path, a YAML string, a dict, or keywords:
    c.create(name="gpt", image="kubetron-trainer:dev", nodes=2, config={"train": {"train_iters": 100}},
             storage={"pvc": {"claimName": "ckpt"}})
    st = c.wait("gpt")                               # JobStatus once Succeeded or Failed
    for line in c.logs("gpt", follow=True): ...      # rank 0's trainer log of the current attempt

Importable without torch, megatron or the Kubernetes client: `Client()` imports the `kubernetes` package
(`pip install 'kubetron[client]'`) and says so in one line when it is missing. Every failure is a
KubetronError whose message is one line: what was asked, and the API server's (or an admission
controller's) own words. `kubetron submit/status/logs/delete` (client_cli.py) are this client.
"""

from __future__ import annotations

import builtins
import copy
import functools
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from kubetron.contract.resource import (
    API_VERSION,
    FINISHED,
    GROUP,
    KIND,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_RANK,
    LABEL_ROLE,
    PLURAL,
    TRAINER,
    VERSION,
)

TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"
WATCH_SECONDS = 60  # one watch request's length; the watch is renewed until the caller's timeout
IN_CLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
INSTALL_HINT = "pip install 'kubetron[client]'"


class KubetronError(Exception):
    """One line: what failed and why. `status`: the API server's HTTP status, None when no request was made."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(" ".join(str(message).split()))
        self.status = status


class BadInput(KubetronError):
    """An argument the client cannot use (a missing file, YAML that is no TrainingJob): nothing was sent."""


class NotFound(KubetronError):
    """The job (or its pods) does not exist (HTTP 404)."""


class Rejected(KubetronError):
    """The API server or an admission controller refused the request (HTTP 400, 403, 409, 422)."""


class WaitTimeout(KubetronError, TimeoutError):
    """wait()/watch() gave up after `timeout` seconds."""


# -- the typed status -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Restarts:
    """status.restarts: attempts restarted, by why the previous one ended (in-place restarts apart)."""

    total: int = 0
    preemptions: int = 0
    failures: int = 0
    never_started: int = 0
    in_place: int = 0


@dataclass(frozen=True)
class Checkpoint:
    """A durable checkpoint: its iteration, and when it was written (UTC, `2026-01-02T03:04:05Z`)."""

    iteration: int
    time: str | None = None


@dataclass(frozen=True)
class JobStatus:
    """A TrainingJob's status as the operator writes it (`kubectl get tj NAME -o yaml`), typed. `phase` is
    Pending before the operator's first word; `goodput` is status.goodput where the operator reports it."""

    name: str
    namespace: str
    phase: str = "Pending"
    reason: str | None = None
    message: str | None = None
    attempt: int | None = None
    nodes: int | None = None
    iteration: int | None = None
    train_iters: int | None = None
    progress: str | None = None
    loss: float | None = None
    learning_rate: float | None = None
    tokens_per_second: float | None = None
    eta: str | None = None
    restarts: Restarts = field(default_factory=Restarts)
    last_checkpoint: Checkpoint | None = None
    goodput: Any = None
    start_time: str | None = None
    completion_time: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The whole object as the API server returned it (metadata, spec, status)."""

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED

    @classmethod
    def of(cls, job: Mapping[str, Any]) -> JobStatus:
        st, meta = job.get("status") or {}, job.get("metadata") or {}
        restarts, ckpt = st.get("restarts") or {}, st.get("lastCheckpoint") or {}
        return cls(
            name=meta.get("name", ""), namespace=meta.get("namespace", ""), phase=st.get("phase") or "Pending",
            reason=st.get("reason"), message=st.get("message"), attempt=st.get("attempt"), nodes=st.get("nodes"),
            iteration=st.get("iteration"), train_iters=st.get("trainIters"), progress=st.get("progress"),
            loss=st.get("loss"), learning_rate=st.get("learningRate"), tokens_per_second=st.get("tokensPerSecond"),
            eta=st.get("eta"), goodput=st.get("goodput"), start_time=st.get("startTime"),
            completion_time=st.get("completionTime"), raw=job,
            restarts=Restarts(total=restarts.get("total", 0), preemptions=restarts.get("preemptions", 0),
                              failures=restarts.get("failures", 0), never_started=restarts.get("neverStarted", 0),
                              in_place=restarts.get("inPlace", 0)),
            last_checkpoint=Checkpoint(ckpt["iteration"], ckpt.get("time")) if "iteration" in ckpt else None,
        )


# -- what create() accepts ----------------------------------------------------------------------------------


def load_job(source: Any, what: str = "job") -> dict[str, Any]:
    """A TrainingJob manifest from a dict, a YAML string or a path (str or os.PathLike). BadInput names
    `what` (the argument) and what is wrong with it."""
    if isinstance(source, Mapping):
        return _one_job([copy.deepcopy(dict(source))], what)  # create() fills in the namespace: not the caller's
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source.strip()
                                           and not source.lstrip().startswith(("{", "apiVersion", "kind"))):
        return _one_job(_read_yaml_file(Path(source), what), f"{what}: {source}")
    if isinstance(source, str):
        return _one_job(_parse_yaml(source, what), what)
    raise BadInput(f"{what}: expected a dict, a YAML string or a path, got {type(source).__name__}")


def _read_yaml_file(path: Path, what: str) -> list[Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise BadInput(f"{what}: {path}: {exc.strerror}") from None
    return _parse_yaml(text, f"{what}: {path}")


def _parse_yaml(text: str, what: str) -> list[Any]:
    try:
        return [d for d in yaml.safe_load_all(text) if d]
    except yaml.YAMLError as exc:
        raise BadInput(f"{what}: invalid YAML: {getattr(exc, 'problem', None) or exc}") from None


def _one_job(docs: list[Any], what: str) -> dict[str, Any]:
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise BadInput(f"{what}: expected exactly one {KIND}, found {len(jobs)}")
    job = jobs[0]
    if job.get("apiVersion") != API_VERSION:
        raise BadInput(f"{what}: apiVersion must be {API_VERSION}, got {job.get('apiVersion')!r}")
    if not (job.get("metadata") or {}).get("name"):
        raise BadInput(f"{what}: metadata.name is required")
    return job


def job_manifest(name: str, image: str, nodes: int, config: Mapping[str, Any] | str, storage: Mapping[str, Any],
                 **spec: Any) -> dict[str, Any]:
    """A TrainingJob from keywords: `config` a dict or YAML text (the trainer's config), `storage` as the
    CRD's spec.storage ({"pvc": {"claimName": ...}} or {"s3": {...}}), `spec` any other spec field by its
    CRD name (gpusPerNode=8, minNodes=2, scheduling={...})."""
    given = {"name": name, "image": image, "nodes": nodes, "config": config, "storage": storage}
    missing = [k for k, v in given.items() if v in (None, "", {})]
    if missing:
        raise BadInput(f"{missing[0]}: required (with name, image, nodes, config and storage)")
    text = config if isinstance(config, str) else yaml.safe_dump(dict(config), sort_keys=False)
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
            "spec": {"image": image, "nodes": nodes, "config": text, "storage": dict(storage), **spec}}


# -- log lines -----------------------------------------------------------------------------------------------


def whole_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Lines of a byte stream whose chunks may end mid-line (or mid-character)."""
    pending = b""
    for chunk in chunks:
        *lines, pending = (pending + chunk).split(b"\n")
        yield from (line.decode("utf-8", "replace") for line in lines)
    if pending:
        yield pending.decode("utf-8", "replace")


def merge_lines(streams: Mapping[str, Callable[[], Iterable[str]]]) -> Iterator[str]:
    """The lines of several streams as they come, each prefixed `[rank R] ` (R: its key), each stream read
    by a daemon thread (a followed pod may never write again, or end). A stream's KubetronError is raised
    once the others ended, all such errors in one line."""
    lines: queue.Queue[tuple[str, str | None]] = queue.Queue(maxsize=1024)
    errors: list[str] = []

    def read(rank: str, open_stream: Callable[[], Iterable[str]]) -> None:
        try:
            for line in open_stream():
                lines.put((rank, line))
        except KubetronError as exc:
            errors.append(str(exc))
        finally:
            lines.put((rank, None))

    for rank, open_stream in streams.items():
        threading.Thread(target=read, args=(rank, open_stream), name=f"logs-rank-{rank}", daemon=True).start()
    open_ = len(streams)
    while open_:
        rank, line = lines.get()
        if line is None:
            open_ -= 1
        else:
            yield f"[rank {rank}] {line}"
    if errors:
        raise KubetronError("; ".join(errors))


def select_pods(pods: Iterable[Mapping[str, Any]], job: Mapping[str, Any], rank: int | None) -> list[dict[str, Any]]:
    """The current attempt's worker pods (by rank), or the one of `rank`; NotFound when there are none."""
    name, st = job["metadata"]["name"], job.get("status") or {}
    attempt = st.get("attempt")
    if not attempt:
        raise NotFound(f"trainingjob {name}: no attempt has started yet (phase {st.get('phase') or 'Pending'})")
    mine = [dict(p) for p in pods
            if (labels := p["metadata"].get("labels") or {}).get(LABEL_JOB) == name
            and labels.get(LABEL_ATTEMPT) == str(attempt) and labels.get(LABEL_ROLE) == "worker"
            and (rank is None or labels.get(LABEL_RANK) == str(rank))]
    if not mine:
        which = f"rank {rank} of attempt {attempt}" if rank is not None else f"attempt {attempt}"
        raise NotFound(f"trainingjob {name}: no pod of {which} exists")
    return sorted(mine, key=lambda p: int(p["metadata"]["labels"].get(LABEL_RANK, 0)))


# -- the client ----------------------------------------------------------------------------------------------


class Client:
    """TrainingJobs of one namespace of one cluster. `namespace`: default the kubeconfig context's (else
    `default`); `kubeconfig`: a file (default $KUBECONFIG or ~/.kube/config; in a pod without one, the
    pod's ServiceAccount); `context`: a kubeconfig context (default the current one)."""

    def __init__(self, namespace: str | None = None, kubeconfig: str | os.PathLike[str] | None = None,
                 context: str | None = None):
        try:
            from kubernetes import client as k8s
        except ImportError:
            raise KubetronError(f"kubetron.client needs the kubernetes package: {INSTALL_HINT}") from None
        self.api_client, own_namespace = _connect(None if kubeconfig is None else str(kubeconfig), context)
        self.namespace = namespace or own_namespace
        self._custom = k8s.CustomObjectsApi(self.api_client)
        self._core = k8s.CoreV1Api(self.api_client)

    # -- jobs ------------------------------------------------------------------------------------------------

    def create(self, job: Any = None, /, **fields: Any) -> JobStatus:
        """Create a TrainingJob from `job` (a dict, a YAML string, or a path), or from keywords (see
        job_manifest: name, image, nodes, config, storage, other spec fields). Its namespace: the manifest's
        metadata.namespace, else the client's."""
        if (job is None) == (not fields):
            raise BadInput("job: give a manifest (dict, YAML or path) or keyword arguments, not both or neither")
        body = load_job(job) if job is not None else job_manifest(**fields)
        ns = body["metadata"].get("namespace") or self.namespace
        body["metadata"]["namespace"] = ns
        name = body["metadata"]["name"]
        return JobStatus.of(self._call(lambda: self._custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, body), f"trainingjob {name}"))

    def get(self, name: str) -> JobStatus:
        return JobStatus.of(self.job(name))

    def job(self, name: str) -> dict[str, Any]:
        """The whole TrainingJob object (metadata, spec, status) as a dict."""
        return self._call(lambda: self._custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                                            name), f"trainingjob {name}")

    def list(self) -> list[JobStatus]:
        """Every TrainingJob of the namespace, by name."""
        got = self._call(lambda: self._custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL),
                         "trainingjobs")
        return sorted((JobStatus.of(j) for j in got.get("items") or ()), key=lambda s: s.name)

    def suspend(self, name: str) -> JobStatus:
        """spec.suspend = true: the operator stops the current attempt (its pods go; the checkpoint stays)."""
        return self._patch_spec(name, {"suspend": True})

    def resume(self, name: str) -> JobStatus:
        """spec.suspend = false: the next attempt starts from the last checkpoint."""
        return self._patch_spec(name, {"suspend": False})

    def delete(self, name: str) -> None:
        """Delete the job; its pods and PodGroups go with it (owner references)."""
        self._call(lambda: self._custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name),
                   f"trainingjob {name}")

    def _patch_spec(self, name: str, spec: dict[str, Any]) -> JobStatus:
        return JobStatus.of(self._call(lambda: self._custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, {"spec": spec}), f"trainingjob {name}"))

    # -- following a job ---------------------------------------------------------------------------------------

    def watch(self, name: str, timeout: float | None = None) -> Iterator[JobStatus]:
        """The job's status now, then each time it changes, until it finished (Succeeded or Failed: its last
        status is yielded, then the iteration ends). NotFound if the job is deleted meanwhile; WaitTimeout
        after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last: JobStatus | None = None
        while True:
            job = self.job(name)
            for st in self._changes(name, job, deadline):
                if st != last:
                    last = st
                    yield st
                if st.finished:
                    return
            if deadline is not None and time.monotonic() >= deadline:
                phase = last.phase if last else "Pending"
                raise WaitTimeout(f"trainingjob {name}: still {phase} after {timeout:g}s")

    def wait(self, name: str, phases: Iterable[str] = FINISHED, timeout: float | None = None) -> JobStatus:
        """The job's status once its phase is one of `phases` (or it finished: it changes no more)."""
        wanted = tuple(phases)
        for st in self.watch(name, timeout):
            if st.phase in wanted or st.finished:
                return st
        raise AssertionError("watch() ends only after yielding a finished status")

    def _changes(self, name: str, job: dict[str, Any], deadline: float | None) -> Iterator[JobStatus]:
        """`job`'s status, then one per watch event, for one watch request (at most WATCH_SECONDS)."""
        from kubernetes import watch

        yield JobStatus.of(job)
        seconds = WATCH_SECONDS if deadline is None else max(1, min(WATCH_SECONDS, int(deadline - time.monotonic())))
        stream = watch.Watch().stream(
            self._custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
            field_selector=f"metadata.name={name}", resource_version=job["metadata"]["resourceVersion"],
            timeout_seconds=seconds)
        for event in _events(stream, f"trainingjob {name}"):
            if event["type"] == "DELETED":
                raise NotFound(f"trainingjob {name}: deleted")
            if event["type"] in ("ADDED", "MODIFIED"):
                yield JobStatus.of(event["object"])

    # -- pods and logs -----------------------------------------------------------------------------------------

    def pods(self, name: str, rank: int | None = None) -> builtins.list[dict[str, Any]]:
        """The current attempt's worker pods by rank (or the one of node rank `rank`); NotFound when none."""
        job = self.job(name)
        attempt = (job.get("status") or {}).get("attempt") or 0
        selector = f"{LABEL_JOB}={name},{LABEL_ATTEMPT}={attempt}"
        listed = self._call(lambda: self.api_client.sanitize_for_serialization(
            self._core.list_namespaced_pod(self.namespace, label_selector=selector)), "pods")
        return select_pods(listed.get("items") or [], job, rank)

    def logs(self, name: str, rank: int | None = 0, follow: bool = False) -> Iterator[str]:
        """The trainer's log lines of the current attempt's pod of node rank `rank` (None: every rank, each line
        prefixed `[rank R] ` when there are several); `follow`: go on as the pod writes, until it ends."""
        pods = {p["metadata"]["labels"].get(LABEL_RANK, "0"): p["metadata"]["name"] for p in self.pods(name, rank)}
        if len(pods) == 1:
            yield from self._pod_lines(next(iter(pods.values())), follow)
            return
        yield from merge_lines({r: functools.partial(self._pod_lines, pod, follow) for r, pod in pods.items()})

    def _pod_lines(self, pod: str, follow: bool) -> Iterator[str]:
        """One pod's trainer log, as the API server gets it from the pod's kubelet."""
        resp = self._call(lambda: self._core.read_namespaced_pod_log(
            pod, self.namespace, container=TRAINER, follow=follow, _preload_content=False), f"logs of pod {pod}")
        yield from whole_lines(resp.stream() if follow else [resp.data])

    # -- the kubectl table ---------------------------------------------------------------------------------------

    def table(self, name: str | None = None) -> dict[str, Any]:
        """The API server's own `kubectl get trainingjobs` table (meta.k8s.io Table, objects included): the
        columns of the CRD's additionalPrinterColumns."""
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{quote(self.namespace, safe='')}/{PLURAL}" + (
            f"/{quote(name, safe='')}" if name else "")
        what = f"trainingjob {name}" if name else "trainingjobs"
        query, headers = [("includeObject", "Object")], {"Accept": TABLE}
        if hasattr(self.api_client, "param_serialize"):  # kubernetes >= 35 (the new generator)
            request = self.api_client.param_serialize("GET", path, query_params=query, header_params=headers,
                                                      auth_settings=["BearerToken"])
            resp = self._call(lambda: self.api_client.call_api(*request), what)
            resp.read()
            if resp.status >= 300:
                raise _error(what, resp.status, _message(resp.data))
        else:  # kubernetes < 35: call_api takes the request's parts (the pinned client's types say otherwise)
            legacy: Any = self.api_client
            resp = self._call(lambda: legacy.call_api(
                path, "GET", header_params=headers, query_params=query, auth_settings=["BearerToken"],
                _preload_content=False, _return_http_data_only=True), what)
        return json.loads(resp.data)

    # -- errors --------------------------------------------------------------------------------------------------

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        """fn(), its failures as KubetronError: `what: HTTP <status>: <the server's message>`."""
        from kubernetes.client.exceptions import ApiException

        try:
            return fn()
        except ApiException as exc:
            raise _error(what, exc.status, _message(exc.body) or exc.reason) from None
        except OSError as exc:  # urllib3's connection errors are OSErrors too
            raise KubetronError(f"{what}: cannot reach the cluster ({exc})") from None


def _connect(kubeconfig: str | None, context: str | None) -> tuple[Any, str]:
    """(an ApiClient, the default namespace) for a kubeconfig and context; in a pod with no kubeconfig, its
    ServiceAccount's."""
    from kubernetes import client as k8s
    from kubernetes import config

    in_pod = kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ and not os.environ.get("KUBECONFIG") \
        and not Path(config.KUBE_CONFIG_DEFAULT_LOCATION).expanduser().exists()
    try:
        if in_pod:
            configuration = k8s.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            return k8s.ApiClient(configuration), Path(IN_CLUSTER_NAMESPACE).read_text().strip() or "default"
        api_client = config.new_client_from_config(config_file=kubeconfig, context=context)
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    except Exception as exc:  # noqa: BLE001 - the client raises several kinds; one line says which
        raise BadInput(f"kubeconfig: {exc}") from None
    chosen = next((c for c in contexts if c["name"] == context), active) if context else active
    return api_client, (chosen or {}).get("context", {}).get("namespace") or "default"


def _events(stream: Iterable[dict[str, Any]], what: str) -> Iterator[dict[str, Any]]:
    """A watch's events; an expired resourceVersion (410) ends it early (the caller reads the job again)."""
    from kubernetes.client.exceptions import ApiException

    try:
        yield from stream
    except ApiException as exc:
        if exc.status != 410:
            raise _error(what, exc.status, _message(exc.body) or exc.reason) from None
    except OSError as exc:
        raise KubetronError(f"{what}: cannot reach the cluster ({exc})") from None


def _message(body: Any) -> str:
    try:
        return json.loads(body).get("message") or ""
    except (TypeError, ValueError, AttributeError):
        return ""


def _error(what: str, status: int, message: str) -> KubetronError:
    kind = NotFound if status == 404 else Rejected if status in (400, 403, 409, 422) else KubetronError
    return kind(f"{what}: HTTP {status}: {message}", status)


__all__ = ["BadInput", "Checkpoint", "Client", "JobStatus", "KubetronError", "NotFound", "Rejected", "Restarts",
           "WaitTimeout", "job_manifest", "load_job", "merge_lines", "select_pods", "whole_lines"]
