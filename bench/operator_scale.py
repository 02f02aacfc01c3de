"""The operator at scale on a real control plane: N TrainingJobs applied at once.

    .venv/bin/python bench/operator_scale.py [--jobs 50 500] [--idle 30] [--failures 3] [--interval 5]

Starts the test suite's control plane (tests/kube: etcd, kube-apiserver, controller-manager, scheduler;
a stand-in kubelet registers one Node and runs nothing, so pods stay Pending) and, per N, a fresh
namespace with the real `kubetron operator --namespace NS` subprocess under the chart's RBAC. Then:

  * pods:    N two-node PVC jobs are applied at once (8 threads); seconds until all 2N worker pods
             exist (as a watch started before the first apply delivers them). Baseline in the same
             run: a bare loop creating the same 2N pod manifests (build()) one after another through
             the same client (the operator's `Kube`, its identity).
             req_per_job: the operator's API requests from the first apply until all pods exist, per job.
             cpu_ratio: the CPU-seconds of every process (etcd, the API server, controller-manager, scheduler,
             the operator, this script with its watch and stand-in kubelet) from the first apply until all pods
             exist, over the same during the bare loop: what a loaded machine skews least (the time ratio counts
             the waits for cores the other jobs on the machine take).
  * idle:    API requests/s the operator makes while nothing changes (once its rate fell to <= 1/s over
             10 s, or after --settle seconds if it never does: settle_s), counted
             by the API server: a FlowSchema matching exactly the operator's ServiceAccount, read from
             `apiserver_flowcontrol_dispatched_requests_total` on /metrics (tests/operator/test_on_kube_events.py).
  * failure: one worker pod of a job is marked Failed (as a kubelet would); seconds until the job's
             status shows it (restarts counted or phase changed; inf: not within 60 s). Repeated on
             --failures jobs (median and max).
  * RSS:     the operator's peak resident memory (VmHWM) at the end.

Targets (issue 12): 1000 pods <= 30 s or <= 1.5x the bare loop; <= 1 request/s idle at N=500;
failure-to-status <= 3 s at N=500; RSS <= 200 MB. To measure another commit's operator, run this
script with PYTHONPATH pointing at that checkout's `operator:trainer` directories.
"""

from __future__ import annotations

import argparse
import copy
import http.client
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.kube import cluster  # noqa: E402
from tests.kube.fixtures import KubeEnv, start_env  # noqa: E402
from tests.kube.request_count import count_operator_requests, operator_requests  # noqa: E402
from tests.operator.jobs import PVC_JOB  # noqa: E402


def job_manifest(ns: str, i: int) -> dict[str, Any]:
    body = copy.deepcopy(PVC_JOB)
    body["metadata"] = {"name": f"j{i:04d}", "namespace": ns}
    return body


class PodWatch:
    """Counts the worker pods of a namespace as a watch delivers them (a thread reading the API server's
    stream): when the `count`-th arrived. A watch costs the API server one encoded event per pod, where
    polling with a LIST every 0.5 s re-read every pod so far from etcd and encoded it each time (at N = 500
    about 0.5 CPU-second per LIST between the API server and this process, on the machine the operator
    shares: a load the bare loop did not carry). A stream the API server closes (a watcher that fell
    behind) is listed and watched again."""

    SELECTOR = "kubetron.dev/role=worker"
    NAME = re.compile(rb'^\{"type":"ADDED","object":\{"kind":"Pod","apiVersion":"v1","metadata":\{"name":"([^"]+)"')

    def __init__(self, api: cluster.Api, ns: str, count: int):
        self.api, self.ns, self.count = api, ns, count
        self.names: set[str] = set()
        self.at = float("inf")
        self.done = threading.Event()
        self.error: BaseException | None = None
        rv = self._list()
        threading.Thread(target=self._run, args=(rv,), daemon=True).start()

    def _list(self) -> str:
        listed = self.api.get(f"/api/v1/namespaces/{self.ns}/pods", query={"labelSelector": self.SELECTOR})
        self.names.update(p["metadata"]["name"] for p in listed["items"])
        return str(listed["metadata"]["resourceVersion"])

    def _arrived(self) -> bool:
        if len(self.names) >= self.count and self.at == float("inf"):
            self.at = time.monotonic()
        return self.at < float("inf")

    def _run(self, rv: str) -> None:
        try:
            while not self._arrived():
                self._watch(rv)
                rv = self._list()
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            self.error = exc
        finally:
            self.done.set()

    def _watch(self, rv: str) -> None:
        conn = http.client.HTTPSConnection(self.api.host, self.api.port, context=self.api.ctx, timeout=None)
        try:
            query = f"watch=1&labelSelector={self.SELECTOR.replace('=', '%3D')}&resourceVersion={rv}"
            conn.request("GET", f"/api/v1/namespaces/{self.ns}/pods?{query}", headers={"Accept": "application/json"})
            for line in conn.getresponse():
                found = self.NAME.match(line)  # ADDED: the pod's name (no need to parse the whole pod)
                if found:
                    self.names.add(found.group(1).decode())
                    if self._arrived():
                        return
        finally:
            conn.close()

    def wait(self, timeout: float) -> float:
        """time.monotonic() when the `count`-th pod arrived; AssertionError after `timeout` seconds."""
        if not self.done.wait(timeout) or self.error is not None:
            raise AssertionError(f"{len(self.names)} of {self.count} worker pods after {timeout:.0f} s"
                                 + (f" ({self.error!r})" if self.error else ""))
        return self.at


def bare_loop(env: KubeEnv, n: int) -> tuple[float, float]:
    """Seconds to create the 2N pods of N jobs one by one through the operator's own client, and the
    CPU-seconds every process spent meanwhile (all_cpu)."""
    from kubernetes import client, config
    from kubetron_operator.api_calls import Kube, kubernetes_transport
    from kubetron_operator.build import build
    from kubetron_operator.model import Job

    configuration = client.Configuration()
    config.load_kube_config(str(env.kubeconfig), client_configuration=configuration)
    kube = Kube(kubernetes_transport(client.ApiClient(configuration)))
    ns = env.namespace("bare")
    pods = []
    for i in range(n):
        body = job_manifest(ns, i)
        body["metadata"]["uid"] = f"uid-{i}"
        for m in build(Job.from_body(body), 1, 0, ()):
            if m["kind"] == "Pod":
                m["metadata"].pop("ownerReferences", None)  # no owner: the garbage collector leaves them be
                pods.append(m)
    c0, t0 = all_cpu(env), time.monotonic()
    for m in pods:
        kube.create(m)
    return time.monotonic() - t0, all_cpu(env) - c0


def job_status(env: KubeEnv, ns: str, name: str) -> dict[str, Any]:
    return (env.job(ns, name) or {}).get("status") or {}


def failure_latency(env: KubeEnv, ns: str, name: str, limit: float = 60.0) -> float:
    """Mark rank 1 of `name`'s current attempt Failed; seconds until the job's status shows it."""
    before = job_status(env, ns, name)
    pod = f"{name}-{before.get('attempt', 1)}-1"
    t0 = time.monotonic()
    cluster.set_exited(env.admin, ns, pod, 1, message="bench: simulated crash")

    def shown() -> bool:
        st = job_status(env, ns, name)
        return (st.get("restarts") or {}) != (before.get("restarts") or {}) or st.get("phase") != before.get("phase")
    try:
        cluster.wait_for(f"{ns}/{name} status after its pod failed", shown, limit, interval=0.05)
    except AssertionError:
        return float("inf")  # not shown within `limit` seconds
    return time.monotonic() - t0


def all_cpu(env: KubeEnv, operator_pid: int | None = None) -> float:
    """CPU-seconds so far of the control plane's processes, this process and the operator (if running)."""
    pids = [p.pid for p in env.cp.procs.values()] + ([operator_pid] if operator_pid else [])
    own = os.times()
    return sum(cpu_seconds(pid) for pid in pids) + own.user + own.system


def cpu_seconds(pid: int) -> float:
    """User + system CPU the process has used (clock ticks of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def settle(env: KubeEnv, limit: float, window: float = 10.0) -> float:
    """Seconds until the operator made at most one request/s over `window` (the scheduler's verdicts on
    the pods have arrived and been reported), or `limit` if it never gets that quiet."""
    t0 = time.monotonic()
    last = operator_requests(env)
    while time.monotonic() - t0 < limit:
        time.sleep(window)
        now = operator_requests(env)
        if now - last <= window:
            break
        last = now
    return time.monotonic() - t0


def run_n(env: KubeEnv, n: int, args: argparse.Namespace) -> dict[str, float]:
    ns = env.namespace(f"scale{n}")
    out: dict[str, float] = {"jobs": n}
    with env.operator(ns, interval=args.interval) as op:
        manifests = [job_manifest(ns, i) for i in range(n)]
        watch = PodWatch(env.admin, ns, 2 * n)
        r0, c0, t0 = operator_requests(env), all_cpu(env, op.proc.pid), time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda m: env.admin.create(env.jobs(ns), m), manifests))
        out["apply_s"] = time.monotonic() - t0
        try:
            out["pods_s"] = watch.wait(args.timeout) - t0
        except AssertionError as exc:
            raise AssertionError(f"{exc}\noperator log:\n{op.tail()}") from None
        out["op_phase_cpu_s"] = all_cpu(env, op.proc.pid) - c0
        out["req_per_job"] = (operator_requests(env) - r0) / n
        out["op_cpu_s"] = cpu_seconds(op.proc.pid)
        out["settle_s"] = settle(env, args.settle)
        r0, t1 = operator_requests(env), time.monotonic()
        time.sleep(args.idle)
        out["idle_rps"] = (operator_requests(env) - r0) / (time.monotonic() - t1)
        latencies = [failure_latency(env, ns, f"j{i:04d}") for i in range(0, n, max(1, n // args.failures))]
        out["fail_to_status_s"] = statistics.median(latencies[: args.failures])
        out["fail_to_status_max_s"] = max(latencies[: args.failures])
        out["rss_mb"] = peak_rss_mb(op.proc.pid)
    out["bare_s"], bare_cpu = bare_loop(env, n)
    out["cpu_ratio"] = out["op_phase_cpu_s"] / bare_cpu
    out["ratio"] = out["pods_s"] / out["bare_s"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, nargs="+", default=[500], help="N values to measure (default: 500)")
    p.add_argument("--interval", type=float, default=5.0, help="the operator's --interval (default: 5)")
    p.add_argument("--settle", type=float, default=120.0,
                   help="at most this many seconds after the pods exist for the operator to quiet down")
    p.add_argument("--idle", type=float, default=30.0, help="seconds of idle request counting")
    p.add_argument("--failures", type=int, default=3, help="pod failures to time per N")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for all pods")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kubetron-scale-") as tmp:
        cp, env, kubelet = start_env(Path(tmp))
        try:
            count_operator_requests(env)
            head = ("jobs", "pods", "pods_s", "op_cpu_s", "bare_s", "ratio", "cpu_ratio", "req_per_job", "settle_s",
                    "idle_rps", "fail_to_status_s", "fail_to_status_max_s", "rss_mb")
            print("  ".join(f"{h:>10}" for h in head), flush=True)
            for n in args.jobs:
                r = run_n(env, n, args)
                r["pods"] = 2 * n
                print("  ".join(f"{r[h]:>10.2f}" if isinstance(r[h], float) else f"{r[h]:>10}" for h in head),
                      flush=True)
        finally:
            kubelet.stop()
            cp.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
