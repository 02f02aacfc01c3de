"""A job's whole life with a real trainer: a pod's exact command run as a local process.

One tiny CPU TrainingJob on a PVC-like directory. The operator's own pure pieces drive it: `decide()`
says what to do, `build()`/`rank_command()` say what each pod runs, `status_endpoint.read_live()` fetches rank 0's
status endpoint. The test plays the kubelet: it runs the pod's command as a local process, SIGTERMs its PID 1 mid-run
(what a preempted pod's container gets; the trainer holds itself at its own step for it, `faults_by_life`, not at a
line the test read), and presents the outcome as the kubelet would
(`status.containerStatuses[].state.terminated` with exitCode/reason and the termination message).

What differs from a pod, and only that (rewritten in `local_command`):
- `python3` is this interpreter (the venv), not the image's;
- the config volume mounted at /etc/kubetron (the pod's annotation) is a file in a temporary directory;
- the termination log (/dev/termination-log) is a file in a temporary directory;
- MASTER_ADDR (rank 0's DNS name through the headless Service) is 127.0.0.1.
The PVC's mountPath *is* the temporary directory, so the store path needs no rewrite; the rendezvous
and status ports are free local ports chosen through the spec's own masterPort/statusPort.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubetron.contract import exitcodes, recovery
from kubetron.supervisor.progress_io import summarize
from kubetron_operator.build import (
    CONFIG_PATH,
    PYTHON,
    TERMINATION_LOG,
    build,
    master_addr,
    rank_command,
)
from kubetron_operator.decide import decide
from kubetron_operator.model import RESERVED_ENV, Job
from kubetron_operator.observe import Observed, PodView
from kubetron_operator.policy.action import Action
from kubetron_operator.trainer_reports import status_endpoint

from tests import dashboard
from tests.multirank.runner import faults_by_life
from tests.operator.jobs import PVC_JOB, kubectl_get
from tests.operator.local_pods import config_yaml
from tests.ports import free_port
from tests.trainer_utils import ITER_RE, TINY, sigterm_while_stopped, stopped_trainer, tb_scalars

pytestmark = pytest.mark.cluster

ITERS = 40
SAVE_INTERVAL = 10
PREEMPT_AT = 5  # the SIGTERM comes at the first iteration this far past a save once the test has seen enough
TIMEOUT = 240.0  # seconds per trainer process (a loaded CI machine; it takes a few seconds alone)




def job_body(name: str, mount: Path, *, status_port: int) -> dict[str, Any]:
    """A one-node CPU job on a PVC whose mountPath is `mount`; TensorBoard events go inside the store."""
    config = yaml.safe_load(Path(TINY).read_text())
    config["train"]["train_iters"] = ITERS
    config["checkpoint"] = {"save_interval": SAVE_INTERVAL, "most_recent_k": 2}  # save/load: the operator's
    config["logger"] = {"log_interval": 1, "tensorboard_dir": str(mount / name / "tb")}
    body = copy.deepcopy(PVC_JOB)
    body["metadata"].update(name=name, creationTimestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    body["spec"].update(nodes=1, gpusPerNode=0, config=yaml.safe_dump(config), backoffLimit=1,
                        storage={"pvc": {"claimName": "ckpt", "mountPath": str(mount)}},
                        statusPort=status_port, masterPort=free_port(), terminationGracePeriodSeconds=60)
    return body


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386, as the API server applies the operator's status patches."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class Operator:
    """decide() in a loop over a status that persists between rounds (the job's .status)."""

    def __init__(self, body: dict[str, Any]):
        self.body, self.job, self.status = body, Job.from_body(body), {}

    def round(self, pods: list[PodView], live_status: dict[str, Any] | None = None) -> Action:
        action = decide(self.job, Observed(now=datetime.now(UTC), status=copy.deepcopy(self.status),
                                           pods=tuple(pods), live=live_status))
        self.status = merge_patch(self.status, action.status)
        return action


@dataclasses.dataclass
class Container:
    """A pod's trainer container running as a local process."""

    pod: dict[str, Any]
    proc: subprocess.Popen
    termination_log: Path
    started: str
    lines: list[str] = dataclasses.field(default_factory=list)


def pod_of(manifests: list[dict[str, Any]], rank: int = 0) -> dict[str, Any]:
    return [m for m in manifests if m["kind"] == "Pod"][rank]


def local_command(job: Job, attempt: int, expected: int, workdir: Path) -> tuple[list[str], dict[str, str], Path]:
    """The pod's argv and env from rank_command(), with only the laptop differences rewritten."""
    manifests = build(job, attempt, expected)
    pod = pod_of(manifests)
    container = pod["spec"]["containers"][0]
    argv, env = rank_command(job, attempt, 0, expected)
    assert argv == container["command"] + container["args"]  # exactly what the pod runs
    assert env == {e["name"]: e["value"] for e in container["env"] if "value" in e}
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "config.yaml"  # the config volume, as the kubelet writes it
    config.write_text(config_yaml(pod) or "")
    termination_log = workdir / "termination-log"  # the container's terminationMessagePath
    assert container["terminationMessagePath"] == env["KUBETRON_TERMINATION_LOG"] == TERMINATION_LOG
    assert env["MASTER_ADDR"] == master_addr(job, attempt)
    argv = [sys.executable if a == PYTHON else str(config) if a == CONFIG_PATH else a for a in argv]
    env.update(KUBETRON_CONFIG=str(config), KUBETRON_TERMINATION_LOG=str(termination_log), MASTER_ADDR="127.0.0.1")
    if recovery.SNAPSHOT_DIR_ENV in env:  # the pod's own memory volume (an emptyDir: gone with the pod)
        assert env[recovery.SNAPSHOT_DIR_ENV] == recovery.SNAPSHOT_MOUNT
        env[recovery.SNAPSHOT_DIR_ENV] = str(workdir / "memory")
    base = {k: v for k, v in os.environ.items() if k not in RESERVED_ENV}
    return argv, {**base, "PYTHONUNBUFFERED": "1", **env}, termination_log


def start(job: Job, attempt: int, expected: int, workdir: Path, output=subprocess.PIPE,
          faults: dict[str, str] | None = None) -> Container:
    argv, env, termination_log = local_command(job, attempt, expected, workdir)
    env.update(faults or {})  # KUBETRON_CHAOS_* (tests.multirank.runner.faults_by_life)
    proc = subprocess.Popen(argv, env=env, stdout=output, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return Container(pod_of(build(job, attempt, expected)), proc, termination_log, _now())


def finish(c: Container) -> dict[str, Any]:
    """Wait for the container to end; return its pod as the API server would serve it then."""
    try:
        c.proc.wait(timeout=TIMEOUT)
    finally:
        if c.proc.poll() is None:
            os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
    rc = c.proc.returncode
    code = rc if rc >= 0 else 128 - rc  # the runtime reports a signal death as 128 + signal
    message = c.termination_log.read_text() if c.termination_log.exists() else ""
    if not message.strip() and code != 0:  # terminationMessagePolicy: FallbackToLogsOnError
        message = "".join(c.lines)[-2048:]
    terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "message": message[:4096],
                  "startedAt": c.started, "finishedAt": _now()}
    return _pod(c.pod, "Succeeded" if code == 0 else "Failed", {"terminated": terminated})


def running(c: Container) -> dict[str, Any]:
    return _pod(c.pod, "Running", {"running": {"startedAt": c.started}})


def _pod(pod: dict[str, Any], phase: str, state: dict[str, Any]) -> dict[str, Any]:
    meta = {**pod["metadata"], "creationTimestamp": _now()}
    name = pod["spec"]["containers"][0]["name"]
    return {"metadata": meta, "spec": pod["spec"], "status": {
        "phase": phase, "podIP": "127.0.0.1", "containerStatuses": [{"name": name, "state": state}]}}


def view(pod: dict[str, Any]) -> PodView:
    return PodView.from_pod(pod, datetime.now(UTC))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_trainer_preempted_resumed_succeeded(tmp_path, capsys):
    t0 = time.monotonic()
    body = job_body("gpt", tmp_path / "pvc", status_port=free_port())
    op = Operator(body)
    job = op.job
    store = Path(job.store)

    # The reference: the same job, uninterrupted, on its own claim (status endpoint off). It runs
    # alongside attempt 1; its output goes to a file so nothing blocks on a pipe.
    ref_job = Job.from_body(job_body("gpt", tmp_path / "ref-pvc", status_port=0))
    with open(tmp_path / "reference.log", "w") as ref_out:
        reference = start(ref_job, 1, 0, tmp_path / "ref-pod", output=ref_out)

    # -- attempt 1: created, running, live status polled, SIGTERM mid-run ----------------------------
    a = op.round([])
    assert (a.kind, a.create_attempt, a.expected_iteration) == ("create", 1, 0)
    assert op.status["phase"] == "Pending" and op.status["attempt"] == 1
    arm = tmp_path / "arm"
    c1 = start(job, 1, 0, tmp_path / "pod-1", faults=faults_by_life((f"step@{PREEMPT_AT}%{SAVE_INTERVAL}", "STOP"),
                                                                    arm=arm))
    assert c1.pod["metadata"]["name"] == "gpt-1-0"
    samples: list[tuple[float, dict[str, Any]]] = []
    checked_live = False
    metrics = ""  # rank 0's GET /metrics once a checkpoint is durable
    reader = threading.Thread(target=lambda: c1.lines.extend(c1.proc.stdout), daemon=True)
    reader.start()
    read = 0
    while not (checked_live and metrics and len(samples) >= 3):
        assert c1.proc.poll() is None, "".join(c1.lines[-40:])
        fresh, read = c1.lines[read:], len(c1.lines)
        if not fresh:
            time.sleep(0.02)
            continue
        iterations = [int(m.group(1)) for m in map(ITER_RE.search, fresh) if m]
        if not iterations:
            continue
        # the operator's own fetch: rank 0 found through the pod's IP and the spec's statusPort
        got = status_endpoint.read_live([view(running(c1))], 1, job.spec.status_port).status
        if got is not None:
            samples.append((time.monotonic(), got))
        if not checked_live and got is not None and (got.get("iteration") or 0) >= 3:
            a = op.round([view(running(c1))], got)
            assert a.kind == "wait" and op.status["phase"] == "Running"
            st = op.status
            assert st["iteration"] == got["iteration"] and st["trainIters"] == ITERS
            assert st["progress"] == f"{math.floor(100 * got['iteration'] / ITERS)}%"
            assert st["tokensPerSecond"] > 0 and st["eta"] and st["eta"].endswith("s")
            checked_live = True
        if not metrics and max(iterations) >= SAVE_INTERVAL + 2:
            with urllib.request.urlopen(f"http://127.0.0.1:{job.spec.status_port}/metrics", timeout=10) as resp:
                metrics = resp.read().decode()
    # Seen what it had to: the trainer stops itself at its next iteration half an interval past a save (its own
    # step, armed now), and there the kubelet stops the container: PID 1 gets the SIGTERM, which reaches the
    # stopped trainer (pending) through the launcher and torchrun; then it goes on, saves there and exits.
    Path(f"{arm}-0").touch()
    sigterm_while_stopped(c1.proc, stopped_trainer(c1.proc, TIMEOUT, lambda: "".join(c1.lines)[-3000:]), TIMEOUT)
    c1.proc.wait(timeout=TIMEOUT)
    reader.join(timeout=30)
    exited = finish(c1)
    out = "".join(c1.lines)

    # the live endpoint while it ran: the contract's keys, iteration growing, sane numbers
    assert checked_live and len(samples) >= 3, out[-3000:]
    iterations = [s["iteration"] for _, s in samples]
    assert iterations == sorted(iterations) and iterations[-1] > iterations[0]
    last = samples[-1][1]
    assert last["trainIters"] == ITERS and last["tokensPerSecond"] > 0 and last["etaSeconds"] > 0
    assert last["loss"] > 0 and last["learningRate"] >= 0 and last["tflopsPerGpu"] > 0
    assert last["consumedSamples"] == 8 * last["iteration"]  # global_batch_size 8
    if last["iteration"] > SAVE_INTERVAL:
        assert last["lastCheckpoint"]["iteration"] == SAVE_INTERVAL
    # Every trainer metric a dashboard query reads is served by the real trainer; the save took some time.
    assert dashboard.read_by("trainer") and dashboard.missing("trainer", metrics) == set(), metrics
    saved_in = dashboard.samples(metrics)
    assert 0 < saved_in["kubetron_trainer_checkpoint_blocked_seconds"] <= saved_in[
        "kubetron_trainer_checkpoint_save_seconds"] < 60, metrics

    # -- the kubelet's report -> decide: a free restart from the checkpoint saved on SIGTERM ----------
    state = exited["status"]["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == exitcodes.SAVED_ON_SIGNAL, out[-3000:]
    term = view(exited).termination
    saved = term["lastCheckpoint"]
    assert term["reason"] == "SavedOnSignal" and term["iteration"] == saved and saved % SAVE_INTERVAL == PREEMPT_AT
    assert (store / f"iter_{saved:07d}" / "metadata.json").is_file()
    a = op.round([view(exited)])
    assert a.kind == "restart" and a.delete_pods == ("gpt-1-0",), a
    st = op.status
    assert st["phase"] == "Restarting" and st["reason"] == "Preempted" and "SavedOnSignal" in st["message"]
    assert st["restarts"] == {"preemptions": 1, "failures": 0, "neverStarted": 0, "total": 1,
                              "inPlace": 0, "hangs": 0}  # backoffLimit kept
    assert st["lastCheckpoint"]["iteration"] == saved and st["lostIterations"] == 0
    assert st["iteration"] == saved

    # -- between attempts: the pod is gone; the next attempt is created at once (no pod reads the log) -----
    summary = summarize(str(store))  # the progress log on the claim says what the termination message said
    assert summary["lastCheckpoint"]["iteration"] == saved and summary["completed"] is False
    assert summary["lastExit"]["reason"] == "SavedOnSignal" and summary["lastExit"]["iteration"] == saved
    a = op.round([])
    assert (a.kind, a.create_attempt, a.expected_iteration) == ("create", 2, saved), a
    assert op.status["attempt"] == 2 and op.status["attemptStartCheckpoint"] == saved
    assert op.status["restarts"]["total"] == 1 and op.status["phase"] == "Pending"

    # -- attempt 2: resumes from the checkpoint, runs to the end --------------------------------------
    c2 = start(job, 2, a.expected_iteration, tmp_path / "pod-2")
    env = {e["name"]: e.get("value") for e in c2.pod["spec"]["containers"][0]["env"]}
    assert env["KUBETRON_EXPECTED_ITERATION"] == str(saved) and env["KUBETRON_JOB_ID"] == "ml/gpt/2"
    a = op.round([view(running(c2))])
    assert op.status["phase"] == "Running"
    for line in c2.proc.stdout:
        c2.lines.append(line)
    done = finish(c2)
    out2 = "".join(c2.lines)
    assert done["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0, out2[-3000:]
    assert f"iteration {saved}" in out2 and "resumed from" in out2
    a = op.round([view(done)])
    assert a.kind == "succeed", a
    st = op.status
    assert st["phase"] == "Succeeded" and st["iteration"] == ITERS and st["progress"] == "100%"
    assert st["eta"] == "0s" and st["lastCheckpoint"]["iteration"] == ITERS and st["lostIterations"] == 0
    assert st["restarts"] == {"preemptions": 1, "failures": 0, "neverStarted": 0, "total": 1, "inPlace": 0,
                              "hangs": 0}
    assert st["completionTime"]
    assert op.round([]).kind == "wait" and op.status["phase"] == "Succeeded"  # never rerun

    # -- the loss trace: continuous, bit for bit the uninterrupted run's --------------------------------
    ref_done = finish(reference)
    assert ref_done["status"]["phase"] == "Succeeded", (tmp_path / "reference.log").read_text()[-3000:]
    expected_loss = tb_scalars(Path(ref_job.store) / "tb")
    loss = tb_scalars(store / "tb")
    assert sorted(loss) == sorted(expected_loss) == list(range(1, ITERS + 1))
    assert {i: loss[i] for i in range(saved + 1, ITERS + 1)} == {
        i: expected_loss[i] for i in range(saved + 1, ITERS + 1)}
    assert loss == expected_loss  # attempt 1 up to the save too

    print("\n" + kubectl_get({**body, "status": op.status}, datetime.now(UTC)))
    print(f"(resumed at iteration {saved}; {len(samples)} live samples, the last {last}; "
          f"story took {time.monotonic() - t0:.0f}s)")
    text = capsys.readouterr().out
    with capsys.disabled():
        print(text)
    header, row = [ln for ln in text.splitlines() if ln.strip()][-3:-1]
    assert header.split() == ["NAME", "PHASE", "NODES", "PROGRESS", "ITERATION", "RESTARTS", "ETA", "AGE"]
    assert row.split()[:7] == ["gpt", "Succeeded", "1", "100%", str(ITERS), "1", "0s"]
