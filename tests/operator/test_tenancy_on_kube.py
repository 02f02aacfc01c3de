"""Tenant safety on the real API server (the pure parts: test_tenancy.py; docs/security.md).

A tenant is a ServiceAccount allowed only TrainingJobs in its own namespace (KubeEnv.tenant). The real
`kubetron operator` runs under the chart's RBAC, watching the tenant's namespace and a victim's, with AWS
credentials of its own in its environment (OPERATOR_KEY) and an S3 endpoint of its own (`own`). Everything a
tenant can name is a local server that records every request: a fake S3 store (`store`), a store that sends a
byte every 2 s, rank 0 status ports that redirect or nest their JSON, and the fault proxy in front of the real
S3 server. The module runs one operator for all its tests (they build on each other only through it):

1. a name outside the namespace is refused at apply, and a job stored before the schema said so fails
   naming the field, with no request for the other namespace's Secret;
2. S3 requests are signed with the job's Secret only; a Secret without a key is a status reason naming it;
   a job without a secretRef is read only in a bucket the admin listed, with the operator's identity;
3. 16 slow jobs of the tenant delay a job of the victim by less than 10 s, their series leave /metrics once
   they are deleted mid-read, and a 32 MiB progress log grows the operator's peak memory by less than 64 MiB;
4. rank 0's endpoint: no redirect followed, a slow one cut off;
5. a pod of the tenant's naming the victim's job as its controller does not end the victim's attempt;
6. hostile termination messages are ignored with a warning, the job still decided, no control character
   reaching status, Events or the operator's log;
7. a tenant that picks a node and controls its pods' output cannot get it tainted, nor flood Events,
   nor break status; a node is tainted only on evidence no tenant controls, carries the namespace, is never a
   control-plane node, one per namespace at a time, and the operator removes the taint; a job's avoidance yields
   rather than leave it no node; the shipped admission policy bounds spec.scheduling. Deleted jobs' series
   leave /metrics (3.).
"""

from __future__ import annotations

import base64
import copy
import json
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubetron.contract.progress import saved_checkpoint_line, starting_job_line
from kubetron.contract.times import stamp

from tests.faultproxy import FaultProxy
from tests.kube.cluster import Api, ApiError, Kubelet, free_port, set_exited, set_running
from tests.kube.fixtures import ROOT, KubeEnv, Operator
from tests.operator.endpoints import Endpoint
from tests.operator.jobs import tj
from tests.operator.status_endpoint import StatusEndpoint

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

OPERATOR_KEY, TENANT_KEY, VICTIM_KEY = "OPERATORENVKEY01", "TENANTKEY0000001", "VICTIMKEY0000001"
OWN_BUCKET, STORE_BUCKET = "operator-readable", "tenant-bkt"
CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/trainingjobs.kubetron.dev"
MiB = 2**20
KEEP = "kubetron.dev/test-keep"  # a finalizer of the test's own
TAINT_SECONDS = 15  # --taint-seconds: how long a failing node's taint stays (the chart's default is an hour)
METRICS_PORT = free_port()


def log_text(checkpoint: int, job_id: str) -> bytes:
    return "\n".join([starting_job_line(0, 40, num_gpus=1, job_id=job_id),
                      saved_checkpoint_line(checkpoint, 1.0, 1.0, 1e12, 1024, 40, num_gpus=1, job_id=job_id)]).encode()


@dataclass
class World:
    kube: KubeEnv
    tenant: Api  # the tenant's identity: TrainingJobs in `ns` only
    ns: str
    victim: str
    op: Operator
    own: Endpoint  # the operator's own S3 endpoint (AWS_ENDPOINT_URL of its environment)
    store: Endpoint  # the S3 endpoint the tenant's jobs name

    def s3_job(self, name: str, *, bucket: str = STORE_BUCKET, endpoint: str | None = None,
               secret: str | None = "creds", prefix: str = "runs", **spec: Any) -> dict[str, Any]:
        body = tj(self.ns, name, nodes=1, statusPort=0, **spec)
        s3 = {"bucket": bucket, "prefix": prefix, "region": "us-east-1",
              "endpoint": self.store.url if endpoint is None else endpoint}
        body["spec"]["storage"] = {"s3": {**s3, **({"secretRef": {"name": secret}} if secret else {})}}
        return body

    def pvc_job(self, name: str, ns: str | None = None, **spec: Any) -> dict[str, Any]:
        body = tj(ns or self.ns, name, **{"nodes": 1, "statusPort": 0, **spec})
        body["spec"]["storage"] = {"pvc": {"claimName": "ckpt"}}
        return body

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """As the tenant."""
        return self.tenant.create(self.kube.jobs(self.ns), body)

    def status(self, name: str, what: str, pred: Any, ns: str | None = None, timeout: float = 30) -> dict[str, Any]:
        return self.kube.wait_status(ns or self.ns, name, what, pred, timeout=timeout)

    def warnings(self, ns: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.kube.events(ns or self.ns) if e["type"] == "Warning"]

    def pods(self, names: set[str], ns: str | None = None) -> dict[str, dict[str, Any]]:
        """The worker pods `names` (of `ns`), once they all exist."""
        return self.kube.wait_for(f"pods {sorted(names)}", lambda: (
            lambda pods: pods if names <= set(pods) else None)(self.kube.pods(ns or self.ns)))


def secret(kube: KubeEnv, ns: str, name: str, **data: str) -> None:
    kube.admin.create(f"/api/v1/namespaces/{ns}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}})


@pytest.fixture(scope="module")
def world(kube, s3_server):
    ns, victim = kube.namespace("tenant"), kube.namespace("victim")
    # The operator's pods pass the `restricted` Pod Security Standard (docs/security.md): enforced here.
    kube.admin.patch(f"/api/v1/namespaces/{ns}", {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted"}}})
    tenant = kube.tenant(ns)
    secret(kube, victim, "their-creds", AWS_ACCESS_KEY_ID=VICTIM_KEY, AWS_SECRET_ACCESS_KEY="victim-secret")
    secret(kube, ns, "creds", AWS_ACCESS_KEY_ID=TENANT_KEY, AWS_SECRET_ACCESS_KEY="tenant-secret")
    secret(kube, ns, "half", AWS_ACCESS_KEY_ID=TENANT_KEY)
    secret(kube, ns, "nokeys", aws_access_key_id=TENANT_KEY, aws_secret_access_key="tenant-secret")
    secret(kube, ns, "seaweed", AWS_ACCESS_KEY_ID=s3_server.access_key, AWS_SECRET_ACCESS_KEY=s3_server.secret_key)
    own = Endpoint.objects({f"/{OWN_BUCKET}/runs/{ns}/optin/progress.txt": log_text(5, f"{ns}/optin/0")})
    store = Endpoint.objects({f"/{STORE_BUCKET}/runs/{ns}/mine/progress.txt": log_text(7, f"{ns}/mine/0")})
    env = {"AWS_ACCESS_KEY_ID": OPERATOR_KEY, "AWS_SECRET_ACCESS_KEY": "operator-secret",
           "AWS_SESSION_TOKEN": "operator-session-token", "AWS_ENDPOINT_URL": own.url, "AWS_REGION": "us-east-1"}
    try:
        with kube.operator(ns, f"--namespace={victim}", f"--s3-operator-buckets={OWN_BUCKET}", "--taint-failing-nodes",
                           f"--taint-seconds={TAINT_SECONDS}", f"--metrics-port={METRICS_PORT}", env=env) as op:
            yield World(kube, tenant, ns, victim, op, own, store)
    finally:
        own.close()
        store.close()


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or () if c["type"] == kind), {})


# -- 1. names ---------------------------------------------------------------------------------------------


def refused_at_apply(w: World) -> dict[str, dict[str, Any]]:
    steal = f"../../{w.victim}/secrets/their-creds"
    volume = {"spec": {"volumes": [{"name": "v", "secret": {"secretName": steal}}]}}
    return {
        "spec.storage.s3.secretRef.name": w.s3_job("steal", secret=steal),
        "spec.serviceAccountName": w.pvc_job("sa", serviceAccountName="../../kube-system/serviceaccounts/x"),
        "spec.podTemplate.spec.volumes[0].secret.secretName": w.pvc_job("vol", podTemplate=volume),
        "spec.storage.s3.prefix": w.s3_job("prefix", prefix=f"runs/../../{w.victim}"),
        "spec.nodes": w.pvc_job("wide", nodes=4096, config="train: {train_iters: 4}\n#" + "x" * 20_000 + "\n"),
    }


def test_a_name_outside_the_namespace_is_refused_at_apply_and_never_requested(world):
    w, admin = world, world.kube.admin
    for field, body in refused_at_apply(w).items():
        with pytest.raises(ApiError) as refused:
            w.create(body)
        assert refused.value.status == 422 and field in str(refused.value), (field, str(refused.value))
        assert "\n" not in str(refused.value)

    # A job stored before the schema said so (the pattern taken off, then put back): the operator's own
    # admission fails it naming the field, and no request ever names the victim's Secret.
    stolen = w.s3_job("steal", secret=f"../../{w.victim}/secrets/their-creds")
    probe = w.s3_job("steal-probe", secret=f"../../{w.victim}/secrets/their-creds")
    with loose_secret_ref(admin, lambda: w.tenant.create(w.kube.jobs(w.ns), probe, query={"dryRun": "All"})):
        w.create(stolen)
    st = w.status("steal", "Failed", lambda s: s.get("phase") == "Failed")
    assert st["reason"] == "InvalidSpec" and st["message"].startswith("spec.storage.s3.secretRef.name: must be"), st
    assert not [c for c in w.kube.operator_calls(w.victim) if c[1] == "secrets"]
    assert w.store.carrying(VICTIM_KEY) == [] and w.store.carrying(f"/{w.ns}/steal/") == []


class loose_secret_ref:  # noqa: N801 - a context manager read as a phrase
    """The CRD without the pattern of spec.storage.s3.secretRef.name while the block runs (`probe()` creates a
    job the pattern refuses; it is retried until the API server serves the looser schema, and after the block
    until it refuses again)."""

    def __init__(self, admin: Api, probe: Any):
        self.admin, self.probe = admin, probe

    def __enter__(self) -> None:
        self.original = self.admin.get(CRD)
        loose = copy.deepcopy(self.original)
        ref = _secret_ref(loose)["properties"]["name"]
        ref.pop("pattern")
        self.admin.request("PUT", CRD, loose)
        _until(lambda: self._probe() == "accepted", "the looser schema")

    def __exit__(self, *exc: object) -> None:
        current = self.admin.get(CRD)
        self.admin.request("PUT", CRD, {**current, "spec": self.original["spec"]})
        _until(lambda: self._probe() == "refused", "the schema put back")

    def _probe(self) -> str:
        try:
            self.probe()
        except ApiError as exc:
            return "refused" if exc.status == 422 else str(exc)
        return "accepted"


def _secret_ref(crd: dict[str, Any]) -> dict[str, Any]:
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["storage"]["properties"]["s3"]["properties"]["secretRef"]


def _until(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# -- 2. whose credentials ---------------------------------------------------------------------------------


def test_s3_requests_are_signed_only_with_the_jobs_secret(world):
    """A Secret whose keys are misnamed would have the operator fall back to its own identity: its read is
    refused instead, naming the Secret and the keys. The tenant's endpoint never sees the operator's key."""
    w = world
    w.create(w.s3_job("nokeys", secret="nokeys"))  # aws_access_key_id ...: neither key the operator reads
    w.create(w.s3_job("half", secret="half"))
    w.create(w.s3_job("mine", overrides=["logger.tensorboard_dir=/ckpt/tb-$(KUBETRON_JOB_ID)"]))
    assert w.status("mine", "the store's checkpoint", lambda s: s.get("lastCheckpoint"))["lastCheckpoint"][
        "iteration"] == 7
    assert w.store.carrying(OPERATOR_KEY) == [] and w.store.carrying("operator-session") == []

    for name, missing in (("nokeys", "AWS_ACCESS_KEY_ID or AWS_SECRET_ACCESS_KEY"), ("half", "AWS_SECRET_ACCESS_KEY")):
        st = w.status(name, "StoreReadable False", lambda s: condition(s, "StoreReadable"))
        assert condition(st, "StoreReadable") | {"lastTransitionTime": ""} == {
            "type": "StoreReadable", "status": "False", "reason": "SecretKeyMissing", "lastTransitionTime": "",
            "message": f"Secret {name} has no key {missing}; the operator reads the job's store only with "
                       "the job's own credentials"}
    w.kube.wait_for("a SecretKeyMissing event", lambda: [e for e in w.warnings() if e["reason"] == "SecretKeyMissing"])

    w.create(w.s3_job("irsa", secret=None))  # the pods' ServiceAccount gives them credentials
    w.create(w.s3_job("optin", secret=None, bucket=OWN_BUCKET, endpoint=""))  # the admin listed the bucket
    assert w.status("optin", "the own store's checkpoint", lambda s: s.get("lastCheckpoint"))["lastCheckpoint"][
        "iteration"] == 5
    pods = w.pods({"irsa-1-0", "mine-1-0", "half-1-0", "nokeys-1-0", "optin-1-0"})
    assert not [e for e in pods["irsa-1-0"]["spec"]["containers"][0]["env"] if e["name"].startswith("AWS_ACCESS")]
    assert "StoreReadable" not in json.dumps(w.kube.job(w.ns, "irsa")["status"])

    # Every request to the tenant's endpoint: the tenant's key, for the one job with a Secret with both keys.
    assert w.store.carrying(OPERATOR_KEY) == [] and w.store.carrying("operator-session") == []
    assert len(w.store.carrying(f"X-Amz-Credential={TENANT_KEY}%2F")) == len(w.store.requests)
    assert {r["path"].partition("?")[0] for r in w.store.requests} == {
        f"/{STORE_BUCKET}/runs/{w.ns}/mine/progress.txt"}  # never half's, nokeys' or irsa's
    # The operator's own identity only at its own endpoint, only for the listed bucket.
    assert w.own.requests and all(f"X-Amz-Credential={OPERATOR_KEY}%2F" in r["path"] and f"/{OWN_BUCKET}/" in r["path"]
                                  for r in w.own.requests)
    # $(VAR) in an override: the pod carries it escaped, so the kubelet gives the trainer the literal.
    assert "logger.tensorboard_dir=/ckpt/tb-$$(KUBETRON_JOB_ID)" in pods["mine-1-0"]["spec"]["containers"][0]["args"]


# -- 3. slow and huge stores --------------------------------------------------------------------------------


def peak_rss(op: Operator) -> int:
    """The operator process's peak resident memory so far (VmHWM), in bytes."""
    status = Path(f"/proc/{op.proc.pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def test_a_huge_progress_log_is_read_by_its_tail(world, s3_server):
    w = world
    bucket, job_id = s3_server.new_bucket(), f"{w.ns}/huge/1"
    line = saved_checkpoint_line(1, 1.0, 1.0, 1e12, 1024, 10**6, num_gpus=1, job_id=job_id) + "\n"
    body = (line * (33 * MiB // len(line))).encode() + log_text(123456, job_id)
    s3_server.client().put_object(Bucket=bucket, Key=f"runs/{w.ns}/huge/progress.txt", Body=body)
    with FaultProxy(s3_server.endpoint) as proxy:
        before = peak_rss(w.op)
        w.create(w.s3_job("huge", bucket=bucket, endpoint=proxy.endpoint, secret="seaweed"))
        st = w.status("huge", "the last checkpoint of a 33 MiB log", lambda s: s.get("lastCheckpoint"))
        grown = peak_rss(w.op) - before
    assert len(body) > 32 * MiB and st["lastCheckpoint"]["iteration"] == 123456
    assert grown <= 64 * MiB, f"the operator's peak memory grew by {grown / MiB:.0f} MiB"
    print(f"\n[tenancy] peak RSS of the operator grew by {grown / MiB:.1f} MiB reading a {len(body) / MiB:.0f} MiB log")
    gets = [r for r in proxy.requests if r["path"].startswith(f"/{bucket}/")]
    assert gets and all(r["headers"].get("Range") == "bytes=-262144" for r in gets)


def settled(count: Any, quiet: float = 1.5, timeout: float = 30.0) -> int:
    """`count()` once it is above 0 and has not changed for `quiet` seconds."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif now > 0 and time.monotonic() - since >= quiet:
            return now
        time.sleep(0.1)
    raise AssertionError(f"still changing after {timeout:.0f}s: {last}")


def scrape() -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5) as answer:
        return answer.read().decode()


def series(ns: str, jobs: list[str]) -> list[str]:
    """The lines of the operator's /metrics naming one of `jobs` of namespace `ns`."""
    return [line for line in scrape().splitlines() if f'namespace="{ns}"' in line
            and any(f'name="{job}"' in line for job in jobs)]


def jobs_counted() -> int:
    """kubetron_trainingjobs summed over the phases: the jobs the operator's /metrics counts."""
    return int(sum(float(line.split()[-1]) for line in scrape().splitlines()
                   if line.startswith("kubetron_trainingjobs{")))


def test_slow_endpoints_of_a_tenant_delay_another_namespace_by_less_than_10s(world):
    """16 jobs (as many as the operator has reconcile threads) whose store sends a byte every 2 s: once their
    reads are under way (as many as the operator lets run at once), the victim's new job still gets its pods
    and status within 10 s, and /healthz stays healthy."""
    w, admin = world, world.kube.admin
    drip = Endpoint.drip(every=2.0)
    names = [f"slow-{i}" for i in range(16)]
    counted = jobs_counted()
    try:
        for name in names:
            w.create(w.s3_job(name, endpoint=drip.url))
        in_flight = settled(lambda: len(drip.requests))
        t0 = time.monotonic()
        admin.create(w.kube.jobs(w.victim), w.pvc_job("gpt", ns=w.victim, nodes=2))
        w.status("gpt", "attempt 1", lambda s: s.get("attempt") == 1, ns=w.victim, timeout=60)
        delay = time.monotonic() - t0
        print(f"\n[tenancy] the victim's job had its status {delay:.1f}s after it was created "
              f"({in_flight} slow reads under way)")
        assert delay < 10.0 and w.op.healthy()
        st = w.status("slow-0", "StoreTimeout", lambda s: condition(s, "StoreReadable"))
        assert condition(st, "StoreReadable")["reason"] == "StoreTimeout"
        # Deleted while their reads are under way: their series leave /metrics (6 of 16 were left once).
        assert series(w.ns, names)
        for name in names:
            w.tenant.delete(f"{w.kube.jobs(w.ns)}/{name}")
        w.kube.wait_for("the deleted jobs' series gone", lambda: not series(w.ns, names), 60)
        assert jobs_counted() == counted + 1  # the victim's job only
    finally:
        drip.close()
        for name in names:
            w.tenant.delete(f"{w.kube.jobs(w.ns)}/{name}", ok=(404,))


# -- 4. rank 0's endpoint ---------------------------------------------------------------------------------


def test_rank_0s_endpoint_is_read_bounded(world):
    """A redirect is not followed (its target gets nothing), a rank 0 that sends a byte every 2 s is cut off
    at 2 s; each with a warning, the job running on."""
    w = world
    target = Endpoint.serve(json.dumps({"iteration": 999, "trainIters": 1000}).encode())
    hops, drip = Endpoint.redirect(f"{target.url}/status"), Endpoint.drip(every=2.0)
    try:
        w.create(w.pvc_job("hops", statusPort=hops.port))
        w.create(w.pvc_job("drips", statusPort=drip.port))
        w.pods({"hops-1-0", "drips-1-0"})
        for pod in ("hops-1-0", "drips-1-0"):
            set_running(w.kube.admin, w.ns, pod)
        problems = {hops.port: "redirect, not followed", drip.port: "no answer within 2s"}
        w.kube.wait_for("a warning for each", lambda: all(any(
            e["reason"] == "TrainerOutputIgnored" and f":{port}/status" in e["message"] and why in e["message"]
            for e in w.warnings()) for port, why in problems.items()))
        assert hops.requests and target.requests == []
        assert w.kube.job(w.ns, "hops")["status"].get("iteration") != 999
        assert w.kube.job(w.ns, "drips")["status"]["phase"] == "Running"
    finally:
        for endpoint in (target, hops, drip):
            endpoint.close()


# -- 5. whose pods ----------------------------------------------------------------------------------------


def test_a_pod_elsewhere_naming_a_jobs_uid_does_not_end_its_attempt(world):
    """A failed pod in the tenant's namespace, with the victim's job's labels and a controller reference to
    its UID (kept by a finalizer: the garbage collector deletes a pod whose owner is not in its namespace),
    is not the victim's: its attempt runs on."""
    w, admin = world, world.kube.admin
    victim = admin.create(w.kube.jobs(w.victim), w.pvc_job("owned", ns=w.victim, nodes=2))
    pods = w.pods({"owned-1-0", "owned-1-1"}, ns=w.victim)
    for name in ("owned-1-0", "owned-1-1"):
        set_running(admin, w.victim, name)
    w.status("owned", "Running", lambda s: s.get("phase") == "Running", ns=w.victim)
    forged = copy.deepcopy(pods["owned-1-1"])
    forged["metadata"] = {**{k: forged["metadata"][k] for k in ("name", "labels", "ownerReferences")},
                          "finalizers": [KEEP]}
    assert forged["metadata"]["ownerReferences"][0]["uid"] == victim["metadata"]["uid"]
    trainer = pods["owned-1-1"]["spec"]["containers"][0]  # restricted, as the namespace enforces
    forged["spec"] = {"securityContext": pods["owned-1-1"]["spec"]["securityContext"], "nodeName": "node-1",
                      "containers": [{k: trainer[k] for k in ("name", "image", "securityContext")}]}
    admin.create(f"/api/v1/namespaces/{w.ns}/pods", forged)
    try:
        set_exited(admin, w.ns, "owned-1-1", 1, {"exitCode": 1, "reason": "TrainerError", "message": "forged"})
        time.sleep(2)  # the operator has seen the pod's watch events
        admin.patch(f"{w.kube.jobs(w.victim)}/owned", {"metadata": {"annotations": {"poke": "1"}}})  # decide again
        time.sleep(2)
        st = w.kube.job(w.victim, "owned")["status"]
        assert st["phase"] == "Running" and st["attempt"] == 1 and st["restarts"]["failures"] == 0, st
    finally:
        admin.patch(f"/api/v1/namespaces/{w.ns}/pods/owned-1-1", {"metadata": {"finalizers": None}})


# -- 6. what trainers say ----------------------------------------------------------------------------------


FORGED = "2026-01-01 00:00:00,000 WARNING kubetron.api: FORGED by a trainer"


def test_hostile_trainer_output_is_ignored_and_the_job_still_decided(world):
    """A termination message nested 2000 deep, one with a number beyond int64, rank 0's status nested 3000
    deep: each ignored with a warning, each job decided by its exit code (the API server would refuse a
    status with such a number; a parser without bounds fails every reconcile). A message that forges a line
    of the operator's log reaches status, Events and the log escaped. One pod per job: the pod that ends an
    attempt is the one the operator reads."""
    w, admin = world, world.kube.admin
    deep = Endpoint.serve(b'{"iteration": 3, "x": ' + b"[" * 3000 + b"]" * 3000 + b"}")
    said = {"nested": '{"exitCode": 1, "x": ' + "[" * 2000 + "]" * 2000 + "}",
            "big": {"exitCode": 1, "iteration": 2**63},
            "forge": {"exitCode": 1, "message": f"boom\n{FORGED}\x1b[2K"}}
    try:
        for name in said:
            w.create(w.pvc_job(name, statusPort=deep.port if name == "nested" else 0))
        w.pods({f"{name}-1-0" for name in said})
        for name in said:
            set_running(admin, w.ns, f"{name}-1-0")
        for name in said:
            w.status(name, "Running", lambda s: s.get("phase") == "Running")
        for name, message in said.items():
            set_exited(admin, w.ns, f"{name}-1-0", 1, message)
        for name in said:
            st = w.status(name, "Restarting", lambda s: s.get("phase") == "Restarting")
            assert st["reason"] == "TrainerError" and st["restarts"]["failures"] == 1, st
        assert f"pod forge-1-0 exited 1 (TrainerError): boom\\n{FORGED}\\x1b[2K" in st["message"], st
        ignored = {"nested-1-0": "nested more than 16 levels deep", "big-1-0": "beyond int64",
                   f":{deep.port}/status": "nested more than 16 levels deep"}
        w.kube.wait_for("a warning for each payload ignored", lambda: all(any(
            e["reason"] == "TrainerOutputIgnored" and where in e["message"] and why in e["message"]
            for e in w.warnings()) for where, why in ignored.items()))
    finally:
        deep.close()
    messages = [e["message"] for e in w.kube.events(w.ns)] + [w.kube.job(w.ns, "forge")["status"]["message"]]
    assert not [m for m in messages if "\x1b" in m or f"\n{FORGED}" in m]
    assert not [line for line in w.op.log().splitlines() if line.startswith(FORGED)], w.op.tail()
    assert f"boom\\n{FORGED}\\x1b[2K" in w.op.log()  # logged, on one line


# -- 7. nodes, counts, times and metrics a tenant's pods cannot turn against others -----------------------


SICK = {"type": "GpuXidError", "status": "True", "reason": "Xid79", "message": "GPU has fallen off the bus"}
CONTROL_PLANE = "node-role.kubernetes.io/control-plane"
EVERYTHING = [{"operator": "Exists"}]  # a toleration of every taint: what spec.scheduling lets a tenant ask for


def pool_nodes(w: World, pool: str) -> dict[str, Kubelet]:
    """n1 (healthy), n2 and n4 (reporting a GPU problem, as node-problem-detector would), n3 (a control-plane
    node with the same problem): tainted `pool` so only this test's jobs land there."""
    out = {}
    for short in ("n1", "n2", "n3", "n4"):
        name = f"{w.ns}-{short}"
        out[short] = Kubelet(w.kube.admin, name=name).start()
        labels = {pool: "1", **({CONTROL_PLANE: ""} if short == "n3" else {})}
        w.kube.admin.patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": labels}, "spec": {
            "taints": [{"key": pool, "value": "1", "effect": "NoSchedule"}]}})
        if short != "n1":
            node = w.kube.admin.get(f"/api/v1/nodes/{name}")
            w.kube.admin.patch(f"/api/v1/nodes/{name}/status", {"status": {
                "conditions": [*node["status"]["conditions"], {**SICK, "lastTransitionTime": node["status"][
                    "conditions"][0]["lastTransitionTime"]}]}})
    return out


def pinned(w: World, name: str, node: str, tolerations: list[dict[str, Any]], ns: str | None = None,
           **spec: Any) -> dict[str, Any]:
    """A 1-pod job on `node` (nodeSelector by hostname), its store an S3 prefix the operator does not read."""
    body = w.pvc_job(name, ns=ns, **spec, scheduling={"nodeSelector": {"kubernetes.io/hostname": node},
                                                       "tolerations": tolerations})
    body["spec"]["storage"] = {"s3": {"bucket": STORE_BUCKET, "prefix": "pinned", "endpoint": w.store.url}}
    return body


def taint_of(w: World, node: str) -> dict[str, Any] | None:
    taints = w.kube.admin.get(f"/api/v1/nodes/{node}")["spec"].get("taints") or []
    return next((t for t in taints if t["key"] == "kubetron.dev/failing-node"), None)


def events_of(w: World, ns: str, job: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in w.kube.events(ns) if e["involvedObject"]["name"] == job and e["reason"] == reason]


def hang_said(**kw: Any) -> dict[str, Any]:
    return {"rank": 0, "nodeRank": 0, "localRank": 0, "phase": "train", "iteration": 3, "idleSeconds": 50.0,
            "timeoutSeconds": 45.0, "state": "stopped", "where": "", "ranks": 1, "stacks": "", "restart": 1, **kw}


def test_a_tenants_pods_take_no_node_flood_nothing_and_break_no_status(world):
    """One scenario, every job pinned to a node by hostname as a tenant may pin it. In the tenant's namespace,
    with a toleration of every taint: `e` (rank 0 says 2 in-place restarts, a hang with 56 KB of report, then
    300 restarts, then its pod ends Hung with the hang in its termination message), `g` (a trainerTime of
    `steps: -1, train: 1e308`, then a SIGSEGV with "CUDA error" words), `c` (fails on a control-plane node that
    reports a GPU problem). In the victim's: `v` and `w` fail on two nodes that report a GPU problem."""
    w, admin, victim = world, world.kube.admin, world.victim
    pool = f"kubetron.dev/pool-{w.ns}"
    ours = [{"key": pool, "operator": "Exists"}]
    nodes = pool_nodes(w, pool)
    name = {short: k.name for short, k in nodes.items()}
    e_rank0, g_rank0 = StatusEndpoint(), StatusEndpoint()
    try:
        e_rank0.live = {"iteration": 3, "inPlaceRestarts": 2, "hangs": 1, "lastHang": hang_said(where="w" * 56_000),
                        "lastRestart": {"restart": 2, "rank": 0, "nodeRank": 0, "how": "was killed by SIGSEGV"}}
        g_rank0.live = {"iteration": 3, "trainerTime": {"started": stamp(datetime.now(UTC) - timedelta(seconds=10)),
                                                         "steps": -1, "train": 1e308, "checkpoint": 0.0,
                                                         "evaluation": 0.0}}
        jobs = {(w.ns, "e"): pinned(w, "e", name["n1"], EVERYTHING, statusPort=e_rank0.port, backoffLimit=0),
                (w.ns, "g"): pinned(w, "g", name["n1"], EVERYTHING, statusPort=g_rank0.port, backoffLimit=0),
                (w.ns, "c"): pinned(w, "c", name["n3"], EVERYTHING, backoffLimit=0),
                (victim, "v"): pinned(w, "v", name["n2"], ours, ns=victim),
                (victim, "w"): pinned(w, "w", name["n4"], ours, ns=victim)}
        for (ns, _), body in jobs.items():
            (w.create if ns == w.ns else lambda b: admin.create(w.kube.jobs(victim), b))(body)
        for ns in (w.ns, victim):
            w.kube.wait_for(f"the pods of {ns} bound", lambda ns=ns: all(
                p["spec"].get("nodeName") for job in "egcvw" if (ns, job) in jobs
                for p in [w.kube.pods(ns).get(f"{job}-1-0") or {"spec": {}}]), 60)
            for ns_job in [k for k in jobs if k[0] == ns]:
                set_running(admin, ns, f"{ns_job[1]}-1-0")
        for job in "vw":  # a crash of the victim's own on a node that reports a GPU problem
            set_exited(admin, victim, f"{job}-1-0", 1, {"exitCode": 1, "message": "RuntimeError: boom"})
        set_exited(admin, w.ns, "c-1-0", 1, {"exitCode": 1, "message": "RuntimeError: boom"})

        # -- item 2: rank 0's counts believed up to the spec, one event, strings cut short ---------------
        st = w.status("e", "2 in-place restarts counted", lambda s: (s.get("restarts") or {}).get("inPlace") == 2)
        assert st["restarts"]["hangs"] == 1 and len(st["lastHang"]["where"]) <= 300
        assert "failingNodes" not in st and "avoidNodes" not in st  # a crash and a hang are no evidence
        once = w.kube.wait_for("e's RestartedInPlace event", lambda: events_of(w, w.ns, "e", "RestartedInPlace"))
        assert len(once) == 1 and "restarted 2 times" in once[0]["message"]
        e_rank0.live = {**e_rank0.live, "inPlaceRestarts": 300}
        w.kube.wait_for("300 restarts refused", lambda: [e for e in events_of(w, w.ns, "e", "TrainerOutputIgnored")
                                                         if "maxInPlaceRestarts 3" in e["message"]])
        # -- item 4: a trainerTime no process can have spent is refused; status keeps being written -------
        w.kube.wait_for("g's trainerTime refused", lambda: [e for e in events_of(w, w.ns, "g", "TrainerOutputIgnored")
                                                            if "trainerTime.steps is not a count" in e["message"]])
        # -- item 1: a node reporting a problem is tainted for the victim's namespace, one at a time --------
        for job in "vw":
            w.kube.wait_for(f"{job} keeps off its node", lambda job=job: events_of(w, victim, job, "NodeAvoided"))
        tainted = {short: taint_of(w, name[short]) for short in ("n2", "n4")}
        (hit,) = [short for short, t in tainted.items() if t]
        assert tainted[hit] == {"key": "kubetron.dev/failing-node", "value": victim, "effect": "NoSchedule"}
        note = json.loads(admin.get(f"/api/v1/nodes/{name[hit]}")["metadata"]["annotations"][
            "kubetron.dev/failing-node"])
        assert note["namespace"] == victim and "GpuXidError=True" in note["evidence"] and note["until"]
        assert f"jobs of namespace {victim} triggered 1 taint(s) still in place" in w.op.log()
        w.kube.wait_for("c keeps off its node", lambda: events_of(w, w.ns, "c", "NodeAvoided"))
        assert taint_of(w, name["n3"]) is None and "is a control-plane node: never tainted" in w.op.log()

        # -- the functional bug: a pod that ends Hung names the hang -------------------------------------
        set_exited(admin, w.ns, "e-1-0", 7, {"exitCode": 7, "reason": "Hung", "message": "the gang hung",
                                             "hang": hang_said(where="x" * 3000, restart=0)})
        set_exited(admin, w.ns, "g-1-0", 139, {"exitCode": 139, "message": "CUDA error: an illegal memory access "
                                                                           "was encountered; killed by SIGSEGV"})
        st = w.status("e", "Failed, hung", lambda s: s.get("phase") == "Failed")
        assert st["restarts"]["inPlace"] == 2 and st["restarts"]["hangs"] == 2, st["restarts"]
        last = st["lastHang"]
        assert (last["pod"], last["node"], last["restartedInPlace"], len(last["where"])) == (
            "e-1-0", name["n1"], False, 300)
        g = w.status("g", "Failed", lambda s: s.get("phase") == "Failed")
        assert all(0 <= v < 1e12 for v in g["goodput"]["seconds"].values()) and 0 <= g["goodput"]["ratio"] <= 1
        for status in (st, g):
            assert "failingNodes" not in status and "avoidNodes" not in status
        assert taint_of(w, name["n1"]) is None  # the node the tenant picked: no taint, whatever its pods said
        assert not [job for job in "eg" if f"reconcile of {w.ns}/{job} failed" in w.op.log()]  # no patch refused

        # -- item 6: the victim's next attempt yields the avoidance that would leave it no node ------------
        st = w.status("v", "attempt 2", lambda s: s.get("attempt") == 2, ns=victim, timeout=60)
        (cond,) = [c for c in st["conditions"] if c["type"] == "NodesAvoided"]
        assert cond["reason"] == "Yielded" and f"avoiding {name['n2']} too would leave room for 0" in cond["message"]
        pod = w.kube.wait_for("v's attempt 2", lambda: w.kube.pods(victim).get("v-2-0"))
        assert "affinity" not in pod["spec"], pod["spec"].get("affinity")
        w.kube.wait_for("the taint removed", lambda: taint_of(w, name[hit]) is None, TAINT_SECONDS + 30)
        assert "kubetron.dev/failing-node" not in (admin.get(f"/api/v1/nodes/{name[hit]}")["metadata"].get(
            "annotations") or {})

        # -- item 5: a deleted job's series leave /metrics -------------------------------------------------
        assert series(w.ns, ["e"]) and series(w.ns, ["g"])
        for job in "egc":
            w.tenant.delete(f"{w.kube.jobs(w.ns)}/{job}")
        w.kube.wait_for("their series gone", lambda: not series(w.ns, list("egc")))
    finally:
        e_rank0.close()
        g_rank0.close()
        for job in ("v", "w"):
            admin.delete(f"{w.kube.jobs(victim)}/{job}", ok=(404,))
        for kubelet in nodes.values():
            kubelet.stop()
            admin.delete(f"/api/v1/nodes/{kubelet.name}", ok=(404,))


def test_the_shipped_admission_policy_bounds_spec_scheduling(world):
    """examples/admission/trainingjob-scheduling-policy.yaml on the real API server (admissionregistration.k8s.io/v1):
    in a namespace labelled kubetron.dev/tenant=true a tenant's job that tolerates every taint, tolerates the
    failing-node taint, picks a node by name or names another PriorityClass is refused at apply, naming the field."""
    w, admin = world, world.kube.admin
    if not w.kube.cp.serves("admissionregistration.k8s.io/v1") or admin.get(
            "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies", ok=(404,)) is None:
        pytest.skip("this API server does not serve ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1)")
    ns = w.kube.namespace("vap")
    admin.patch(f"/api/v1/namespaces/{ns}", {"metadata": {"labels": {"kubetron.dev/tenant": "true"}}})
    tenant = w.kube.tenant(ns)
    policy = list(yaml.safe_load_all((ROOT / "examples/admission/trainingjob-scheduling-policy.yaml").read_text()))
    paths = ["/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
             "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"]
    refused = {
        "a toleration without a key tolerates every taint": {"tolerations": EVERYTHING},
        "may not tolerate kubetron.dev/failing-node": {"tolerations": [
            {"key": "kubetron.dev/failing-node", "operator": "Exists"}]},
        "may not pick a node by name": {"nodeSelector": {"kubernetes.io/hostname": "gpu-7"}},
        "may use only training-low or training": {"priorityClassName": "system-cluster-critical"},
    }

    def apply(scheduling: dict[str, Any]) -> str:
        body = w.pvc_job("gpt", ns=ns, scheduling=scheduling)
        try:
            tenant.create(w.kube.jobs(ns), body, query={"dryRun": "All"})
        except ApiError as exc:
            return str(exc)
        return "accepted"

    try:
        for manifest, path in zip(policy, paths, strict=True):
            admin.create(path, manifest)
        _until(lambda: apply({"tolerations": EVERYTHING}) != "accepted", "the policy in force")
        for why, scheduling in refused.items():
            answer = apply(scheduling)
            assert "spec.scheduling." in answer and why in answer and "\n" not in answer, (why, answer)
        assert apply({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                      "nodeSelector": {"zone": "a"}, "priorityClassName": "training"}) == "accepted"
    finally:
        for manifest, path in zip(policy, paths, strict=True):
            admin.delete(f"{path}/{manifest['metadata']['name']}", ok=(404,))

