"""An elastic job on the real API server, kube-scheduler and operator: a `nodes: 2,
minNodes: 1` job on a pool of one Node with room for one pod trains at 1 node instead of waiting, grows to 2
when a second Node joins the pool, and ends Succeeded at train_iters with its losses continuous. Its
startupTimeoutSeconds is shorter than shrinkAfterSeconds: it shrinks at the start-up timeout.

The test plays the kubelet of its two Nodes (tests/operator/local_pods.py): a bound pod's exact command
runs as a local process (workers and progress readers; a probe pod only reports Running, its command is a
sleep); a pod being deleted gets SIGTERM (the trainer saves and exits 75), its exit is reported, then its
deletion finished. Placement is the real scheduler's: each pod requests the one CPU a Node of the pool has.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.kube.cluster import ApiError, Kubelet, free_port, pod_path, set_exited, set_running
from tests.operator.jobs import PVC_JOB, job_body
from tests.operator.local_pods import Container, pvc, tiny_config
from tests.trainer_utils import env_for, kubetron_cmd, tb_scalars

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]
ITERS = 150  # ~30 ms each: the grow (a Node joins, the probe is bound, the trainer is stopped) takes some of them
GROW_AFTER = 5  # iteration of the shrunk attempt after which the second Node joins
POOL = "kubetron.dev/test-pool"
GRACE = 30.0  # seconds: a container still running this long after its pod's deletion is killed
STARTUP_TIMEOUT = 8  # spec.startupTimeoutSeconds (shrinkAfterSeconds stays at its default, 60)


class PoolKubelet:
    """The kubelet of the Nodes of one pool, for the pods of one namespace (a thread; stop() ends it)."""

    def __init__(self, api, ns: str, config: str, workdir: Path):
        self.api, self.ns, self.config, self.dir = api, ns, config, workdir
        self.nodes: list[Kubelet] = []
        self.containers: dict[str, Container] = {}  # pod UID -> its main container
        self.reported: set[str] = set()
        self.stopping: dict[str, float] = {}  # pod UID -> when SIGTERM was sent
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"pool-{ns}", daemon=True)

    def add_node(self, name: str) -> None:
        node = Kubelet(self.api, name=name, cpu="1", gpus=0)
        node.finish_deletions = False  # ours: only once the container has stopped
        node.start()
        self.api.patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {POOL: self.ns}}})
        self.nodes.append(node)

    def container(self, pod_name: str) -> Container | None:
        return next((c for c in self.containers.values() if c.name == pod_name), None)

    def iteration(self, pod_name: str) -> int:
        c = self.container(pod_name)
        return c.last_iteration() if c else 0

    def start(self) -> PoolKubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for c in self.containers.values():
            c.kill()
        for node in self.nodes:
            node.stop()
            self.api.delete(f"/api/v1/nodes/{node.name}", ok=(404,))

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            try:
                for pod in self.api.get(pod_path(self.ns))["items"]:
                    if pod["spec"].get("nodeName") in {n.name for n in self.nodes}:
                        self._sync(pod)
            except (OSError, ApiError) as exc:
                self.errors.append(str(exc))

    def _sync(self, pod: dict[str, Any]) -> None:
        meta, uid = pod["metadata"], pod["metadata"]["uid"]
        main = pod["spec"]["containers"][0]["name"]
        c = self.containers.get(uid)
        if meta.get("deletionTimestamp"):
            self._stop_pod(pod, c)
        elif meta["labels"].get("kubetron.dev/role") == "probe":
            if (pod.get("status") or {}).get("phase") != "Running":
                set_running(self.api, self.ns, meta["name"], container=main)
        elif c is None:
            self.containers[uid] = Container(pod, self.config, self.dir / f"{meta['name']}-{uid[:8]}")
            set_running(self.api, self.ns, meta["name"], container=main)
        elif c.exit_code() is not None and uid not in self.reported:
            self._report(pod, c)

    def _report(self, pod: dict[str, Any], c: Container) -> None:
        set_exited(self.api, self.ns, pod["metadata"]["name"], c.exit_code(), c.termination_message(),
                   container=pod["spec"]["containers"][0]["name"])
        self.reported.add(pod["metadata"]["uid"])  # a report the API server refused is tried again

    def _stop_pod(self, pod: dict[str, Any], c: Container | None) -> None:
        """What a kubelet does with a pod being deleted: SIGTERM, the grace period, the exit, then gone."""
        meta, uid = pod["metadata"], pod["metadata"]["uid"]
        if c is not None and c.exit_code() is None:
            if uid not in self.stopping:
                self.stopping[uid] = time.monotonic()
                c.proc.send_signal(signal.SIGTERM)  # PID 1 of the container: kubetron.launch
            elif time.monotonic() - self.stopping[uid] > GRACE:
                c.kill()
            return
        if c is not None and uid not in self.reported:
            self._report(pod, c)
        self.api.request("DELETE", pod_path(self.ns, meta["name"]),
                         {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}, ok=(404, 409))


def reference_run(config: str, workdir: Path) -> subprocess.Popen:
    """The same config trained uninterrupted on one process (world size 1); its losses in workdir/tb."""
    workdir.mkdir()
    (workdir / "config.yaml").write_text(config)
    args = ["train", "--config", str(workdir / "config.yaml"), f"checkpoint.save={workdir / 'ckpt'}",
            f"checkpoint.load={workdir / 'ckpt'}", f"logger.tensorboard_dir={workdir / 'tb'}"]
    return subprocess.Popen(kubetron_cmd(*args), env=env_for(workdir, OMP_NUM_THREADS="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def test_elastic_job_shrinks_runs_grows_and_succeeds(kube, kube_ns, tmp_path):
    ns, api = kube_ns, kube.admin
    store = tmp_path / "pvc"
    store.mkdir()
    pvc(kube, ns, store)
    config = tiny_config(ITERS, tensorboard_dir=str(store / "tb"))
    # startupTimeoutSeconds below the default shrinkAfterSeconds (60): the pod the scheduler cannot place
    # shrinks the job at the start-up timeout, it does not end the attempt as StartupTimeout.
    body = job_body(PVC_JOB, nodes=2, minNodes=1, startupTimeoutSeconds=STARTUP_TIMEOUT, config=config,
                    storage={"pvc": {"claimName": "ckpt", "mountPath": str(store)}},
                    statusPort=free_port(), masterPort=free_port(), terminationGracePeriodSeconds=int(GRACE),
                    resources={"requests": {"cpu": "1"}}, scheduling={"nodeSelector": {POOL: ns}})
    body["metadata"] = {"name": "gpt"}
    pool = PoolKubelet(api, ns, config, tmp_path / "pods")
    pool.add_node(f"{ns}-a")  # room for one pod
    pool.start()
    t0 = time.monotonic()
    reference = reference_run(config, tmp_path / "reference")  # meanwhile
    try:
        with kube.operator(ns):
            api.create(kube.jobs(ns), body)
            shrunk = kube.wait_status(ns, "gpt", "running shrunk at 1 node", lambda s: s.get("phase") == "Running"
                                      and s.get("nodes") == 1, timeout=120)
            t_shrunk = time.monotonic() - t0
            worker = f"gpt-{shrunk['attempt']}-0"
            kube.wait_for(f"{worker} past iteration {GROW_AFTER}", lambda: pool.iteration(worker) >= GROW_AFTER, 120)
            probe = kube.pods(ns, role="probe")
            assert list(probe) == [f"gpt-{shrunk['attempt']}-probe-1"], probe  # asks the scheduler for rank 1
            pool.add_node(f"{ns}-b")  # capacity returns
            t_grow = time.monotonic()
            grown = kube.wait_status(ns, "gpt", "running at 2 nodes", lambda s: s.get("phase") == "Running"
                                     and s.get("nodes") == 2, timeout=120)
            t_grown = time.monotonic() - t_grow
            st = kube.wait_status(ns, "gpt", "Succeeded", lambda s: s.get("phase") == "Succeeded", timeout=180)
            events = [e for e in kube.events(ns) if e["reason"] == "Resized"]
        # The API server keeps minNodes in range and immutable (the CRD's rules).
        with pytest.raises(ApiError, match="spec.minNodes cannot change"):
            api.patch(f"{kube.jobs(ns)}/gpt", {"spec": {"minNodes": 2}})
        wide = job_body(PVC_JOB, nodes=2, minNodes=3)
        wide["metadata"] = {"name": "wide"}
        with pytest.raises(ApiError, match="spec.minNodes must be at most spec.nodes"):
            api.create(kube.jobs(ns), wide)
    finally:
        pool.stop()
        out, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, out[-3000:]
    total = time.monotonic() - t0
    assert shrunk["attempt"] == 2 and grown["attempt"] == 3 and st["attempt"] == 3
    assert st["nodes"] == 2 and st["iteration"] == ITERS and st["resizes"] == {"shrinks": 1, "grows": 1}
    assert st["restarts"]["total"] == 0 and st["lostIterations"] == 0  # not failures; no iteration lost
    assert (st["minNodes"], st["sizes"]) == (1, [1, 2])
    assert sorted(e["message"].split(":")[0] for e in events) == ["attempt 1", "attempt 2"]
    assert any("2 -> 1 nodes" in e["message"] and "Unschedulable for more than startupTimeoutSeconds "
               f"({STARTUP_TIMEOUT}s)" in e["message"] for e in events), events
    assert any("1 -> 2 nodes" in e["message"] and "probe" in e["message"] for e in events)
    stopped = pool.container(f"gpt-{shrunk['attempt']}-0")
    assert stopped.exit_code() == 75, "".join(stopped.lines[-60:])  # saved on SIGTERM: the grow lost nothing
    saved = stopped.last_iteration()

    losses, reference = tb_scalars(store / "tb"), tb_scalars(tmp_path / "reference" / "tb")
    assert sorted(losses) == sorted(reference) == list(range(1, ITERS + 1))
    assert saved < ITERS - 20, saved  # enough iterations on two ranks to compare
    # Up to the save one process both ways. After it two ranks each average one micro-batch and the
    # all-reduce averages the two, where one rank averaged the same two micro-batches: (g1 + g2) / 2 either
    # way, halving being exact in binary floating point, so the losses are bit-exact (with more than two
    # data-parallel ranks the summation order differs and they agree to fp32 rounding only; docs/elastic.md).
    assert losses == reference, {i: (losses[i], reference[i]) for i in losses if losses[i] != reference[i]}
    print(f"\n[elastic] shrunk and running after {t_shrunk:.1f}s; grown and running {t_grown:.1f}s after the "
          f"second node joined; saved at {saved}; losses bit-exact; {total:.0f}s in all")

