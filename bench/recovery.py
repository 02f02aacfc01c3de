"""Recovery time on a real control plane: a rank's death (or hang) to the job's next completed iteration, in
place (the gang restarted inside its pods, docs/recovery.md) vs whole-gang recreation (new pods), and a hung
rank found and the gang restarted by the pods' watchdogs.

    .venv/bin/python bench/recovery.py [--repeats 3] [--imports 5] [--hang-timeout S] [--json OUT]
    .venv/bin/python bench/recovery.py --quick          # one run of each, side by side (what CI runs)

Starts the test suite's control plane (tests/kube: etcd, kube-apiserver, controller-manager, scheduler)
and the real `kubetron operator`; a ProcessKubelet (tests/operator/local_pods.py) runs every pod the scheduler
binds as local processes, the pods' exact commands (real launcher, torchrun, trainer; gloo on CPU),
reports their ends, and stops the containers of pods being deleted. Each run: a 2-pod job of the tiny
GPT on a hostPath claim trains, its two pods on two Nodes with room for one pod each (a full cluster: a
restart has no room for any pod but the gang's); once a durable checkpoint is in the progress log, rank 1's
trainer is armed to SIGKILL itself (SIGSTOP, for the hang) at its next iteration half an interval past a save
(kubetron.cli.chaos_from_env, `step@<r>%<m>`: the run's own step, not a line read from it). Then

  * in place:  spec.maxInPlaceRestarts 3: the torchrun agents restart the gang in the same pods (each rank
               resumes from its memory snapshot when one newer than the store's checkpoint exists, the
               default, else from the store: status.lastRecovery says which);
  * recreate:  spec.maxInPlaceRestarts 0: the pod fails, the operator deletes the gang and creates attempt 2
               at once after its failure backoff (no pod to read the progress log: its rank 0 resumes from
               the newest checkpoint in the store);
  * hang:      rank 1 stopped, not killed: the pods' watchdogs see no progress past the hang timeout, agree,
               stop the gang and restart it in place (spec.hangTimeoutSeconds from --hang-timeout, else the
               trainer's default rule: 45 s for the tiny GPT).

Phases, each from the end of the one before: detect (the agent's restart line / the killed rank's pod
ended, as the kubelet reports it), or for the hang its detection (the watchdogs' verdict line) and the
gang's stop and restart; the operator deleting the gang, old pods gone, the operator's failure backoff (a
SIGKILL is a failure: no new attempt before status.nextAttemptTime, 10 s and more; a preemption has none),
new pods created and bound, then up to the start of rank 0's new trainer process (container start,
launcher, torchrun agent, rendezvous), then the trainer's own start-up line (kubetron.startup: python +
config, imports, distributed init, model + data, checkpoint load, first step). Times come from the
kubelet's observations (polled every 50 ms), the arrival of log lines, status.nextAttemptTime, and the
start-up line (its end is the line's arrival; process start = end - total). The ratio in place / recreate
is given with and without the backoff.

Elastic (spec.minNodes, docs/elastic.md): a `nodes: 2, minNodes: 1` job on two Nodes with room for one
pod each; one Node is drained (cordoned, its pod evicted): seconds to the first step at 1 node; then
it is uncordoned: seconds to the first step at 2 nodes.

`--memory MB [MB ...]`: instead, memory snapshots (docs/recovery.md) against the store, side by side in one run,
at each size: the tiny GPT with a frozen padding parameter (bench/padded_trainer.py) so that a rank's state is
about MB megabytes while its steps stay the tiny GPT's (a wider model makes CPU steps of seconds): rank 1's trainer
SIGKILLed (by itself, half an interval past a save), then (another job) pod 1 deleted at once (grace 0, as a lost
node leaves it) while its trainer has SIGSTOPped itself at the same point, each with
spec.memorySnapshots on (in place from memory; the pod replaced in its attempt, from pod 0's copy) and off
(in place from the store; a new attempt from the store). Per run: seconds from the kill (deletion) to rank 1's
line of the first iteration after the one resumed from, status.lastRecovery's loadedFrom, and the iterations
lost (reached at the kill less the one resumed from), and a timeline (seconds after the kill or deletion: the new
pod's container started, a surviving rank saw its peer fail, an agent restarts its ranks, the new pod's agent up,
the round formed and the trainer's start-up phases, the state resumed, rank 0's first step, rank 1's next
iteration; `--logs DIR`: every pod's lines, stamped the same way). Snapshots off means no non-persistent
checkpoints at all. `--store pvc s3`: the runs with snapshots off once per store, a PVC directory and a bucket on the
local S3 server (tests/s3server.py: seaweedfs); the runs with snapshots on use the first (they do not read it).

`--imports N`: the import of megatron-core as it is, vs as the run's setup imports it
(kubetron.compat.megatron_core.install) with wandb run at import (as before lazy wandb) and now, N
alternating fresh processes each (median seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kubetron.contract.times import parse_stamp  # noqa: E402
from kubetron.storage import snapshot_files as sf  # noqa: E402
from kubetron.supervisor import startup  # noqa: E402
from kubetron.supervisor.launch import TRAINER_MODULE_ENV  # noqa: E402

from bench.padded_trainer import PADDING_ENV  # noqa: E402
from tests.kube import cluster  # noqa: E402
from tests.kube.fixtures import KubeEnv, start_env  # noqa: E402
from tests.multirank.runner import faults_by_life  # noqa: E402
from tests.operator.jobs import PVC_JOB, S3_JOB, job_body  # noqa: E402
from tests.operator.local_pods import Container, ProcessKubelet, last_checkpoint, pinned, pool, pvc, tiny_config  # noqa: E402
from tests.s3server import S3Server, start_s3_server  # noqa: E402
from tests.trainer_utils import ITER_RE  # noqa: E402

IN_PLACE, RECREATE, HANG = "in place", "recreate", "hang"
MODES = (IN_PLACE, RECREATE, HANG)
RESTART_LINE = "restarting the gang in place"
HUNG_LINE = "the gang hung"  # kubetron.watchdog's verdict, in every pod's log
# The rows before the trainer's own start-up phases; '-' where a mode has no such phase.
BACKOFF = "failure backoff (status.nextAttemptTime)"
DETECTED, STOPPED = "hang detected (no progress past the timeout)", "pods agree, gang stopped, restart"
OUTSIDE = ("detect", DETECTED, STOPPED, "operator deletes the gang", "old pods gone", BACKOFF,
           "new pods created + bound", "to trainer process start")
PHASES = OUTSIDE + startup.PHASES
TIMEOUT = 300.0


@dataclass
class Recovery:
    mode: str
    phases: dict[str, float]  # seconds, PHASES order
    total: float  # kill -> end of the first step after it, measured directly
    first_iteration: int  # the first iteration completed after the kill (resumed from the one before)
    killed_at_iteration: int  # the iteration rank 1's trainer completed last, at which its fault fired
    checkpoint_at_kill: int  # the newest durable checkpoint then (the progress log's)
    loaded_from: str  # status.lastRecovery.loadedFrom: memory (a snapshot), peer, store (the durable checkpoint)
    resumed_from: int  # status.lastRecovery.iteration
    lines: list[str] = field(default_factory=list, repr=False)


def startup_after(c: Container, t: float) -> tuple[float, tuple[float, int, dict[str, float]]] | None:
    """(arrival time, parsed line) of the container's first start-up line that arrived after `t`."""
    for arrived, line in list(c.stamped):
        if arrived > t and (parsed := startup.parse_line(line)) is not None:
            return arrived, parsed
    return None


def wait(what: str, check, node: ProcessKubelet, timeout: float = TIMEOUT):
    def explain() -> str:
        return "\n".join(f"--- {name}\n" + "".join(c.lines[-15:]) for name, c in node.containers.items())
    return cluster.wait_for(what, check, timeout, interval=0.02, explain=explain)


def recover(env: KubeEnv, workdir: Path, mode: str, save_interval: int, hang_timeout: int | None = None) -> Recovery:
    """One job, one SIGKILL (in place, recreate) or SIGSTOP (hang) of rank 1's trainer, the phases until rank
    0's first step after it. Its two pods run on two Nodes with room for one pod each: a full cluster (the
    recreated gang needs no room for any other pod)."""
    ns = env.namespace("recovery")
    store = workdir / ns / "pvc"
    store.mkdir(parents=True)
    pvc(env, ns, store)
    spec = {"hangTimeoutSeconds": hang_timeout} if mode == HANG and hang_timeout is not None else {}
    body = job_body(PVC_JOB, nodes=2, config=tiny_config(train_iters=100_000, save_interval=save_interval),
                    storage={"pvc": {"claimName": "ckpt", "mountPath": str(store)}},
                    statusPort=cluster.free_port(), masterPort=cluster.free_port(),
                    maxInPlaceRestarts=0 if mode == RECREATE else 3, terminationGracePeriodSeconds=30,
                    **pinned(ns), **spec)
    body["metadata"] = {"name": "gpt"}
    arm, sig = workdir / ns / "arm", "STOP" if mode == HANG else "KILL"
    with pool(env.admin, ns, 2) as names, env.operator(ns), BackoffWatch(env, ns) as backoff, \
            ProcessKubelet(env.admin, ns, workdir / ns, nodes=names,
                           faults={"gpt-1-1": mid_interval_fault(save_interval, sig, arm)}) as node:
        env.admin.create(env.jobs(ns), body)
        wait("a durable checkpoint (the trainer's progress log)", lambda: last_checkpoint(store / "gpt"), node)
        rank1 = wait("rank 1's pod", lambda: node.containers.get("gpt-1-1"), node)
        killed, reached = fire(rank1, arm, sig, save_interval, node)  # rank 1's trainer, not its pod's PID 1
        durable = last_checkpoint(store / "gpt")
        rank0 = "gpt-2-0" if mode == RECREATE else "gpt-1-0"
        arrived, (total, first, trainer) = wait(
            f"{rank0}'s first step after the kill", lambda: (c := node.containers.get(rank0)) is not None
            and startup_after(c, killed), node, timeout=TIMEOUT + (hang_timeout or 60))
        if mode == RECREATE:
            outside = recreate_phases(node, killed, arrived - total, backoff.not_before)
        else:
            outside = in_place_phases(node, killed, arrived - total, hung=mode == HANG)
        # Where it resumed from: in place, the rank's memory snapshot when a newer one than the store's exists.
        last = wait("status.lastRecovery", lambda: ((env.job(ns, "gpt") or {}).get("status") or {}).get(
            "lastRecovery"), node)
        lines = [f"--- {name}\n" + "".join(c.lines) for name, c in node.containers.items()]
    return Recovery(mode, {**outside, **trainer}, arrived - killed, first, reached, durable, last["loadedFrom"],
                    last["iteration"], lines)


def mid_interval_fault(save_interval: int, sig: str, arm: Path) -> dict[str, str]:
    """Rank 1's trainer sends itself SIG<sig> at its first iteration half an interval past a save once `fire` armed
    it (kubetron.cli.chaos_from_env): the run's own step, not a line read from it."""
    return faults_by_life((f"step@{save_interval // 2}%{save_interval}", sig), arm=arm)


def fire(rank1: Container, arm: Path, sig: str, save_interval: int, node: ProcessKubelet) -> tuple[float, int]:
    """Arms rank 1's fault (`mid_interval_fault`) and waits until its trainer acted on it: (the time it did,
    polled every 20 ms; the iteration it did at, its last line)."""
    trainer = psutil.Process(rank1.trainer_pid())
    Path(f"{arm}-0").touch()

    def acted() -> bool:
        try:
            status = trainer.status()
        except psutil.NoSuchProcess:
            return sig == "KILL"
        return status in ((psutil.STATUS_STOPPED,) if sig == "STOP" else (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD))

    wait(f"rank 1's trainer SIG{sig}", acted, node)
    when = time.time()
    # The fault is a listener of StepDone(k) that runs before the one that prints iteration k's line: the last
    # line is k's or k - 1's (once the pipe delivered it).
    r, m = save_interval // 2, save_interval

    def fault_iteration() -> int | None:
        last = rank1.last_iteration()
        return last + (r - last) % m if last and last % m in (r, (r - 1) % m) else None

    return when, wait("rank 1's line of that iteration (or the one before)", fault_iteration, node, timeout=30)


def consecutive(names: tuple[str, ...], times: list[float]) -> dict[str, float]:
    """{name: seconds from the time before to its own} over a timeline (kill first)."""
    return {name: b - a for name, a, b in zip(names, times, times[1:], strict=False)}


def in_place_phases(node: ProcessKubelet, killed: float, process_start: float, hung: bool = False) -> dict[str, float]:
    """In place: the agent's restart line (a crash), or the watchdogs' verdict and then the restart (a hang)."""
    def first(text: str) -> float:
        return min(t for c in node.containers.values() for t, line in list(c.stamped) if t > killed and text in line)

    restart = first(RESTART_LINE)
    if hung:
        return consecutive((DETECTED, STOPPED, "to trainer process start"), [killed, first(HUNG_LINE), restart,
                                                                             process_start])
    return consecutive(("detect", "to trainer process start"), [killed, restart, process_start])


def recreate_phases(node: ProcessKubelet, killed: float, process_start: float,
                    not_before: float | None) -> dict[str, float]:
    seen, old = node.seen, ("gpt-1-0", "gpt-1-1")
    gone = max(seen[(p, "gone")] for p in old)
    # A pod that ended (Failed) is deleted at once, never seen "deleting": its deletion shows as "gone".
    times = [killed, seen[("gpt-1-1", "exited")], min(seen.get((p, "deleting"), seen[(p, "gone")]) for p in old),
             gone, max(gone, not_before or gone), seen[("gpt-2-0", "bound")], process_start]
    return consecutive(("detect", "operator deletes the gang", "old pods gone", BACKOFF, "new pods created + bound",
                        "to trainer process start"), times)


class BackoffWatch:
    """The job's status.nextAttemptTime (the operator's backoff after a failed attempt: no new pods
    before it), polled every 0.2 s while the block runs: `not_before`, seconds since the epoch."""

    def __init__(self, env: KubeEnv, ns: str):
        self.env, self.ns, self.not_before = env, ns, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> BackoffWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _poll(self) -> None:
        while self.not_before is None and not self._stop.wait(0.2):
            with contextlib.suppress(OSError, cluster.ApiError):
                when = ((self.env.job(self.ns, "gpt") or {}).get("status") or {}).get("nextAttemptTime")
                if when:
                    self.not_before = parse_iso(when)


SHRINK_AFTER = 2  # spec.shrinkAfterSeconds of the elastic run


def elastic_timings(env: KubeEnv, workdir: Path, save_interval: int) -> dict[str, float]:
    """The elastic node range (spec.minNodes, docs/elastic.md): a `nodes: 2, minNodes: 1` job on two
    Nodes with room for one pod each. Capacity gone: one Node is drained (cordoned, its pod evicted);
    seconds until rank 0 of the 1-node attempt completed its first step. Capacity back: the Node is
    uncordoned; seconds until rank 0 of the 2-node attempt completed its first step."""
    ns = env.namespace("elastic")
    store = workdir / ns / "pvc"
    store.mkdir(parents=True)
    pvc(env, ns, store)
    body = job_body(PVC_JOB, nodes=2, minNodes=1, shrinkAfterSeconds=SHRINK_AFTER,
                    config=tiny_config(train_iters=100_000, save_interval=save_interval),
                    storage={"pvc": {"claimName": "ckpt", "mountPath": str(store)}},
                    statusPort=cluster.free_port(), masterPort=cluster.free_port(), terminationGracePeriodSeconds=30,
                    **pinned(ns))
    body["metadata"] = {"name": "gpt"}
    with pool(env.admin, ns, 2) as names, env.operator(ns), \
            ProcessKubelet(env.admin, ns, workdir / ns, nodes=names) as pods:
        env.admin.create(env.jobs(ns), body)
        wait("a durable checkpoint (the trainer's progress log)", lambda: last_checkpoint(store / "gpt"), pods)
        gone = time.time()
        drain(env, ns, names[1])
        shrunk = training_at(env, ns, pods, 1, gone)
        back = time.time()
        env.admin.patch(f"/api/v1/nodes/{names[1]}", {"spec": {"unschedulable": False}})
        grown = training_at(env, ns, pods, 2, back)
    return {"capacity gone -> training at 1 of 2 nodes": shrunk - gone,
            "capacity back -> training at 2 nodes": grown - back}


def drain(env: KubeEnv, ns: str, node: str) -> None:
    """`kubectl drain`: the Node cordoned, the job's pod on it evicted (the Eviction API)."""
    env.admin.patch(f"/api/v1/nodes/{node}", {"spec": {"unschedulable": True}})
    for name, pod in env.pods(ns).items():
        if pod["spec"].get("nodeName") == node:
            env.admin.create(f"/api/v1/namespaces/{ns}/pods/{name}/eviction", {
                "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}})


def training_at(env: KubeEnv, ns: str, pods: ProcessKubelet, size: int, since: float) -> float:
    """When rank 0 of the job's first attempt at `size` nodes created after `since` completed its first step."""
    st = env.wait_status(ns, "gpt", f"an attempt at {size} node(s)", lambda s: s.get("nodes") == size
                         and s.get("phase") in ("Pending", "Running") and parse_iso(s.get("attemptStartTime")) >= since
                         - 1, timeout=TIMEOUT)
    rank0 = f"gpt-{st['attempt']}-0"
    arrived, _ = wait(f"{rank0}'s first step", lambda: (c := pods.containers.get(rank0)) is not None
                      and startup_after(c, since), pods)
    return arrived


def parse_iso(text: str | None) -> float:
    when = parse_stamp(text)
    return when.timestamp() if when else 0.0


# -- imports: megatron-core as it is vs as kubetron's setup imports it -------------------------------------

INSTALL = "kubetron.compat.megatron_core as c; c.install()"
IMPORTS = {
    "megatron-core as it is": "import torch, megatron.core",
    "kubetron's install, wandb run at import (before)": f"import torch, wandb, {INSTALL}",
    "kubetron's install (now)": f"import torch, {INSTALL}",
}


def import_seconds(code: str) -> float:
    """Seconds a fresh process spends in `code` (after `import torch`, which every variant pays alike)."""
    timed = (f"import time, torch; t = time.perf_counter(); {code.replace('import torch, ', 'import ')}; "
             "print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", timed], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def imports(rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in IMPORTS}
    for _ in range(rounds):
        for name, code in IMPORTS.items():  # alternating: machine noise hits every variant alike
            times[name].append(import_seconds(code))
    return times


# -- report --------------------------------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(runs: list[Recovery]) -> tuple[str, float]:
    """The phase table (medians over runs of each mode) and the ratio of the in-place and recreate totals."""
    by_mode = {m: [r for r in runs if r.mode == m] for m in MODES}

    def cell(mode: str, phase: str) -> str:
        values = [r.phases[phase] for r in by_mode[mode] if phase in r.phases]
        return f"{median(values):10.2f}" if values else f"{'-':>10}"

    head = f"phase (seconds; median of {' + '.join(str(len(rs)) for rs in by_mode.values())} runs)"
    rows = [f"{head:<48}" + "".join(f"{m:>10}" for m in MODES)]
    rows += [f"{phase:<48}" + "".join(cell(m, phase) for m in MODES) for phase in PHASES]
    totals = {m: median([r.total for r in rs]) for m, rs in by_mode.items()}
    total = "total: kill/stop -> end of the first step after"
    rows.append(f"{total:<48}" + "".join(f"{totals[m]:10.2f}" for m in MODES))
    ratio = totals[IN_PLACE] / totals[RECREATE]
    backoff = median([r.phases[BACKOFF] for r in by_mode[RECREATE]])
    rows.append(f"in place / recreate: {ratio:.2f} (target <= 0.5); without the failure backoff "
                f"({backoff:.2f} s): {totals[IN_PLACE] / (totals[RECREATE] - backoff):.2f}")
    detected = median([r.phases[DETECTED] for r in by_mode[HANG]])
    rows.append(f"hang: detected after {detected:.2f} s (goal <= 60), training again after {totals[HANG]:.2f} s "
                "(goal <= 120)")
    return "\n".join(rows), ratio


def one_by_one(env: KubeEnv, workdir: Path, save_interval: int, repeats: int,
               hang_timeout: int | None) -> tuple[list[Recovery], dict[str, float]]:
    """The runs one after another, the modes alternating; then the elastic run."""
    runs = []
    for i in range(repeats):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            runs.append(recover(env, workdir, mode, save_interval, hang_timeout))
            print(f"{mode}: {runs[-1].total:.2f} s", flush=True)
    return runs, elastic_timings(env, workdir, save_interval)


def side_by_side(env: KubeEnv, workdir: Path, save_interval: int, repeats: int,
                 hang_timeout: int | None) -> tuple[list[Recovery], dict[str, float]]:
    """--quick: one run of each mode and the elastic run at the same time, in their own namespaces.
    Every part runs and every phase is measured, in a fraction of the time; the figures, each run slowed
    by the others, are for a full run to give."""
    with ThreadPoolExecutor(len(MODES) + 1) as workers:
        modes = [workers.submit(recover, env, workdir, mode, save_interval, hang_timeout) for mode in MODES]
        elastic = workers.submit(elastic_timings, env, workdir, save_interval)
        return [m.result() for m in modes], elastic.result()


MEMORY_SAVE_INTERVAL, SNAPSHOT_INTERVAL = 20, 3  # the store's checkpoints; snapshots (non_persistent_save_interval)
# With snapshots on, the store's checkpoints as a large run takes them: rarely (here: none before the kill). Every 20
# iterations of a 15-80 ms step, the durable saves of a state of hundreds of megabytes follow each other back to back
# and are always newer than the newest snapshot with its copies (written in seconds, each waiting for the one before):
# the gang then rightly resumes from the store, and the run measures the store, not memory or a peer.
SNAPSHOT_RUN_SAVE_INTERVAL = 100_000


@dataclass
class FromWhere:
    scenario: str  # "a rank SIGKILLed" | "a pod deleted"
    snapshots: bool  # spec.memorySnapshots.enabled
    seconds: float  # kill (deletion) -> rank 1's line of the first iteration after the one resumed from
    loaded_from: str  # status.lastRecovery.loadedFrom
    kind: str  # status.lastRecovery.kind
    lost: int  # iterations run again: rank 1's newest at the kill less the one resumed from
    store: str = "pvc"  # the job's store: "pvc" (a directory) or "s3" (a bucket on the local S3 server)
    state: float = 0.0  # bytes of a rank's state (kubetron plan's estimate, the padding's share with it)
    gap: int | None = None  # iterations between rank 1's two newest snapshots written before the kill (its events)
    timeline: dict[str, float] = field(default_factory=dict)  # what happened when, seconds after the kill (deletion)
    lines: list[str] = field(default_factory=list, repr=False)


# The marks of `timeline`, in the order they happen; a run shows those it has.
REPLACED, PEER_SAW, AGENT_RESTART = "new pod's container started", "a surviving rank saw its peer fail", \
    "an agent restarts its ranks"
NEW_AGENT, ROUND = "new pod's agent up (its peer server)", "the round formed: trainer processes start"
RESUMED, FIRST_STEP, NEXT = "state resumed (memory, peer or store)", "rank 0's first step", \
    "rank 1's next iteration"
MARKS = (REPLACED, PEER_SAW, AGENT_RESTART, NEW_AGENT, ROUND, RESUMED, FIRST_STEP, NEXT)


def timeline(node: ProcessKubelet, before: dict[str, Container], killed: float, arrived: float) -> dict[str, float]:
    """When each of MARKS happened (seconds after `killed`; those found): the kubelet's start of a new container
    (`before`: the containers then), the arrival of the pods' lines, rank 0's start-up line (the trainer processes
    start when the round formed: its arrival less its total) and its phases."""
    containers = list(node.containers.values())
    new = [c for c in containers if all(c is not b for b in before.values())]

    def first(text: str, among: list[Container]) -> float | None:
        return min((t for c in among for t, line in list(c.stamped) if t > killed and text in line), default=None)

    marks: dict[str, float | None] = {
        REPLACED: min((c.started for c in new), default=None),
        PEER_SAW: first("PeerFailure", list(before.values())),
        AGENT_RESTART: first(RESTART_LINE, containers),
        NEW_AGENT: first("kubetron.peers: serving", new),
        RESUMED: first("resumed from", containers)}
    marks[NEXT] = arrived
    phases: dict[str, float] = {}
    up = [s for c in containers if (s := startup_after(c, killed)) is not None]
    if up:
        end, (total, _, phases) = up[0]
        marks.update({ROUND: end - total, FIRST_STEP: end})
    out: dict[str, float] = {}
    for name, t in sorted(((n, t) for n, t in marks.items() if t is not None), key=lambda m: m[1]):
        out[name] = t - killed
        if name == ROUND:  # the trainer's own start-up phases (durations), after the round formed
            out.update({f"  {phase}": seconds for phase, seconds in phases.items()})
    return out


def padded(mb: float) -> tuple[dict[str, str], float]:
    """Every container's environment for bench/padded_trainer.py with a frozen padding parameter that brings the tiny
    GPT's state per rank (kubetron plan's estimate, at 2 ranks) to about `mb` MB, and those bytes. The memory volume's
    limit for the copies on peers (KUBETRON_SNAPSHOT_LIMIT_BYTES) is what the operator would size it to for that state:
    its estimate knows nothing of the padding."""
    from kubetron.config import ConfigContainer
    from kubetron.contract import recovery
    from kubetron.contract.plan import snapshot_bytes

    base = snapshot_bytes(ConfigContainer.from_dict(yaml.safe_load(tiny_config())), 2)
    padding = 2 * max(0, math.ceil(mb * 1e6 - base) // 4 * 4)  # a replicated weight: each rank writes half of it
    state = base + padding / 2
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "bench"), os.environ.get("PYTHONPATH")])),
            TRAINER_MODULE_ENV: "padded_trainer", PADDING_ENV: str(padding),
            recovery.SNAPSHOT_LIMIT_ENV: str(recovery.volume_bytes(state, 1, 2))}, state


def from_where(env: KubeEnv, workdir: Path, scenario: str, snapshots: bool, padding: dict[str, str],
               store: str = "pvc", s3: S3Server | None = None, interval: int = SNAPSHOT_INTERVAL) -> FromWhere:
    """One run: `scenario` with snapshots on or off (every `interval` iterations; 0: the trainer's default, as often
    as costs 2 % of the step time), the job's store a PVC directory or a bucket on `s3`."""
    ns = env.namespace("memory")
    save_interval = SNAPSHOT_RUN_SAVE_INTERVAL if snapshots else MEMORY_SAVE_INTERVAL
    spec = dict(nodes=2, config=tiny_config(train_iters=100_000, save_interval=save_interval),
                statusPort=cluster.free_port(), masterPort=cluster.free_port(), maxInPlaceRestarts=3,
                overrides=[f"checkpoint.non_persistent_save_interval={interval}"]
                if snapshots and interval else [],  # off: no non-persistent checkpoints at all
                memorySnapshots={"enabled": snapshots}, **pinned(ns))
    bucket = None
    if store == "s3":
        assert s3 is not None
        env.admin.create(f"/api/v1/namespaces/{ns}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
            "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}})
        bucket = s3.new_bucket("memory")
        body = job_body(S3_JOB, **spec)
        body["spec"]["storage"]["s3"].update(bucket=bucket, endpoint=s3.endpoint)
    else:
        claim = workdir / ns / "pvc"
        claim.mkdir(parents=True)
        pvc(env, ns, claim)
        body = job_body(PVC_JOB, storage={"pvc": {"claimName": "ckpt", "mountPath": str(claim)}}, **spec)
    body["metadata"] = {"name": "gpt"}
    # Rank 1's trainer SIGKILLs itself mid-interval; for a deletion it SIGSTOPs itself there and its pod is deleted
    # then, so both lose the same iterations to the store (a deletion at the same moment, not at a line read).
    arm, sig = workdir / ns / "arm", "KILL" if scenario == "a rank SIGKILLed" else "STOP"
    with pool(env.admin, ns, 2) as names, env.operator(ns), \
            ProcessKubelet(env.admin, ns, workdir / ns, nodes=names, env=padding, events=True,
                           faults={"gpt-1-1": mid_interval_fault(MEMORY_SAVE_INTERVAL, sig, arm)}) as node:
        env.admin.create(env.jobs(ns), body)

        def durable() -> int:
            """The newest checkpoint the trainers made durable (their CheckpointDurable events), whatever the store."""
            return max((e["iteration"] for c in list(node.containers.values()) for e in c.events()
                        if e["event"] == "CheckpointDurable"), default=0)

        if not snapshots:
            wait("a durable checkpoint (the trainers' events)", durable, node)
        rank1 = wait("rank 1's pod", lambda: node.containers.get("gpt-1-1"), node)
        if snapshots:
            # else the gang would rightly resume from the store, and the run would not measure memory or a peer
            wait("a copy of rank 1's snapshot on pod 0 newer than the store's checkpoint", lambda: max(
                sf.iterations(sf.peer_dir(node.containers["gpt-1-0"].memory, 1)), default=0) > durable(), node)
            # the kill falls in the steady rhythm of snapshots (two written), not right after the first one
            wait("rank 1's second snapshot", lambda: sum(e["event"] == "SnapshotWritten" for e in rank1.events()) >= 2,
                 node)
        before = dict(node.containers)
        killed, reached = fire(rank1, arm, sig, MEMORY_SAVE_INTERVAL, node)
        written = [e["iteration"] for e in rank1.events() if e["event"] == "SnapshotWritten"]  # before the kill
        gap = written[-1] - written[-2] if len(written) >= 2 else None
        if scenario == "a pod deleted":
            env.admin.request("DELETE", cluster.pod_path(ns, "gpt-1-1"), {"gracePeriodSeconds": 0}, ok=(200, 404))
            killed = time.time()

        last = wait("status.lastRecovery", lambda: ((env.job(ns, "gpt") or {}).get("status") or {}).get(
            "lastRecovery"), node)

        def next_iteration() -> float | None:
            """When rank 1's line of the iteration after the one resumed from arrived (lines the killed process
            logged before the kill may arrive after it: they are not this one)."""
            return min((t for c in list(node.containers.values()) for t, line in list(c.stamped)
                        if t > killed and (m := ITER_RE.search(line)) and int(m.group(1)) == last["iteration"] + 1),
                       default=None)

        arrived = wait("rank 1's first iteration after the recovery", next_iteration, node)
        marks = timeline(node, before, killed, arrived)
        lines = [f"--- {name} (started {c.started - killed:+.3f} s)\n" + "".join(
            f"{t - killed:+9.3f} {line}" for t, line in list(c.stamped)) for name, c in
            [*((f"{n} (before)", c) for n, c in before.items()),
             *((n, c) for n, c in node.containers.items() if all(c is not b for b in before.values()))]]
    shutil.rmtree(workdir / ns, ignore_errors=True)  # its store and memory volumes: gigabytes at the larger sizes
    if bucket is not None:
        empty(s3, bucket)
    return FromWhere(scenario, snapshots, arrived - killed, last["loadedFrom"], last["kind"],
                     reached - last["iteration"], store=store, gap=gap, timeline=marks, lines=lines)


def empty(s3: S3Server, bucket: str) -> None:
    """Delete every object of `bucket` (gigabytes of checkpoints at the larger sizes)."""
    client = s3.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents") or ()]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def memory_vs_store(env: KubeEnv, workdir: Path, sizes: list[float], stores: list[str], s3: S3Server | None,
                    repeats: int = 1, interval: int = SNAPSHOT_INTERVAL) -> list[FromWhere]:
    """Each scenario at each size (MB of state per rank, `padded`): with snapshots on (the store: the first of
    `stores`; recovery does not read it), and off, from each store."""
    runs = []
    for (padding, state), _, scenario in itertools.product([padded(mb) for mb in sizes], range(repeats),
                                                           ("a rank SIGKILLed", "a pod deleted")):
        for store, snapshots in [(stores[0], True), *((s, False) for s in stores)]:
            r = replace(from_where(env, workdir, scenario, snapshots, padding, store, s3, interval), state=state)
            runs.append(r)
            print(f"{state / 1e6:.0f} MB per rank, {r.scenario}, snapshots {'on' if r.snapshots else 'off'}, store "
                  f"{store}: {r.seconds:.2f} s, {r.kind} from {r.loaded_from}, {r.lost} iterations lost"
                  f"{f' (snapshots {r.gap} apart)' if r.gap else ''}; load "
                  f"average {os.getloadavg()[0]:.1f}", flush=True)
            for mark, seconds in r.timeline.items():
                print(f"    {mark:<52}{seconds:7.2f}" if mark.startswith("  ") else f"    {mark:<52}{seconds:+7.2f}",
                      flush=True)
    return runs


STORE_NAMES = {"pvc": "a PVC directory", "s3": "S3 (the local server)"}


def memory_table(runs: list[FromWhere], interval: int = SNAPSHOT_INTERVAL) -> str:
    sizes = sorted({r.state for r in runs})
    stores = list(dict.fromkeys(r.store for r in runs if not r.snapshots))
    rows = [f"2 pods x 1 rank on CPU (the tiny GPT, its state padded by a frozen parameter: bench/padded_trainer.py), "
            f"snapshot {f'every {interval}' if interval else 'at the default interval (2 % of the step time)'} "
            f"(and no checkpoint in the store before the kill); snapshots off: "
            f"checkpoint every {MEMORY_SAVE_INTERVAL}; rank 1 killed at an iteration {MEMORY_SAVE_INTERVAL // 2} "
            f"past a multiple of {MEMORY_SAVE_INTERVAL}; load average {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} cores",
            "| state per rank | scenario | from memory / peer | "
            + " | ".join(f"from the store: {STORE_NAMES[s]} (snapshots off)" for s in stores) + " |",
            "|---|---|---|" + "---|" * len(stores)]
    in_place: dict[float, float] = {}
    ratios: list[str] = []
    for state in sizes:
        for scenario in ("a rank SIGKILLed", "a pod deleted"):
            mine = [r for r in runs if r.state == state and r.scenario == scenario]
            on = [r for r in mine if r.snapshots]
            off = [[r for r in mine if not r.snapshots and r.store == s] for s in stores]
            size = f"{state / 1e6:.0f} MB"
            rows.append(f"| {size} | {scenario} -> next iteration | {_cell(on, lambda r: r.seconds, ' s')} | "
                        + " | ".join(_cell(o, lambda r: r.seconds, ' s', kind=True) for o in off) + " |")
            gaps = [r.gap for r in on if r.gap]
            apart = f" (snapshots {'/'.join(map(str, gaps))} apart)" if gaps else ""
            rows.append(f"| {size} | {scenario}: iterations lost | {_cell(on, lambda r: r.lost)}{apart} | "
                        + " | ".join(_cell(o, lambda r: r.lost) for o in off) + " |")
        in_place[state], replaced = (median([r.seconds for r in runs if r.state == state and r.scenario == sc
                                             and r.snapshots]) for sc in ("a rank SIGKILLed", "a pod deleted"))
        ratios.append(f"{state / 1e6:.0f} MB: a pod deleted, from its peer / a rank SIGKILLed, from memory in place: "
                      f"{replaced / in_place[state]:.2f} (goal <= 1.5)")
    kept = [r for r in runs if r.snapshots and r.gap]
    if kept:
        within = sum(r.lost <= r.gap for r in kept)
        ratios.append(f"iterations lost <= the interval between rank 1's two newest snapshots at the kill: {within} of "
                      f"{len(kept)} runs (goal: all)")
    rows += ["", *ratios]
    if len(sizes) > 1:
        rows.append(f"a rank SIGKILLed, from memory in place, {sizes[-1] / 1e6:.0f} MB / {sizes[0] / 1e6:.0f} MB: "
                    f"{in_place[sizes[-1]] / in_place[sizes[0]]:.2f} (goal <= 1.3)")
    return "\n".join(rows)


def _cell(runs: list[FromWhere], value, unit: str = "", kind: bool = False) -> str:
    """The median of `value` over the runs (each run's after it, when more than one), and where they loaded from."""
    values = [value(r) for r in runs]
    text = f"{median(values):.1f}{unit}" if unit else f"{median(values):g}"
    if len(values) > 1:
        text += " (" + ", ".join(f"{v:.1f}" if unit else f"{v:g}" for v in values) + ")"
    if unit:
        where = sorted({r.loaded_from + (f", {r.kind}" if kind else "") for r in runs})
        text += f" from {' / '.join(where)}" if len(where) > 1 else f" ({where[0]})"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="one run of each mode and the elastic run side by side, one round of imports (CI)")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of each mode, alternating (default: 3; --quick, --memory: 1)")
    p.add_argument("--imports", type=int, default=None,
                   help="rounds of the import comparison, 0: none (default: 5, --quick: 1)")
    p.add_argument("--save-interval", type=int, default=4, help="iterations between checkpoints (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the runs and the table here")
    p.add_argument("--logs", type=Path, default=None, help="write each run's pod logs into this directory")
    p.add_argument("--memory", type=float, nargs="+", default=None, metavar="MB",
                   help="only memory snapshots against the store, a rank's state about MB megabytes (several: each)")
    p.add_argument("--snapshot-interval", type=int, default=SNAPSHOT_INTERVAL, metavar="N",
                   help="--memory: checkpoint.non_persistent_save_interval (default: %(default)s; 0: the trainer's "
                        "default, as often as costs 2 %% of the step time)")
    p.add_argument("--store", choices=("pvc", "s3"), nargs="+", default=["pvc"],
                   help="--memory: the job's store, each (snapshots off) side by side (default: pvc)")
    p.add_argument("--hang-timeout", type=int, default=None,
                   help="spec.hangTimeoutSeconds of the hang run (default: unset, the trainer's own rule, 45 s for "
                        "the tiny GPT; --quick: 10)")
    args = p.parse_args(argv)
    hang_timeout = args.hang_timeout if args.hang_timeout is not None or not args.quick else 10
    repeats = args.repeats if args.repeats is not None else 1 if args.quick or args.memory is not None else 3
    rounds = args.imports if args.imports is not None else 1 if args.quick else 5

    if args.memory is not None:
        with tempfile.TemporaryDirectory(prefix="kubetron-recovery-", ignore_cleanup_errors=True) as tmp:
            cp, env, kubelet = start_env(Path(tmp) / "kube")
            kubelet.finish_deletions = False
            try:
                with contextlib.ExitStack() as stack:
                    s3 = stack.enter_context(start_s3_server(Path(tmp) / "s3")) if "s3" in args.store else None
                    memory_runs = memory_vs_store(env, Path(tmp), args.memory, args.store, s3, repeats,
                                                  args.snapshot_interval)
            finally:
                kubelet.stop()
                cp.stop()
        print("\n" + memory_table(memory_runs, args.snapshot_interval))
        if args.json:
            args.json.write_text(json.dumps({"memory": [{k: v for k, v in asdict(r).items() if k != "lines"}
                                                        for r in memory_runs]}, indent=1))
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            for i, r in enumerate(memory_runs, 1):
                on = "on" if r.snapshots else "off"
                name = f"{i}-{r.state / 1e6:.0f}MB-{r.scenario.split()[-1]}-snapshots-{on}.log"
                (args.logs / name).write_text("".join(r.lines))
        return 0

    with tempfile.TemporaryDirectory(prefix="kubetron-recovery-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        cp, env, kubelet = start_env(workdir / "kube")
        kubelet.finish_deletions = False  # the ProcessKubelet finishes them once the containers stopped
        try:
            runs, elastic = (side_by_side if args.quick else one_by_one)(env, workdir, args.save_interval, repeats,
                                                                         hang_timeout)
        finally:
            kubelet.stop()
            cp.stop()
    for i, run in enumerate(runs, 1):
        print(f"{run.mode}: {run.total:.2f} s (killed after iteration {run.killed_at_iteration}, first step "
              f"after it: iteration {run.first_iteration}, resumed from the {run.loaded_from} at {run.resumed_from})")
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            (args.logs / f"{i}-{run.mode.replace(' ', '-')}.log").write_text("".join(run.lines))
    import_times = imports(rounds)

    text, ratio = table(runs)
    hang = f"spec.hangTimeoutSeconds {hang_timeout}" if hang_timeout is not None else "the default hang timeout"
    print(f"\nrecovery of a 2-pod job of the tiny GPT (1 layer, hidden 32, gloo on CPU), its pods on two Nodes with "
          f"room for one pod each, after a SIGKILL (in place, recreate) or a SIGSTOP (hang; {hang}) of rank 1's "
          f"trainer, checkpoint every {args.save_interval} iterations; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n{text}")
    print(f"\nelastic (nodes 2, minNodes 1, shrinkAfterSeconds {SHRINK_AFTER}; one of two Nodes drained, "
          "then uncordoned; seconds to rank 0's first step at the new size):")
    for name, seconds in elastic.items():
        print(f"  {name:<52}{seconds:6.2f}")
    if rounds:
        print(f"\nimport seconds after `import torch` (median of {rounds}, fresh processes):")
        for name, xs in import_times.items():
            print(f"  {name:<52}{median(xs):6.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "runs": [{k: v for k, v in asdict(r).items() if k != "lines"} for r in runs], "ratio": ratio,
            "phases": list(PHASES), "elastic": elastic, "imports": import_times}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
