"""The API wrapper's declared calls, reading an S3 progress log with the job's Secret, the live endpoint."""

from __future__ import annotations

import base64
import json
import logging

import pytest
from kubetron.progress import saved_checkpoint_line, starting_job_line
from kubetron_operator import live
from kubetron_operator.api_calls import ALL_CALLS, Call, Kube, UndeclaredCall, cluster_role_rules
from kubetron_operator.decide import PodView
from kubetron_operator.model import Job
from kubetron_operator.progress_io import read_s3_progress, s3_key

from tests.operator.jobs import S3_JOB, job_body


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


def test_undeclared_calls_are_refused(monkeypatch):
    from kubetron_operator import api_calls

    monkeypatch.setattr(api_calls, "OPERATOR_CALLS", api_calls.OPERATOR_CALLS - {Call("", "secrets", "get")})
    with pytest.raises(UndeclaredCall):
        Kube(FakeApi({})).secret_data("ml", "s3-creds")


def test_cluster_role_rules_cover_every_call():
    rules = cluster_role_rules()
    allowed = {Call(r["apiGroups"][0], r["resources"][0], v) for r in rules for v in r["verbs"]}
    assert allowed == ALL_CALLS
    # The PVC progress reader reports through its termination message: no pods/exec, no pods/log.
    assert not any(c.resource in ("pods/exec", "pods/log") for c in ALL_CALLS)
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]} in rules


def test_read_s3_progress_with_the_jobs_secret(s3_server, caplog):
    endpoint, access_key, secret_key, bucket = s3_server
    body = job_body(S3_JOB, storage={"s3": {"bucket": bucket, "prefix": "runs", "endpoint": endpoint,
                                            "region": "us-east-1", "secretRef": {"name": "s3-creds"}}})
    job = Job.from_body(body)
    secret = {"data": {"AWS_ACCESS_KEY_ID": base64.b64encode(access_key.encode()).decode(),
                       "AWS_SECRET_ACCESS_KEY": base64.b64encode(secret_key.encode()).decode()}}
    kube = Kube(FakeApi({("GET", "/api/v1/namespaces/ml/secrets/s3-creds"): (200, secret)}))
    assert read_s3_progress(job, kube)["lastCheckpoint"] is None  # no log yet: read, empty

    text = "\n".join([starting_job_line(0, 40, num_gpus=2, job_id="ml/gpt/1"),
                      saved_checkpoint_line(20, 0.1, 0.1, 1e12, 20480, 40, num_gpus=2, job_id="ml/gpt/1")])
    bucket_name, key = s3_key(job)
    assert key == "runs/ml/gpt/progress.txt"
    s3_server.client().put_object(Bucket=bucket_name, Key=key, Body=text.encode())
    with caplog.at_level(logging.DEBUG):
        summary = read_s3_progress(job, kube)
    assert summary["lastCheckpoint"]["iteration"] == 20 and summary["trainIters"] == 40
    assert secret_key not in caplog.text

    wrong = Kube(FakeApi({("GET", "/api/v1/namespaces/ml/secrets/s3-creds"): (200, {"data": {}})}))
    with caplog.at_level(logging.DEBUG):
        assert read_s3_progress(job, wrong) is None  # unreadable: "unknown", never a guess
    assert secret_key not in caplog.text


def test_live_status_from_rank0_only():
    pods = [PodView(name="gpt-2-1", attempt=2, rank=1, phase="Running", ip="10.0.0.2"),
            PodView(name="gpt-2-0", attempt=2, rank=0, phase="Running", ip="10.0.0.1")]
    seen = []

    def fetch(url):
        seen.append(url)
        return {"iteration": 5}

    assert live.read_live(pods, 2, 8080, fetch) == {"iteration": 5}
    assert seen == ["http://10.0.0.1:8080/status"]
    assert live.read_live(pods, 2, 0, fetch) is None  # endpoint off

    def refused(url):
        raise OSError("connection refused")

    assert live.read_live(pods, 2, 8080, refused) is None
