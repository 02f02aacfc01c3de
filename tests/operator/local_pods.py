"""Pods as local processes, for on-kube tests that play the kubelet (test_in_place_on_kube.py,
test_elastic_on_kube.py, bench/recovery.py): a pod's exact command and env from the API server, with only
the laptop differences rewritten (the interpreter, the mounted config, the termination log,
MASTER_ADDR), and `$(VAR)` in the command and args expanded from the container's env as the kubelet does
(`expand`). A PVC's mountPath is a local directory already (`pvc` makes its hostPath the mountPath). A memory
volume for the snapshots (docs/recovery.md) is the container's `memory` directory: it outlives the pod's
processes (their restarts in place) and goes with the pod.

`ProcessKubelet` does for every pod of a namespace bound to its Nodes what a kubelet does: a bound pod's
container is started and the pod reported Running; a container that ends is reported with its exit code
and termination message; a pod being deleted has its container SIGTERMed (SIGKILL after the pod's grace
period), its end reported, and its deletion finished. It records when it saw each.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import yaml
from kubetron.cli import EVENTS_FILE_ENV
from kubetron.contract import recovery
from kubetron_operator.build import CONFIG_PATH, PYTHON, TERMINATION_LOG
from kubetron_operator.model import RESERVED_ENV

from tests.kube.cluster import Api, ApiError, Kubelet, pod_path, set_exited, set_running, wait_for
from tests.trainer_utils import ITER_RE, TINY, LineReader, trainer_of

POOL = "kubetron.dev/test-pool"  # the label of the Nodes a job's pods are pinned to (one pod each)


@contextlib.contextmanager
def pool(api: Api, ns: str, size: int, timeout: float = 300.0) -> Iterator[tuple[str, ...]]:
    """`size` Nodes with room for one pod (1 CPU) each, labelled and tainted for `ns`'s pods alone (`pinned`);
    yields their names once they are schedulable."""
    names = tuple(f"{ns}-{chr(ord('a') + i)}" for i in range(size))
    nodes = [Kubelet(api, name=name, cpu="1", gpus=0) for name in names]
    try:
        for node in nodes:
            node.finish_deletions = False  # the ProcessKubelet's, once the containers stopped
            node.start()
            api.patch(f"/api/v1/nodes/{node.name}", {"metadata": {"labels": {POOL: ns}}, "spec": {
                "taints": [{"key": POOL, "value": ns, "effect": "NoSchedule"}]}})  # no other job's pods
        # A new Node may carry the node controller's not-ready taint for a few seconds (longer on a loaded
        # machine): a pod the scheduler finds no room for in that time would shrink an elastic job at its start.
        wait_for("the Nodes schedulable", lambda: all(only_pool_taint(api, name) for name in names), timeout)
        yield names
    finally:
        for node in nodes:
            node.stop()
            api.delete(f"/api/v1/nodes/{node.name}", ok=(404,))


def pinned(ns: str) -> dict[str, Any]:
    """The spec that puts a job's pods on the Nodes of `pool(api, ns, ...)`, one pod per Node."""
    return {"resources": {"requests": {"cpu": "1"}},
            "scheduling": {"nodeSelector": {POOL: ns}, "tolerations": [{"key": POOL, "operator": "Exists"}]}}


def only_pool_taint(api: Api, node: str) -> bool:
    spec = api.get(f"/api/v1/nodes/{node}").get("spec", {})
    return not spec.get("unschedulable") and [t["key"] for t in spec.get("taints") or []] == [POOL]


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of a container's command and args (k8s.io/kubernetes third_party/forked/golang/
    expansion, Expand with MappingFuncFor): `$(VAR)` becomes VAR's value when the container defines it and
    stays as written otherwise, `$$` becomes `$`, an unterminated `$(` and any other `$x` stay as they are."""
    out, checkpoint, cursor = [], 0, 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            rest = text[cursor + 1:]
            close = rest.find(")") if rest[0] == "(" else -1
            if rest[0] == "$":
                out.append("$")
            elif close > 0:
                name = rest[1:close]
                out.append(env.get(name, f"$({name})"))
                cursor += close
            else:
                out.append("$" + rest[0])
            cursor += 1
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + text[checkpoint:]


def tiny_config(train_iters: int = 100, save_interval: int = 10, **logger: Any) -> str:
    """A one-layer tiny GPT, a checkpoint every `save_interval` iterations, a log line every iteration."""
    config = yaml.safe_load(Path(TINY).read_text())
    config["train"]["train_iters"] = train_iters
    config["model"].update(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=32)
    config["scheduler"]["lr_warmup_iters"] = 1
    config["validation"]["eval_interval"] = None
    config["checkpoint"] = {"save_interval": save_interval, "most_recent_k": 2}  # save/load: the operator's
    config["logger"] = {"log_interval": 1, **logger}
    return yaml.safe_dump(config)


def pvc(kube, ns: str, path: Path) -> None:
    """PersistentVolume + bound claim `ckpt` on a host path (the pods' store, mounted at the same path)."""
    kube.admin.create("/api/v1/persistentvolumes", {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"pv-{ns}"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "hostPath": {"path": str(path)}, "claimRef": {"namespace": ns, "name": "ckpt"}}})
    kube.admin.create(f"/api/v1/namespaces/{ns}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "ckpt"},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"pv-{ns}",
                 "resources": {"requests": {"storage": "1Gi"}}}})


class Container:
    """A pod's main container as a local process: the pod's command and env from the API server (and a test's
    `faults`: KUBETRON_CHAOS_* variables). Its output is collected line by line with the time each line arrived
    (`stamped`); with `events`, its trainers' events too (kubetron.cli.events_tap: `events()`)."""

    def __init__(self, pod: dict[str, Any], config_yaml: str | None, workdir: Path,
                 secrets: dict[str, str] | None = None, faults: dict[str, str] | None = None, events: bool = False):
        workdir.mkdir(parents=True)
        self.name, self.uid = pod["metadata"]["name"], pod["metadata"]["uid"]  # the pod's
        self.node = pod["spec"].get("nodeName")
        container = pod["spec"]["containers"][0]
        self.container = container["name"]
        config = workdir / "config.yaml"  # the config volume
        if config_yaml is not None:
            config.write_text(config_yaml)
        self.termination_log = workdir / "termination-log"
        env = {e["name"]: e["value"] for e in container.get("env") or () if "value" in e}
        env.update(secrets or {})  # the values of its secretKeyRef variables (`secret_env`)
        assert env.get("KUBETRON_TERMINATION_LOG", TERMINATION_LOG) == container["terminationMessagePath"]
        if "KUBETRON_TERMINATION_LOG" in env:  # a trainer pod
            env.update(KUBETRON_CONFIG=str(config), KUBETRON_TERMINATION_LOG=str(self.termination_log),
                       MASTER_ADDR="127.0.0.1")
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TMPDIR=str(workdir), **{POD_MARK: self.uid})
        env.update(faults or {})  # a test's fault at a step (tests.multirank.runner.fault_at)
        self.events_file = workdir / "events.jsonl" if events else None
        self._events: list[dict[str, Any]] = []
        self._events_read = 0  # bytes of events_file parsed
        if self.events_file is not None:
            env[EVENTS_FILE_ENV] = str(self.events_file)
        # The memory volume (docs/recovery.md): a directory of the pod's, kept across its processes' restarts,
        # removed with the pod (ProcessKubelet); the downward API's pod IP (the job's token: `secret_env`).
        self.memory = workdir / "memory" if recovery.SNAPSHOT_DIR_ENV in env else None
        if self.memory is not None:
            env[recovery.SNAPSHOT_DIR_ENV] = str(self.memory)
            env[recovery.POD_IP_ENV] = "127.0.0.1"
        local = {PYTHON: sys.executable, CONFIG_PATH: str(config), TERMINATION_LOG: str(self.termination_log)}
        argv = [local.get(a, a) for a in (expand(a, env) for a in container["command"] + container.get("args", []))]
        base = {k: v for k, v in os.environ.items() if k not in RESERVED_ENV}
        self.started = time.time()
        self.proc = subprocess.Popen(argv, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.stamped: list[tuple[float, str]] = []  # (time.time() it arrived, line)
        self.reaped = False  # every process of it ended once PID 1 did (ProcessKubelet._reap)
        self.reader = LineReader(self.proc, lambda line: self.stamped.append((time.time(), line)))

    @property
    def lines(self) -> list[str]:
        return [line for _, line in list(self.stamped)]

    def events(self) -> list[dict[str, Any]]:
        """Every event its trainers wrote so far (`{"event", "iteration", "phase", "time", "pid"}`, in order; the
        complete lines only; empty without `events`). Not thread-safe: one reader."""
        if self.events_file is None:
            return self._events
        try:
            with open(self.events_file, "rb") as f:
                f.seek(self._events_read)
                complete, _, _ = f.read().rpartition(b"\n")
        except FileNotFoundError:
            return self._events
        if complete:
            self._events_read += len(complete) + 1
            self._events.extend(json.loads(line) for line in complete.split(b"\n"))
        return self._events

    def trainer_pid(self) -> int:
        """The trainer process (`python -m kubetron train ...` under torchrun), not the pod's PID 1."""
        return trainer_of(self.proc.pid, f"pod {self.name}").pid

    def last_iteration(self) -> int:
        return max([int(m.group(1)) for m in map(ITER_RE.search, self.lines) if m] or [0])

    def exit_code(self) -> int | None:
        """As the container runtime reports it: a death by signal N is 128 + N; None while it runs."""
        rc = self.proc.poll()
        return None if rc is None else (rc if rc >= 0 else 128 - rc)

    def termination_message(self) -> str:
        """terminationMessagePolicy FallbackToLogsOnError: the file, else the log's tail on an error."""
        text = self.termination_log.read_text() if self.termination_log.exists() else ""
        return text if text.strip() or self.exit_code() == 0 else "".join(self.lines)[-2048:]

    def kill(self) -> None:
        """SIGKILL every process of the container, as a container runtime ends its cgroup: its process group,
        all descendants (torchrun starts each rank in a session of its own) and whatever of it outlived its
        parent (a rank whose torchrun agent died is re-parented, and keeps the pod's ports): every process
        that carries the pod's POD_MARK. Also after PID 1 ended by itself."""
        processes = []
        if self.proc.poll() is None:  # not reaped yet: its PID (and group) cannot be another's
            with contextlib.suppress(psutil.Error):
                processes = psutil.Process(self.proc.pid).children(recursive=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for p in processes + pod_processes(self.uid):
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.proc.wait()


POD_MARK = "KUBETRON_LOCAL_POD_UID"  # in the environment of every process of a pod run here (its cgroup, in effect)


def pod_processes(uid: str) -> list[psutil.Process]:
    """The live processes of the pod `uid` (those whose environment carries its POD_MARK)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(POD_MARK) == uid:
                found.append(p)
    return found


def secret_env(api: Api, pod: dict[str, Any]) -> dict[str, str]:
    """The pod's main container's variables from Secrets (`valueFrom.secretKeyRef`), as a kubelet reads them."""
    out = {}
    for e in pod["spec"]["containers"][0].get("env") or ():
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            secret = api.get(f"/api/v1/namespaces/{pod['metadata']['namespace']}/secrets/{ref['name']}")
            out[e["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return out


def config_yaml(pod: dict[str, Any]) -> str | None:
    """The config.yaml a kubelet writes into the pod's `config` volume (None: it has none): a downward
    API volume whose file is one of the pod's annotations (the only kind of item this kubelet knows)."""
    for volume in pod["spec"].get("volumes") or ():
        if volume["name"] == "config":
            (item,) = volume["downwardAPI"]["items"]
            key = re.fullmatch(r"metadata\.annotations\['(.+)'\]", item["fieldRef"]["fieldPath"])
            assert item["path"] == "config.yaml" and key, item
            return pod["metadata"]["annotations"][key.group(1)]
    return None


class ProcessKubelet:
    """Runs the pods of `namespace` bound to `nodes` as local processes (a background thread polling the
    API every `period` seconds). `seen[(pod name, what)]`: when it saw or did `what` ("bound",
    "started", "exited", "deleting", "gone"); `containers[pod name]`: the newest container of that name.
    `env`: more environment for every container (bench/padded_trainer.py's), under a pod's `faults`."""

    def __init__(self, api: Api, namespace: str, workdir: Path, nodes: tuple[str, ...] = ("node-1",),
                 period: float = 0.05, faults: dict[str, dict[str, str]] | None = None, events: bool = False,
                 env: dict[str, str] | None = None):
        self.api, self.ns, self.dir, self.nodes, self.period = api, namespace, workdir, nodes, period
        self.faults = faults or {}  # pod name -> a test's KUBETRON_CHAOS_* variables for that pod's container
        self.env = env or {}
        self.events = events  # every container's trainers write their events (Container.events())
        self.containers: dict[str, Container] = {}
        self.seen: dict[tuple[str, str], float] = {}
        self._by_uid: dict[str, Container] = {}
        self._stopping: dict[str, float] = {}  # pod UID -> when its container got SIGTERM
        self.lost: set[str] = set()  # nodes powered off (`lose`): their pods are neither run nor reported
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"process-kubelet-{namespace}", daemon=True)

    def __enter__(self) -> ProcessKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for c in self._by_uid.values():
            c.kill()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self._reap()
            with contextlib.suppress(OSError, ApiError):  # the server is busy (or away): next round
                self._round()

    def _reap(self) -> None:
        """A container whose PID 1 ended has every process ended at once, as a runtime ends its cgroup, with or
        without the API server (its end is reported to it when it answers)."""
        for c in list(self._by_uid.values()):
            if c.exit_code() is not None:
                self._end(c)

    @staticmethod
    def _end(c: Container) -> None:
        """Every process of `c` ended, once (its PID 1 has)."""
        if not c.reaped:
            c.kill()
            c.reaped = True

    def _round(self) -> None:
        pods = {p["metadata"]["uid"]: p for p in self.api.get(pod_path(self.ns))["items"]}
        now = time.time()
        for uid in [u for u in self._by_uid if u not in pods]:
            c = self._by_uid.pop(uid)
            self.seen.setdefault((c.name, "gone"), now)
            c.kill()
            if c.memory is not None:  # an emptyDir goes with its pod
                shutil.rmtree(c.memory, ignore_errors=True)
        for uid, pod in pods.items():
            name = pod["metadata"]["name"]
            if pod["spec"].get("nodeName") not in self.nodes or pod["spec"]["nodeName"] in self.lost:
                continue
            self.seen.setdefault((name, "bound"), now)
            c = self._by_uid.get(uid)
            if pod["metadata"].get("deletionTimestamp"):
                self.seen.setdefault((name, "deleting"), now)
                self._delete(pod, c)
            elif c is None and (pod.get("status") or {}).get("phase") in (None, "Pending"):
                self._start(pod)
            elif c is not None and c.exit_code() is not None and (name, "exited") not in self.seen:
                self._report_exit(pod, c)

    def _start(self, pod: dict[str, Any]) -> None:
        name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        c = Container(pod, config_yaml(pod), self.dir / f"{name}-{uid[:8]}", secrets=secret_env(self.api, pod),
                      faults={**self.env, **self.faults.get(name, {})}, events=self.events)
        self.containers[name] = self._by_uid[uid] = c
        for key in ("exited", "exit noticed", "deleting", "gone"):
            self.seen.pop((name, key), None)
        self.seen[(name, "started")] = c.started
        set_running(self.api, self.ns, name, container=c.container)

    def lose(self, node: str) -> None:
        """`node` powered off: every process of its pods killed; nothing of them reported until `come_back`
        (then their containers' ends are, as a rebooted node's kubelet reports them)."""
        self.lost.add(node)
        for c in list(self._by_uid.values()):
            if c.node == node:
                c.kill()

    def come_back(self, node: str) -> None:
        self.lost.discard(node)

    def _report_exit(self, pod: dict[str, Any], c: Container) -> None:
        self._end(c)  # the pod's end is every process's (a rank orphaned by its agent's death, say)
        noticed = self.seen.setdefault((c.name, "exit noticed"), time.time())
        set_exited(self.api, self.ns, c.name, c.exit_code(), c.termination_message(), container=c.container)
        self.seen[(c.name, "exited")] = noticed  # reported: a report the API server refused is tried again

    def _delete(self, pod: dict[str, Any], c: Container | None) -> None:
        """A pod being deleted: SIGTERM to its container's PID 1, SIGKILL to all of it after the grace
        period; its end reported, then its deletion finished."""
        meta = pod["metadata"]
        if c is not None and c.exit_code() is None:
            if meta["uid"] not in self._stopping:
                self._stopping[meta["uid"]] = time.monotonic()
                c.proc.send_signal(signal.SIGTERM)
            elif time.monotonic() - self._stopping[meta["uid"]] > float(
                    pod["spec"].get("terminationGracePeriodSeconds") or 30):
                c.kill()
            return
        if c is not None and (c.name, "exited") not in self.seen:
            self._report_exit(pod, c)
        self.api.request("DELETE", pod_path(self.ns, meta["name"]),
                         {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}, ok=(404, 409))


def last_checkpoint(store: Path) -> int:
    """The newest durable checkpoint's iteration by the trainer's progress log in the store (0: none yet)."""
    from kubetron.supervisor.progress_io import summarize

    try:
        return (summarize(str(store)).get("lastCheckpoint") or {}).get("iteration") or 0
    except OSError:
        return 0
