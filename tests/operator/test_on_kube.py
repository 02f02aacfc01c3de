"""The real `kubetron operator` command against a real API server (tests/kube): it runs as the chart's
ServiceAccount under the chart's RBAC and reconciles TrainingJobs end to end. The test plays the kubelet
(pod phases, DisruptionTarget conditions, termination messages; pods are bound by the real scheduler and
deleted by the garbage collector / the kubelet stand-in) and the trainer (rank 0's status endpoint on a
local port, the progress log in a real S3 bucket).

These stories used to run against kmock; a real server shows everything they need, so none are left
there.
"""

from __future__ import annotations

import base64
import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubetron.progress import saved_checkpoint_line, starting_job_line

from tests.kube.cluster import free_port, set_exited, set_running
from tests.operator.jobs import S3_JOB

pytestmark = pytest.mark.timeout(180)


def tj(ns: str, name: str = "gpt", **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(S3_JOB)
    body["metadata"] = {"name": name, "namespace": ns}
    body["spec"].update(spec)
    return body


class StatusEndpoint:
    """Rank 0's `GET /status` (docs/CONTRACT.md) on 127.0.0.1: `live` is served, None refuses."""

    def __init__(self) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if endpoint.live is None:
                    self.send_error(503)
                    return
                data = json.dumps(endpoint.live).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: Any) -> None:
                pass

        self.live: dict[str, Any] | None = None
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def status_endpoint():
    endpoint = StatusEndpoint()
    yield endpoint
    endpoint.close()


def s3_job(kube, ns: str, s3_server, **spec: Any) -> dict[str, Any]:
    """A job whose store is a fresh bucket of the real S3 server; its Secret holds the keys."""
    bucket = s3_server.new_bucket()
    kube.admin.create(f"/api/v1/namespaces/{ns}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
        "data": {"AWS_ACCESS_KEY_ID": base64.b64encode(s3_server.access_key.encode()).decode(),
                 "AWS_SECRET_ACCESS_KEY": base64.b64encode(s3_server.secret_key.encode()).decode()}})
    body = tj(ns, **spec)
    body["spec"]["storage"]["s3"].update(bucket=bucket, endpoint=s3_server.endpoint)
    return body


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
        assert st["attempt"] == 1 and st["restarts"] == {"preemptions": 0, "failures": 0, "neverStarted": 0, "total": 0}
        env = {e["name"]: e for e in pods["gpt-1-0"]["spec"]["containers"][0]["env"]}
        assert env["MASTER_ADDR"]["value"] == f"gpt-1-0.gpt.{ns}.svc"
        assert "value" not in env["AWS_SECRET_ACCESS_KEY"]  # a secretKeyRef, never the secret itself
        kube.wait_for("pods bound by the scheduler", lambda: all(
            p["spec"].get("nodeName") == "node-1" for p in kube.pods(ns).values()))

        # Running; rank 0 reports live progress on its status endpoint.
        live.live = {"iteration": 12, "trainIters": 40, "tokensPerSecond": 2048.0, "etaSeconds": 95,
                     "lastCheckpoint": {"iteration": 10, "time": "2026-11-22T12:00:09Z"}}
        set_running(api, ns, "gpt-1-0")
        set_running(api, ns, "gpt-1-1")
        st = kube.wait_status(ns, "gpt", "Running with live progress",
                              lambda s: s.get("phase") == "Running" and s.get("iteration") == 12)
        assert st["progress"] == "30%" and st["eta"] == "1m35s" and st["tokensPerSecond"] == 2048.0

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
        assert st["restarts"] == {"preemptions": 1, "failures": 0, "neverStarted": 0, "total": 1}
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
        assert {"AttemptCreated", "Running", "Preempted", "Succeeded"} <= reasons(kube, ns)
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
        assert st["restarts"] == {"preemptions": 0, "failures": 2, "neverStarted": 0, "total": 2}
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
    ns, api = kube_ns, kube.admin
    with kube.operator(ns):
        api.create(kube.jobs(ns), tj(ns))
        kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        kube.wait_status(ns, "gpt", "Pending", lambda s: s.get("phase") == "Pending")
        assert api.get(f"/api/v1/namespaces/{ns}/configmaps/gpt-1-config")
        api.delete(f"{kube.jobs(ns)}/gpt")
        kube.wait_for("job, pods, Service and ConfigMap deleted", lambda: kube.job(ns, "gpt") is None
                      and not kube.pods(ns, role=None)
                      and api.get(f"/api/v1/namespaces/{ns}/services/gpt", ok=(404,)) is None
                      and api.get(f"/api/v1/namespaces/{ns}/configmaps/gpt-1-config", ok=(404,)) is None)
