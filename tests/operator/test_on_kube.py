"""The real `kubetron operator` command against a real API server (tests/kube): it runs as the chart's
ServiceAccount under the chart's RBAC and reconciles TrainingJobs end to end. The test plays the kubelet
(pod phases, DisruptionTarget conditions, termination messages; pods are bound by the real scheduler and
deleted by the garbage collector / the kubelet stand-in) and the trainer (rank 0's status endpoint on a
local port, the progress log in a real S3 bucket).

These stories used to run against kmock; a real server shows everything they need, so none are left
there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubetron.contract.progress import saved_checkpoint_line, starting_job_line
from packaging.requirements import Requirement

from tests.kube.cluster import set_exited, set_running
from tests.operator.jobs import s3_job, tj
from tests.operator.status_endpoint import StatusEndpoint

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def status_endpoint():
    endpoint = StatusEndpoint()
    yield endpoint
    endpoint.close()


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def reasons(kube, ns: str) -> set[str]:
    return {e["reason"] for e in kube.events(ns)}


# -- the stories ---------------------------------------------------------------------------------------


def test_preempted_then_resumed_then_succeeded(kube, kube_ns, s3_server, status_endpoint):
    ns, api, live = kube_ns, kube.admin, status_endpoint
    body = s3_job(kube, ns, s3_server, statusPort=live.port)
    bucket = body["spec"]["storage"]["s3"]["bucket"]
    log_key = f"runs/{ns}/gpt/progress.txt"
    with kube.operator(ns) as op:
        api.create(kube.jobs(ns), body)
        pods = kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        st = kube.wait_status(ns, "gpt", "Pending attempt 1", lambda s: s.get("phase") == "Pending")
        assert st["attempt"] == 1
        assert st["restarts"] == {"preemptions": 0, "failures": 0, "neverStarted": 0, "total": 0,
                                  "inPlace": 0, "hangs": 0}
        env = {e["name"]: e for e in pods["gpt-1-0"]["spec"]["containers"][0]["env"]}
        assert env["MASTER_ADDR"]["value"] == f"gpt-1-0.gpt.{ns}.svc"
        assert "value" not in env["AWS_SECRET_ACCESS_KEY"]  # a secretKeyRef, never the secret itself
        if "kube-scheduler" in kube.cp.procs:  # KUBEBUILDER_ASSETS from setup-envtest has none
            kube.wait_for("pods bound by the scheduler", lambda: all(
                p["spec"].get("nodeName") == "node-1" for p in kube.pods(ns).values()))

        # Running; rank 0 reports live progress on its status endpoint.
        live.live = {"iteration": 12, "trainIters": 40, "tokensPerSecond": 2048.0, "etaSeconds": 95,
                     "lastCheckpoint": {"iteration": 10, "time": "2026-11-22T12:00:09Z"}, "loss": 2.5,
                     "learningRate": 0.0003}
        set_running(api, ns, "gpt-1-0")
        set_running(api, ns, "gpt-1-1")
        st = kube.wait_status(ns, "gpt", "Running with live progress",
                              lambda s: s.get("phase") == "Running" and s.get("iteration") == 12)
        assert st["progress"] == "30%" and st["eta"] == "1m35s" and st["tokensPerSecond"] == 2048.0
        assert st["loss"] == 2.5 and st["learningRate"] == 0.0003  # stored: the CRD's schema keeps them

        # Rank 1's node is preempted; the trainer saved iteration 13 on SIGTERM (the progress log in the
        # bucket says so; the termination message does not) and exits 75.
        live.live = None
        s3_server.client().put_object(Bucket=bucket, Key=log_key, Body="\n".join([
            starting_job_line(0, 40, num_gpus=2, job_id=f"{ns}/gpt/1"),
            saved_checkpoint_line(13, 1.0, 1.0, 1e12, 13312, 40, num_gpus=2, job_id=f"{ns}/gpt/1")]).encode())
        set_exited(api, ns, "gpt-1-1", 75, {"exitCode": 75, "reason": "SavedOnSignal", "iteration": 13,
                                             "message": "received SIGTERM"},
                   conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}])
        pods = kube.wait_pods(ns, {"gpt-2-0", "gpt-2-1"})  # the whole gang went, the next one came
        st = kube.wait_status(ns, "gpt", "attempt 2", lambda s: s.get("attempt") == 2)
        assert st["restarts"] == {"preemptions": 1, "failures": 0, "neverStarted": 0, "total": 1,
                                  "inPlace": 0, "hangs": 0}
        assert st["lastCheckpoint"]["iteration"] == 13
        env = env_of(pods["gpt-2-1"])
        assert env["KUBETRON_EXPECTED_ITERATION"] == "13" and env["KUBETRON_JOB_ID"] == f"{ns}/gpt/2"

        # Attempt 2 trains to the end; every rank exits 0 saying train_iters was reached.
        set_running(api, ns, "gpt-2-0")
        set_running(api, ns, "gpt-2-1")
        kube.wait_status(ns, "gpt", "Running attempt 2", lambda s: s.get("phase") == "Running")
        done = {"exitCode": 0, "reason": "Completed", "iteration": 40, "trainIters": 40, "lastCheckpoint": 40}
        set_exited(api, ns, "gpt-2-0", 0, done)
        set_exited(api, ns, "gpt-2-1", 0, done)
        st = kube.wait_status(ns, "gpt", "Succeeded", lambda s: s.get("phase") == "Succeeded")
        assert st["progress"] == "100%" and st["iteration"] == 40 and st["completionTime"]
        assert st["lostIterations"] == 0
        assert [c["type"] for c in st["conditions"] if c["status"] == "True"] == ["Succeeded"]
        kube.wait_for("the story's events", lambda: {"AttemptCreated", "Running", "Preempted", "Succeeded"}
                      <= reasons(kube, ns))  # each posted just after its status write
    assert "Traceback" not in op.log(), op.tail()


def test_trainer_errors_past_backoff_limit_fail_the_job(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    with kube.operator(ns):
        api.create(kube.jobs(ns), tj(ns, backoffLimit=1))
        for attempt in (1, 2):
            kube.wait_pods(ns, {f"gpt-{attempt}-0", f"gpt-{attempt}-1"})
            set_running(api, ns, f"gpt-{attempt}-0")
            set_running(api, ns, f"gpt-{attempt}-1")
            set_exited(api, ns, f"gpt-{attempt}-0", 1, {"exitCode": 1, "reason": "TrainerError",
                                                        "lastCheckpoint": 10 * attempt,
                                                        "message": "RuntimeError: boom"})
        st = kube.wait_status(ns, "gpt", "Failed", lambda s: s.get("phase") == "Failed")
        assert st["reason"] == "BackoffLimitExceeded" and "RuntimeError: boom" in st["message"]
        assert st["restarts"] == {"preemptions": 0, "failures": 2, "neverStarted": 0, "total": 2,
                                  "inPlace": 0, "hangs": 0}
        kube.wait_pods(ns, {"gpt-2-0"})  # the rank still running was stopped; the failed one is kept for logs


def test_config_error_fails_at_once(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    with kube.operator(ns):
        api.create(kube.jobs(ns), tj(ns))
        kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        set_running(api, ns, "gpt-1-0")
        set_running(api, ns, "gpt-1-1")
        set_exited(api, ns, "gpt-1-0", 2, {"exitCode": 2, "reason": "ConfigError",
                                            "message": "optimizer.lr: must be > 0"})
        st = kube.wait_status(ns, "gpt", "Failed", lambda s: s.get("phase") == "Failed")
        assert st["reason"] == "ConfigError" and st["message"] == "optimizer.lr: must be > 0"
        kube.wait_pods(ns, {"gpt-1-0"})
        assert st["restarts"]["total"] == 0


def test_suspend_and_unsuspend(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    with kube.operator(ns):
        api.create(kube.jobs(ns), tj(ns))
        kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        set_running(api, ns, "gpt-1-0")
        set_running(api, ns, "gpt-1-1")
        kube.wait_status(ns, "gpt", "Running", lambda s: s.get("phase") == "Running")
        api.patch(f"{kube.jobs(ns)}/gpt", {"spec": {"suspend": True}})
        st = kube.wait_status(ns, "gpt", "Suspended", lambda s: s.get("phase") == "Suspended")
        kube.wait_pods(ns, set())
        assert st["restarts"]["total"] == 0
        api.patch(f"{kube.jobs(ns)}/gpt", {"spec": {"suspend": False}})
        kube.wait_pods(ns, {"gpt-2-0", "gpt-2-1"})
        st = kube.wait_status(ns, "gpt", "Pending attempt 2", lambda s: s.get("attempt") == 2
                              and s["phase"] == "Pending")
        assert st["restarts"]["total"] == 0


def test_deletion_removes_children_and_stops_reconciling(kube, kube_ns):
    """No finalizer holds a job (it is not queued in Kueue): deleting it takes effect at once, its children
    go with the garbage collector (owner references), and its daemon stops asking anything about it."""
    ns, api = kube_ns, kube.admin
    with kube.operator(ns):
        api.create(kube.jobs(ns), tj(ns))
        kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        kube.wait_status(ns, "gpt", "Pending", lambda s: s.get("phase") == "Pending")
        # The scheduler placed the pods on the test's node: the job's Service (rank 0's name) exists.
        kube.wait_for("the job's Service", lambda: api.get(f"/api/v1/namespaces/{ns}/services/gpt", ok=(404,)))
        assert not kube.job(ns, "gpt")["metadata"].get("finalizers")
        api.delete(f"{kube.jobs(ns)}/gpt")
        kube.wait_for("job, pods and Service deleted", lambda: kube.job(ns, "gpt") is None
                      and not kube.pods(ns, role=None)
                      and api.get(f"/api/v1/namespaces/{ns}/services/gpt", ok=(404,)) is None)
        # Its last reactions to the deletion (the watch's DELETED event) may still be in flight when the test sees
        # everything gone (a CI run counted one more): once the count stood still for a second, it must stay still.
        seen: list[tuple[float, int]] = []

        def still() -> bool:
            seen.append((time.monotonic(), sum(kube.operator_calls(ns).values())))
            moved = max((t for (_, n), (t, m) in zip(seen, seen[1:], strict=False) if n != m), default=seen[0][0])
            return seen[-1][0] - moved >= 1.0

        kube.wait_for("the operator's requests standing still", still)
        before = seen[-1][1]
        time.sleep(2)
        assert sum(kube.operator_calls(ns).values()) == before, kube.operator_calls(ns)


def test_an_older_operators_finalizer_comes_off_a_job_that_needs_none(kube, kube_ns):
    """Operators before this one held every job with kopf's finalizer: after an upgrade it comes off each
    job not queued in Kueue, so deleting one never waits for an operator."""
    ns, api = kube_ns, kube.admin
    body = tj(ns)
    body["metadata"]["finalizers"] = ["kubetron.dev/operator"]
    api.create(kube.jobs(ns), body)
    with kube.operator(ns):
        kube.wait_for("the finalizer taken off", lambda: not kube.job(ns, "gpt")["metadata"].get("finalizers"))
        kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        api.delete(f"{kube.jobs(ns)}/gpt")
        kube.wait_for("job deleted", lambda: kube.job(ns, "gpt") is None)


# -- how the operator logs in, and with which kopf -----------------------------------------------------

IN_CLUSTER = """
import sys
from kubernetes.config import incluster_config
# A pod's service-account files live under /var/run/secrets: point the loader at the test's copies.
incluster_config.SERVICE_TOKEN_FILENAME, incluster_config.SERVICE_CERT_FILENAME = sys.argv.pop(1), sys.argv.pop(1)
from kubetron.cli import main
sys.exit(main())
"""


def test_operator_logs_in_with_the_in_cluster_service_account(kube, kube_ns, tmp_path):
    """What a pod sees: KUBERNETES_SERVICE_HOST/PORT and the service-account token and CA files; no
    kubeconfig at all."""
    ns, api = kube_ns, kube.admin
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text(kube.operator_token)
    ca.write_bytes((kube.cp.pki / "ca.crt").read_bytes())
    host, port = kube.cp.server.removeprefix("https://").split(":")
    env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port,
           "KUBECONFIG": str(tmp_path / "no-such-kubeconfig")}
    with kube.operator(ns, env=env, command=[sys.executable, "-c", IN_CLUSTER, str(token), str(ca)]):
        api.create(kube.jobs(ns), tj(ns))
        kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        kube.wait_status(ns, "gpt", "Pending attempt 1", lambda s: s.get("attempt") == 1)


def test_operator_without_credentials_says_so_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    env["KUBECONFIG"] = str(tmp_path / "missing")
    out = subprocess.run([str(Path(sys.executable).with_name("kubetron")), "operator"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kubetron: error: cluster: no in-cluster service account"), lines


def test_operator_interval_must_be_positive():
    out = subprocess.run([str(Path(sys.executable).with_name("kubetron")), "operator", "--interval=0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip() == "kubetron: error: --interval: must be > 0 seconds, got 0.0"


def _pypi_reachable() -> bool:
    try:
        with urllib.request.urlopen("https://pypi.org/simple/kopf/", timeout=5):
            return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_operator_runs_with_the_newest_kopf_pyproject_allows(kube, kube_ns, tmp_path):
    """constraints.txt pins the kopf CI runs (every other test here); this one takes the newest release
    inside pyproject's range, so a kopf release that breaks the operator fails here before users see it."""
    (kopf_req,) = [r for r in (Requirement(x) for x in tomllib.loads(
        (ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["operator"]) if r.name == "kopf"]
    if not _pypi_reachable():
        pytest.skip(f"PyPI unreachable: cannot fetch the newest {kopf_req}")
    target = tmp_path / "newest"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--upgrade",
                    "--target", str(target), str(kopf_req)], check=True, timeout=400, capture_output=True)
    env = {"PYTHONPATH": str(target)}
    probe = subprocess.run([sys.executable, "-c", "import kopf, importlib.metadata as m; "
                            "print(kopf.__file__, m.version('kopf'))"],
                           env={**os.environ, **env}, capture_output=True, text=True, check=True)
    where, version = probe.stdout.split()
    assert where.startswith(str(target)) and kopf_req.specifier.contains(version)
    ns, api = kube_ns, kube.admin
    with kube.operator(ns, env=env) as op:
        api.create(kube.jobs(ns), tj(ns))
        kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        kube.wait_status(ns, "gpt", "Pending attempt 1", lambda s: s.get("attempt") == 1)
    print(f"\nkubetron operator reconciled a job with kopf {version} ({kopf_req})")
    assert "Traceback" not in op.log(), op.tail()
