"""`kubetron submit|status|logs|delete`: follow TrainingJobs from a terminal (also `kubectl kubetron ...`).

Talks to the cluster of the kubeconfig (`--kubeconfig`, `--context`, `-n`), as kubectl does. Errors are one
line on stderr: exit 2 for what no retry fixes (a bad manifest, a rejected spec), 1 for the rest (a job
that failed or does not exist, logs the kubelet cannot serve).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import yaml

from kubetron_operator.build import LABEL_ATTEMPT, LABEL_JOB, LABEL_RANK, LABEL_ROLE
from kubetron_operator.job_status import FINISHED
from kubetron_operator.model import API_VERSION, GROUP, KIND, PLURAL, VERSION

PROG = "kubetron"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"


class CliError(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(" ".join(str(message).split()))
        self.code = code


class Cluster:
    """The kubernetes client for one kubeconfig/context/namespace."""

    def __init__(self, args: argparse.Namespace):
        try:
            from kubernetes import client, config
        except ImportError:
            raise CliError("the kubernetes client is missing: pip install 'kubetron[operator]'", 2) from None
        try:
            config.load_kube_config(config_file=args.kubeconfig, context=args.context)
            _, active = config.list_kube_config_contexts(config_file=args.kubeconfig)
        except Exception as exc:  # noqa: BLE001 - the client raises several kinds; one line says which
            raise CliError(f"--kubeconfig: {exc}", 2) from None
        if args.context:
            active = next((c for c in config.list_kube_config_contexts(args.kubeconfig)[0]
                           if c["name"] == args.context), active)
        self.namespace = args.namespace or (active or {}).get("context", {}).get("namespace") or "default"
        self.api_client = client.ApiClient()
        self.custom = client.CustomObjectsApi(self.api_client)
        self.core = client.CoreV1Api(self.api_client)

    def job(self, name: str) -> dict[str, Any]:
        return self.call(lambda: self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name), f"trainingjob {name}")

    def table(self, name: str | None) -> dict[str, Any]:
        """The API server's own `kubectl get` table: columns from the CRD's additionalPrinterColumns."""
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}" + (f"/{name}" if name else "")
        what = f"trainingjob {name}" if name else "trainingjobs"
        query, headers = [("includeObject", "Object")], {"Accept": TABLE}
        if hasattr(self.api_client, "param_serialize"):  # kubernetes >= 35 (the new generator)
            request = self.api_client.param_serialize("GET", path, query_params=query, header_params=headers,
                                                      auth_settings=["BearerToken"])
            resp = self.call(lambda: self.api_client.call_api(*request), what)
            resp.read()
            if resp.status >= 300:
                raise CliError(f"{what}: HTTP {resp.status}: {_message(resp.data)}",
                               2 if resp.status in (400, 403, 422) else 1)
        else:  # kubernetes < 35: call_api takes the request's parts (the pinned client's types say otherwise)
            legacy: Any = self.api_client
            resp = self.call(lambda: legacy.call_api(
                path, "GET", header_params=headers, query_params=query, auth_settings=["BearerToken"],
                _preload_content=False, _return_http_data_only=True), what)
        return json.loads(resp.data)

    def call(self, fn: Callable[[], Any], what: str) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return fn()
        except ApiException as exc:
            raise CliError(f"{what}: {api_message(exc)}", 2 if exc.status in (400, 403, 422) else 1) from None
        except OSError as exc:
            raise CliError(f"{what}: cannot reach the cluster ({exc})") from None


def api_message(exc: Any) -> str:
    """The API server's message of an ApiException (its JSON Status), else its reason."""
    return f"HTTP {exc.status}: {_message(exc.body) or exc.reason}"


def _message(body: Any) -> str:
    try:
        return json.loads(body).get("message") or ""
    except (TypeError, ValueError, AttributeError):
        return ""


# -- status lines ---------------------------------------------------------------------------------------


def status_line(job: Mapping[str, Any]) -> str:
    """`gpt: Running attempt 1 iteration 40/100 (40%) - Running: all 2 pods running`."""
    st = job.get("status") or {}
    parts = [f"{job['metadata']['name']}: {st.get('phase') or 'Pending'}"]
    if st.get("attempt"):
        parts.append(f"attempt {st['attempt']}")
    if st.get("iteration") is not None and st.get("trainIters"):
        parts.append(f"iteration {st['iteration']}/{st['trainIters']} ({st.get('progress', '')})")
    if st.get("loss") is not None:
        parts.append(f"loss {st['loss']}")
    line = " ".join(parts)
    if st.get("reason"):
        line += f" - {st['reason']}" + (f": {st['message']}" if st.get("message") else "")
    return line


def follow(cluster: Cluster, name: str, until: tuple[str, ...], timeout: float | None,
           out: Callable[[str], None] = print, interval: float = 1.0) -> dict[str, Any]:
    """Print the status line whenever it changes, until the phase is one of `until` (or a finished one)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    last = None
    while True:
        job = cluster.job(name)
        line = status_line(job)
        if line != last:
            out(line)
            last = line
        phase = (job.get("status") or {}).get("phase")
        if phase in until or phase in FINISHED:
            return job
        if deadline is not None and time.monotonic() > deadline:
            raise CliError(f"trainingjob {name}: still {phase or 'Pending'} after --timeout {timeout:g}s")
        time.sleep(interval)


# -- commands --------------------------------------------------------------------------------------------


def load_manifest(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
    except OSError as exc:
        raise CliError(f"FILE: {path}: {exc.strerror}", 2) from None
    except yaml.YAMLError as exc:
        raise CliError(f"FILE: {path}: invalid YAML: {getattr(exc, 'problem', None) or exc}", 2) from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise CliError(f"FILE: {path}: expected exactly one {KIND}, found {len(jobs)}", 2)
    job = jobs[0]
    if job.get("apiVersion") != API_VERSION:
        raise CliError(f"FILE: {path}: apiVersion must be {API_VERSION}, got {job.get('apiVersion')!r}", 2)
    if not (job.get("metadata") or {}).get("name"):
        raise CliError(f"FILE: {path}: metadata.name is required", 2)
    return job


def submit(args: argparse.Namespace) -> int:
    body = load_manifest(args.file)
    cluster = Cluster(args)
    ns = (body.get("metadata") or {}).get("namespace")
    if ns and args.namespace and ns != args.namespace:
        raise CliError(f"--namespace {args.namespace} disagrees with the manifest's metadata.namespace {ns}", 2)
    cluster.namespace = ns or cluster.namespace
    name = body["metadata"]["name"]
    cluster.call(lambda: cluster.custom.create_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL,
                                                                        body), f"trainingjob {name}")
    print(f"trainingjob {cluster.namespace}/{name} created")
    job = follow(cluster, name, FINISHED if args.wait else ("Running",), args.timeout)
    return 1 if (job.get("status") or {}).get("phase") == "Failed" else 0


def status(args: argparse.Namespace) -> int:
    cluster = Cluster(args)
    table = cluster.table(args.name)
    rows = table.get("rows") or []
    if not rows and not args.name:
        print(f"No TrainingJobs in namespace {cluster.namespace}.")
        return 0
    print(format_table(table))
    return 0


def format_table(table: Mapping[str, Any]) -> str:
    """The server's columns (NAME PHASE ... AGE), plus REASON and LAST-CHECKPOINT from each object."""
    head = [c["name"].upper() for c in table["columnDefinitions"]] + ["REASON", "LAST-CHECKPOINT"]
    lines = [head]
    for row in table.get("rows") or ():
        st = (row.get("object") or {}).get("status") or {}
        ckpt = st.get("lastCheckpoint") or {}
        cells = ["<none>" if c is None or c == "" else str(c) for c in row["cells"]]
        lines.append(cells + [st.get("reason") or "<none>",
                              f"{ckpt['iteration']} ({ckpt.get('time', '')})".replace(" ()", "")
                              if ckpt.get("iteration") is not None else "<none>"])
    widths = [max(len(r[i]) for r in lines) + 3 for i in range(len(head))]
    return "\n".join("".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in lines)


def delete(args: argparse.Namespace) -> int:
    cluster = Cluster(args)
    cluster.call(lambda: cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL,
                                                                        args.name), f"trainingjob {args.name}")
    print(f"trainingjob {cluster.namespace}/{args.name} deleted")
    return 0


def select_pods(pods: Iterable[Mapping[str, Any]], job: Mapping[str, Any], rank: int | None) -> list[dict[str, Any]]:
    """The current attempt's worker pods (by rank), or the one of `rank`; CliError when there are none."""
    name, attempt = job["metadata"]["name"], (job.get("status") or {}).get("attempt")
    if not attempt:
        raise CliError(f"trainingjob {name}: no attempt has started yet (phase "
                       f"{(job.get('status') or {}).get('phase') or 'Pending'})")
    mine = [dict(p) for p in pods
            if (labels := p["metadata"].get("labels") or {}).get(LABEL_JOB) == name
            and labels.get(LABEL_ATTEMPT) == str(attempt) and labels.get(LABEL_ROLE) == "worker"
            and (rank is None or labels.get(LABEL_RANK) == str(rank))]
    if not mine:
        which = f"rank {rank} of attempt {attempt}" if rank is not None else f"attempt {attempt}"
        raise CliError(f"trainingjob {name}: no pod of {which} exists")
    return sorted(mine, key=lambda p: int(p["metadata"]["labels"].get(LABEL_RANK, 0)))


def logs(args: argparse.Namespace) -> int:
    cluster = Cluster(args)
    job = cluster.job(args.name)
    selector = f"{LABEL_JOB}={args.name},{LABEL_ATTEMPT}={(job.get('status') or {}).get('attempt') or 0}"
    listed = cluster.call(lambda: cluster.api_client.sanitize_for_serialization(
        cluster.core.list_namespaced_pod(cluster.namespace, label_selector=selector)), "pods")
    pods = select_pods(listed.get("items") or [], job, args.rank)
    prefix = len(pods) > 1
    errors: list[str] = []
    closed = threading.Event()  # stdout's reader went away (`kubetron logs -f gpt | head`)
    threads = [threading.Thread(target=_stream, args=(cluster, p, args.follow, prefix, errors, closed), daemon=True)
               for p in pods]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive() and not closed.is_set():  # a followed pod may never write again
            t.join(0.2)
    if closed.is_set():
        raise BrokenPipeError("stdout closed")  # the kubetron command ends quietly (exit 141)
    if errors:
        raise CliError("; ".join(errors))
    return 0


def whole_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Lines of a byte stream whose chunks may end mid-line (or mid-character)."""
    pending = b""
    for chunk in chunks:
        *lines, pending = (pending + chunk).split(b"\n")
        yield from (line.decode("utf-8", "replace") for line in lines)
    if pending:
        yield pending.decode("utf-8", "replace")


def _stream(cluster: Cluster, pod: Mapping[str, Any], follow_: bool, prefix: bool, errors: list[str],
            closed: threading.Event) -> None:
    name, rank = pod["metadata"]["name"], pod["metadata"]["labels"].get(LABEL_RANK, "0")
    try:
        resp = cluster.call(lambda: cluster.core.read_namespaced_pod_log(
            name, cluster.namespace, container="trainer", follow=follow_, _preload_content=False),
            f"logs of pod {name}")
        for text in whole_lines(resp.stream() if follow_ else [resp.data]):
            sys.stdout.write(f"[rank {rank}] {text}\n" if prefix else f"{text}\n")
            sys.stdout.flush()
    except CliError as exc:
        errors.append(str(exc))
    except BrokenPipeError:
        closed.set()


# -- the parser --------------------------------------------------------------------------------------


def add_commands(sub: Any, parser_class: type) -> None:
    """Add submit/status/logs/delete to the `kubetron` parser; each sets func=run(<command>)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", default=None, metavar="FILE",
                        help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    common.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    common.add_argument("-n", "--namespace", default=None, metavar="NS",
                        help="namespace (default: the context's, else default)")

    p = sub.add_parser("submit", parents=[common], help="create a TrainingJob and follow it until Running",
                       description="Create the TrainingJob of FILE and print its status line whenever it changes, "
                                   "until it is Running (or with --wait, until it finished). Exit 1 if it failed.")
    p.add_argument("file", metavar="FILE", help="TrainingJob YAML manifest")
    p.add_argument("--wait", action="store_true", help="follow until Succeeded or Failed")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="give up after this long (exit 1)")
    p.set_defaults(func=run(submit))

    p = sub.add_parser("status", parents=[common], help="show TrainingJobs as kubectl get does, plus reason",
                       description="The `kubectl get trainingjobs` columns, plus the reason and last checkpoint.")
    p.add_argument("name", nargs="?", metavar="NAME", help="one job (default: all in the namespace)")
    p.set_defaults(func=run(status))

    p = sub.add_parser("logs", parents=[common], help="print the logs of the current attempt's pods",
                       description="Print the trainer logs of the current attempt's pods (each line prefixed with "
                                   "its rank when there are several).")
    p.add_argument("name", metavar="NAME")
    p.add_argument("-f", "--follow", action="store_true", help="stream the logs")
    p.add_argument("--rank", type=int, default=None, metavar="N", help="only the pod of node rank N")
    p.set_defaults(func=run(logs))

    p = sub.add_parser("delete", parents=[common], help="delete a TrainingJob (its pods go with it)")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=run(delete))


def run(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except CliError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return exc.code
        except KeyboardInterrupt:
            return 130
    return wrapped
