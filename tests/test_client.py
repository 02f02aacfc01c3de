"""kubetron.client without a cluster: it imports without torch, megatron or the Kubernetes client, reads
what create() accepts, types the status, and merges the log streams of several pods. On the real API
server: tests/operator/test_client_on_kube.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from kubetron.client import BadInput, JobStatus, KubetronError, job_manifest, load_job, merge_lines

pytestmark = pytest.mark.unit

# Blocks torch, megatron and the Kubernetes client, imports kubetron.client, reports what got loaded and what
# Client() says without the Kubernetes client.
PROBE = """
import json, sys
for name in ("torch", "megatron", "megatron.core", "kubernetes", "kopf"):
    sys.modules[name] = None  # any import of them now fails
import kubetron.client
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron", "kubernetes", "kopf",
                                                             "kubetron_operator") and sys.modules[m] is not None)
try:
    kubetron.client.Client()
    error = None
except kubetron.client.KubetronError as exc:
    error = str(exc)
print(json.dumps({"loaded": loaded, "error": error}))
"""

JOB = {"apiVersion": "kubetron.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "gpt"},
       "spec": {"image": "kubetron:dev", "nodes": 2, "config": "train: {train_iters: 10}\n",
                "storage": {"pvc": {"claimName": "ckpt"}}}}


@pytest.mark.process
def test_imports_without_torch_megatron_or_the_kubernetes_client():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["loaded"] == []
    assert report["error"] == "kubetron.client needs the kubernetes package: pip install 'kubetron[client]'"


def test_a_job_from_a_dict_a_yaml_string_a_path_or_keywords(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("# a comment\n---\n" + yaml.safe_dump(JOB))
    assert load_job(JOB) == load_job(yaml.safe_dump(JOB)) == load_job(path) == load_job(str(path)) == JOB
    assert load_job(json.dumps(JOB)) == JOB  # JSON is YAML
    load_job(JOB)["metadata"]["namespace"] = "ml"
    assert "namespace" not in JOB["metadata"]  # the caller's dict is left as it was
    made = job_manifest("gpt", "kubetron:dev", 2, {"train": {"train_iters": 10}}, {"pvc": {"claimName": "ckpt"}})
    assert made == {**JOB, "spec": {**JOB["spec"], "config": "train:\n  train_iters: 10\n"}}
    assert job_manifest("gpt", "i", 1, "a: 1\n", {"pvc": {"claimName": "c"}}, gpusPerNode=8)["spec"] == {
        "image": "i", "nodes": 1, "config": "a: 1\n", "storage": {"pvc": {"claimName": "c"}}, "gpusPerNode": 8}


@pytest.mark.parametrize(("source", "message"), [
    ("kind: TrainingJob\nmetadata: {name: x}\n", "job: apiVersion must be kubetron.dev/v1alpha1, got None"),
    ("apiVersion: v1\nkind: Pod\n", "job: expected exactly one TrainingJob, found 0"),
    ("apiVersion: kubetron.dev/v1alpha1\nkind: TrainingJob\nmetadata: {}\n", "job: metadata.name is required"),
    ("a: [1\nb: 2\n", "job: invalid YAML: "),
    ("no-such-file.yaml", "job: no-such-file.yaml: No such file or directory"),
    (42, "job: expected a dict, a YAML string or a path, got int"),
])
def test_what_cannot_be_a_job_is_one_line_naming_it(source, message):
    with pytest.raises(BadInput) as err:
        load_job(source)
    assert str(err.value).startswith(message) and "\n" not in str(err.value) and err.value.status is None


def test_keywords_name_the_missing_one():
    with pytest.raises(BadInput, match="^storage: required"):
        job_manifest("gpt", "i", 1, {"train": {}}, {})


def test_status_is_typed_from_what_the_operator_writes():
    job = {"metadata": {"name": "gpt", "namespace": "ml"}, "status": {
        "phase": "Running", "attempt": 3, "nodes": 2, "iteration": 120, "trainIters": 400, "progress": "30%",
        "loss": 2.25, "learningRate": 3e-4, "tokensPerSecond": 2048.0, "eta": "5m",
        "restarts": {"preemptions": 1, "failures": 1, "neverStarted": 0, "total": 2, "inPlace": 4},
        "lastCheckpoint": {"iteration": 100, "time": "2026-11-22T12:00:09Z"}, "goodput": {"ratio": 0.9},
        "startTime": "2026-11-22T11:00:00Z", "reason": "Running", "message": "all 2 pods running"}}
    st = JobStatus.of(job)
    assert (st.name, st.namespace, st.phase, st.attempt, st.iteration, st.train_iters, st.loss, st.eta) == (
        "gpt", "ml", "Running", 3, 120, 400, 2.25, "5m")
    assert (st.restarts.total, st.restarts.preemptions, st.restarts.failures, st.restarts.in_place) == (2, 1, 1, 4)
    assert (st.last_checkpoint.iteration, st.last_checkpoint.time) == (100, "2026-11-22T12:00:09Z")
    assert st.goodput == {"ratio": 0.9} and not st.finished and st.raw is job
    fresh = JobStatus.of({"metadata": {"name": "gpt", "namespace": "ml"}})  # before the operator's first word
    assert (fresh.phase, fresh.last_checkpoint, fresh.goodput, fresh.restarts.total) == ("Pending", None, None, 0)


def test_merged_logs_go_on_while_a_pod_is_silent_and_report_every_failure():
    silent = threading.Event()

    def chatty():
        yield from ("one", "two")

    def quiet():
        silent.wait(5)
        yield "late"

    def broken():
        raise KubetronError("logs of pod gpt-1-2: HTTP 500: no kubelet")
        yield  # a generator, as a pod's stream is

    lines = merge_lines({"0": chatty, "1": quiet, "2": broken})
    assert [next(lines), next(lines)] == ["[rank 0] one", "[rank 0] two"]  # rank 1 writes nothing yet
    silent.set()
    rest = []
    with pytest.raises(KubetronError, match="^logs of pod gpt-1-2: HTTP 500: no kubelet$"):
        rest.extend(lines)  # the failure comes once the other streams ended
    assert rest == ["[rank 1] late"]


def test_the_cli_commands_are_the_client():
    """`kubetron submit/status/logs/delete` (trainer/kubetron/client_cli.py) reach the cluster only through
    kubetron.client.Client: one client in the code."""
    source = (Path(__file__).resolve().parents[1] / "trainer" / "kubetron" / "client_cli.py").read_text()
    assert "import kubernetes" not in source and "from kubernetes" not in source
    assert "from kubetron.client import" in source
