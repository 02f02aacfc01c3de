"""kubetron.client on the real API server (tests/kube) with the real `kubetron operator` reconciling: a job
created from YAML, waited for, read, listed, its logs read and streamed, suspended, resumed, finished and
deleted, as a notebook would (docs/client.md). The test plays the kubelet: pod phases, and the logs, which
the API server fetches from the pod's node (tests/kube/kubelet_logs.py serves them there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from kubetron.client import BadInput, Client, JobStatus, NotFound, Rejected, WaitTimeout

from tests.kube.cluster import set_exited, set_running
from tests.kube.kubelet_logs import LogNode
from tests.operator.jobs import tj

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def client_for(kube, ns: str | None) -> Client:
    return Client(namespace=ns, kubeconfig=kube.cp._cert_kubeconfig("admin"))  # the cluster admin's kubeconfig


def on_node(kube, ns: str, node: str, names: set[str]) -> None:
    """`names` exist, bound by the scheduler to `node`, and Running."""
    kube.wait_for(f"{sorted(names)} on {node}", lambda: {n for n, p in kube.pods(ns).items()
                                                          if p["spec"].get("nodeName") == node} == names)
    for name in sorted(names):
        set_running(kube.admin, ns, name)


def test_client_creates_waits_reads_lists_streams_logs_and_deletes(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    node_name = f"{ns}-logs"
    body = tj(ns, scheduling={"nodeSelector": {"kubernetes.io/hostname": node_name}})
    with LogNode(kube.cp, node_name) as node, kube.operator(ns):
        c = client_for(kube, ns)
        created = c.create(yaml.safe_dump(body))  # a YAML string
        assert (created.name, created.namespace, created.phase, created.attempt) == ("gpt", ns, "Pending", None)
        seen: list[JobStatus] = []
        watcher = threading.Thread(target=lambda: seen.extend(c.watch("gpt", timeout=150)), daemon=True)
        watcher.start()
        on_node(kube, ns, node_name, {"gpt-1-0", "gpt-1-1"})
        st = c.wait("gpt", phases=("Running",), timeout=60)
        assert (st.phase, st.attempt, st.nodes, st.reason) == ("Running", 1, 2, "Running")
        assert c.get("gpt").phase == "Running"

        # Keyword arguments; list() sees both jobs.
        kw = c.create(name="kw", image="kubetron:dev", nodes=1, config={"train": {"train_iters": 10}},
                      storage={"pvc": {"claimName": "ckpt"}}, backoffLimit=1)
        assert yaml.safe_load(c.job("kw")["spec"]["config"]) == {"train": {"train_iters": 10}}
        assert [(s.name, s.namespace) for s in c.list()] == [("gpt", ns), ("kw", ns)] and kw.phase == "Pending"
        with pytest.raises(WaitTimeout, match=r"^trainingjob kw: still Pending after 1s$"):
            c.wait("kw", timeout=1)  # its claim does not exist: it never starts
        c.delete("kw")

        # Logs through the API server's pods/log (proxied to the node's kubelet port).
        node.write(ns, "gpt-1-0", "iteration 1 | lm loss: 2.0", "iteration 2 | lm loss: 1.9")
        node.write(ns, "gpt-1-1", "rank 1 up")
        assert list(c.logs("gpt")) == ["iteration 1 | lm loss: 2.0", "iteration 2 | lm loss: 1.9"]
        assert sorted(c.logs("gpt", rank=None)) == ["[rank 0] iteration 1 | lm loss: 2.0",
                                                   "[rank 0] iteration 2 | lm loss: 1.9", "[rank 1] rank 1 up"]
        stream = c.logs("gpt", follow=True)
        assert [next(stream), next(stream)] == ["iteration 1 | lm loss: 2.0", "iteration 2 | lm loss: 1.9"]
        node.write(ns, "gpt-1-0", "iteration 3 | lm loss: 1.8")  # written while the stream is open
        assert next(stream) == "iteration 3 | lm loss: 1.8"
        node.end(ns, "gpt-1-0")  # the container exited: the followed log ends
        assert list(stream) == []
        assert node.requests.count(f"/containerLogs/{ns}/gpt-1-0/trainer") >= 3
        kubetron = str(Path(sys.executable).with_name("kubetron"))
        cli = subprocess.run([kubetron, "logs", "gpt", "--rank", "1", "-n", ns], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "KUBECONFIG": str(kube.cp._cert_kubeconfig("admin"))})
        assert (cli.returncode, cli.stdout, cli.stderr) == (0, "rank 1 up\n", "")

        # Suspend, resume, train to the end.
        assert c.suspend("gpt").name == "gpt"
        assert c.wait("gpt", ("Suspended",), timeout=60).phase == "Suspended"
        kube.wait_pods(ns, set())
        c.resume("gpt")
        on_node(kube, ns, node_name, {"gpt-2-0", "gpt-2-1"})
        done = {"exitCode": 0, "reason": "Completed", "iteration": 40, "trainIters": 40, "lastCheckpoint": 40}
        set_exited(api, ns, "gpt-2-0", 0, done)
        set_exited(api, ns, "gpt-2-1", 0, done)
        final = c.wait("gpt", timeout=60)
        assert (final.phase, final.attempt, final.iteration) == ("Succeeded", 2, 40), final
        assert final.last_checkpoint is not None and final.last_checkpoint.iteration == 40
        assert final.restarts.total == 0 and final.completion_time and final.finished
        watcher.join(30)
        phases = [s.phase for s in seen]
        assert phases[0] == "Pending" and phases[-1] == "Succeeded" and "Suspended" in phases, phases
        assert all(a != b for a, b in zip(seen, seen[1:], strict=False))  # each one a change

        c.delete("gpt")
        kube.wait_for("job gone", lambda: kube.job(ns, "gpt") is None)
        with pytest.raises(NotFound, match="^trainingjob gpt: HTTP 404: "):
            c.get("gpt")


def test_client_errors_carry_the_servers_one_line_message(kube, kube_ns, tmp_path):
    """What the API server and its admission refuse is an exception with their own words, in one line;
    what the client itself cannot use is BadInput, and nothing is sent."""
    ns = kube_ns
    c = client_for(kube, ns)
    c.create(tj(ns, "a"))
    with pytest.raises(Rejected, match='^trainingjob a: HTTP 409: trainingjobs.kubetron.dev "a" already exists$'):
        c.create(tj(ns, "a"))
    with pytest.raises(Rejected) as clash:  # the CRD's validation rule
        c.create(tj(ns, "clash", statusPort=29500))
    assert clash.value.status == 422 and "spec.statusPort must differ from spec.masterPort" in str(clash.value)
    assert "\n" not in str(clash.value)
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "jobs"},
             "spec": {"hard": {"count/trainingjobs.kubetron.dev": "1"}}}
    kube.admin.create(f"/api/v1/namespaces/{ns}/resourcequotas", quota)
    kube.wait_for("the quota counted", lambda: (kube.admin.get(f"/api/v1/namespaces/{ns}/resourcequotas/jobs")
                                                .get("status") or {}).get("used"))
    with pytest.raises(Rejected, match=r"^trainingjob b: HTTP 403: trainingjobs.kubetron.dev \"b\" is forbidden: "
                                       r"exceeded quota: jobs"):  # the ResourceQuota admission plugin
        c.create(tj(ns, "b"))
    (tmp_path / "two.yaml").write_text(yaml.safe_dump_all([tj(ns, "x"), tj(ns, "y")]))
    with pytest.raises(BadInput, match=r"^job: .*two.yaml: expected exactly one TrainingJob, found 2$"):
        c.create(tmp_path / "two.yaml")
    with pytest.raises(BadInput, match=r"^job: .*missing.yaml: No such file or directory$"):
        c.create(str(tmp_path / "missing.yaml"))
    with pytest.raises(BadInput, match="^image: required"):
        c.create(name="n", image="", nodes=1, config="train: {}", storage={"pvc": {"claimName": "c"}})
    with pytest.raises(NotFound, match="^trainingjob nope: HTTP 404: "):
        c.wait("nope", timeout=5)
    assert [s.name for s in c.list()] == ["a"]
    assert client_for(kube, None).namespace == "default"  # the kubeconfig's context names none
