"""Whole stories: the real kopf operator (our handlers, our API wrapper, the kubernetes client) against
the kmock Kubernetes emulator. The test plays kubelet and scheduler by patching pod statuses, and the
trainer by feeding the progress log and rank 0's status endpoint.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kmock
import kopf
import pytest
from kubernetes import client
from kubetron_operator.api_calls import Kube, kubernetes_transport
from kubetron_operator.handlers import Deps, register
from kubetron_operator.main import settings as operator_settings

from tests.operator.jobs import S3_JOB, kubectl_get

STORY_TIMEOUT = 60.0
JOBS = "/apis/kubetron.dev/v1alpha1/namespaces/ml/trainingjobs"
PODS = "/api/v1/namespaces/ml/pods"


class Cluster:
    """The emulator plus a fake trainer: progress log contents and rank 0's live status."""

    def __init__(self, k8s: kmock.KubernetesEmulator, session: aiohttp.ClientSession):
        self.k8s, self.session = k8s, session
        self.progress: dict[str, Any] = {"lastCheckpoint": None, "trainIters": 40, "iteration": 0, "completed": False}
        self.live: dict[str, Any] | None = None
        self.created_pods: list[str] = []

    async def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body)
        async with self.session.request(method, path, data=data, headers={"Content-Type": content_type}) as resp:
            text = await resp.text()
            return json.loads(text) if text and resp.status < 300 else None

    async def job(self, name: str = "gpt") -> dict[str, Any] | None:
        return await self.call("GET", f"{JOBS}/{name}")

    async def pods(self) -> dict[str, dict[str, Any]]:
        data = await self.call("GET", PODS) or {}
        return {p["metadata"]["name"]: p for p in data.get("items") or [] if p["metadata"].get("labels", {}).get(
            "kubetron.dev/role") == "worker"}

    async def pod_status(self, name: str, status: dict[str, Any]) -> None:
        await self.call("PATCH", f"{PODS}/{name}/status", {"status": status}, "application/merge-patch+json")

    async def running(self, *names: str) -> None:
        for i, name in enumerate(names):
            await self.pod_status(name, {"phase": "Running", "podIP": f"10.0.0.{i + 1}", "containerStatuses": [
                {"name": "trainer", "state": {"running": {"startedAt": "2026-11-22T12:00:00Z"}}}]})

    async def exited(self, name: str, code: int, message: dict[str, Any] | None = None, **extra: Any) -> None:
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                      "startedAt": "2026-11-22T12:00:00Z", "message": json.dumps(message or {"exitCode": code})}
        await self.pod_status(name, {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
            {"name": "trainer", "state": {"terminated": terminated}}], **extra})

    async def until(self, what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
        """Poll `check` (async) until it returns something truthy."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            result = await check()
            if result:
                return result
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for: {what}; job status: "
                                     f"{json.dumps(((await self.job()) or {}).get('status'), indent=1)}")
            await asyncio.sleep(0.05)

    async def until_status(self, what: str, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            job = await self.job()
            status = (job or {}).get("status") or {}
            return status if pred(status) else None
        return await self.until(what, check)

    async def until_pods(self, names: set[str]) -> dict[str, dict[str, Any]]:
        async def check() -> tuple[dict[str, dict[str, Any]]] | None:
            pods = await self.pods()
            return (pods,) if set(pods) == names else None  # a tuple: {} (no pods) is a result too
        (pods,) = await self.until(f"pods == {sorted(names)}", check)
        return pods


async def _story(body: dict[str, Any], script: Callable[[Cluster], Any]) -> None:
    async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
        k8s.resources.load_bundled()
        k8s.resources["kubetron.dev/v1alpha1/trainingjobs"] = kmock.ResourceInfo(
            kind="TrainingJob", singular="trainingjob", namespaced=True, shortnames={"tj"},
            verbs={"create", "delete", "get", "list", "patch", "update", "watch"}, subresources={"status"})
        url = str(server.url).rstrip("/")
        async with aiohttp.ClientSession(base_url=url) as session:
            cluster = Cluster(k8s, session)
            registry = register(kopf.OperatorRegistry())

            @kopf.on.login(registry=registry)
            def _login(**_: Any) -> kopf.ConnectionInfo:
                return kopf.ConnectionInfo(server=url, insecure=True)

            api_client = client.ApiClient(client.Configuration(host=url))
            deps = Deps(kube=Kube(kubernetes_transport(api_client, timeout=5.0)), interval=0.1,
                        read_progress=lambda job, kube: copy.deepcopy(cluster.progress),
                        fetch_live=lambda url: _live(cluster))
            s = operator_settings(peering=None)
            s.scanning.disabled = True
            s.posting.enabled = False
            stop = asyncio.Event()
            operator = asyncio.create_task(kopf.operator(
                registry=registry, settings=s, memo=kopf.Memo(deps=deps), clusterwide=True, standalone=True,
                stop_flag=stop))
            try:
                meta = {**body["metadata"], "resourceVersion": "1", "uid": "uid-gpt",
                        "creationTimestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
                await cluster.call("POST", JOBS, {**body, "metadata": meta})
                await asyncio.wait_for(script(cluster), STORY_TIMEOUT)
            finally:
                stop.set()
                await asyncio.wait_for(operator, 15)
                api_client.close()


def _live(cluster: Cluster) -> dict[str, Any]:
    if cluster.live is None:
        raise OSError("connection refused")
    return cluster.live


def run_story(body: dict[str, Any], script: Callable[[Cluster], Any]) -> None:
    logging.getLogger("kopf").setLevel(logging.WARNING)
    asyncio.run(_story(body, script))


def job_body(**spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(S3_JOB)
    body["spec"].update(spec)
    return body


# -- the stories ---------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_preempted_then_resumed_then_succeeded(capsys):
    async def script(c: Cluster) -> None:
        pods = await c.until_pods({"gpt-1-0", "gpt-1-1"})
        st = await c.until_status("Pending attempt 1", lambda s: s.get("phase") == "Pending")
        assert st["attempt"] == 1 and st["restarts"] == {"preemptions": 0, "failures": 0, "neverStarted": 0, "total": 0}
        env = {e["name"]: e for e in pods["gpt-1-0"]["spec"]["containers"][0]["env"]}
        assert env["MASTER_ADDR"]["value"] == "gpt-1-0.gpt.ml.svc"
        assert "value" not in env["AWS_SECRET_ACCESS_KEY"]  # a secretKeyRef, never the secret itself

        # Scheduled and running; rank 0 reports live progress.
        c.live = {"iteration": 12, "trainIters": 40, "tokensPerSecond": 2048.0, "etaSeconds": 95,
                  "lastCheckpoint": {"iteration": 10, "time": "2026-11-22T12:00:09Z"}}
        await c.running("gpt-1-0", "gpt-1-1")
        st = await c.until_status("Running with live progress", lambda s: s.get("phase") == "Running"
                                  and s.get("iteration") == 12)
        assert st["progress"] == "30%" and st["eta"] == "1m35s" and st["tokensPerSecond"] == 2048.0

        # Rank 1's node is preempted: DisruptionTarget, then the trainer saves on SIGTERM and exits 75.
        c.live = None
        c.progress.update(lastCheckpoint={"iteration": 13, "time": "2026-11-22T12:00:13Z"}, iteration=13)
        await c.exited("gpt-1-1", 75, {"exitCode": 75, "reason": "SavedOnSignal", "iteration": 13,
                                       "lastCheckpoint": 13, "message": "received SIGTERM; saved iter_0000013"},
                       conditions=[{"type": "DisruptionTarget", "status": "True",
                                    "reason": "PreemptionByScheduler"}])
        pods = await c.until_pods({"gpt-2-0", "gpt-2-1"})  # the whole gang went, the next one came
        st = await c.until_status("attempt 2", lambda s: s.get("attempt") == 2)
        assert st["restarts"] == {"preemptions": 1, "failures": 0, "neverStarted": 0, "total": 1}
        assert st["lastCheckpoint"]["iteration"] == 13
        env = {e["name"]: e.get("value") for e in pods["gpt-2-1"]["spec"]["containers"][0]["env"]}
        assert env["KUBETRON_EXPECTED_ITERATION"] == "13" and env["KUBETRON_JOB_ID"] == "ml/gpt/2"

        # Attempt 2 trains to the end; every rank exits 0 and the log says train_iters reached.
        await c.running("gpt-2-0", "gpt-2-1")
        await c.until_status("Running attempt 2", lambda s: s.get("phase") == "Running")
        c.progress.update(lastCheckpoint={"iteration": 40, "time": "2026-11-22T12:01:00Z"}, iteration=40,
                          completed=True)
        done = {"exitCode": 0, "reason": "Completed", "iteration": 40, "trainIters": 40, "lastCheckpoint": 40}
        await c.exited("gpt-2-0", 0, done)
        await c.exited("gpt-2-1", 0, done)
        st = await c.until_status("Succeeded", lambda s: s.get("phase") == "Succeeded")
        assert st["progress"] == "100%" and st["iteration"] == 40 and st["completionTime"]
        assert st["lostIterations"] == 0
        assert [cnd["type"] for cnd in st["conditions"] if cnd["status"] == "True"] == ["Succeeded"]

        # A finished job is never rerun: its pods vanishing changes nothing.
        for name in ("gpt-2-0", "gpt-2-1"):
            await c.call("DELETE", f"{PODS}/{name}")
        await asyncio.sleep(0.5)
        assert await c.pods() == {}
        assert (await c.job())["status"]["phase"] == "Succeeded"
        events = [e for (res, _, _), e in c.k8s.objects.items() if res.plural == "events"]
        reasons = [e["reason"] for e in events]
        assert {"AttemptCreated", "Running", "Preempted", "Succeeded"} <= set(reasons)
        job = await c.job()
        print("\n" + kubectl_get(job, datetime.now(UTC)))

    run_story(job_body(), script)
    out = capsys.readouterr().out
    with capsys.disabled():
        print(out)
    header, row = out.strip().splitlines()[-2:]
    assert header.split() == ["NAME", "PHASE", "PROGRESS", "ITERATION", "RESTARTS", "ETA", "AGE"]
    assert row.split()[:6] == ["gpt", "Succeeded", "100%", "40", "1", "0s"]


@pytest.mark.timeout(90)
def test_trainer_errors_past_backoff_limit_fail_the_job():
    async def script(c: Cluster) -> None:
        for attempt in (1, 2):
            await c.until_pods({f"gpt-{attempt}-0", f"gpt-{attempt}-1"})
            await c.running(f"gpt-{attempt}-0", f"gpt-{attempt}-1")
            c.progress.update(lastCheckpoint={"iteration": 10 * attempt, "time": "t"})  # progress is made
            await c.exited(f"gpt-{attempt}-0", 1, {"exitCode": 1, "reason": "TrainerError",
                                                   "message": "RuntimeError: boom"})
        st = await c.until_status("Failed", lambda s: s.get("phase") == "Failed")
        assert st["reason"] == "BackoffLimitExceeded" and "RuntimeError: boom" in st["message"]
        assert st["restarts"] == {"preemptions": 0, "failures": 2, "neverStarted": 0, "total": 2}
        await asyncio.sleep(0.5)
        assert all(not name.startswith("gpt-3") for name in await c.pods())  # no third attempt

    run_story(job_body(backoffLimit=1), script)


@pytest.mark.timeout(90)
def test_config_error_fails_at_once():
    async def script(c: Cluster) -> None:
        await c.until_pods({"gpt-1-0", "gpt-1-1"})
        await c.running("gpt-1-0", "gpt-1-1")
        await c.exited("gpt-1-0", 2, {"exitCode": 2, "reason": "ConfigError", "message": "optimizer.lr: must be > 0"})
        st = await c.until_status("Failed", lambda s: s.get("phase") == "Failed")
        assert st["reason"] == "ConfigError" and st["message"] == "optimizer.lr: must be > 0"
        await c.until_pods({"gpt-1-0"})  # the rank still running was stopped; the failed one is kept for logs

    run_story(job_body(), script)


@pytest.mark.timeout(90)
def test_suspend_and_unsuspend():
    async def script(c: Cluster) -> None:
        await c.until_pods({"gpt-1-0", "gpt-1-1"})
        await c.running("gpt-1-0", "gpt-1-1")
        await c.until_status("Running", lambda s: s.get("phase") == "Running")
        c.progress.update(lastCheckpoint={"iteration": 8, "time": "t"})
        await c.call("PATCH", f"{JOBS}/gpt", {"spec": {"suspend": True}}, "application/merge-patch+json")
        st = await c.until_status("Suspended", lambda s: s.get("phase") == "Suspended")
        await c.until_pods(set())
        assert st["restarts"]["total"] == 0
        await asyncio.sleep(0.3)
        assert await c.pods() == {}  # stays suspended
        await c.call("PATCH", f"{JOBS}/gpt", {"spec": {"suspend": False}}, "application/merge-patch+json")
        pods = await c.until_pods({"gpt-2-0", "gpt-2-1"})
        st = await c.until_status("Pending attempt 2", lambda s: s.get("attempt") == 2 and s["phase"] == "Pending")
        assert st["restarts"]["total"] == 0
        env = {e["name"]: e.get("value") for e in pods["gpt-2-0"]["spec"]["containers"][0]["env"]}
        assert env["KUBETRON_EXPECTED_ITERATION"] == "8"

    run_story(job_body(), script)


@pytest.mark.timeout(90)
def test_deletion_removes_children_and_stops_reconciling():
    async def script(c: Cluster) -> None:
        await c.until_pods({"gpt-1-0", "gpt-1-1"})
        await c.until_status("Pending", lambda s: s.get("phase") == "Pending")
        await c.call("DELETE", f"{JOBS}/gpt")

        async def gone() -> bool:
            return await c.job() is None and await c.pods() == {}
        await c.until("job and pods deleted", gone)
        await asyncio.sleep(0.5)
        assert await c.pods() == {}  # nothing recreated

    run_story(job_body(), script)
