"""`kubetron submit/status/logs/delete` as a user types them: the installed entry points (`kubetron` and the
kubectl plugin `kubectl-kubetron`) as subprocesses, KUBECONFIG pointing at the real API server's admin
kubeconfig, the real `kubetron operator` reconciling. The test plays the kubelet (pod phases); there is
no kubelet to serve `pods/log`, so the logs test checks the error path and, separately, the pod selection.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from kubetron.client import Client, NotFound, select_pods, whole_lines
from kubetron.client_cli import format_table

from tests.kube.cluster import set_running
from tests.operator.cli import BIN, kubetron, user_env
from tests.operator.jobs import tj

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def manifest(tmp_path: Path, body: dict) -> Path:
    path = tmp_path / f"{body['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kubetron: error: "), proc.stderr
    return lines[0]


def test_submit_status_logs_delete(kube, kube_ns, tmp_path):
    ns, api = kube_ns, kube.admin
    path = manifest(tmp_path, tj(ns))
    with kube.operator(ns):
        submit = subprocess.Popen([str(BIN / "kubetron"), "submit", str(path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=user_env(kube))
        try:
            kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
            set_running(api, ns, "gpt-1-0")
            set_running(api, ns, "gpt-1-1")
            out, err = submit.communicate(timeout=60)
        finally:
            submit.kill()
        assert submit.returncode == 0, err
        lines = out.splitlines()
        assert lines[0] == f"trainingjob {ns}/gpt created"
        assert lines[-1] == "gpt: Running attempt 1 - Running", out

        got = kubetron(kube, "status", "-n", ns)
        assert got.returncode == 0, got.stderr
        head, row = got.stdout.splitlines()
        assert head.split() == ["NAME", "PHASE", "NODES", "PROGRESS", "ITERATION", "RESTARTS", "ETA", "GOODPUT",
                                "LOSS", "AGE", "REASON", "LAST-CHECKPOINT"]  # the CRD's columns, the wide ones too
        assert row.split()[:2] == ["gpt", "Running"] and row.split()[-2:] == ["Running", "<none>"]
        read_end, write_end = os.pipe()  # `kubetron status | head -1` once head has its line
        os.close(read_end)
        try:
            got = subprocess.run([str(BIN / "kubetron"), "status", "-n", ns], stdout=write_end, stderr=subprocess.PIPE,
                                 text=True, timeout=60, env=user_env(kube))
        finally:
            os.close(write_end)
        assert (got.returncode, got.stderr) == (141, ""), got.stderr  # quiet, as a SIGPIPE'd program

        # No kubelet serves pods/log here: the API server answers 500; the user gets one line, exit 1.
        got = kubetron(kube, "logs", "gpt", "--rank", "1", "-n", ns)
        assert got.returncode == 1
        assert one_error_line(got).startswith("kubetron: error: logs of pod gpt-1-1: HTTP 500")
        got = kubetron(kube, "logs", "gpt", "--rank", "5", "-n", ns)
        assert one_error_line(got) == "kubetron: error: trainingjob gpt: no pod of rank 5 of attempt 1 exists"

        got = kubetron(kube, "delete", "gpt", "-n", ns, exe="kubectl-kubetron")  # the kubectl plugin
        assert got.returncode == 0 and got.stdout.strip() == f"trainingjob {ns}/gpt deleted", got.stderr
        kube.wait_for("job gone", lambda: kube.job(ns, "gpt") is None)
        got = kubetron(kube, "status", "gpt", "-n", ns)
        assert got.returncode == 1
        assert "trainingjob gpt: HTTP 404" in one_error_line(got)


def test_submit_wait_reports_failure_and_rejections(kube, kube_ns, tmp_path):
    ns = kube_ns
    with kube.operator(ns):
        bad_config = tj(ns, "bad", config="train:\n  train_iters: -3\n")
        got = kubetron(kube, "submit", "--wait", "--timeout", "60", str(manifest(tmp_path, bad_config)))
        assert got.returncode == 1, got.stderr
        assert got.stdout.splitlines()[-1].startswith("bad: Failed - ConfigError: spec.config: train.train_iters"), (
            got.stdout)

    # Rejected by the API server (the CRD's CEL rule): exit 2, the server's words in one line.
    clash = tj(ns, "clash", statusPort=29500)
    got = kubetron(kube, "submit", str(manifest(tmp_path, clash)))
    assert got.returncode == 2
    assert "HTTP 422" in one_error_line(got) and "spec.statusPort must differ from spec.masterPort" in got.stderr
    got = kubetron(kube, "submit", str(tmp_path / "missing.yaml"))
    assert got.returncode == 2 and "No such file" in one_error_line(got)


# -- pure parts ---------------------------------------------------------------------------------------


def pod(name: str, attempt: int, rank: int, role: str = "worker", job: str = "gpt") -> dict:
    return {"metadata": {"name": name, "labels": {"kubetron.dev/job": job, "kubetron.dev/attempt": str(attempt),
                                                  "kubetron.dev/rank": str(rank), "kubetron.dev/role": role}}}


def test_logs_select_the_current_attempts_pods_by_rank():
    job = {"metadata": {"name": "gpt"}, "status": {"attempt": 2, "phase": "Running"}}
    pods = [pod("gpt-2-1", 2, 1), pod("gpt-1-0", 1, 0), pod("gpt-2-0", 2, 0),
            pod("gpt-2-probe-2", 2, 2, "probe"), pod("other-2-0", 2, 0, job="other")]
    assert [p["metadata"]["name"] for p in select_pods(pods, job, None)] == ["gpt-2-0", "gpt-2-1"]
    assert [p["metadata"]["name"] for p in select_pods(pods, job, 1)] == ["gpt-2-1"]
    with pytest.raises(NotFound, match="no attempt has started yet"):
        select_pods(pods, {"metadata": {"name": "gpt"}, "status": {}}, None)


def test_status_table_adds_reason_and_last_checkpoint():
    table = {"columnDefinitions": [{"name": "Name"}, {"name": "Phase"}, {"name": "ETA"}],
             "rows": [{"cells": ["gpt", "Running", None],
                       "object": {"status": {"reason": "Running", "lastCheckpoint": {"iteration": 20, "time": "t"}}}}]}
    head, row = format_table(table).splitlines()
    assert head.split() == ["NAME", "PHASE", "ETA", "REASON", "LAST-CHECKPOINT"]
    assert row.split() == ["gpt", "Running", "<none>", "Running", "20", "(t)"]


def test_followed_logs_print_whole_lines():
    chunks = [b"iteration 1 | lo", b"ss: 2.0\niteration 2", b" \xc3", b"\xa9\n", b"tail"]
    assert list(whole_lines(chunks)) == ["iteration 1 | loss: 2.0", "iteration 2 \u00e9", "tail"]
    assert list(whole_lines([b"a\nb\n"])) == ["a", "b"]


def test_followed_logs_end_quietly_when_stdout_closes(monkeypatch, capsys):
    """`kubetron logs -f gpt | head`: the pods' streams are read in threads, one pod silent forever; the
    closed pipe still ends the command at once, exit 141, no thread traceback."""
    import threading

    from kubetron import client_cli
    from kubetron.cli import main

    silent = threading.Event()

    class Pods(Client):  # the real Client.logs over two pods whose streams the test makes up
        def __init__(self, **_):
            self.namespace = "ns"

        def pods(self, name, rank=None):
            return [pod("gpt-1-0", 1, 0), pod("gpt-1-1", 1, 1)]

        def _pod_lines(self, pod_name, follow):
            while pod_name.endswith("-1"):
                yield "iteration 1 | loss 2.0"
            silent.wait()  # a pod that writes nothing more: its thread blocks in the read

    class ClosedPipe:
        def write(self, _text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(client_cli, "Client", Pods)
    monkeypatch.setattr("sys.stdout", ClosedPipe())
    result = []
    command = threading.Thread(target=lambda: result.append(main(["logs", "gpt", "-f"])), daemon=True)
    command.start()
    command.join(10)
    silent.set()
    assert result == [141] and capsys.readouterr().err == ""


def test_context_and_its_namespace_come_from_the_kubeconfig(kube, kube_ns, tmp_path):
    """`--kubeconfig`, `--context`, and the context's namespace as the default, as kubectl reads them."""
    kube.admin.create(kube.jobs(kube_ns), tj(kube_ns, "ctx-job"))
    config = yaml.safe_load(kube.cp._cert_kubeconfig("admin").read_text())
    (ctx,) = config["contexts"]
    config["contexts"].append({"name": "team", "context": {**ctx["context"], "namespace": kube_ns}})
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    got = kubetron(kube, "status", "--kubeconfig", str(path), "--context", "team")
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines()[1].split()[0] == "ctx-job"
    got = kubetron(kube, "status", "--kubeconfig", str(path))  # the current context: namespace default
    assert got.returncode == 0 and got.stdout.strip() == "No TrainingJobs in namespace default.", got.stdout
    got = kubetron(kube, "status", "--kubeconfig", str(path), "--context", "nope")
    assert got.returncode == 2 and one_error_line(got).startswith("kubetron: error: --kubeconfig: ")
