"""Nodes that fail jobs (docs/recovery.md, "Nodes that fail a job"; docs/security.md, "Nodes").

Evidence is weighed by who controls it. What a job's own pods say (the trainer's words, its exit code, a hang,
an in-place restart, rank 0's endpoint) is the tenant's: it may keep that job off a node, never another job.
What the node says about itself (node_view.py: a problem condition, unhealthy devices) and what its kubelet
does (refusing a pod) is not the tenant's.

For one job (status.failingNodes, status.avoidNodes), only evidence that points at the node:
- a pod that failed on a node reporting a problem: avoided at once (NodeProblem);
- the kubelet refusing a pod: avoided at once (AdmissionRejected, policy/restart.py);
- the trainer's words for broken hardware (Xid, ECC, "fallen off the bus") or a straggler exit naming a rank
  on the node: a strike, STRIKES strikes avoid it (HardwareError, StragglerDetected).
Never a generic crash (any signal, an OOM kill, an exception), a hang or an in-place restart: a job's own code
does those on any node. Strikes and avoidance expire after AVOID_SECONDS. An attempt avoids only as many of the
avoided nodes as leave it the eligible nodes it needs (plan_avoidance: its nodeSelector, required affinity and
tolerations, cordons, readiness, room for one of its pods); the oldest avoidance yields first, and the condition
NodesAvoided says what is avoided and what yielded.

For every job (the chart's failingNodes.taint, node_taints.py applies it): a node one of this job's decisions
points at is tainted TAINT_KEY=<namespace>:NoSchedule only on evidence no single tenant controls (taint_verdict):
it reports a problem itself, or jobs of TAINT_NAMESPACES namespaces avoid it. Never a control-plane node; a
namespace triggers at most TAINTS_PER_NAMESPACE taints at a time; the operator removes its taint after
--taint-seconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from decimal import Decimal
from typing import Any, cast

from kubetron.contract import exitcodes
from kubetron.contract.times import parse_stamp, stamp

from kubetron_operator.job_status import AvoidedNode, Condition, FailingNode, JobStatus, StatusPatch
from kubetron_operator.model import Job
from kubetron_operator.node_view import NodeView, quantity
from kubetron_operator.observe import Observed, PodView
from kubetron_operator.policy.action import Action, Event
from kubetron_operator.policy.hang import set_condition
from kubetron_operator.untrusted import clean

STRIKES = 2  # strikes of a job's own evidence (its words, a straggler exit) before it avoids a node
AVOID_SECONDS = 3600.0  # a strike and an avoidance hold this long
TAINT_KEY = "kubetron.dev/failing-node"  # <key>=<namespace>:NoSchedule, with the chart's failingNodes.taint
TAINT_NAMESPACES = 2  # namespaces whose jobs avoid a node before it is tainted on their evidence alone
TAINTS_PER_NAMESPACE = 1  # taints one namespace's jobs may have triggered at a time
MAX_AVOID_NODES = 8  # nodes remembered in status.avoidNodes
MAX_FAILING_NODES = 16  # nodes with strikes remembered in status.failingNodes
EVIDENCE_KEPT = 3  # strikes' evidence kept per node
EVIDENCE_CHARS = 300  # of one piece of evidence
AVOIDED = "NodesAvoided"  # the condition: which nodes the current attempt avoids, which yielded
NODE_PROBLEM, HARDWARE, STRAGGLER, REJECTED = "NodeProblem", "HardwareError", "StragglerDetected", "AdmissionRejected"
EVIDENCE_REASONS = frozenset({NODE_PROBLEM, HARDWARE, STRAGGLER, REJECTED})
"""The reasons an avoidance is written for; another (an older operator's Hung, Crashed) is not evidence."""
HARDWARE_WORDS = re.compile(r"\bXid\b|\bECC\b|uncorrectable|fallen off the bus|GPU is lost|row remap",
                            re.IGNORECASE)
"""A trainer's words for a failing GPU (NVIDIA's driver and CUDA); a user's bug says none of them."""
STRAGGLER_RANK = re.compile(r"rank (\d+) at [0-9.]+ of the fastest")


# -- what a job avoids ------------------------------------------------------------------------------------


def avoided(status: JobStatus, now: datetime) -> tuple[str, ...]:
    """The names on status.avoidNodes whose avoidance holds at `now` (oldest first)."""
    return tuple(e["node"] for e in live_avoidance(status, now))


def live_avoidance(status: JobStatus, now: datetime) -> list[AvoidedNode]:
    """status.avoidNodes' entries that have not expired (an entry without a time, an older operator's bare
    name, has), oldest first."""
    out = []
    for entry in status.get("avoidNodes") or ():
        when = parse_stamp(entry.get("time")) if isinstance(entry, Mapping) else None
        if when is not None and entry.get("node") and (now - when).total_seconds() < AVOID_SECONDS:
            out.append(AvoidedNode(node=str(entry["node"]), reason=str(entry.get("reason") or ""),
                                   evidence=str(entry.get("evidence") or ""), time=str(entry["time"])))
    return sorted(out, key=lambda e: e["time"])


def avoid(status: JobStatus, nodes: Iterable[str], reason: str, evidence: str, now: datetime) -> list[AvoidedNode]:
    """status.avoidNodes with `nodes` (added last, or moved there), the expired ones gone, the newest
    MAX_AVOID_NODES."""
    fresh = [AvoidedNode(node=n, reason=reason, evidence=clean(evidence, EVIDENCE_CHARS), time=stamp(now))
             for n in nodes]
    names = {a["node"] for a in fresh}
    held = [e for e in live_avoidance(status, now) if e["node"] not in names]
    return (held + fresh)[-MAX_AVOID_NODES:]


def with_node_strikes(job: Job | None, obs: Observed, action: Action) -> Action:
    """`action` with the strikes it reveals counted (status.failingNodes), the nodes they avoid added to
    status.avoidNodes (an event each), and the nodes newly avoided offered for a taint (Action.taint_nodes)."""
    strikes = _strikes(job, obs, action) if job is not None else []
    before = set(avoided(obs.status, obs.now))
    if not strikes:
        newly = _newly_avoided(action, before)
        return replace(action, taint_nodes=action.taint_nodes + newly) if newly else action
    st = cast(JobStatus, {**obs.status, **action.status})
    failing = {f["node"]: f for f in _live_strikes(st, obs.now)}
    status: StatusPatch = {}
    events: list[Event] = []
    for node, reason, evidence in strikes:
        held = failing.get(node) or FailingNode(node=node, failures=0, evidence=[], time="")
        failing[node] = FailingNode(node=node, failures=int(held.get("failures") or 0) + 1, time=stamp(obs.now),
                                    evidence=[*(held.get("evidence") or [])[-(EVIDENCE_KEPT - 1):], evidence])
        at_once = reason == NODE_PROBLEM  # the node's own word
        if (at_once or failing[node]["failures"] >= STRIKES) and node not in avoided(st, obs.now):
            why = "; ".join(failing[node]["evidence"])
            st["avoidNodes"] = status["avoidNodes"] = avoid(st, (node,), reason, why, obs.now)
            count = "failed this job on evidence that points at it" if at_once else \
                f"failed this job {failing[node]['failures']} times"
            events.append(Event("Warning", "NodeAvoided", f"node {node} {count}; later attempts are kept off it "
                                                          f"for {AVOID_SECONDS / 3600:g}h: {why}"))
    status["failingNodes"] = list(failing.values())[-MAX_FAILING_NODES:]
    action = replace(action, status={**action.status, **status}, events=action.events + tuple(events))
    return replace(action, taint_nodes=action.taint_nodes + _newly_avoided(action, before))


def _newly_avoided(action: Action, before: set[str]) -> tuple[str, ...]:
    return tuple(a["node"] for a in action.status.get("avoidNodes") or ()
                 if isinstance(a, Mapping) and a.get("node") not in before)


def _live_strikes(status: JobStatus, now: datetime) -> list[FailingNode]:
    """status.failingNodes' entries whose newest strike has not expired."""
    out = []
    for f in status.get("failingNodes") or ():
        when = parse_stamp(f.get("time")) if isinstance(f, Mapping) else None
        if when is not None and f.get("node") and (now - when).total_seconds() < AVOID_SECONDS:
            out.append(f)
    return out


def _strikes(job: Job, obs: Observed, action: Action) -> list[tuple[str, str, str]]:
    """(node, reason, evidence) of each failure this decision counts that points at a node."""
    if not _failed_now(obs, action):
        return []
    attempt = obs.status.get("attempt") or 0
    current = [p for p in obs.pods if p.role == "worker" and p.attempt == attempt]
    return _node_problems(obs, current) + _hardware(current) + _stragglers(job, current)


def _failed_now(obs: Observed, action: Action) -> bool:
    """This decision ends the current attempt as a failure (it counts one more, or fails the job)."""
    before = (obs.status.get("restarts") or {}).get("failures") or 0
    after = (action.status.get("restarts") or {}).get("failures") or 0
    return after > before


def _ended_by_itself(p: PodView) -> bool:
    """The pod's trainer ended by its own failure (not a peer's, not a config error) on a known node."""
    return bool(p.node) and p.phase == "Failed" and p.code not in (exitcodes.PEER_FAILURE, exitcodes.CONFIG_ERROR)


def _node_problems(obs: Observed, current: list[PodView]) -> list[tuple[str, str, str]]:
    """Pods that failed on a node reporting a problem of its own (observe.Observed.node_problems)."""
    out = []
    for p in current:
        said = obs.node_problems.get(p.node) if _ended_by_itself(p) else None
        if said:
            out.append((p.node, NODE_PROBLEM, clean(f"pod {p.name} failed on {p.node}, which reports {said}",
                                                    EVIDENCE_CHARS)))
    return out


def _hardware(current: list[PodView]) -> list[tuple[str, str, str]]:
    """Pods whose trainer ended in the words of a failing GPU (the job's own account: for this job only)."""
    return [(p.node, HARDWARE, clean(f"pod {p.name} on {p.node}: {p.detail}", EVIDENCE_CHARS)) for p in current
            if _ended_by_itself(p) and HARDWARE_WORDS.search(f"{p.detail} {p.term_text}")]


def _stragglers(job: Job, current: list[PodView]) -> list[tuple[str, str, str]]:
    """The nodes of the ranks a straggler exit (6) names (the same on every rank: each node once)."""
    ended = next((p for p in current if p.code == exitcodes.STRAGGLER), None)
    if ended is None:
        return []
    by_rank = {p.rank: p for p in current}
    pod_ranks = sorted({int(r) // job.spec.nproc_per_node for r in STRAGGLER_RANK.findall(ended.detail)[:64]})
    pods = [by_rank[r] for r in pod_ranks if r in by_rank and by_rank[r].node]
    return [(p.node, STRAGGLER, clean(f"pod {p.name}: {ended.detail}", EVIDENCE_CHARS)) for p in pods]


# -- an attempt never avoids itself out of room -------------------------------------------------------------


def placing_due(status: JobStatus, now: datetime) -> bool:
    """The next attempt may be created now and would avoid nodes: the handler then lists the nodes, so
    plan_avoidance can tell how many are left to it."""
    phase, attempt = status.get("phase"), status.get("attempt") or 0
    due = parse_stamp(status.get("nextAttemptTime"))
    return (attempt == 0 or phase in ("Restarting", "Suspended")) and (due is None or now >= due) and bool(
        avoided(status, now))


def plan_avoidance(job: Job, status: JobStatus, nodes: Sequence[NodeView] | None, size: int,
                   now: datetime) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """(the nodes the next attempt of `size` pods avoids, those that yield, why they yield): as many of the
    avoided nodes as leave it room for the pods it needs (an elastic job: its smallest size) on nodes its pods
    may land on, the oldest avoidance yielding first. `nodes` None: not listed, nothing yields."""
    avoid = list(avoided(status, now))
    if nodes is None or not avoid:
        return tuple(avoid), (), ""
    needed = job.spec.sizes[0] if job.spec.elastic else size
    eligible = {n.name: room for n in nodes if (room := pods_on(job, n))}
    yielded: list[str] = []
    while avoid and sum(room for name, room in eligible.items() if name not in avoid) < needed:
        yielded.append(avoid.pop(0))
    if not yielded:
        return tuple(avoid), (), ""
    left = sum(room for name, room in eligible.items() if name not in [*avoid, *yielded])
    why = (f"avoiding {', '.join(yielded)} too would leave room for {left} of the {needed} pod(s) it needs on "
           f"the {len(eligible)} node(s) its pods may use")
    return tuple(avoid), tuple(yielded), why


def avoidance_condition(obs: Observed, attempt: int, avoid: Sequence[str], yielded: Sequence[str],
                        why: str) -> list[Condition] | None:
    """The conditions with NodesAvoided set for attempt `attempt` (None: unchanged, it avoids nothing and the
    condition does not say otherwise)."""
    conditions = obs.status.get("conditions") or []
    if not avoid and not yielded:
        held = next((c for c in conditions if c.get("type") == AVOIDED), None)
        if held is None or held.get("status") != "True":
            return None
        return set_condition(conditions, AVOIDED, "False", "Expired", f"attempt {attempt} avoids no node (an "
                             f"avoidance expires after {AVOID_SECONDS / 3600:g}h)", obs.now)
    words = f"attempt {attempt} avoids {', '.join(avoid) or 'no node'}" + (f"; yielded: {why}" if yielded else "")
    return set_condition(conditions, AVOIDED, "True" if avoid else "False", "Yielded" if yielded else "Avoiding",
                         clean(words), obs.now)


def pods_on(job: Job, node: NodeView) -> int:
    """How many of the job's pods `node` could hold by itself (0: none may land there), as the scheduler's
    filters see it: ready, not cordoned, its nodeSelector and required node affinity, every NoSchedule and
    NoExecute taint tolerated, and room for the pod's requests in what the node has allocatable."""
    sched = job.spec.scheduling
    if not node.ready or node.unschedulable or any(node.labels.get(k) != v for k, v in sched.node_selector.items()):
        return 0
    if not _affinity_allows(sched.affinity, node) or not all(
            _tolerated(sched.tolerations, t) for t in node.taints if t.get("effect") in ("NoSchedule", "NoExecute")):
        return 0
    room = [int(node.allocatable.get(name, Decimal(0)) // amount) for name, amount in _requests(job).items()
            if amount > 0]
    return max(0, min([*room, int(node.allocatable.get("pods", Decimal(110)))]))


def _requests(job: Job) -> dict[str, Decimal]:
    """One pod's requests, as the scheduler counts them (a limit without a request requests it)."""
    res = job.spec.resources
    named = {**(res.get("limits") or {}), **(res.get("requests") or {})}
    if job.spec.gpus_per_node:
        named["nvidia.com/gpu"] = job.spec.gpus_per_node
    return {k: q for k, v in named.items() if (q := quantity(v)) is not None}


def _tolerated(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        exists = (t.get("operator") or "Equal") == "Exists"
        if not t.get("key"):
            if exists:
                return True
            continue
        if t.get("key") == taint.get("key") and (exists or (t.get("value") or "") == (taint.get("value") or "")):
            return True
    return False


def _affinity_allows(affinity: Mapping[str, Any], node: NodeView) -> bool:
    required = ((affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or ()
    return not terms or any(_term_matches(t, node) for t in terms)


def _term_matches(term: Mapping[str, Any], node: NodeView) -> bool:
    exprs, fields = term.get("matchExpressions") or (), term.get("matchFields") or ()
    return bool(exprs or fields) and all(_expression(e, node.labels) for e in exprs) and all(
        _expression(f, {"metadata.name": node.name}) for f in fields)


def _expression(e: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op, values = e.get("key"), e.get("operator"), list(e.get("values") or ())
    value = labels.get(str(key))
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op in ("Exists", "DoesNotExist"):
        return (value is not None) == (op == "Exists")
    if op in ("Gt", "Lt") and value is not None and values:
        try:
            return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])
        except ValueError:
            return False
    return False


# -- the cluster-wide taint (node_taints.py applies it) -----------------------------------------------------


def taint_verdict(node: NodeView, namespace: str, avoiders: Mapping[str, str],
                  live_taints: Mapping[str, int]) -> tuple[bool, str]:
    """(whether to taint `node` for a decision of a job in `namespace` that points at it, why or why not).
    `avoiders`: namespace -> what a job of it that avoids the node says; `live_taints`: namespace -> the
    taints with its name on the cluster's nodes now."""
    if node.control_plane:
        return False, f"node {node.name} is a control-plane node: never tainted"
    if any(t.get("key") == TAINT_KEY for t in node.taints):
        return False, f"node {node.name} is tainted {TAINT_KEY} already"
    if live_taints.get(namespace, 0) >= TAINTS_PER_NAMESPACE:
        return False, (f"jobs of namespace {namespace} triggered {live_taints[namespace]} taint(s) still in place "
                       f"(at most {TAINTS_PER_NAMESPACE} at a time)")
    if node.problems:
        return True, f"a job of {namespace} failed on it, and it reports {'; '.join(node.problems)}"
    if len(avoiders) >= TAINT_NAMESPACES:
        return True, "jobs of namespaces " + "; ".join(f"{ns} ({why})" for ns, why in sorted(avoiders.items()))
    return False, (f"node {node.name} is avoided by jobs of {len(avoiders)} namespace(s) and reports no problem "
                   f"itself: a taint needs {TAINT_NAMESPACES} namespaces")


def avoiders(statuses: Iterable[tuple[str, JobStatus]], node: str, now: datetime) -> dict[str, str]:
    """namespace -> the evidence of a job there whose live avoidance of `node` rests on evidence."""
    out: dict[str, str] = {}
    for namespace, status in statuses:
        for entry in live_avoidance(status, now):
            if entry["node"] == node and entry["reason"] in EVIDENCE_REASONS:
                out.setdefault(namespace, clean(f"{entry['reason']}: {entry['evidence']}", 200))
    return out
