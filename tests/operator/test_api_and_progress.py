"""The API wrapper's declared calls, reading an S3 progress log with the job's Secret, the live endpoint."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time

import pytest
from kubetron.contract.progress import saved_checkpoint_line, starting_job_line
from kubetron_operator import events
from kubetron_operator.api_calls import (
    ALL_CALLS,
    Call,
    Conflict,
    Kube,
    NameConflict,
    UndeclaredCall,
    cluster_role_rules,
)
from kubetron_operator.events import Activity, EventPoster
from kubetron_operator.model import Job
from kubetron_operator.observe import PodView
from kubetron_operator.trainer_reports import status_endpoint
from kubetron_operator.trainer_reports.store_log import read_s3_progress, s3_key

from tests.operator.jobs import S3_JOB, job_body

pytestmark = pytest.mark.cluster


class FakeApi:
    """A transport that answers from a dict of (method, path) -> (status, body) and records calls."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def __call__(self, method, path, query, body, content_type):
        self.calls.append((method, path, query, body))
        status, data = self.answers.get((method, path), (404, {"message": "not found"}))
        return status, json.dumps(data).encode()


def test_create_409_and_delete_404_are_fine():
    api = FakeApi({("POST", "/api/v1/namespaces/ml/pods"): (409, {"message": "exists"})})
    kube = Kube(api)
    assert kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml"}}) is False
    assert kube.delete_pod("ml", "p") is False
    assert kube.get_job("ml", "gone") is None


def test_events_are_posted_in_order_without_holding_the_caller(caplog):
    """A reconcile hands its Events to the poster and goes on (pods, status); one thread posts them in
    order; a refused post is logged, and the ones after it still go out."""
    release, posted = threading.Event(), []

    def transport(method, path, query, body, content_type):
        release.wait(10)
        posted.append(body["reason"])
        return (403 if body["reason"] == "Refused" else 201), b"{}"

    poster, body = EventPoster(Kube(transport)), job_body(S3_JOB)
    logger = logging.getLogger("test.events")
    for reason in ("AttemptCreated", "Refused", "Running"):
        poster.post(body, "Normal", reason, "m", "2026-01-01T00:00:00Z", logger)
    assert posted == []  # the first post still waits on the API server: nobody else did
    release.set()
    for _ in range(100):
        if len(posted) == 3:
            break
        threading.Event().wait(0.05)
    assert posted == ["AttemptCreated", "Refused", "Running"]
    assert "could not post event Refused" in caplog.text


def test_events_wait_for_a_quiet_moment_at_most_event_hold(monkeypatch):
    """While the operator is applying actions (a burst of starts) an Event waits: pods and status go first.
    It goes out once nothing is in flight, or after EVENT_HOLD seconds however busy the operator is."""
    posted: list[tuple[str, float]] = []

    def transport(method, path, query, body, content_type):
        posted.append((body["reason"], time.monotonic()))
        return 201, b"{}"

    activity = Activity()
    poster, body, logger = EventPoster(Kube(transport), activity), job_body(S3_JOB), logging.getLogger("test.events")
    with activity.acting():
        poster.post(body, "Normal", "AttemptCreated", "m", "2026-01-01T00:00:00Z", logger)
        time.sleep(0.5)
        assert posted == []  # held while an action is in flight
        released = time.monotonic()
    until = time.monotonic() + 5
    while not posted and time.monotonic() < until:
        time.sleep(0.01)
    assert [r for r, _ in posted] == ["AttemptCreated"] and posted[0][1] >= released
    monkeypatch.setattr(events, "EVENT_HOLD", 0.3)
    with activity.acting():  # busy for good: the event goes out after EVENT_HOLD anyway
        poster.post(body, "Warning", "Unschedulable", "m", "2026-01-01T00:00:01Z", logger)
        time.sleep(1.0)
        assert [r for r, _ in posted] == ["AttemptCreated", "Unschedulable"]


def _owned_by(uid):
    return {"metadata": {"name": "gpt", "namespace": "ml", "uid": "svc-uid",
                         "ownerReferences": [{"uid": uid, "controller": True}] if uid else []}}


SVC = "/api/v1/namespaces/ml/services"


def test_create_409_adopts_only_what_the_same_job_controls():
    manifest = {"apiVersion": "v1", "kind": "Service", **_owned_by("job-uid")}
    ours = FakeApi({("POST", SVC): (409, {}), ("GET", f"{SVC}/gpt"): (200, _owned_by("job-uid"))})
    assert Kube(ours).create(manifest) is False
    for other in ("other-uid", None):
        foreign = FakeApi({("POST", SVC): (409, {}), ("GET", f"{SVC}/gpt"): (200, _owned_by(other))})
        with pytest.raises(NameConflict, match="Service ml/gpt already exists"):
            Kube(foreign).create(manifest)


def test_delete_owned_never_deletes_a_foreign_object():
    foreign = FakeApi({("GET", f"{SVC}/gpt"): (200, _owned_by("other-uid"))})
    assert Kube(foreign).delete_owned("v1", "Service", "ml", "gpt", "job-uid") is False
    assert [c[0] for c in foreign.calls] == ["GET"]
    ours = FakeApi({("GET", f"{SVC}/gpt"): (200, _owned_by("job-uid")),
                    ("DELETE", f"{SVC}/gpt"): (200, {})})
    assert Kube(ours).delete_owned("v1", "Service", "ml", "gpt", "job-uid") is True
    assert ours.calls[-1][3]["preconditions"] == {"uid": "svc-uid"}  # not a namesake created meanwhile


def test_status_patch_carries_the_resource_version_and_a_409_is_a_conflict():
    path = "/apis/kubetron.dev/v1alpha1/namespaces/ml/trainingjobs/gpt/status"
    api = FakeApi({("PATCH", path): (409, {"message": "the object has been modified"})})
    with pytest.raises(Conflict):
        Kube(api).patch_status("ml", "gpt", {"phase": "Running"}, resource_version="41")
    assert api.calls[-1][3] == {"status": {"phase": "Running"}, "metadata": {"resourceVersion": "41"}}


def test_undeclared_calls_are_refused(monkeypatch):
    from kubetron_operator import api_calls

    monkeypatch.setattr(api_calls, "OPERATOR_CALLS", api_calls.OPERATOR_CALLS - {Call("", "secrets", "get")})
    with pytest.raises(UndeclaredCall):
        Kube(FakeApi({})).secret_data("ml", "s3-creds")


@pytest.mark.unit
def test_cluster_role_rules_cover_every_call():
    rules = cluster_role_rules()
    allowed = {Call(r["apiGroups"][0], r["resources"][0], v) for r in rules for v in r["verbs"]}
    assert allowed == ALL_CALLS
    # The PVC progress reader reports through its termination message: no pods/exec, no pods/log.
    assert not any(c.resource in ("pods/exec", "pods/log") for c in ALL_CALLS)
    # Secrets: get (the S3 credentials a job names), create (its peer token): never list or watch a namespace's
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "get"]} in rules


def test_read_s3_progress_with_the_jobs_secret(s3_server, caplog):
    endpoint, access_key, secret_key, bucket = s3_server
    body = job_body(S3_JOB, storage={"s3": {"bucket": bucket, "prefix": "runs", "endpoint": endpoint,
                                            "region": "us-east-1", "secretRef": {"name": "s3-creds"}}})
    job = Job.from_body(body)
    secret = {"data": {"AWS_ACCESS_KEY_ID": base64.b64encode(access_key.encode()).decode(),
                       "AWS_SECRET_ACCESS_KEY": base64.b64encode(secret_key.encode()).decode()}}
    kube = Kube(FakeApi({("GET", "/api/v1/namespaces/ml/secrets/s3-creds"): (200, secret)}))
    assert read_s3_progress(job, kube).summary["lastCheckpoint"] is None  # no log yet: read, empty

    text = "\n".join([starting_job_line(0, 40, num_gpus=2, job_id="ml/gpt/1"),
                      saved_checkpoint_line(20, 0.1, 0.1, 1e12, 20480, 40, num_gpus=2, job_id="ml/gpt/1")])
    bucket_name, key = s3_key(job)
    assert key == "runs/ml/gpt/progress.txt"
    s3_server.client().put_object(Bucket=bucket_name, Key=key, Body=text.encode())
    with caplog.at_level(logging.DEBUG):
        summary = read_s3_progress(job, kube).summary
    assert summary["lastCheckpoint"]["iteration"] == 20 and summary["trainIters"] == 40
    assert secret_key not in caplog.text

    wrong = Kube(FakeApi({("GET", "/api/v1/namespaces/ml/secrets/s3-creds"): (200, {"data": {}})}))
    with caplog.at_level(logging.DEBUG):
        read = read_s3_progress(job, wrong)
    assert read.summary is None  # unreadable: "unknown", never a guess
    assert read.unread == ("SecretKeyMissing", "Secret s3-creds has no key AWS_ACCESS_KEY_ID or AWS_SECRET_ACCESS_KEY; "
                           "the operator reads the job's store only with the job's own credentials")
    assert secret_key not in caplog.text


def test_live_status_from_rank0_only():
    pods = [PodView(name="gpt-2-1", attempt=2, rank=1, phase="Running", ip="10.0.0.2"),
            PodView(name="gpt-2-0", attempt=2, rank=0, phase="Running", ip="10.0.0.1")]
    seen = []

    def fetch(url):
        seen.append(url)
        return {"iteration": 5}

    status = status_endpoint.read_live(pods, 2, 8080, fetch).status
    assert status is not None and status["iteration"] == 5
    assert status["lastCheckpoint"] is None and status["inPlaceRestarts"] == 0  # not said: unknown
    assert seen == ["http://10.0.0.1:8080/status"]
    assert status_endpoint.read_live(pods, 2, 0, fetch) == status_endpoint.LiveRead()  # endpoint off

    def refused(url):
        raise OSError("connection refused")

    not_yet = status_endpoint.read_live(pods, 2, 8080, refused)
    assert not_yet == status_endpoint.LiveRead()  # not listening yet: nothing to say


def test_transient_creation_errors_back_off_exponentially_to_a_cap():
    from datetime import UTC, datetime

    from kubetron_operator.observe import Observed
    from kubetron_operator.policy.create_retry import create_failed

    now = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
    delays, status = [], {}
    for _ in range(7):
        action = create_failed(Observed(now=now, status=status), "CreateRetrying", "exceeded quota", True)
        status = {**status, **action.status}
        delays.append((datetime.fromisoformat(status["nextCreateTime"]) - now).total_seconds())
    assert delays == [10, 20, 40, 80, 160, 300, 300] and status["createFailures"] == 7
    assert status["phase"] == "Pending" and action.events[0].type == "Warning"
    failed = create_failed(Observed(now=now, status={"attempt": 2}), "CreateFailed", "HTTP 422: bad", False)
    assert failed.phase == "Failed" and failed.status["reason"] == "CreateFailed"


def test_live_status_reads_what_rank_0_serves():
    """The trainer's status endpoint and the operator's reader share one payload (kubetron.contract.live)."""
    from kubetron.training.status_server import StatusServer

    with StatusServer(0, host="127.0.0.1") as server:
        server.update(iteration=12, trainIters=40, consumedSamples=96, tokensPerSecond=1234.5, etaSeconds=30.2,
                      loss=2.31, learningRate=3e-4, tflopsPerGpu=float("nan"),
                      lastCheckpoint={"iteration": 10, "time": "2026-11-22T12:00:09Z"})
        pod = PodView(name="gpt-1-0", attempt=1, rank=0, phase="Running", ip="127.0.0.1")
        assert status_endpoint.read_live([pod], 1, server.port).status == server.snapshot()
        assert server.snapshot()["tflopsPerGpu"] is None and server.snapshot()["loss"] == 2.31


def test_live_status_of_the_wrong_type_reads_as_unknown():
    odd = {"iteration": "12", "trainIters": 40.0, "loss": True, "etaSeconds": "soon", "inPlaceRestarts": None,
           "lastCheckpoint": {"iteration": "x", "time": "2026-11-22T12:00:09Z"}, "futureKey": 1}
    pod = PodView(name="gpt-1-0", attempt=1, rank=0, phase="Running", ip="10.0.0.1")
    status = status_endpoint.read_live([pod], 1, 8080, lambda url: odd).status
    assert status is not None and "futureKey" not in status
    assert (status["iteration"], status["trainIters"], status["loss"], status["etaSeconds"]) == (None, 40, None, None)
    assert status["lastCheckpoint"] is None and status["inPlaceRestarts"] == 0
    assert status_endpoint.read_live([pod], 1, 8080, lambda url: [1, 2]).status is None  # not an object
