"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager, kube-scheduler
on free ports of 127.0.0.1, with its own PKI. No kubelet: `Kubelet` plays it (Node + Lease, finishing
pod deletions), and tests set pod statuses themselves.

    with control_plane(workdir) as cp:         # ~7 s; the pytest fixture starts one per session
        api = cp.admin                         # system:masters
        cp.kubeconfig_for(token, path)         # a kubeconfig for a token-file identity
        cp.audit(user)                         # the API server's record of every request `user` made

Binaries (the envtest convention): `$KUBEBUILDER_ASSETS` (kube-apiserver + etcd; controller-manager and
scheduler are used when present), else the .xz files of ../shared/k8s, unpacked once per machine into
~/.cache/kubetron/k8s-<sha> (verified against SHA256SUMS).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import http.client
import json
import lzma
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from tests.ports import free_port  # noqa: F401 - the harness's one port picker, re-exported

ROOT = Path(__file__).resolve().parents[2]
SHARED_K8S = Path(os.environ.get("KUBETRON_K8S_DIR", ROOT.parent / "shared" / "k8s"))
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kubetron"
REQUIRED = ("etcd", "kube-apiserver")
OPTIONAL = ("kube-controller-manager", "kube-scheduler")
HOW_TO_GET = ("no Kubernetes server binaries: set KUBEBUILDER_ASSETS to a directory with kube-apiserver and etcd "
              "(KUBEBUILDER_ASSETS=$(setup-envtest use -p path)), or provide ../shared/k8s/*.xz next to the repository")
READY_TIMEOUT = 90.0
# Kubernetes' own gang scheduling (KEP-4671, alpha in 1.36): scheduling.k8s.io/v1alpha2 PodGroups, which the
# API server serves and the scheduler honours only with these gates (docs/gang.md). An older kube-apiserver
# refuses them: it is started again without (cp.gates == ""); KUBETRON_K8S_GATES="" never sets them.
GANG_GATES = os.environ.get("KUBETRON_K8S_GATES", "GenericWorkload=true,GangScheduling=true")
GANG_API = "scheduling.k8s.io/v1alpha2"
# The API server's audit log: every request of a ServiceAccount (the operators under test), outside
# kube-system (the controller manager's own), at Metadata level: who, verb, resource, response code,
# and the authorizer's decision ("authorization.k8s.io/decision": "forbid" for an RBAC denial).
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
    "rules": [{"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
              {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
              {"level": "None"}],
}


class NoBinaries(RuntimeError):
    pass


# -- binaries ------------------------------------------------------------------------------------------


def find_binaries() -> dict[str, Path]:
    """name -> executable; raises NoBinaries (its message says how to get them)."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        found = {n: Path(assets) / n for n in REQUIRED + OPTIONAL if (Path(assets) / n).is_file()}
        if all(n in found for n in REQUIRED):
            return found
        raise NoBinaries(f"KUBEBUILDER_ASSETS={assets} lacks {[n for n in REQUIRED if n not in found]}; "
                         + HOW_TO_GET)
    sums = SHARED_K8S / "SHA256SUMS"
    if not sums.is_file():
        raise NoBinaries(HOW_TO_GET)
    return _unpacked(sums)


def _unpacked(sums: Path) -> dict[str, Path]:
    """Unpack the .xz files once per machine (verified), into a directory named after their checksums."""
    digest = hashlib.sha256(sums.read_bytes()).hexdigest()[:16]
    target = CACHE / f"k8s-{digest}"
    if not (target / ".complete").exists():
        expected = dict(reversed(line.split()) for line in sums.read_text().splitlines() if line.strip())
        CACHE.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="k8s-unpack-", dir=CACHE))
        for xz_name, want in expected.items():
            src = SHARED_K8S / xz_name
            got = hashlib.sha256(src.read_bytes()).hexdigest()
            if got != want:
                raise NoBinaries(f"{src}: sha256 {got} != {want} in SHA256SUMS")
            out = staging / xz_name.removesuffix(".xz")
            with lzma.open(src) as fin, open(out, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
            out.chmod(0o755)
        (staging / ".complete").touch()
        try:
            staging.rename(target)  # atomic: a concurrent session either wins or finds it complete
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return {n: target / n for n in REQUIRED + OPTIONAL if (target / n).is_file()}


# -- PKI -----------------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """ca.{crt,key}; server.{crt,key} (IP:127.0.0.1); client certs admin, controller-manager, scheduler;
    sa.{key,pub} for service-account tokens."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=kubetron-test-ca", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    certs = {"server": "/CN=kube-apiserver", "admin": "/O=system:masters/CN=kubetron-test-admin",
             "controller-manager": "/CN=system:kube-controller-manager", "scheduler": "/CN=system:kube-scheduler"}
    for name, subject in certs.items():
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", subject, cwd=d)
        ext = "server.ext" if name == "server" else "client.ext"
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", ext, cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


# -- a small API client --------------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, body: Any):
        self.status, self.body = status, body
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {message}")


class Api:
    """JSON over HTTPS to the API server (admin cert or a bearer token). One connection per call: the
    fixture's helpers run in threads."""

    def __init__(self, server: str, ca: Path, cert: tuple[Path, Path] | None = None, token: str | None = None):
        self.server, self.token = server, token
        self.ctx = ssl.create_default_context(cafile=str(ca))
        if cert:
            self.ctx.load_cert_chain(str(cert[0]), str(cert[1]))
        host, port = server.removeprefix("https://").split(":")
        self.host, self.port = host, int(port)

    def request(self, method: str, path: str, body: Any = None, query: Mapping[str, str] | None = None,
                content_type: str = "application/json", ok: tuple[int, ...] = ()) -> Any:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), content_type
        url = path + (f"?{urlencode(query)}" if query else "")
        conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=30)
        try:
            conn.request(method, url, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode("utf-8", "replace")
        if resp.status >= 300:
            if resp.status in ok:
                return None
            raise ApiError(resp.status, parsed)
        return parsed

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def create(self, path: str, body: Any, **kw: Any) -> Any:
        return self.request("POST", path, body, **kw)

    def patch(self, path: str, body: Any, **kw: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json", **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.request("DELETE", path, **kw)

    def apply_all(self, manifests: list[dict[str, Any]]) -> None:
        """Create each manifest (409: already there, fine). Knows the kinds the tests create."""
        for m in manifests:
            self.create(collection_path(m), m, ok=(409,))


_PLURALS = {"Namespace": "namespaces", "ServiceAccount": "serviceaccounts", "ClusterRole": "clusterroles",
            "ClusterRoleBinding": "clusterrolebindings", "Role": "roles", "RoleBinding": "rolebindings",
            "CustomResourceDefinition": "customresourcedefinitions", "Pod": "pods", "Secret": "secrets",
            "ConfigMap": "configmaps", "PersistentVolumeClaim": "persistentvolumeclaims", "Service": "services",
            "ResourceQuota": "resourcequotas",
            "PriorityClass": "priorityclasses", "TrainingJob": "trainingjobs", "Node": "nodes", "Lease": "leases",
            "KopfPeering": "kopfpeerings", "ClusterKopfPeering": "clusterkopfpeerings"}


def collection_path(m: Mapping[str, Any]) -> str:
    api_version, plural = m["apiVersion"], _PLURALS[m["kind"]]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = (m.get("metadata") or {}).get("namespace")
    return f"{base}/namespaces/{ns}/{plural}" if ns else f"{base}/{plural}"


# -- processes -----------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, even by SIGKILL (no orphaned servers)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_for(what: str, check: Any, timeout: float = 30.0, interval: float = 0.1, explain: Any = None) -> Any:
    """Poll `check()` until truthy; on timeout an AssertionError naming `what` (+ `explain()`)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            extra = f"\n{explain()}" if explain else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for: {what}{extra}")
        time.sleep(interval)


# -- the control plane ---------------------------------------------------------------------------------


class ControlPlane:
    def __init__(self, workdir: Path, binaries: dict[str, Path], flags: Mapping[str, list[str]] | None = None):
        self.dir, self.bin = workdir, binaries
        self.flags = dict(flags or {})  # component name -> extra command-line flags (bench/chaos.py's timings)
        self.port = 0  # the API server's, kept across restart_apiserver()
        self.pki = workdir / "pki"
        self.procs: dict[str, subprocess.Popen] = {}
        self.tokens: dict[str, tuple[str, list[str]]] = {}  # token -> (user, groups)
        self.sa_tokens: dict[tuple[str, str], str] = {}  # (namespace, name) -> token
        self.server = ""
        self.startup_seconds = 0.0
        self.audit_log = workdir / "audit.log"
        self.gates = GANG_GATES  # "" once a kube-apiserver without them refused to start

    # identities -----------------------------------------------------------------------------------

    def add_service_account_token(self, namespace: str, name: str) -> str:
        """A token (token-auth-file) that authenticates as the ServiceAccount `namespace/name`. Call
        before start()."""
        token = secrets.token_hex(16)
        self.sa_tokens[(namespace, name)] = token
        self.tokens[token] = (f"system:serviceaccount:{namespace}:{name}",
                              ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"])
        return token

    def kubeconfig_for(self, token: str, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.server,
                                                      "certificate-authority": str(self.pki / "ca.crt")}}],
            "users": [{"name": "test", "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        }))
        return path

    def _cert_kubeconfig(self, name: str) -> Path:
        path = self.dir / f"{name}.kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": self.server,
                                                   "certificate-authority": str(self.pki / "ca.crt")}}],
            "users": [{"name": "u", "user": {"client-certificate": str(self.pki / f"{name}.crt"),
                                             "client-key": str(self.pki / f"{name}.key")}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        }))
        return path

    @property
    def admin(self) -> Api:
        return Api(self.server, self.pki / "ca.crt", cert=(self.pki / "admin.crt", self.pki / "admin.key"))

    def api_for(self, token: str) -> Api:
        return Api(self.server, self.pki / "ca.crt", token=token)

    def audit(self, user: str) -> list[dict[str, Any]]:
        """Every request `user` (a ServiceAccount: system:serviceaccount:NS:NAME) made, as the API server
        recorded it (audit.k8s.io/v1 Events, the response stage)."""
        try:
            lines = self.audit_log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []
        events = []
        for line in lines:
            if f'"username":"{user}"' in line:
                with contextlib.suppress(ValueError):  # the line being written right now
                    events.append(json.loads(line))
        return [e for e in events if (e.get("user") or {}).get("username") == user]

    # lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        t0 = time.monotonic()
        make_pki(self.pki)
        self._start_etcd()
        self._start_apiserver()
        for name in ("kube-controller-manager", "kube-scheduler"):
            if name in self.bin:
                self._start_component(name)
        self.startup_seconds = time.monotonic() - t0

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            stop_process(proc)

    def _log(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode}:\n{tail(self._log(name))}")

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self.procs["etcd"] = _spawn([
            str(self.bin["etcd"]), "--data-dir", str(self.dir / "etcd"), "--name", "test",
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}", "--initial-cluster", f"test=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync",
        ], self._log("etcd"))

        def healthy() -> bool:
            self._check_alive("etcd")
            conn = http.client.HTTPConnection("127.0.0.1", client, timeout=2)
            try:
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
            except OSError:
                return False
            finally:
                conn.close()
        wait_for("etcd /health", healthy, READY_TIMEOUT, explain=lambda: tail(self._log("etcd")))

    def serves(self, api_version: str) -> bool:
        """Whether the API server serves `api_version` (group/version), e.g. GANG_API."""
        return self.admin.get(f"/apis/{api_version}", ok=(404,)) is not None

    def _gates(self, *with_gates: str) -> list[str]:
        """The feature-gate flags and `with_gates`, or none when the gates are off."""
        return [f"--feature-gates={self.gates}", *with_gates] if self.gates else []

    def _start_apiserver(self) -> None:
        try:
            self._start_apiserver_once()
        except RuntimeError:  # exited: a kube-apiserver older than the gates (< 1.36) names them unknown
            if not self.gates:
                raise
            self.gates = ""
            self._start_apiserver_once()

    def restart_apiserver(self, down: float = 0.0, tries: int = 5) -> None:
        """Stop the API server (SIGTERM, as a rolling upgrade does), keep it away `down` seconds, start it again
        on the same address with the same etcd: every client's kubeconfig still points at it. One that exits while
        starting (a post-start hook timed out on a loaded machine) is started again, as the kubelet restarts a
        static pod, up to `tries` times."""
        stop_process(self.procs["kube-apiserver"])
        time.sleep(down)
        for left in reversed(range(tries)):
            try:
                return self._start_apiserver_once()
            except RuntimeError:
                if not left:
                    raise

    def _start_apiserver_once(self) -> None:
        port = self.port = self.port or free_port()
        self.server = f"https://127.0.0.1:{port}"
        tokens = self.dir / "tokens.csv"
        tokens.write_text("".join(f'{t},{user},{user},"{",".join(groups)}"\n'
                                  for t, (user, groups) in self.tokens.items()))
        policy = self.dir / "audit-policy.json"
        policy.write_text(json.dumps(AUDIT_POLICY))
        p = self.pki
        self.procs["kube-apiserver"] = _spawn([
            str(self.bin["kube-apiserver"]), f"--etcd-servers={self.etcd_url}", "--bind-address=127.0.0.1",
            f"--secure-port={port}", f"--cert-dir={self.dir / 'certs'}",
            f"--tls-cert-file={p / 'server.crt'}", f"--tls-private-key-file={p / 'server.key'}",
            f"--client-ca-file={p / 'ca.crt'}", f"--token-auth-file={tokens}",
            f"--service-account-key-file={p / 'sa.pub'}", f"--service-account-signing-key-file={p / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc", "--service-cluster-ip-range=10.0.0.0/24",
            "--authorization-mode=RBAC", "--allow-privileged=true", "--event-ttl=1h",
            f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-mode=blocking",
            *self._gates(f"--runtime-config={GANG_API}=true"), *self.flags.get("kube-apiserver", ()),
        ], self._log("kube-apiserver"))
        admin = self.admin

        def ready() -> bool:
            self._check_alive("kube-apiserver")
            try:
                return admin.get("/readyz") is not None
            except (OSError, ApiError):
                return False
        wait_for("kube-apiserver /readyz", ready, READY_TIMEOUT, interval=0.2,
                 explain=lambda: tail(self._log("kube-apiserver")))

    def _start_component(self, name: str) -> None:
        short = name.removeprefix("kube-")
        argv = [str(self.bin[name]), f"--kubeconfig={self._cert_kubeconfig(short)}", "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}", "--leader-elect=false", *self._gates(), *self.flags.get(name, ())]
        if name == "kube-controller-manager":
            p = self.pki
            argv += [f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
                     f"--cluster-signing-cert-file={p / 'ca.crt'}", f"--cluster-signing-key-file={p / 'ca.key'}",
                     "--use-service-account-credentials=true", "--controllers=*",
                     f"--cert-dir={self.dir / 'kcm-certs'}"]
        else:
            argv += [f"--cert-dir={self.dir / 'scheduler-certs'}"]
        self.procs[name] = _spawn(argv, self._log(name))

    # helpers --------------------------------------------------------------------------------------

    def create_namespace(self, name: str) -> None:
        """A namespace with its `default` ServiceAccount (pods need it; made here rather than waiting
        for the controller manager's ServiceAccount controller)."""
        admin = self.admin
        admin.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
                     ok=(409,))
        admin.create(f"/api/v1/namespaces/{name}/serviceaccounts",
                     {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}, ok=(409,))

    def install_crd(self, path: Path) -> None:
        """Every CRD in the YAML file; waits until each is established and served."""
        import yaml

        for crd in yaml.safe_load_all(path.read_text()):
            if crd:
                self.install_crd_object(crd)

    def install_crd_object(self, crd: dict[str, Any]) -> None:
        """One CRD (a dict); waits until it is established and served."""
        admin = self.admin
        admin.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd, ok=(409,))

        def established() -> bool:
            got = admin.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}")
            return any(c["type"] == "Established" and c["status"] == "True"
                       for c in (got.get("status") or {}).get("conditions") or ())
        wait_for(f"CRD {crd['metadata']['name']} Established", established, 60)
        group, version = crd["spec"]["group"], crd["spec"]["versions"][0]["name"]
        wait_for(f"{group}/{version} discoverable", lambda: admin.get(f"/apis/{group}/{version}", ok=(404,)), 60)


@contextlib.contextmanager
def control_plane(workdir: Path, sa_tokens: tuple[tuple[str, str], ...] = ()) -> Iterator[ControlPlane]:
    """Start a control plane (raises NoBinaries when there are none). `sa_tokens`: (namespace, name) of
    ServiceAccounts to mint tokens for: `cp.sa_tokens[(ns, name)]`."""
    cp = ControlPlane(workdir, find_binaries())
    for sa in sa_tokens:
        cp.add_service_account_token(*sa)
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()


# -- the kubelet stand-in ------------------------------------------------------------------------------


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Kubelet:
    """Registers a Node (GPUs, Ready), renews its Lease so it stays healthy, and finishes deletions of
    pods bound to it (what a kubelet does once containers stopped). A background thread; stop() ends it."""

    def __init__(self, api: Api, name: str = "node-1", gpus: int = 8, cpu: str = "64", memory: str = "512Gi",
                 pods: int = 110, period: float = 0.5):
        self.api, self.name, self.period = api, name, period
        self.capacity = {"cpu": cpu, "memory": memory, "pods": str(pods), "nvidia.com/gpu": str(gpus)}
        self.finish_deletions = True
        self.heartbeat = threading.Event()  # cleared: the node is lost (no Lease renewals, no deletions finished)
        self.heartbeat.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kubelet-{name}", daemon=True)
        self._last_lease = 0.0

    def start(self) -> Kubelet:
        self.api.create("/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.name, "labels": {"kubernetes.io/hostname": self.name,
                                                       "kubernetes.io/os": "linux"}},
            "spec": {},
        }, ok=(409,))
        self._node_status()
        self.api.create("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": self.name, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": self.name, "leaseDurationSeconds": 40, "renewTime": micro_now()},
        }, ok=(409,))
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def lose(self) -> None:
        """The node is lost: its kubelet stops heartbeating (the node controller marks it NotReady, then its
        pods are evicted by their taint tolerations running out)."""
        self.heartbeat.clear()

    def come_back(self) -> None:
        """The node's kubelet is back: it reports the node Ready again and renews its Lease."""
        self._node_status()
        self._last_lease = 0.0
        self.heartbeat.set()

    def _still_ready(self) -> None:
        """As a kubelet's status sync does: report the node Ready again where the node controller marked it
        otherwise (after its Lease went unrenewed: an API server away for longer than the grace period)."""
        node = self.api.get(f"/api/v1/nodes/{self.name}")
        if [c["status"] for c in node["status"].get("conditions") or () if c["type"] == "Ready"] != ["True"]:
            self._node_status()

    def _node_status(self) -> None:
        now = now_iso()
        conditions = [{"type": t, "status": "False", "reason": f"Kubelet Has No {t}", "lastHeartbeatTime": now,
                       "lastTransitionTime": now} for t in ("MemoryPressure", "DiskPressure", "PIDPressure")]
        conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test kubelet",
                           "lastHeartbeatTime": now, "lastTransitionTime": now})
        self.api.patch(f"/api/v1/nodes/{self.name}/status", {"status": {
            "capacity": self.capacity, "allocatable": self.capacity, "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.name}],
            "nodeInfo": {"kubeletVersion": "v1.36.0", "architecture": "amd64", "operatingSystem": "linux"},
        }})

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            if not self.heartbeat.is_set():
                continue
            try:
                if time.monotonic() - self._last_lease > 5:
                    self.api.patch(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}",
                                   {"spec": {"renewTime": micro_now()}})
                    self._last_lease = time.monotonic()
                    self._still_ready()
                if self.finish_deletions:
                    self._finish_deletions()
            except (OSError, ApiError):
                continue  # the server is going away (end of session) or busy: try again next round

    def _finish_deletions(self) -> None:
        pods = self.api.get("/api/v1/pods", query={"fieldSelector": f"spec.nodeName={self.name}"})
        for pod in pods.get("items") or ():
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                self.api.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                 {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}, ok=(404, 409))


# -- pod status helpers (what a kubelet would report) ----------------------------------------------------


def pod_path(namespace: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "")


def set_pod_status(api: Api, namespace: str, name: str, status: dict[str, Any]) -> None:
    api.patch(pod_path(namespace, name) + "/status", {"status": status})


def set_running(api: Api, namespace: str, name: str, ip: str = "127.0.0.1", container: str = "trainer") -> None:
    now = now_iso()
    set_pod_status(api, namespace, name, {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "startTime": now,
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
        "containerStatuses": [{"name": container, "ready": True, "restartCount": 0, "image": "x", "imageID": "",
                               "started": True, "state": {"running": {"startedAt": now}}}]})


def set_exited(api: Api, namespace: str, name: str, code: int, message: Any = None, reason: str | None = None,
               container: str = "trainer", conditions: list[dict[str, Any]] | None = None,
               **extra: Any) -> None:
    """The container terminated with `code`; `message` (a dict is JSON-encoded) is its termination message."""
    now = now_iso()
    if isinstance(message, dict):
        message = json.dumps(message)
    terminated = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                  "startedAt": now, "finishedAt": now, "message": message or ""}
    status: dict[str, Any] = {
        "phase": "Succeeded" if code == 0 else "Failed",
        "containerStatuses": [{"name": container, "ready": False, "restartCount": 0, "image": "x", "imageID": "",
                               "state": {"terminated": terminated}}], **extra}
    if conditions:
        status["conditions"] = [{"lastTransitionTime": now, **c} for c in conditions]
    set_pod_status(api, namespace, name, status)
