"""Issue 24's "done when", on the real API server with the real operator: a 2-pod job whose pods' exact
commands run as local processes (the test plays the kubelet, as in test_real_trainer_story.py: only the
interpreter, the mounted ConfigMap, the termination log and MASTER_ADDR are rewritten). One trainer
process is SIGKILLed mid-run: the gang restarts inside the same pods, rank 0's status endpoint says so,
the operator counts `restarts.inPlace` = 1 with a `RestartedInPlace` event, and the job succeeds in
attempt 1 with the same pods (same UIDs).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from kubetron_operator.build import CONFIG_PATH, PYTHON, TERMINATION_LOG
from kubetron_operator.model import RESERVED_ENV

from tests.kube.cluster import free_port, set_exited, set_running
from tests.operator.jobs import PVC_JOB, job_body
from tests.trainer_utils import TINY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
LOSS_RE = re.compile(r"iteration\s+(\d+)/")


def tiny_config() -> str:
    config = yaml.safe_load(Path(TINY).read_text())
    config["train"]["train_iters"] = 100
    config["model"].update(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=32)
    config["scheduler"]["lr_warmup_iters"] = 1
    config["validation"]["eval_interval"] = None
    config["checkpoint"] = {"save_interval": 10, "most_recent_k": 2}  # save/load: the operator's
    config["logger"] = {"log_interval": 1}
    return yaml.safe_dump(config)


def pvc(kube, ns: str, path: Path) -> None:
    kube.admin.create("/api/v1/persistentvolumes", {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"pv-{ns}"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "hostPath": {"path": str(path)}, "claimRef": {"namespace": ns, "name": "ckpt"}}})
    kube.admin.create(f"/api/v1/namespaces/{ns}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "ckpt"},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"pv-{ns}",
                 "resources": {"requests": {"storage": "1Gi"}}}})


class Container:
    """A pod's trainer container as a local process: the pod's command and env from the API server."""

    def __init__(self, pod: dict[str, Any], config_yaml: str, workdir: Path):
        workdir.mkdir(parents=True)
        container = pod["spec"]["containers"][0]
        config = workdir / "config.yaml"  # the ConfigMap volume
        config.write_text(config_yaml)
        self.termination_log = workdir / "termination-log"
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        assert env["KUBETRON_TERMINATION_LOG"] == TERMINATION_LOG
        env.update(KUBETRON_CONFIG=str(config), KUBETRON_TERMINATION_LOG=str(self.termination_log),
                   MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TMPDIR=str(workdir))
        argv = [sys.executable if a == PYTHON else str(config) if a == CONFIG_PATH else a
                for a in container["command"] + container.get("args", [])]
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
        return max([int(m.group(1)) for m in map(LOSS_RE.search, list(self.lines)) if m] or [0])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def test_a_killed_trainer_is_restarted_in_the_same_pods(kube, kube_ns, tmp_path):
    ns, api = kube_ns, kube.admin
    store = tmp_path / "pvc"
    store.mkdir()
    pvc(kube, ns, store)
    config = tiny_config()
    body = job_body(PVC_JOB, nodes=2, config=config, storage={"pvc": {"claimName": "ckpt", "mountPath": str(store)}},
                    statusPort=free_port(), masterPort=free_port(), maxInPlaceRestarts=2)
    body["metadata"] = {"name": "gpt"}
    containers: list[Container] = []
    with kube.operator(ns):
        api.create(kube.jobs(ns), body)
        pods = kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        uids = {name: pod["metadata"]["uid"] for name, pod in pods.items()}
        try:
            for rank in (0, 1):
                containers.append(Container(pods[f"gpt-1-{rank}"], config, tmp_path / f"pod-{rank}"))
                set_running(api, ns, f"gpt-1-{rank}")
            kube.wait_for("iteration 15", lambda: containers[1].last_iteration() >= 15, 300,
                          explain=lambda: "".join(containers[0].lines[-20:] + containers[1].lines[-20:]))
            os.kill(containers[1].trainer_pid(), signal.SIGKILL)  # rank 1's trainer, not its pod's PID 1

            st = kube.wait_status(ns, "gpt", "restarts.inPlace == 1",
                                  lambda s: (s.get("restarts") or {}).get("inPlace") == 1, timeout=300)
            assert st["phase"] == "Running" and st["attempt"] == 1 and st["restarts"]["total"] == 0
            kube.wait_for("a RestartedInPlace event", lambda: any(
                e["reason"] == "RestartedInPlace" for e in kube.events(ns)))

            for rank, c in enumerate(containers):  # the kubelet reports each container's end
                assert c.proc.wait(timeout=300) == 0, "".join(c.lines[-40:])
                set_exited(api, ns, f"gpt-1-{rank}", 0, c.termination_log.read_text())
            st = kube.wait_status(ns, "gpt", "Succeeded", lambda s: s.get("phase") == "Succeeded", timeout=60)
        finally:
            for c in containers:
                c.kill()
    assert st["attempt"] == 1 and st["restarts"]["total"] == 0 and st["restarts"]["inPlace"] == 1
    assert {name: pod["metadata"]["uid"] for name, pod in kube.pods(ns).items()} == uids  # the same pods
    assert json.loads(containers[0].termination_log.read_text())["reason"] == "Completed"
    assert "restarting the gang in place" in "".join(containers[1].lines)
