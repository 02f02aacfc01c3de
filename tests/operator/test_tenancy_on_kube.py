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
3. 16 slow jobs of the tenant delay a job of the victim by less than 10 s, and a 32 MiB progress log grows
   the operator's peak memory by less than 64 MiB;
4. rank 0's endpoint: no redirect followed, a slow one cut off;
5. a pod of the tenant's naming the victim's job as its controller does not end the victim's attempt;
6. hostile termination messages are ignored with a warning, the job still decided, no control character
   reaching status, Events or the operator's log.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubetron.contract.progress import saved_checkpoint_line, starting_job_line

from tests.faultproxy import FaultProxy
from tests.kube.cluster import Api, ApiError, set_exited, set_running
from tests.kube.fixtures import KubeEnv, Operator
from tests.operator.endpoints import Endpoint
from tests.operator.jobs import tj

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

OPERATOR_KEY, TENANT_KEY, VICTIM_KEY = "OPERATORENVKEY01", "TENANTKEY0000001", "VICTIMKEY0000001"
OWN_BUCKET, STORE_BUCKET = "operator-readable", "tenant-bkt"
CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/trainingjobs.kubetron.dev"
MiB = 2**20
KEEP = "kubetron.dev/test-keep"  # a finalizer of the test's own


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
        with kube.operator(ns, f"--namespace={victim}", f"--s3-operator-buckets={OWN_BUCKET}", env=env) as op:
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


def test_slow_endpoints_of_a_tenant_delay_another_namespace_by_less_than_10s(world):
    """16 jobs (as many as the operator has reconcile threads) whose store sends a byte every 2 s: once their
    reads are under way (as many as the operator lets run at once), the victim's new job still gets its pods
    and status within 10 s, and /healthz stays healthy."""
    w, admin = world, world.kube.admin
    drip = Endpoint.drip(every=2.0)
    names = [f"slow-{i}" for i in range(16)]
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
