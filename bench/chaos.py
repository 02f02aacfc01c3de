"""A chaos soak on the real control plane: one 2-pod TrainingJob of the tiny GPT, random faults at random moments,
and a certificate of what it survived.

    .venv/bin/python bench/chaos.py --faults 30 --seed 7                  # every kind the store allows
    .venv/bin/python bench/chaos.py --faults 10 --seed 1 --kinds rank-kill,pod-evict,operator-kill
    .venv/bin/python bench/chaos.py --faults 200 --seed 45 --log /work/chaos-200.log   # hours on a quiet machine
    .venv/bin/python bench/chaos.py --list                                 # the kinds and moments

The parts are the test suite's (tests/kube, tests/operator/local_pods.py): etcd, kube-apiserver,
kube-controller-manager and kube-scheduler; the real `kubetron operator` (kopf peering on, so a second replica can
stand by); POOL Nodes with room for one pod each, whose kubelet is played by a ProcessKubelet (each pod's exact
command run as local processes: launcher, torchrun, trainer; gloo on CPU; every process of a pod ended when the pod
ends, as a container runtime does); the job's store on the local S3 server behind a fault proxy (tests/faultproxy.py),
or with `--store pvc` a directory standing for the claim (a size-limited tmpfs where this process may mount one, so
the claim can fill up). The control plane's node timings are shortened (a lost node is NotReady after
NODE_GRACE seconds, its pods evicted TOLERATION seconds later), nothing else.

First the job runs once without faults (the reference: its per-iteration losses, cached by config and trainer code
in ~/.cache/kubetron/chaos/), then again while faults are injected, one at a time: each fault's moment drawn from
the seed, then its kind (among those that fit then, one used least so far); its earliest iteration is spread over the
run (the job reaches `train_iters` soon after the last). The soak watches the run by its trainers' own events
(kubetron.cli.events_tap, each pod's KUBETRON_EVENTS_FILE), never by a printed line. The moments: mid-step, mid-save
(a trainer has just scheduled an async save: its SaveScheduled), mid-restart (0-3 s after the fault before, while
the job recovers), mid-rendezvous (the trainers of a recovering gang are starting), and during the operator's own
start (right after it was killed and started again).
The API server's restarts and the store's outages run beside the soak, which goes on injecting what does not need
them. A fault that ends an attempt (pod evicted, deleted, node lost, rank SIGTERMed, agent killed, claim full)
never hits an attempt another such fault ended, so what the job's status must count is known: each Kind's `counts`.

At the end the soak checks, and the certificate says, that the job Succeeded; that every loss any attempt logged
(TensorBoard, all event files) equals the reference's bit for bit, for every iteration; that once the job is done
no process of any of its pods runs, and once it is deleted no pod, PodGroup or Service of it is left; that its
Events stay below a flood; that `status.restarts` equals what the injected faults add up to, by kind (a fault the
next one overlapped, before the job recovered, may count 0: its evidence can end with the attempt); that goodput's
buckets sum to its total. Per kind: faults, recoveries, median and worst seconds from the injection to the next
completed iteration (the trainers' StepDone events: the status is throttled), iterations lost (the last iteration
logged before the fault minus the one the next completed iteration continued from).

Learned from running it (issue 45): the stand-in kubelet must end every process of a pod when the pod ends, or a
rank orphaned by its agent's death keeps the pod's ports; after an API server restart the etcd 3.4 of
../shared/k8s may answer 504 "Too large resource version" to a list or watch from the API server's cache until an
event of that kind arrives (clients re-list; the soak's own clients retry); a 2-node cluster runs out of nodes once
the job avoids both (status.avoidNodes), so the pool has more.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from kubetron.contract.resource import LABEL_JOB  # noqa: E402

from tests.faultproxy import FaultProxy  # noqa: E402
from tests.kube import cluster  # noqa: E402
from tests.kube.cluster import ApiError, Kubelet  # noqa: E402
from tests.kube.fixtures import Operator, start_env  # noqa: E402
from tests.operator.jobs import PVC_JOB, S3_JOB, job_body  # noqa: E402
from tests.operator.local_pods import Container, ProcessKubelet, pod_processes, pvc, tiny_config  # noqa: E402
from tests.s3server import S3Server, start_s3_server  # noqa: E402

# -- the cluster's timings and the job --------------------------------------------------------------------------

NODE_GRACE = 50  # seconds without a Lease renewal before the node controller marks a Node NotReady (kube's default)
# Not shorter: an API server away longer than this (apiserver-down's API_DOWN plus its restart, 10-20 s on a loaded
# machine) leaves every Node's Lease unrenewed as the node controller sees it, every Node goes NotReady at once, and
# with TOLERATION every pod is evicted: the soak's timings, not a cluster's (found with a grace of 16 s).
API_DOWN = (10.0, 30.0)  # seconds apiserver-down keeps the API server away
TOLERATION = 2  # seconds a pod tolerates a NotReady/unreachable Node before it is evicted (default 300)
FLAGS = {
    "kube-apiserver": [f"--default-not-ready-toleration-seconds={TOLERATION}",
                       f"--default-unreachable-toleration-seconds={TOLERATION}"],
    "kube-controller-manager": [f"--node-monitor-grace-period={NODE_GRACE}s", "--node-monitor-period=1s"],
}
POOL = 10  # Nodes for a 2-pod job: status.avoidNodes keeps the newest 8 (policy/nodes.py), so two stay free
POOL_LABEL = "kubetron.dev/chaos-pool"
NAME = "gpt"
SAVE_INTERVAL = 5  # iterations between checkpoints
GAP = 15  # iterations of progress between two faults' earliest moments (--gap); train_iters = GAP * (faults + 2)
HANG_TIMEOUT = 20  # spec.hangTimeoutSeconds: a loaded 2-core machine has slow steps; short enough to soak
GRACE = 30  # spec.terminationGracePeriodSeconds
WAIT = 420.0  # seconds any one wait of the soak may take before it fails, saying what it waited for
EVENTS_PER_FAULT = 12  # Events about the job and its pods per fault (+ EVENTS_BASE) before it counts as a flood
EVENTS_BASE = 40


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    what: str
    counts: tuple[tuple[str, int], ...] = ()  # what status.restarts gains (inPlace and hangs too)
    ends_attempt: bool = False  # ends the attempt it hits: never two in one attempt
    needs: str = ""  # "trainer": a trainer process of the newest attempt; "training": and it trains; "pod": a pod
    store: str = ""  # only with this store


KINDS = {k.name: k for k in (
    Kind("rank-kill", "a rank's trainer SIGKILLed: the gang restarts in its pods", (("inPlace", 1),),
         needs="trainer"),
    Kind("rank-stop", "a rank's trainer SIGSTOPped and left stopped: a hang, found by the pods' watchdogs",
         (("inPlace", 1), ("hangs", 1)), needs="training"),
    Kind("rank-term", "a rank's trainer SIGTERMed: every rank saves, exits 75", (("preemptions", 1),),
         ends_attempt=True, needs="training"),
    Kind("agent-kill", "a pod's torchrun agent SIGKILLed: the pod fails (137)", (("failures", 1),),
         ends_attempt=True, needs="trainer"),
    Kind("agent-stop", "a pod's torchrun agent (its ranks' helper: rendezvous host, watchdog) SIGSTOPped for "
         "3-20 s, then continued", needs="trainer"),
    Kind("pod-evict", "a pod evicted (the Eviction API)", (("preemptions", 1),), ends_attempt=True, needs="pod"),
    Kind("pod-delete", "a pod deleted", (("preemptions", 1),), ends_attempt=True, needs="pod"),
    Kind("node-lost", "a pod's Node powered off: its processes die, its kubelet stops heartbeating (NotReady, then "
         "the taint-based eviction); it comes back 5-30 s after its pod was evicted", (("preemptions", 1),),
         ends_attempt=True, needs="pod"),
    Kind("operator-kill", "the operator SIGKILLed and started again (its container restarted)"),
    Kind("operator-failover", "two operator replicas (kopf peering): the leader SIGKILLed, the other takes over, "
         "a new standby starts"),
    Kind("apiserver-restart", "the API server restarted"),
    Kind("apiserver-down", f"the API server away for {API_DOWN[0]:.0f}-{API_DOWN[1]:.0f} s"),
    Kind("store-down", "the store unreachable for 10-40 s (every request reset or answered 503)", store="s3"),
    Kind("store-slow", "the store slow for 10-40 s (every answer held 1-4 s)", store="s3"),
    Kind("pvc-full", "the claim full until the attempt ends (a ballast file fills its filesystem)",
         (("failures", 1),), ends_attempt=True, needs="training", store="pvc"),
)}
NEEDS_API = {"pod-evict", "pod-delete", "operator-failover", "apiserver-restart", "apiserver-down"}
"""Kinds injected through the API server (or restarting it): not while it restarts."""
MOMENTS = {
    "step": "mid-step: a random moment while the gang trains",
    "save": "mid-save: a trainer has just scheduled an async checkpoint save",
    "restart": "mid-restart: 0-3 s after the fault before, while the job recovers",
    "rendezvous": "mid-rendezvous: the trainers of the recovering gang are starting",
    "operator-start": "during the operator's start: right after the operator was killed and started again",
}
LATE = "late"  # no moment: the job is too near its end


@dataclasses.dataclass
class Fault:
    index: int
    kind: str
    moment: str
    at: float  # time.time() of the injection
    attempt: int  # the newest attempt then
    target: str  # the pod, node or process hit
    before: int  # the last iteration logged before it (0: none)
    recovered: float | None = None  # seconds to the next completed iteration
    overlapped: bool = False  # the next fault came first (this one's recovery time holds that one's too)
    lost: int | None = None  # iterations lost


# -- the soak's cluster --------------------------------------------------------------------------------------


class Soak:
    """The control plane, the store (and its proxy), the pool of Nodes, the operator replicas, the ProcessKubelet."""

    def __init__(self, workdir: Path, rng: random.Random, store: str, s3: S3Server | None, log: Callable[[str], None]):
        self.dir, self.rng, self.store, self.s3, self.log = workdir, rng, store, s3, log
        self.cp, self.env, self.kubelet = start_env(workdir / "kube", FLAGS)
        self.kubelet.finish_deletions = False  # every pod runs on the pool, whose ProcessKubelet finishes them
        self.proxy = FaultProxy(s3.endpoint, seed=rng.randrange(2**31)).start() if s3 else None
        self.nodes: dict[str, Kubelet] = {}
        self.operators: dict[str, Operator] = {}  # POD_ID -> replica
        self.lock = threading.RLock()  # held to change `operators` (the faults and the keeper thread do)
        self.crashes: list[str] = []  # replicas that ended by themselves, each started again (`keep_operators`)
        self._closing = threading.Event()
        self._keeper = threading.Thread(target=self.keep_operators, name="operator-keeper", daemon=True)
        self._keeper.start()
        self.ns = ""
        self.pods: ProcessKubelet | None = None
        self.claim: Path | None = None  # the pvc store's mount (a tmpfs where one can be mounted)
        self._ids = 0

    def close(self) -> None:
        self._closing.set()
        self._keeper.join(timeout=30)
        if self.pods is not None:
            self.pods.__exit__(None, None, None)
        with self.lock:
            for op in self.operators.values():
                op.stop()
        for node in self.nodes.values():
            node.stop()
        if self.proxy is not None:
            self.proxy.stop()
        self.kubelet.stop()
        self.cp.stop()
        if self.claim is not None:
            subprocess.run(["umount", "-l", str(self.claim)], capture_output=True)

    # the pool -------------------------------------------------------------------------------------------------

    def start_pool(self, size: int) -> None:
        """`size` Nodes with room for one pod (1 CPU) each, labelled and tainted for the soak's pods alone."""
        for i in range(size):
            name = f"chaos-{i:02d}"
            node = self.nodes[name] = Kubelet(self.env.admin, name=name, cpu="1", gpus=0)
            node.finish_deletions = False
            node.start()
            self.env.admin.patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {POOL_LABEL: "soak"}}, "spec": {
                "taints": [{"key": POOL_LABEL, "value": "soak", "effect": "NoSchedule"}]}})
        cluster.wait_for("the pool's Nodes schedulable", lambda: all(
            [t["key"] for t in self.env.admin.get(f"/api/v1/nodes/{n}")["spec"].get("taints") or []] == [POOL_LABEL]
            for n in self.nodes), WAIT)

    # the operator replicas ------------------------------------------------------------------------------------

    def start_operator(self, pod_id: str | None = None) -> str:
        """A replica (kopf peering `kubetron`, POD_ID its identity there, as the chart sets it); its POD_ID."""
        with self.lock:
            if pod_id is None:
                self._ids += 1
                pod_id = f"operator-{self._ids}"
            self.operators[pod_id] = self.env.start_operator(self.ns, "--peering=kubetron", env={"POD_ID": pod_id})
        return pod_id

    def kill_operator(self, pod_id: str) -> None:
        with self.lock:
            op = self.operators.pop(pod_id)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(op.proc.pid, signal.SIGKILL)
        op.proc.wait()

    def keep_operators(self) -> None:
        """As the kubelet restarts a Deployment's container that exited: a replica that ended by itself (no fault
        of the soak killed it) is started again with its POD_ID, and its end noted in `crashes` (its exit and the
        last line of its log). (A thread that lives as long as the soak: a replica it starts gets SIGTERM when the
        thread that started it ends, PR_SET_PDEATHSIG.)"""
        while not self._closing.wait(0.5):
            with self.lock:
                ended = [(pod_id, op) for pod_id, op in self.operators.items() if op.proc.poll() is not None]
                for pod_id, op in ended:
                    last = (op.tail(1).strip().splitlines() or [""])[-1][-200:]
                    self.crashes.append(f"{pod_id} exited {op.proc.returncode}: {last}")
                    self.log(f"  (operator {pod_id} ended by itself, exit {op.proc.returncode}: {last}; started "
                             "again)")
                    self.start_operator(pod_id)

    def peers(self) -> dict[str, Any]:
        """The KopfPeering's record of the replicas: POD_ID -> {priority, lastseen, lifetime}."""
        path = f"/apis/kopf.dev/v1/namespaces/{self.ns}/kopfpeerings/kubetron"
        return (retry(lambda: self.env.admin.get(path, ok=(404,))) or {}).get("status") or {}

    def leader(self) -> str | None:
        """The active replica: the highest priority among the live ones in the peering (None: none there yet)."""
        peers = self.peers()
        live = [pod_id for pod_id in self.operators if pod_id in peers]
        return max(live, key=lambda pod_id: peers[pod_id].get("priority") or 0, default=None)

    # the job ----------------------------------------------------------------------------------------------------

    def namespace(self, prefix: str) -> str:
        ns = self.ns = self.env.namespace(prefix)
        return ns

    def job(self, train_iters: int, tensorboard: Path, proxied: bool) -> dict[str, Any]:
        """The job's body in the current namespace: its store (S3 through the proxy when `proxied`, else the
        server itself; or the claim), pinned to the pool, restarts never exhausted."""
        config = tiny_config(train_iters=train_iters, save_interval=SAVE_INTERVAL, tensorboard_dir=str(tensorboard))
        spec = dict(nodes=2, config=config, statusPort=cluster.free_port(), masterPort=cluster.free_port(),
                    maxInPlaceRestarts=100_000, backoffLimit=100_000, maxNoProgressAttempts=100_000,
                    hangTimeoutSeconds=HANG_TIMEOUT, terminationGracePeriodSeconds=GRACE,
                    resources={"requests": {"cpu": "1"}},
                    scheduling={"nodeSelector": {POOL_LABEL: "soak"},
                                "tolerations": [{"key": POOL_LABEL, "operator": "Exists"}]})
        if self.store == "s3":
            assert self.s3 is not None and self.proxy is not None
            self.env.admin.create(f"/api/v1/namespaces/{self.ns}/secrets", {
                "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
                "data": {"AWS_ACCESS_KEY_ID": base64.b64encode(self.s3.access_key.encode()).decode(),
                         "AWS_SECRET_ACCESS_KEY": base64.b64encode(self.s3.secret_key.encode()).decode()}})
            body = job_body(S3_JOB, **spec)
            body["spec"]["storage"]["s3"].update(bucket=self.s3.new_bucket("chaos"), prefix="runs",
                                                 endpoint=self.proxy.endpoint if proxied else self.s3.endpoint)
        else:
            mount = self.dir / f"claim-{self.ns}"
            mount.mkdir()
            if proxied:
                self.claim = mount if mount_tmpfs(mount) else None
            pvc(self.env, self.ns, mount)
            body = job_body(PVC_JOB, storage={"pvc": {"claimName": "ckpt", "mountPath": str(mount)}}, **spec)
        body["metadata"] = {"name": NAME, "namespace": self.ns}
        return body

    def run_pods(self) -> ProcessKubelet:
        self.pods = ProcessKubelet(self.env.admin, self.ns, self.dir / self.ns, nodes=tuple(self.nodes),
                                   period=0.1, events=True).__enter__()
        return self.pods

    def stop_pods(self) -> None:
        if self.pods is not None:
            self.pods.__exit__(None, None, None)
            self.pods = None

    def status(self) -> dict[str, Any]:
        return (retry(lambda: self.env.job(self.ns, NAME)) or {}).get("status") or {}

    def wait_status(self, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float = WAIT) -> dict[str, Any]:
        return wait(what, lambda: (st := self.status()) and pred(st) and st, self, timeout)

    def explain(self) -> str:
        try:
            st = self.status()
            keep = ("phase", "reason", "message", "attempt", "iteration", "restarts", "lastCheckpoint", "avoidNodes",
                    "nextAttemptTime")
            lines = [f"job status: {json.dumps({k: st.get(k) for k in keep})}"]
            for name, pod in self.env.pods(self.ns).items():
                lines.append(f"pod {name}: {pod['spec'].get('nodeName')} {(pod.get('status') or {}).get('phase')} "
                             f"deleting={pod['metadata'].get('deletionTimestamp')}")
            for name in self.nodes:
                node = self.env.admin.get(f"/api/v1/nodes/{name}")
                ready = [c["status"] for c in node["status"].get("conditions") or () if c["type"] == "Ready"]
                taints = [t["key"] for t in node["spec"].get("taints") or ()]
                lines.append(f"node {name}: Ready={ready} taints={taints}")
        except (OSError, ApiError) as exc:
            lines = [f"(the API server: {exc})"]
        for pod_id, op in self.operators.items():
            lines.append(f"--- operator {pod_id}:\n{op.tail(40)}")
        for name, c in sorted((self.pods.containers if self.pods else {}).items())[-4:]:
            lines.append(f"--- pod {name}:\n" + "".join(c.lines[-12:]))
        return "\n".join(lines)


def retry(call: Callable[[], Any], timeout: float = WAIT) -> Any:
    """`call()` until the API server answers: it may be restarting (refused), or answer 5xx (the etcd 3.4 cache's
    504 "Too large resource version" after a restart) or 429 for a while."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except (OSError, ApiError) as exc:
            if isinstance(exc, ApiError) and exc.status < 500 and exc.status != 429:
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def wait(what: str, check: Callable[[], Any], soak: Soak, timeout: float = WAIT) -> Any:
    def safe() -> Any:
        try:
            return check()
        except (OSError, ApiError):
            return None
    return cluster.wait_for(what, safe, timeout, interval=0.05, explain=soak.explain)


def mount_tmpfs(path: Path, size: str = "64m") -> bool:
    """A size-limited filesystem at `path` (needs the right to mount; False where there is none)."""
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


# -- what the pods say ---------------------------------------------------------------------------------------------


def attempt_of(name: str) -> tuple[int, int] | None:
    """(attempt, rank) of a worker pod `gpt-<attempt>-<rank>`."""
    parts = name.rsplit("-", 2)
    return (int(parts[1]), int(parts[2])) if len(parts) == 3 and parts[0] == NAME and parts[1].isdigit() else None


class Pods:
    """The job's pods as the ProcessKubelet runs them: their trainers' events (kubetron.cli.events_tap: the soak
    watches the run by its own events, never by its printed lines), trainers and agents."""

    def __init__(self, kubelet: ProcessKubelet):
        self.kubelet = kubelet
        self._read: dict[str, int] = {}  # pod UID -> events indexed
        self._iterations: list[tuple[float, int]] = []
        self._startups: list[tuple[float, int]] = []
        self._saves: list[float] = []
        self._trainers: set[tuple[str, int]] = set()  # (pod UID, pid) of every trainer process seen stepping

    def containers(self, attempt: int | None = None) -> list[Container]:
        found = [(attempt_of(n), c) for n, c in list(self.kubelet.containers.items())]
        return [c for a, c in found if a and (attempt is None or a[0] == attempt)]

    def newest_attempt(self) -> int:
        return max((a[0] for n in list(self.kubelet.containers) if (a := attempt_of(n))), default=0)

    def iterations(self) -> list[tuple[float, int]]:
        """(time, iteration) of every iteration any trainer completed (its StepDone), by time."""
        self._index()
        return self._iterations

    def startups(self) -> list[tuple[float, int]]:
        """(time, iteration) of every trainer process's first completed iteration."""
        self._index()
        return self._startups

    def saves_after(self, t: float) -> list[float]:
        """When a trainer's async save left its loop (SaveScheduled) after `t`: a save in flight."""
        self._index()
        return [s for s in self._saves if s > t]

    def stepped_since(self, attempt: int, t: float) -> bool:
        """A trainer of `attempt` completed an iteration after `t`."""
        return any(e["event"] == "StepDone" and e["time"] > t for c in self.containers(attempt)
                   for e in c.events()[-8:])

    def _index(self) -> None:
        """Read the events written since the last call (a long soak's trainers write hundreds of thousands)."""
        fresh = False
        for c in self.containers():
            events = c.events()
            for e in events[self._read.get(c.uid, 0):]:
                if e["event"] == "StepDone":
                    self._iterations.append((e["time"], e["iteration"]))
                    if (c.uid, e["pid"]) not in self._trainers:
                        self._trainers.add((c.uid, e["pid"]))
                        self._startups.append((e["time"], e["iteration"]))
                    fresh = True
                elif e["event"] == "SaveScheduled":
                    self._saves.append(e["time"])
            self._read[c.uid] = len(events)
        if fresh:
            self._iterations.sort()
            self._startups.sort()

    def live(self, attempt: int) -> list[Container]:
        return [c for c in self.containers(attempt) if c.exit_code() is None]

    def process(self, c: Container, module: str) -> psutil.Process | None:
        """The container's `python -m <module>` process (the trainer: `kubetron`; the agent:
        `kubetron.supervisor.torchrun`)."""
        for p in pod_processes(c.uid):
            with contextlib.suppress(psutil.Error):
                if p.cmdline()[1:3] == ["-m", module] and p.status() != psutil.STATUS_ZOMBIE:
                    if module != "kubetron" or p.cmdline()[3:4] == ["train"]:
                        return p
        return None


# -- the faults ------------------------------------------------------------------------------------------------


class Injector:
    """Injects faults of each kind into the running soak; restores what a timed fault took (in threads)."""

    def __init__(self, soak: Soak, pods: Pods):
        self.soak, self.pods, self.rng = soak, pods, soak.rng
        self.timers: list[threading.Thread] = []
        self.store_busy_until = 0.0
        self.ballast: Path | None = None
        self.lost_nodes: set[str] = set()
        self.stopped_ranks: list[psutil.Process] = []
        self.api_back = threading.Event()  # cleared while the API server restarts
        self.api_back.set()
        # The API server is restarted by a thread that lives as long as the soak: a process started with
        # PR_SET_PDEATHSIG (cluster._spawn) gets SIGTERM when the *thread* that started it ends.
        self.hand: queue.Queue[Callable[[], None]] = queue.Queue()
        threading.Thread(target=lambda: [job() for job in iter(self.hand.get, None)], daemon=True).start()

    def later(self, fn: Callable[[], None]) -> None:
        thread = threading.Thread(target=fn, daemon=True)
        thread.start()
        self.timers.append(thread)

    def settle(self) -> None:
        for thread in self.timers:
            thread.join(timeout=WAIT)
        self.api_back.wait(timeout=WAIT)

    def feasible(self, kind: Kind, attempt: int, ended: set[int]) -> bool:
        """Whether `kind` can hit now: an attempt that no other fault ended, with what it needs."""
        if kind.store and kind.store != self.soak.store or (kind.name == "pvc-full" and self.soak.claim is None):
            return False
        if kind.name.startswith("store-") and time.time() < self.store_busy_until:
            return False
        if kind.name in NEEDS_API and not self.api_back.is_set():
            return False
        if not kind.needs:
            return True
        if attempt in ended or attempt == 0:
            return False
        live = self.pods.live(attempt)
        if kind.needs == "pod":
            return len(live) == 2 and not self.lost_nodes
        if len(live) < 2 or not all(self.pods.process(c, "kubetron") for c in live):
            return False
        return kind.needs == "trainer" or self.training(attempt)

    def training(self, attempt: int) -> bool:
        """The gang of `attempt` completed an iteration in the last few seconds, and none of its ranks is stopped."""
        return self.pods.stepped_since(attempt, time.time() - 3.0) and not self.stopped()

    def stopped(self) -> bool:
        """A rank this soak stopped is still there, stopped (the watchdogs have not ended it yet)."""
        def held(p: psutil.Process) -> bool:
            try:
                return p.status() == psutil.STATUS_STOPPED
            except psutil.Error:
                return False
        self.stopped_ranks = [p for p in self.stopped_ranks if held(p)]
        return bool(self.stopped_ranks)

    def inject(self, kind: Kind, attempt: int) -> str:
        """Inject now; returns what it hit."""
        return getattr(self, kind.name.replace("-", "_"))(attempt)

    def _container(self, attempt: int) -> Container:
        return self.rng.choice(sorted(self.pods.live(attempt), key=lambda c: c.name))

    def _signal(self, attempt: int, module: str, sig: int) -> tuple[Container, psutil.Process]:
        c = self._container(attempt)
        p = self.pods.process(c, module)
        if p is None:
            raise LookupError(f"no {module} process in {c.name}")
        p.send_signal(sig)
        return c, p

    def rank_kill(self, attempt: int) -> str:
        return self._signal(attempt, "kubetron", signal.SIGKILL)[0].name

    def rank_stop(self, attempt: int) -> str:
        c, p = self._signal(attempt, "kubetron", signal.SIGSTOP)
        self.stopped_ranks.append(p)
        return c.name

    def rank_term(self, attempt: int) -> str:
        return self._signal(attempt, "kubetron", signal.SIGTERM)[0].name

    def agent_kill(self, attempt: int) -> str:
        return self._signal(attempt, "kubetron.supervisor.torchrun", signal.SIGKILL)[0].name

    def agent_stop(self, attempt: int) -> str:
        c, p = self._signal(attempt, "kubetron.supervisor.torchrun", signal.SIGSTOP)
        seconds = self.rng.uniform(3, 20)

        def go_on() -> None:
            time.sleep(seconds)
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)
        self.later(go_on)
        return f"{c.name} ({seconds:.0f} s)"

    def pod_evict(self, attempt: int) -> str:
        name, ns = self._container(attempt).name, self.soak.ns
        retry(lambda: self.soak.env.admin.create(f"/api/v1/namespaces/{ns}/pods/{name}/eviction", {
            "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}}))
        return name

    def pod_delete(self, attempt: int) -> str:
        name = self._container(attempt).name
        retry(lambda: self.soak.env.admin.delete(f"/api/v1/namespaces/{self.soak.ns}/pods/{name}"))
        return name

    def node_lost(self, attempt: int) -> str:
        c = self._container(attempt)
        node = c.node
        assert node is not None and self.soak.pods is not None
        self.lost_nodes.add(node)
        self.soak.nodes[node].lose()
        self.soak.pods.lose(node)
        pods_api = self.soak.env.admin

        def come_back() -> None:
            def evicted() -> bool:
                pod = pods_api.get(f"/api/v1/namespaces/{self.soak.ns}/pods/{c.name}", ok=(404,))
                return pod is None or bool(pod["metadata"].get("deletionTimestamp"))
            with contextlib.suppress(AssertionError):
                wait(f"pod {c.name} evicted from the lost node {node}", evicted, self.soak)
            time.sleep(self.rng.uniform(5, 30))
            self.soak.nodes[node].come_back()
            assert self.soak.pods is not None
            self.soak.pods.come_back(node)
            self.lost_nodes.discard(node)
        self.later(come_back)
        return f"{node} ({c.name})"

    def operator_kill(self, attempt: int) -> str:
        """Every replica SIGKILLed; one started again with the identity of the first (a container restart)."""
        replicas = list(self.soak.operators)
        for pod_id in replicas:
            self.soak.kill_operator(pod_id)
        self.soak.start_operator(replicas[0])
        return ", ".join(replicas)

    def operator_failover(self, attempt: int) -> str:
        """Two replicas (a standby started if need be); the leader SIGKILLed; a new standby started."""
        soak = self.soak
        if len(soak.operators) < 2:
            soak.start_operator()
            wait("two operator replicas in the peering", lambda: set(soak.operators) <= set(soak.peers()), soak)
        leader = wait("the operators' leader", soak.leader, soak)
        soak.kill_operator(leader)
        soak.start_operator()
        return leader

    def apiserver_restart(self, attempt: int) -> str:
        self._apiserver(0.0)
        return "kube-apiserver"

    def apiserver_down(self, attempt: int) -> str:
        seconds = self.rng.uniform(*API_DOWN)
        self._apiserver(seconds)
        return f"kube-apiserver ({seconds:.0f} s)"

    def _apiserver(self, down: float) -> None:
        """The API server stopped, and started again after `down` seconds, while the soak goes on (faults that
        need the API wait for it: `feasible`)."""
        self.api_back.clear()

        def restart() -> None:
            t0 = time.monotonic()
            try:
                self.soak.cp.restart_apiserver(down)
            finally:
                self.api_back.set()
                self.soak.log(f"  (the API server was away {time.monotonic() - t0:.0f} s)")
        self.hand.put(restart)

    def _store(self, seconds: float, **faults: float) -> None:
        proxy = self.soak.proxy
        assert proxy is not None
        self.store_busy_until = time.time() + seconds
        proxy.set(**faults)

        def heal() -> None:
            time.sleep(seconds)
            proxy.set(**{k: 0.0 for k in faults})
        self.later(heal)

    def store_down(self, attempt: int) -> str:
        seconds = self.rng.uniform(10, 40)
        how = self.rng.choice(["p_reset", "p_503"])
        self._store(seconds, **{how: 1.0})
        return f"store ({seconds:.0f} s, {'reset' if how == 'p_reset' else '503'})"

    def store_slow(self, attempt: int) -> str:
        seconds = self.rng.uniform(10, 40)
        assert self.soak.proxy is not None
        self.soak.proxy.delay_s = self.rng.uniform(1, 4)
        self._store(seconds, p_delay=1.0)
        return f"store ({seconds:.0f} s, {self.soak.proxy.delay_s:.1f} s per answer)"

    def pvc_full(self, attempt: int) -> str:
        """A ballast file fills the claim's filesystem; removed once a pod of the attempt ended."""
        assert self.soak.claim is not None
        ballast = self.soak.claim / "ballast"
        with open(ballast, "wb") as out, contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * (1 << 20))
        free = os.statvfs(self.soak.claim)

        def empty() -> None:
            with contextlib.suppress(AssertionError):
                wait(f"attempt {attempt} ended on the full claim",
                     lambda: any(c.exit_code() is not None for c in self.pods.containers(attempt)), self.soak)
            ballast.unlink(missing_ok=True)
        self.later(empty)
        return f"claim ({free.f_bavail * free.f_frsize} bytes left)"


# -- the soak -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    faults: list[Fault]
    status: dict[str, Any]
    checks: dict[str, tuple[bool, str]]  # name -> (held, what was seen)
    seconds: float
    train_iters: int
    seed: int
    store: str

    @property
    def ok(self) -> bool:
        return all(held for held, _ in self.checks.values())


def plan(rng: random.Random, faults: int) -> Iterator[tuple[int, str]]:
    """(index, moment) of each fault, told the kind of the one before; the kind is drawn when the fault is due
    (what is feasible depends on then)."""
    previous: Kind | None = None
    for i in range(faults):
        moments = ["step", "step", "save"]
        if previous is not None:
            moments.append("restart")  # another fault while the job recovers (or while a timed fault lasts)
            if previous.counts:
                moments.append("rendezvous")
            if previous.name == "operator-kill":
                moments = ["operator-start", "step"]
        name = yield i, rng.choice(moments)
        previous = KINDS[name]


def soak(workdir: Path, faults: int, seed: int, kinds: list[str] | None = None, store: str = "s3",
         s3: S3Server | None = None, log: Callable[[str], None] = print, gap: int = GAP) -> Result:
    """Run the soak in `workdir` (its own control plane; the store on `s3` or one started here), a fault due every
    `gap` iterations (more than SAVE_INTERVAL: a new checkpoint between two)."""
    if gap <= SAVE_INTERVAL:
        raise ValueError(f"--gap {gap}: must be more than the {SAVE_INTERVAL} iterations between checkpoints")
    kinds = kinds or [k.name for k in KINDS.values() if not k.store or k.store == store]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kind(s) {unknown}: --list shows them")
    rng = random.Random(seed)
    train_iters = gap * (faults + 2)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        if store == "s3" and s3 is None:
            s3 = stack.enter_context(start_s3_server(workdir / "s3"))
        cluster_ = Soak(workdir, rng, store, s3 if store == "s3" else None, log)
        stack.callback(cluster_.close)
        cluster_.start_pool(POOL)
        reference = reference_losses(cluster_, train_iters)
        log(f"reference: {len(reference)} iterations")
        return run(cluster_, faults, kinds, train_iters, reference, seed, t0, gap)


def reference_losses(soak: Soak, train_iters: int) -> dict[int, float]:
    """The job's per-iteration losses without faults: from the cache, else from a run of the same spec."""
    config = tiny_config(train_iters=train_iters, save_interval=SAVE_INTERVAL)
    digest = hashlib.sha256(config.encode())
    for path in sorted((ROOT / "trainer" / "kubetron").rglob("*.py")):
        digest.update(path.read_bytes())
    cache = cluster.CACHE / "chaos" / f"reference-{soak.store}-{digest.hexdigest()[:20]}.json"
    if cache.exists():
        return {int(k): v for k, v in json.loads(cache.read_text()).items()}
    soak.namespace("chaos-ref")
    tb = soak.dir / "reference-tb"
    body = soak.job(train_iters, tb, proxied=False)
    soak.start_operator()
    soak.run_pods()
    retry(lambda: soak.env.admin.create(soak.env.jobs(soak.ns), body))
    soak.log(f"reference: the job without faults, {train_iters} iterations (cached afterwards in {cache})")
    st = soak.wait_status("the reference run Succeeded", lambda s: s.get("phase") in ("Succeeded", "Failed"),
                          timeout=WAIT + 2 * train_iters)
    assert st["phase"] == "Succeeded", soak.explain()
    soak.stop_pods()
    for pod_id in list(soak.operators):
        soak.kill_operator(pod_id)
    losses = {step: values[-1] for step, values in losses_by_step(tb).items()}
    assert sorted(losses) == list(range(1, train_iters + 1)), f"reference steps: {sorted(losses)[:5]}..."
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(losses))
    return losses


def losses_by_step(logdir: Path, tag: str = "lm loss") -> dict[int, list[float]]:
    """Every value of `tag` any event file under `logdir` holds, by step (all attempts' writes, not only the newest)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, list[float]] = {}
    for f in sorted(Path(logdir).rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                values.setdefault(ev.step, []).append(ev.value)
    return values


def run(soak: Soak, faults: int, kinds: list[str], train_iters: int, reference: dict[int, float], seed: int,
        t0: float, gap: int = GAP) -> Result:
    soak.namespace("chaos")
    tb = soak.dir / "soak-tb"
    body = soak.job(train_iters, tb, proxied=True)
    soak.start_operator()
    pods = Pods(soak.run_pods())
    injector = Injector(soak, pods)
    retry(lambda: soak.env.admin.create(soak.env.jobs(soak.ns), body))
    try:
        done = inject_all(soak, pods, injector, faults, kinds, train_iters, gap)
        st = soak.wait_status("the job Succeeded", lambda s: s.get("phase") in ("Succeeded", "Failed"),
                              timeout=WAIT + 2 * train_iters)
        injector.settle()
        recoveries(done, pods)
        checks = {"faults injected": (len(done) == faults, f"{len(done)} of {faults}")}
        checks.update(check(soak, pods, st, done, reference, tb, train_iters))
        return Result(done, st, checks, time.monotonic() - t0, train_iters, seed, soak.store)
    finally:
        keep_logs(soak, pods)


def inject_all(soak: Soak, pods: Pods, injector: Injector, faults: int, kinds: list[str],
               train_iters: int, gap: int = GAP) -> list[Fault]:
    """The faults, one at a time (`plan` draws each moment, then the kind among those that fit); returns them."""
    rng, log = soak.rng, soak.log
    done: list[Fault] = []
    ended: set[int] = set()
    moments = plan(rng, faults)
    i, moment = next(moments)
    while True:
        target = (i + 1) * gap
        attempt, moment = reach(soak, pods, injector, moment, target, train_iters - gap, done)
        if moment == LATE:
            log(f"the job is past iteration {train_iters - gap}: no room for faults {i + 1}-{faults}")
            return done
        choices = [k for k in kinds if injector.feasible(KINDS[k], attempt, ended)]
        if not choices:  # e.g. mid-rendezvous, where only the control plane's faults fit: those, or a later moment
            moment = "step"
            continue
        used = Counter(f.kind for f in done)
        kind = KINDS[rng.choice([k for k in choices if used[k] == min(used[c] for c in choices)])]
        iterations = pods.iterations()
        before = iterations[-1][1] if iterations else 0
        at = time.time()
        try:
            what = injector.inject(kind, attempt)
        except (LookupError, psutil.Error) as exc:  # the process ended between the check and the signal
            log(f"  (fault {i + 1}: {kind.name} missed: {exc}; drawing again)")
            continue
        if kind.ends_attempt:
            ended.add(attempt)
        fault = Fault(i + 1, kind.name, moment, at, attempt, what, before)
        done.append(fault)
        log(f"fault {fault.index:3d}/{faults}: {kind.name:<18} {moment:<15} attempt {attempt:<3} iteration "
            f"{before:<5} {what}")
        try:
            i, moment = moments.send(kind.name)
        except StopIteration:
            return done


def keep_logs(soak: Soak, pods: Pods) -> None:
    """Every pod's output (stamped) and the namespace's Events into the work directory (the operators' logs are in
    kube/ already), for the post-mortem of a failed check."""
    folder = soak.dir / "logs"
    folder.mkdir(exist_ok=True)
    def clock(t: float) -> str:
        return time.strftime("%H:%M:%S", time.localtime(t)) + f"{t % 1:.2f}"[1:]
    for c in pods.containers():
        (folder / f"{c.name}.log").write_text("".join(f"{clock(t)} {line}" for t, line in list(c.stamped)))
    with contextlib.suppress(OSError, ApiError):
        events = soak.env.admin.get(f"/api/v1/namespaces/{soak.ns}/events")["items"]
        (folder / "events.json").write_text(json.dumps(events, indent=1))


def reach(soak: Soak, pods: Pods, injector: Injector, moment: str, target: int, end: int,
          done: list[Fault]) -> tuple[int, str]:
    """Wait for `moment` (progress at `target` first, for the moments that wait for it); returns (the newest
    attempt, the moment reached: a follow-up moment that passed unseen becomes mid-step; LATE: the job is past
    `end`, too near its end for more faults)."""
    last = done[-1].at if done else 0.0
    if moment in ("restart", "operator-start"):
        if moment == "restart":
            time.sleep(soak.rng.uniform(0, 3))
        return pods.newest_attempt(), moment
    if moment == "rendezvous":
        def starting() -> str | None:
            if iterated(pods, last):
                return "missed"  # it trains again already
            trainers = [pods.process(c, "kubetron") for c in pods.live(pods.newest_attempt())]
            return "now" if any(p is not None and p.create_time() > last for p in trainers) else None
        try:
            now = wait("the recovering gang's trainers starting", starting, soak, 120) == "now"
        except AssertionError:
            now = False
        if now:
            time.sleep(soak.rng.uniform(0, 2))
            return pods.newest_attempt(), moment
        moment = "step"
    def reached() -> int:
        return max([i for _, i in pods.iterations()[-50:]] or [0])
    wait(f"the job past iteration {target}", lambda: reached() >= end or reached() >= target
         and injector.training(pods.newest_attempt()), soak, WAIT)
    if reached() >= end:
        return pods.newest_attempt(), LATE
    if moment == "save":
        since = time.time()
        try:
            wait("a trainer scheduling a save", lambda: pods.saves_after(since), soak, 60)
            return pods.newest_attempt(), moment
        except AssertionError:
            moment = "step"
    time.sleep(soak.rng.uniform(0, 0.5))
    return pods.newest_attempt(), moment


def iterated(pods: Pods, since: float) -> bool:
    return any(t > since for t, _ in pods.iterations()[-50:])


def recoveries(faults: list[Fault], pods: Pods) -> None:
    """Each fault's seconds to the next completed iteration, and the iterations it cost. After a fault that
    restarts the gang (in place or as a new attempt) that is the first step of a trainer started after it (rank 0's
    start-up line, logged at its end: an iteration the old gang finished on its way out does not count); after any
    other, the next iteration logged."""
    iterations = pods.iterations()
    startups = pods.startups()
    for f, following in zip(faults, faults[1:] + [None], strict=True):
        after = [(t, it) for t, it in (startups if KINDS[f.kind].counts else iterations) if t > f.at]
        if after:
            f.recovered = after[0][0] - f.at
            f.lost = max(0, f.before - after[0][1] + 1)
            f.overlapped = following is not None and following.at < after[0][0]


def check(soak: Soak, pods: Pods, st: dict[str, Any], faults: list[Fault], reference: dict[int, float], tb: Path,
          train_iters: int) -> dict[str, tuple[bool, str]]:
    checks: dict[str, tuple[bool, str]] = {}
    checks["Succeeded"] = (st.get("phase") == "Succeeded", f"{st.get('phase')}: {st.get('reason')} {st.get('message')}")
    # -- every loss logged, by every attempt, the reference's -----------------------------------------------------
    logged = losses_by_step(tb)
    wrong = sorted(s for s, values in logged.items() if any(v != reference.get(s) for v in values))
    missing = sorted(set(range(1, train_iters + 1)) - set(logged))
    writes = sum(len(v) for v in logged.values())
    checks["losses bit-identical"] = (
        not wrong and not missing,
        f"{writes} values of {len(logged)} iterations" + (f"; differ at {wrong[:10]}" if wrong else "")
        + (f"; missing {missing[:10]}" if missing else ""))
    # -- restarts by kind --------------------------------------------------------------------------------------------
    # Exact for a fault the job recovered from before the next came; one the next overlapped may be cut short
    # before its restart is seen (a kill ending the attempt before rank 0 reported an in-place restart; two
    # ends of one attempt are one restart): it counts 0 to its kind's count.
    expected: Counter[str] = Counter()
    at_least: Counter[str] = Counter()
    for f in faults:
        expected.update(dict(KINDS[f.kind].counts))
        if not f.overlapped:
            at_least.update(dict(KINDS[f.kind].counts))
    for c in (expected, at_least):
        c["total"] = c["preemptions"] + c["failures"] + c["neverStarted"]
    got = st.get("restarts") or {}
    keys = ("preemptions", "failures", "neverStarted", "total", "inPlace", "hangs")
    faults_said = {k: expected[k] if at_least[k] == expected[k] else f"{at_least[k]}-{expected[k]}" for k in keys}
    checks["status.restarts by kind"] = (
        all(at_least[k] <= (got.get(k) or 0) <= expected[k] for k in keys),
        f"status {json.dumps({k: got.get(k) or 0 for k in keys})}, faults {json.dumps(faults_said)}"
        + (" (a range: overlapped faults)" if at_least != expected else ""))
    # -- goodput ---------------------------------------------------------------------------------------------------
    g = st.get("goodput") or {}
    total, parts = g.get("totalSeconds") or 0, sum((g.get("seconds") or {}).values())
    checks["goodput buckets sum to total"] = (total > 0 and abs(parts - total) <= 0.01 * total,
                                              f"buckets {parts:.1f} s, total {total:.1f} s")
    # -- the operator ran until a fault killed it -------------------------------------------------------------
    clashes = [c for c in soak.crashes if PORT_CLASH in c]  # the stand-ins' shared host network, not the operator
    crashes = [c for c in soak.crashes if PORT_CLASH not in c]
    seen = "; ".join(crashes) or "none"
    if clashes:
        seen += f" ({len(clashes)} replicas could not bind their liveness port on the shared host network: restarted)"
    checks["no operator crash"] = (not crashes, seen)
    # -- nothing left --------------------------------------------------------------------------------------------
    injector_free(soak)

    def left() -> list[str]:
        return [c.name for c in pods.containers() if pod_processes(c.uid)]
    with contextlib.suppress(AssertionError):  # the last pods may still be stopping (their grace period)
        wait("no process of the job's pods left", lambda: not left(), soak, 2 * GRACE)
    checks["no process left"] = (not left(), f"processes of {left()}" if left() else
                                 f"every process of {len(pods.containers())} pods ended")
    events = event_count(soak)
    bound = EVENTS_BASE + EVENTS_PER_FAULT * len(faults)
    checks["no Event flood"] = (events <= bound, f"{events} Events (bound {bound})")
    checks["nothing left after delete"] = deleted_clean(soak)
    return checks


def injector_free(soak: Soak) -> None:
    """Lost nodes back, so their pods' deletions can finish (a timed fault of the end may still hold one)."""
    for name, node in soak.nodes.items():
        if not node.heartbeat.is_set():
            node.come_back()
            if soak.pods is not None:
                soak.pods.come_back(name)


PORT_CLASH = "address already in use"
"""A replica that could not bind its liveness port: every process of the soak shares one host network, where a port
picked free may be taken (a rank's gloo connection, say) before the operator binds it; a pod has a network of its
own. Not the operator's fault: it is restarted, as the kubelet restarts it after a failed liveness probe."""

STAND_IN_EVENTS = {"FailedToUpdateEndpoint", "FailedToUpdateEndpointSlices"}
"""The controller manager's words for the stand-in kubelet's pod IP (127.0.0.1, where the pods really are: the
operator reads rank 0's status endpoint there), which a Service's endpoints may not hold: not the job's doing."""


def event_count(soak: Soak) -> int:
    """Events about the job and its pods (an aggregated Event counts as its `count`), the stand-ins' aside."""
    items = retry(lambda: soak.env.admin.get(f"/api/v1/namespaces/{soak.ns}/events"))["items"]
    ours = [e for e in items if (e.get("involvedObject") or {}).get("name", "").startswith(NAME)
            and e.get("reason") not in STAND_IN_EVENTS]
    return sum(max(1, e.get("count") or ((e.get("series") or {}).get("count")) or 1) for e in ours)


def deleted_clean(soak: Soak) -> tuple[bool, str]:
    """Delete the job; its pods, PodGroups and Services must all go (owner references, the garbage collector)."""
    admin, ns = soak.env.admin, soak.ns
    retry(lambda: admin.delete(f"{soak.env.jobs(ns)}/{NAME}", ok=(404,)))
    selector = {"labelSelector": f"{LABEL_JOB}={NAME}"}

    def left() -> list[str]:
        found = []
        for path in (f"/api/v1/namespaces/{ns}/pods", f"/api/v1/namespaces/{ns}/services",
                     f"/apis/scheduling.k8s.io/v1alpha2/namespaces/{ns}/podgroups"):
            items = (admin.get(path, query=selector, ok=(404,)) or {}).get("items") or []
            found += [f"{path.rsplit('/', 1)[1]}/{i['metadata']['name']}" for i in items]
        return found
    try:
        wait("the job's pods, PodGroups and Services gone", lambda: not left(), soak, 120)
        return True, "pods, PodGroups, Services: none"
    except AssertionError:
        return False, f"left: {left()}"


# -- the certificate ------------------------------------------------------------------------------------------


def certificate(result: Result) -> str:
    by_kind: dict[str, list[Fault]] = {}
    for f in result.faults:
        by_kind.setdefault(f.kind, []).append(f)
    moments = Counter(f.moment for f in result.faults)
    head = (f"chaos certificate: {len(result.faults)} faults of {len(by_kind)} kinds, seed {result.seed}, store "
            f"{result.store}, a 2-pod job of the tiny GPT, {result.train_iters} iterations, "
            f"{result.seconds / 60:.1f} min; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    rows = [head, f"moments: {', '.join(f'{m} {n}' for m, n in moments.most_common())}", "",
            "recovered: the job completed an iteration after it (a new trainer's first, after a fault that restarts "
            "the gang); overlapped: the next fault came before that",
            f"{'kind':<20}{'faults':>7}{'recovered':>10}{'overlapped':>11}{'median s':>10}{'worst s':>9}{'lost it':>9}"
            f"{'worst lost':>11}"]
    for kind, fs in sorted(by_kind.items()):
        times = [f.recovered for f in fs if f.recovered is not None]
        lost = [f.lost for f in fs if f.lost is not None]
        median = statistics.median(times) if times else float("nan")
        rows.append(f"{kind:<20}{len(fs):>7}{len(times):>10}{sum(f.overlapped for f in fs):>11}{median:>10.1f}"
                    f"{max(times, default=float('nan')):>9.1f}{sum(lost):>9}{max(lost, default=0):>11}")
    g = result.status.get("goodput") or {}
    seconds = g.get("seconds") or {}
    rows += ["", f"goodput {g.get('ratio')}: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
             + f" (total {g.get('totalSeconds', 0):.0f} rank-seconds)", ""]
    rows += [f"{'PASS' if held else 'FAIL'}  {name}: {seen}" for name, (held, seen) in result.checks.items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=30, help="faults to inject (default: %(default)s)")
    p.add_argument("--seed", type=int, default=45, help="the seed of every draw (default: %(default)s)")
    p.add_argument("--gap", type=int, default=GAP, help="iterations between two faults' earliest moments "
                   "(default: %(default)s)")
    p.add_argument("--kinds", default="", help="comma-separated kinds (default: all the store allows; --list)")
    p.add_argument("--store", choices=("s3", "pvc"), default="s3", help="the job's store (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=None, help="keep the logs here (default: a temporary directory)")
    p.add_argument("--log", type=Path, default=None, help="also append every line to this file")
    p.add_argument("--json", type=Path, default=None, help="write the faults and checks here")
    p.add_argument("--list", action="store_true", help="print the fault kinds and moments, and exit")
    args = p.parse_args(argv)
    if args.list:
        for kind in KINDS.values():
            print(f"{kind.name:<20}{kind.what}" + (f" ({kind.store} store)" if kind.store else ""))
        for name, what in MOMENTS.items():
            print(f"{'moment ' + name:<20}{what}")
        return 0
    kinds = [k for k in args.kinds.split(",") if k] or None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop every pod's processes on the way out
    logfile = open(args.log, "a") if args.log else None  # noqa: SIM115 - open for the whole run

    def log(line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"{stamp} {line}", flush=True)
        if logfile:
            logfile.write(f"{stamp} {line}\n")
            logfile.flush()
    with contextlib.ExitStack() as stack:
        if args.workdir:
            args.workdir.mkdir(parents=True, exist_ok=True)
            workdir = args.workdir
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kubetron-chaos-",
                                                                           ignore_cleanup_errors=True)))
        try:
            result = soak(workdir, args.faults, args.seed, kinds, args.store, log=log, gap=args.gap)
        except ValueError as exc:
            print(f"chaos: {exc}", file=sys.stderr)
            return 2
    text = certificate(result)
    log("\n" + text)
    if args.json:
        args.json.write_text(json.dumps({"faults": [dataclasses.asdict(f) for f in result.faults],
                                         "checks": result.checks, "status": result.status}, indent=1))
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
