"""Pods as local processes, for on-kube tests that play the kubelet (test_in_place_on_kube.py,
test_elastic_on_kube.py): a pod's exact command and env from the API server, with only the laptop
differences rewritten (the interpreter, the mounted ConfigMap, the termination log, MASTER_ADDR)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import yaml
from kubetron_operator.build import CONFIG_PATH, PYTHON, TERMINATION_LOG
from kubetron_operator.model import RESERVED_ENV

from tests.trainer_utils import TINY

ITER_RE = re.compile(r"iteration\s+(\d+)/")


def tiny_config(train_iters: int = 100, **logger: Any) -> str:
    """A one-layer tiny GPT, a checkpoint every 10 iterations, a log line every iteration."""
    config = yaml.safe_load(Path(TINY).read_text())
    config["train"]["train_iters"] = train_iters
    config["model"].update(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=32)
    config["scheduler"]["lr_warmup_iters"] = 1
    config["validation"]["eval_interval"] = None
    config["checkpoint"] = {"save_interval": 10, "most_recent_k": 2}  # save/load: the operator's
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
    """A pod's main container as a local process: the pod's command and env from the API server."""

    def __init__(self, pod: dict[str, Any], config_yaml: str, workdir: Path):
        workdir.mkdir(parents=True)
        self.name = pod["metadata"]["name"]
        container = pod["spec"]["containers"][0]
        config = workdir / "config.yaml"  # the ConfigMap volume
        config.write_text(config_yaml)
        self.termination_log = workdir / "termination-log"
        env = {e["name"]: e["value"] for e in container.get("env") or () if "value" in e}
        assert env.get("KUBETRON_TERMINATION_LOG", TERMINATION_LOG) == container["terminationMessagePath"]
        env.update(KUBETRON_CONFIG=str(config), KUBETRON_TERMINATION_LOG=str(self.termination_log),
                   MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TMPDIR=str(workdir))
        local = {PYTHON: sys.executable, CONFIG_PATH: str(config), TERMINATION_LOG: str(self.termination_log)}
        argv = [local.get(a, a) for a in container["command"] + container.get("args", [])]
        base = {k: v for k, v in os.environ.items() if k not in RESERVED_ENV}
        self.proc = subprocess.Popen(argv, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def trainer_pid(self) -> int:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if child.cmdline()[1:4] == ["-m", "kubetron", "train"]:
                return child.pid
        raise AssertionError("no trainer process in the pod")

    def last_iteration(self) -> int:
        return max([int(m.group(1)) for m in map(ITER_RE.search, list(self.lines)) if m] or [0])

    def exit_code(self) -> int | None:
        """As the container runtime reports it: a death by signal N is 128 + N."""
        rc = self.proc.poll()
        return None if rc is None else (rc if rc >= 0 else 128 - rc)

    def termination_message(self) -> str:
        """terminationMessagePolicy FallbackToLogsOnError: the file, else the log's tail on an error."""
        text = self.termination_log.read_text() if self.termination_log.exists() else ""
        return text if text.strip() or self.exit_code() == 0 else "".join(self.lines)[-2048:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
