"""Nodes that keep failing a job are left out (docs/recovery.md, "Nodes that keep failing").

A failure that points at a node is a strike against it, kept in status.failingNodes: a rank on it named by a
hang, a pod on it that ended with a hardware-looking error (a crash by SIGSEGV, SIGBUS, SIGILL, SIGFPE or
SIGABRT; words such as "CUDA error", "Xid", "ECC"), a straggler exit naming a rank on it, a rank on it whose
crash restarted the gang in place (rank 0's lastRestart). STRIKES strikes put
the node on status.avoidNodes (the reason and the evidence with it), as a kubelet that rejects a pod does at
once: every later attempt's pods get a required node affinity `kubernetes.io/hostname NotIn` those nodes
(build.py). An elastic job whose pods then find no room shrinks (policy/elastic.py) rather than wait for them.
The current attempt keeps its pods; the node is left out from the next attempt on. With the chart's
failingNodes.taint (off by default) the operator also taints such a node cluster-wide (TAINT_KEY, NoSchedule):
no pod without a toleration lands there until someone removes the taint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any, cast

from kubetron.contract import exitcodes
from kubetron.contract.times import stamp

from kubetron_operator.job_status import AvoidedNode, FailingNode, JobStatus, StatusPatch
from kubetron_operator.model import Job
from kubetron_operator.observe import NO_LIVE, Observed, PodView
from kubetron_operator.policy.action import Action, Event

STRIKES = 2  # failures pointing at a node before it is avoided
TAINT_KEY = "kubetron.dev/failing-node"  # with the chart's failingNodes.taint: <key>=<job>:NoSchedule on the node
MAX_AVOID_NODES = 8  # nodes remembered in status.avoidNodes
MAX_FAILING_NODES = 16  # nodes with strikes remembered in status.failingNodes
EVIDENCE_KEPT = 3  # strikes' evidence kept per node
HARDWARE_SIGNALS = {132: "SIGILL", 134: "SIGABRT", 135: "SIGBUS", 136: "SIGFPE", 139: "SIGSEGV"}
"""Exit codes of a process killed by a signal that says more about the machine than about the program."""
HARDWARE_WORDS = re.compile(r"CUDA error|NCCL error|cudaError|\bXid\b|\bECC\b|uncorrectable|fallen off the bus|"
                            r"illegal memory access|unspecified launch failure|Input/output error|"
                            r"killed by SIG(?:SEGV|BUS|ILL|FPE|ABRT)", re.IGNORECASE)
"""A trainer's (or its launcher's: `rank 1 ... was killed by SIGSEGV`) words for a failing machine."""
STRAGGLER_RANK = re.compile(r"rank (\d+) at [0-9.]+ of the fastest")


def avoided(status: JobStatus) -> tuple[str, ...]:
    """The names on status.avoidNodes (entries are {node, reason, evidence, time}; an older operator's are names)."""
    return tuple(_name(entry) for entry in status.get("avoidNodes") or () if _name(entry))


def _name(entry: Any) -> str:
    return entry if isinstance(entry, str) else str((entry or {}).get("node") or "")


def avoid(status: JobStatus, nodes: Iterable[str], reason: str, evidence: str, now: str) -> list[AvoidedNode]:
    """status.avoidNodes with `nodes` (added last, or moved there), the newest MAX_AVOID_NODES."""
    fresh = [AvoidedNode(node=n, reason=reason, evidence=evidence[:300], time=now) for n in nodes]
    names = {a["node"] for a in fresh}
    held = [_entry(e) for e in status.get("avoidNodes") or () if _name(e) and _name(e) not in names]
    return (held + fresh)[-MAX_AVOID_NODES:]


def _entry(entry: Any) -> AvoidedNode:
    if isinstance(entry, str):
        return AvoidedNode(node=entry, reason="", evidence="", time="")
    return AvoidedNode(node=str(entry.get("node") or ""), reason=str(entry.get("reason") or ""),
                       evidence=str(entry.get("evidence") or ""), time=str(entry.get("time") or ""))


def with_node_strikes(job: Job | None, obs: Observed, action: Action) -> Action:
    """`action` with the strikes it reveals counted (status.failingNodes) and the nodes that reached STRIKES
    avoided (status.avoidNodes), with an event for each."""
    strikes = _strikes(job, obs, action) if job is not None else []
    if not strikes:
        return action
    st = cast(JobStatus, {**obs.status, **action.status})
    failing = {f["node"]: f for f in st.get("failingNodes") or [] if isinstance(f, Mapping) and f.get("node")}
    status: StatusPatch = {}
    events: list[Event] = []
    for node, reason, evidence in strikes:
        held = failing.get(node) or FailingNode(node=node, failures=0, evidence=[])
        failing[node] = FailingNode(node=node, failures=int(held.get("failures") or 0) + 1,
                                    evidence=[*(held.get("evidence") or [])[-(EVIDENCE_KEPT - 1):], evidence[:300]])
        if failing[node]["failures"] >= STRIKES and node not in avoided(st):
            why = "; ".join(failing[node]["evidence"])
            st["avoidNodes"] = status["avoidNodes"] = avoid(st, (node,), reason, why, stamp(obs.now))
            events.append(Event("Warning", "NodeAvoided", f"node {node} failed this job {STRIKES} times; later "
                                                          f"attempts are kept off it: {why}"))
    status["failingNodes"] = list(failing.values())[-MAX_FAILING_NODES:]
    newly = tuple(a["node"] for a in status.get("avoidNodes") or () if a["node"] not in avoided(obs.status))
    return replace(action, status={**action.status, **status}, events=action.events + tuple(events),
                   taint_nodes=action.taint_nodes + newly)


def _strikes(job: Job, obs: Observed, action: Action) -> list[tuple[str, str, str]]:
    """(node, reason, evidence) of each failure this decision reveals that points at a node."""
    out = []
    hang = action.status.get("lastHang")
    if isinstance(hang, Mapping) and hang != obs.status.get("lastHang") and hang.get("node"):
        out.append((str(hang["node"]), "Hung", f"attempt {hang.get('attempt')}: rank {hang.get('rank')} (pod "
                    f"{hang.get('pod')}) hung in phase {hang.get('phase')} after iteration {hang.get('iteration')}"))
    attempt = obs.status.get("attempt") or 0
    current = [p for p in obs.pods if p.role == "worker" and p.attempt == attempt]
    if _failed_now(obs, action):
        out += _hardware(current) + _stragglers(job, current)
    return out + _crashed_in_place(obs, action, current)


def _crashed_in_place(obs: Observed, action: Action, current: list[PodView]) -> list[tuple[str, str, str]]:
    """The pod whose rank's crash caused an in-place restart this decision counts (rank 0's lastRestart)."""
    counted = obs.status.get("attemptInPlaceRestarts") or 0
    now = action.status.get("attemptInPlaceRestarts") or counted
    cause = (obs.live or NO_LIVE).get("lastRestart")
    if cause is None or not counted < cause["restart"] <= now:
        return []
    pod = next((p for p in current if p.rank == cause["nodeRank"] and p.node), None)
    if pod is None:
        return []
    return [(pod.node, "Crashed", f"attempt {pod.attempt}, in-place restart {cause['restart']}: rank {cause['rank']} "
                                  f"(pod {pod.name}) {cause['how']}")]


def _failed_now(obs: Observed, action: Action) -> bool:
    """This decision ends the current attempt as a failure (it counts one more, or fails the job)."""
    before = (obs.status.get("restarts") or {}).get("failures") or 0
    after = (action.status.get("restarts") or {}).get("failures") or 0
    return after > before


def _hardware(current: list[PodView]) -> list[tuple[str, str, str]]:
    """Pods whose trainer ended with a hardware-looking error: a crash by a machine signal, or its words."""
    out = []
    for p in current:
        if not p.node or not p.terminated or p.code in (0, exitcodes.PEER_FAILURE, exitcodes.CONFIG_ERROR):
            continue
        words = HARDWARE_WORDS.search(f"{p.detail} {p.term_text}")
        signal = HARDWARE_SIGNALS.get(p.code or 0)
        if signal or words:
            how = f" (killed by {signal})" if signal else ""
            out.append((p.node, "HardwareError", f"pod {p.name} on {p.node}{how}: {p.detail[:200]}"))
    return out


def _stragglers(job: Job, current: list[PodView]) -> list[tuple[str, str, str]]:
    """The nodes of the ranks a straggler exit (6) names (the same on every rank: each node once)."""
    ended = next((p for p in current if p.code == exitcodes.STRAGGLER), None)
    if ended is None:
        return []
    by_rank = {p.rank: p for p in current}
    pod_ranks = sorted({int(r) // job.spec.nproc_per_node for r in STRAGGLER_RANK.findall(ended.detail)})
    pods = [by_rank[r] for r in pod_ranks if r in by_rank and by_rank[r].node]
    return [(p.node, "StragglerDetected", f"pod {p.name}: {ended.detail[:200]}") for p in pods]
