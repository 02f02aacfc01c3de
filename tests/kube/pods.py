"""Pods as local processes: the kubelet's container part, which `cluster.Kubelet` leaves out.

`Container` runs one pod's container command (from the API server) on this machine. What differs from
a pod, and only that: `python3` is this interpreter, the ConfigMap mounted at /etc/kubetron is a file in
a work directory, the termination log (/dev/termination-log) too, and MASTER_ADDR (rank 0's DNS name)
is 127.0.0.1. A PVC's mountPath is a local directory already (tests make its hostPath the mountPath).

`ProcessKubelet` does for every pod of a namespace what a kubelet does: a pod bound to the node
(by the scheduler) gets its container started and is reported Running; a container that ends is
reported with its exit code and termination message; a pod being deleted has its container SIGTERMed
(the pod's grace period, then SIGKILL) and its deletion finished. It records when it saw each.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from kubetron_operator.build import CONFIG_PATH, PYTHON, TERMINATION_LOG
from kubetron_operator.model import RESERVED_ENV

from tests.kube.cluster import Api, ApiError, now_iso, pod_path, set_exited, set_pod_status


class Container:
    """A pod's (first) container as a local process, its output collected line by line with the time
    each line arrived (`stamped`)."""

    def __init__(self, pod: dict[str, Any], config_yaml: str | None, workdir: Path):
        workdir.mkdir(parents=True)
        container = pod["spec"]["containers"][0]
        self.name, self.pod = container["name"], pod["metadata"]["name"]
        self.termination_log = workdir / "termination-log"
        config = workdir / "config.yaml"  # the ConfigMap volume
        if config_yaml is not None:
            config.write_text(config_yaml)
        env = {e["name"]: e["value"] for e in container.get("env") or () if "value" in e}
        if "KUBETRON_TERMINATION_LOG" in env:
            assert env["KUBETRON_TERMINATION_LOG"] == TERMINATION_LOG
            env.update(KUBETRON_CONFIG=str(config), KUBETRON_TERMINATION_LOG=str(self.termination_log),
                       MASTER_ADDR="127.0.0.1")
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TMPDIR=str(workdir))
        rewrite = {PYTHON: sys.executable, CONFIG_PATH: str(config), TERMINATION_LOG: str(self.termination_log)}
        argv = [rewrite.get(a, a) for a in container["command"] + container.get("args", [])]
        base = {k: v for k, v in os.environ.items() if k not in RESERVED_ENV}
        self.started = time.time()
        self.proc = subprocess.Popen(argv, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.stamped: list[tuple[float, str]] = []  # (time.time() it arrived, line)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.stamped.append((time.time(), line))

    @property
    def lines(self) -> list[str]:
        return [line for _, line in list(self.stamped)]

    def trainer_pid(self) -> int:
        """The trainer process (`python -m kubetron train ...` under torchrun), not the pod's PID 1."""
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.cmdline()[1:4] == ["-m", "kubetron", "train"]:
                    return child.pid
        raise AssertionError(f"no trainer process in pod {self.pod}")

    def termination_message(self) -> str:
        """As the kubelet reads it: the file, else (FallbackToLogsOnError) the log's tail on a failure."""
        text = self.termination_log.read_text() if self.termination_log.exists() else ""
        if not text.strip() and self.proc.returncode:
            text = "".join(self.lines)[-2048:]
        return text[:4096]

    def exit_code(self) -> int:
        rc = self.proc.returncode
        return rc if rc >= 0 else 128 - rc  # the runtime reports a signal death as 128 + signal

    def stop(self, grace: float) -> None:
        """What a kubelet does to a container of a pod being deleted: SIGTERM to its PID 1, then after
        `grace` seconds SIGKILL to every process left in it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
        self.kill()

    def kill(self) -> None:
        """SIGKILL every process of the container: its process group and all descendants (torchrun
        starts each rank in a session of its own)."""
        if self.proc.poll() is not None:
            return
        try:
            processes = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            processes = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for p in processes:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.proc.wait()


def hostpath_claim(api: Api, namespace: str, path: Path, name: str = "ckpt") -> None:
    """A PersistentVolumeClaim `name` bound to a hostPath PV at `path` (make it the job's mountPath too)."""
    api.create("/api/v1/persistentvolumes", {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"pv-{namespace}"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "hostPath": {"path": str(path)}, "claimRef": {"namespace": namespace, "name": name}}})
    api.create(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"pv-{namespace}",
                 "resources": {"requests": {"storage": "1Gi"}}}})


def config_yaml(api: Api, namespace: str, pod: dict[str, Any]) -> str | None:
    """The config.yaml of the ConfigMap the pod mounts (None: it mounts none)."""
    for volume in pod["spec"].get("volumes") or ():
        if "configMap" in volume:
            cm = api.get(f"/api/v1/namespaces/{namespace}/configmaps/{volume['configMap']['name']}")
            return cm["data"]["config.yaml"]
    return None


class ProcessKubelet:
    """Runs the pods of `namespace` bound to `node` as local processes (a background thread polling the
    API every `period` seconds). `seen[(pod name, what)]`: when it saw or did `what` ("bound",
    "started", "exited", "deleting", "gone"); `containers[pod name]`: the last container of that name."""

    def __init__(self, api: Api, namespace: str, workdir: Path, node: str = "node-1", period: float = 0.05):
        self.api, self.ns, self.dir, self.node, self.period = api, namespace, workdir, node, period
        self.containers: dict[str, Container] = {}
        self.seen: dict[tuple[str, str], float] = {}
        self._running: dict[str, tuple[str, Container]] = {}  # pod name -> (uid, container)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"process-kubelet-{namespace}", daemon=True)
        self._rounds = 0

    def __enter__(self) -> ProcessKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for _, c in self._running.values():
            c.kill()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            with contextlib.suppress(OSError, ApiError):  # the server is busy: next round
                self._round()

    def _round(self) -> None:
        pods = {p["metadata"]["name"]: p for p in self.api.get(pod_path(self.ns))["items"]}
        now = time.time()
        for name in [n for n in self._running if n not in pods]:
            self.seen.setdefault((name, "gone"), now)
            self._running.pop(name)[1].kill()
        for name, pod in pods.items():
            meta, uid = pod["metadata"], pod["metadata"]["uid"]
            if pod["spec"].get("nodeName") != self.node:
                continue
            self.seen.setdefault((name, "bound"), now)
            running = self._running.get(name)
            if running is not None and running[0] != uid:  # a new pod of the same name
                self._running.pop(name)[1].kill()
                running = None
            if meta.get("deletionTimestamp"):
                self.seen.setdefault((name, "deleting"), now)
                self._delete(pod, running[1] if running else None)
            elif running is None and (pod.get("status") or {}).get("phase") in (None, "Pending"):
                self._start(pod)
            elif running is not None and running[1].proc.poll() is not None and (name, "exited") not in self.seen:
                self._report_exit(pod, running[1])

    def _start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        c = Container(pod, config_yaml(self.api, self.ns, pod), self.dir / f"{name}-{pod['metadata']['uid'][:8]}")
        self.containers[name], self._running[name] = c, (pod["metadata"]["uid"], c)
        for key in ("started", "exited", "deleting", "gone"):
            self.seen.pop((name, key), None)
        self.seen[(name, "started")] = c.started
        now = now_iso()
        set_pod_status(self.api, self.ns, name, {
            "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}], "startTime": now,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
            "containerStatuses": [{"name": c.name, "ready": True, "restartCount": 0, "image": "x", "imageID": "",
                                   "started": True, "state": {"running": {"startedAt": now}}}]})

    def _report_exit(self, pod: dict[str, Any], c: Container) -> None:
        name = pod["metadata"]["name"]
        self.seen[(name, "exited")] = time.time()
        set_exited(self.api, self.ns, name, c.exit_code(), c.termination_message(), container=c.name)

    def _delete(self, pod: dict[str, Any], c: Container | None) -> None:
        """Stop the container (SIGTERM to its process group, SIGKILL after the grace period), then finish
        the deletion."""
        meta = pod["metadata"]
        if c is not None:
            c.stop(grace=float(pod["spec"].get("terminationGracePeriodSeconds") or 30))
        self.api.request("DELETE", pod_path(self.ns, meta["name"]),
                         {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}, ok=(404, 409))
