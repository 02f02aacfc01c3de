"""pytest fixtures over tests/kube/cluster.py: one real control plane per session, a namespace per test,
and the real `kubetron operator` command as a subprocess running as the chart's ServiceAccount.

    def test_x(kube, kube_ns):                    # kube: KubeEnv (session); kube_ns: a fresh namespace
        with kube.operator(kube_ns) as op:       # `kubetron operator --namespace <ns> --interval 0.5`
            kube.admin.create(...)               # admin client (system:masters)
            kube.wait_for(...)                   # on timeout: the operator's log tail in the message

Where no server binaries exist, every test using `kube` skips with one line saying how to get them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kube import cluster
from tests.kube.cluster import Api, ApiError, ControlPlane, Kubelet, NoBinaries, free_port, stop_process, tail

ROOT = cluster.ROOT
CRD = ROOT / "crds" / "trainingjob.yaml"
CHART = ROOT / "charts" / "kubetron"
OPERATOR_NS, OPERATOR_SA = "kubetron-system", "kubetron"  # the chart's release namespace and SA name
PLACEHOLDER_NS = "kubetron-test-placeholder"
# The chart in its namespaced mode (as `watchNamespaces: [ns]` renders it) with every optional rule:
# the operator under test watches one namespace per test, so each gets the chart's Role + RoleBinding.
CHART_VALUES = {"gangScheduling": {"enabled": True}, "watchNamespaces": [PLACEHOLDER_NS],
                "operator": {"peering": "kubetron"}, "failingNodes": {"taint": True}}
PEERING_CRDS = CHART / "crds" / "kopf-peering.yaml"
JOBS = "/apis/kubetron.dev/v1alpha1/namespaces/{ns}/trainingjobs"
_counter = itertools.count(1)


def chart_rbac() -> list[dict[str, Any]]:
    """The chart's ServiceAccount, ClusterRole(Binding), Role(Binding) and KopfPeering for PLACEHOLDER_NS,
    rendered as `helm install` would (helm-python-sdk, a dev dependency)."""
    from kubetron_operator import helm

    rendered = helm.template(CHART, CHART_VALUES, namespace=OPERATOR_NS)
    return [m for m in rendered
            if m["kind"] in ("ClusterRole", "ClusterRoleBinding", "ServiceAccount", "Role", "RoleBinding",
                             "KopfPeering")]


class Operator:
    """A running `kubetron operator` process; its output goes to `log_path`."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, health: str):
        self.proc, self.log_path, self.health = proc, log_path, health

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def healthy(self) -> bool:
        import urllib.request

        if self.proc.poll() is not None:
            raise AssertionError(f"kubetron operator exited {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(self.health, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> int:
        stop_process(self.proc, timeout=20)
        return self.proc.returncode


class KubeEnv:
    """What the `kube` fixture yields: the control plane, an admin client, the operator's identity."""

    def __init__(self, cp: ControlPlane, workdir: Path):
        self.cp, self.dir = cp, workdir
        self.admin: Api = cp.admin
        self.operator_token = cp.sa_tokens[(OPERATOR_NS, OPERATOR_SA)]
        self.operator_api: Api = cp.api_for(self.operator_token)
        self.kubeconfig = cp.kubeconfig_for(self.operator_token, workdir / "operator.kubeconfig")
        self.current: Operator | None = None
        rbac = chart_rbac()
        per_namespace = ("Role", "RoleBinding", "KopfPeering")
        self.admin.apply_all([m for m in rbac if m["kind"] not in per_namespace])
        self.namespaced_rbac = [m for m in rbac if m["kind"] in per_namespace]

    def namespace(self, prefix: str = "t") -> str:
        name = f"{prefix}-{next(_counter)}-{os.getpid() % 10000}"
        self.cp.create_namespace(name)
        self.admin.apply_all([_in_namespace(m, name) for m in self.namespaced_rbac])
        return name

    def tenant(self, ns: str, name: str = "tenant") -> Api:
        """A client with the identity of a tenant: ServiceAccount `name` of `ns`, allowed only TrainingJobs
        in `ns` (a Role and RoleBinding; a token from the TokenRequest API, as a pod would mount)."""
        rbac = "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/{kind}"
        self.admin.create(f"/api/v1/namespaces/{ns}/serviceaccounts",
                          {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}, ok=(409,))
        self.admin.create(rbac.format(ns=ns, kind="roles"), {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name},
            "rules": [{"apiGroups": ["kubetron.dev"], "resources": ["trainingjobs"],
                       "verbs": ["create", "get", "list", "watch", "update", "patch", "delete"]}]}, ok=(409,))
        self.admin.create(rbac.format(ns=ns, kind="rolebindings"), {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]}, ok=(409,))
        token = self.admin.create(f"/api/v1/namespaces/{ns}/serviceaccounts/{name}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}})
        return self.cp.api_for(token["status"]["token"])

    def jobs(self, ns: str) -> str:
        return JOBS.format(ns=ns)

    def job(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.admin.get(f"{self.jobs(ns)}/{name}", ok=(404,))

    def pods(self, ns: str, role: str | None = "worker") -> dict[str, dict[str, Any]]:
        items = self.admin.get(f"/api/v1/namespaces/{ns}/pods")["items"]
        return {p["metadata"]["name"]: p for p in items
                if role is None or (p["metadata"].get("labels") or {}).get("kubetron.dev/role") == role}

    def events(self, ns: str) -> list[dict[str, Any]]:
        return self.admin.get(f"/api/v1/namespaces/{ns}/events")["items"]

    def operator_calls(self, ns: str) -> Counter[tuple[str, str, int]]:
        """The operator's requests on objects in `ns` so far, as the API server's audit log has them:
        (verb, resource[/subresource], HTTP code) -> how many."""
        calls: Counter[tuple[str, str, int]] = Counter()
        for event in self.cp.audit(f"system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}"):
            ref = event.get("objectRef") or {}
            if ref.get("namespace") == ns:
                resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
                calls[(event["verb"], resource, (event.get("responseStatus") or {}).get("code", 0))] += 1
        return calls

    @contextlib.contextmanager
    def operator(self, ns: str | None, *args: str, interval: float = 0.5, env: dict[str, str] | None = None,
                 command: list[str] | None = None) -> Iterator[Operator]:
        """Run `kubetron operator` (watching `ns`, or every namespace when None) until the block ends.
        `command` replaces the `kubetron` executable (e.g. a wrapper); `env` is added to the environment."""
        op = self.start_operator(ns, *args, interval=interval, env=env, command=command)
        self.current = op
        try:
            cluster.wait_for("kubetron operator liveness endpoint", op.healthy, 60, interval=0.2,
                             explain=op.tail)
            yield op
        finally:
            op.stop()
            self.current = None

    def start_operator(self, ns: str | None, *args: str, interval: float = 0.5, env: dict[str, str] | None = None,
                       command: list[str] | None = None) -> Operator:
        """`kubetron operator` started (not yet waited for): `operator()`'s process, for a caller that stops it."""
        port = free_port()
        argv = [*(command or [str(Path(sys.executable).with_name("kubetron"))]), "operator",
                f"--liveness=http://127.0.0.1:{port}/healthz", f"--interval={interval}", *args]
        if ns:
            argv.append(f"--namespace={ns}")
        log_path = self.dir / f"operator-{ns or 'all'}-{next(_counter)}.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
        full_env.update({"KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}, **(env or {}))
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=full_env, start_new_session=True, preexec_fn=cluster._die_with_parent)
        return Operator(proc, log_path, f"http://127.0.0.1:{port}/healthz")

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 30.0,
                 explain: Callable[[], str] | None = None) -> Any:
        """Poll until `check()` is truthy; the failure message carries the operator's log tail."""
        op = self.current

        def why() -> str:
            return "\n".join(x for x in ((explain() if explain else ""),
                                          (f"operator log:\n{op.tail()}" if op else "")) if x)
        return cluster.wait_for(what, check, timeout, interval=0.1, explain=why)

    def wait_status(self, ns: str, name: str, what: str, pred: Callable[[dict[str, Any]], bool],
                    timeout: float = 30.0) -> dict[str, Any]:
        """The job's status once `pred(status)` holds."""
        def check() -> dict[str, Any] | None:
            status = (self.job(ns, name) or {}).get("status") or {}
            return status if pred(status) else None
        try:
            return self.wait_for(what, check, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\njob status: {(self.job(ns, name) or {}).get('status')}") from None

    def wait_pods(self, ns: str, names: set[str], timeout: float = 30.0) -> dict[str, dict[str, Any]]:
        """The worker pods once exactly `names` exist (not being deleted)."""
        def check() -> tuple[dict[str, dict[str, Any]]] | None:
            pods = {n: p for n, p in self.pods(ns).items() if not p["metadata"].get("deletionTimestamp")}
            return (pods,) if set(pods) == names else None  # a tuple: {} is a result too
        (pods,) = self.wait_for(f"pods == {sorted(names)} in {ns}", check, timeout)
        return pods


def _in_namespace(manifest: dict[str, Any], ns: str) -> dict[str, Any]:
    out = {**manifest, "metadata": {**manifest["metadata"], "namespace": ns}}
    assert manifest["metadata"]["namespace"] == PLACEHOLDER_NS, manifest["metadata"]
    return out


def start_env(workdir: Path, flags: dict[str, list[str]] | None = None) -> tuple[ControlPlane, KubeEnv, Kubelet]:
    """The control plane (`flags`: extra command-line flags by component), the chart's RBAC, one Node."""
    cp = ControlPlane(workdir, cluster.find_binaries(), flags)
    cp.add_service_account_token(OPERATOR_NS, OPERATOR_SA)
    cp.start()
    try:
        cp.create_namespace(OPERATOR_NS)
        for crd in (CRD, PEERING_CRDS):
            cp.install_crd(crd)
        kubelet = Kubelet(cp.admin).start()
    except BaseException:
        cp.stop()
        raise
    return cp, KubeEnv(cp, workdir), kubelet


@pytest.fixture(scope="session")
def kube(tmp_path_factory) -> Iterator[KubeEnv]:
    try:
        cluster.find_binaries()
    except NoBinaries as exc:
        pytest.skip(str(exc))
    t0 = time.monotonic()
    cp, env, kubelet = start_env(tmp_path_factory.mktemp("kube"))
    env.startup_seconds = time.monotonic() - t0
    print(f"\n[kube] control plane at {cp.server} ready in {env.startup_seconds:.1f}s")
    try:
        yield env
    finally:
        kubelet.stop()
        cp.stop()


@pytest.fixture
def kube_ns(kube) -> str:
    """A fresh namespace (its `default` ServiceAccount exists) for one test."""
    return kube.namespace()


__all__ = ["ApiError", "KubeEnv", "Operator", "kube", "kube_ns"]
