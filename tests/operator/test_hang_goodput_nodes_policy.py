"""Hangs, failing nodes and goodput decided as tables, no cluster (policy/hang.py, nodes.py, goodput.py): what a hang
writes into status, which nodes are left out, and where every rank-second of a job goes."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from kubetron.contract import exitcodes, hang
from kubetron.contract.times import stamp
from kubetron_operator.api_calls import Kube, TaintNotGranted
from kubetron_operator.decide import decide
from kubetron_operator.model import Job
from kubetron_operator.node_taints import Taints
from kubetron_operator.node_view import NodeView, quantity
from kubetron_operator.observe import Observed, PodView
from kubetron_operator.policy.nodes import TAINT_KEY, avoiders, plan_avoidance, taint_verdict

from tests.operator.jobs import S3_JOB, job_body

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)
JOB = Job.from_body(S3_JOB)  # 2 nodes, CPU: 2 ranks, backoffLimit 2
RESTARTS = {"preemptions": 0, "failures": 0, "neverStarted": 0, "total": 0, "inPlace": 0, "hangs": 0}
RUNNING = {"phase": "Running", "attempt": 1, "startTime": stamp(T0), "attemptStartCheckpoint": 0,
           "restarts": dict(RESTARTS), "iteration": 30}


def pod(rank, phase="Running", attempt=1, node=None, **kw):
    kw.setdefault("started", phase != "Pending")
    return PodView(name=f"gpt-{attempt}-{rank}", attempt=attempt, rank=rank, phase=phase,
                   node=node if node is not None else f"gpu-{rank}", **kw)


def run(status, pods=(), job=JOB, now=T0, **kw):
    return decide(job, Observed(now=now, status=status, pods=tuple(pods), created=T0, **kw))


def merge(status, patch):
    out = copy.deepcopy(status)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = copy.deepcopy(v)
    return out


def report(rank=1, restart=1, iteration=35, **kw):
    return hang.HangReport(**{"rank": rank, "nodeRank": rank, "localRank": 0, "phase": "train", "iteration": iteration,
                              "idleSeconds": 47.2, "timeoutSeconds": 45.0, "state": hang.STOPPED, "where": "",
                              "ranks": 2, "stacks": "s3://b/gpt/hangs/1-1/", "restart": restart, **kw})


def live(**kw):
    return {"iteration": 30, "inPlaceRestarts": 0, "hangs": 0, "lastHang": None, **kw}


# -- hangs (policy/hang.py) --------------------------------------------------------------------------------


def test_a_hang_restarted_in_place_is_counted_apart_and_names_the_rank_its_pod_and_node():
    pods = [pod(0), pod(1)]
    action = run(RUNNING, pods, live=live(iteration=30, inPlaceRestarts=1, hangs=1, lastHang=report()))
    st = action.status
    assert st["restarts"] == {**RESTARTS, "inPlace": 1, "hangs": 1} and st["attemptHangs"] == 1
    last = st["lastHang"]
    assert (last["rank"], last["pod"], last["node"], last["state"]) == (1, "gpt-1-1", "gpu-1", hang.STOPPED)
    assert last["restartedInPlace"] and last["stacks"] == "s3://b/gpt/hangs/1-1/" and last["iteration"] == 35
    (hung,) = [c for c in st["conditions"] if c["type"] == "Hung"]
    assert hung["status"] == "True" and "pod gpt-1-1 on node gpu-1" in hung["message"]
    (event,) = [e for e in action.events if e.reason == "Hung"]
    assert event.type == "Warning" and "rank 1 (pod gpt-1-1 on node gpu-1) hung: no progress for 47 s" in event.message
    assert "stacks in s3://b/gpt/hangs/1-1/" in event.message and "restarted in place" in event.message
    held = merge(RUNNING, st)
    again = run(held, pods, live=live(iteration=34, inPlaceRestarts=1, hangs=1, lastHang=report()))
    assert "Hung" not in {e.reason for e in again.events} and again.status.get("restarts") is None  # counted once
    past = run(held, pods, live=live(iteration=36, inPlaceRestarts=1, hangs=1, lastHang=report()))
    (hung,) = [c for c in past.status["conditions"] if c["type"] == "Hung"]
    assert (hung["status"], hung["reason"]) == ("False", "Progressing")  # training again, past the hang
    assert [c["status"] for c in past.status["conditions"] if c["type"] == "Running"] in ([], ["True"])


def test_a_hang_in_a_later_attempt_is_counted_after_one_in_an_earlier_attempt():
    """Found by the chaos soak (bench/chaos.py): attempt 6 hung and restarted in place, attempt 7 hung too, and
    status.restarts.hangs said 1. A new attempt's rank 0 counts its hangs from 0 (as its in-place restarts), so the
    attempt's count of hangs already taken in (attemptHangs) starts again at 0 with it."""
    first = run(RUNNING, [pod(0), pod(1)], live=live(inPlaceRestarts=1, hangs=1, lastHang=report()))
    hung = merge(RUNNING, first.status)
    assert hung["restarts"]["hangs"] == 1
    preempted = run(hung, [pod(r, "Failed", exit_code=exitcodes.SAVED_ON_SIGNAL) for r in (0, 1)])
    created = run(merge(hung, preempted.status), [])
    assert created.create_attempt == 2
    second = merge(merge(hung, preempted.status), created.status)
    again = run(second, [pod(0, attempt=2), pod(1, attempt=2)],
                live=live(inPlaceRestarts=1, hangs=1, lastHang=report(rank=0, iteration=70)))
    assert again.status["restarts"]["hangs"] == 2 and again.status["restarts"]["inPlace"] == 2
    assert again.status["lastHang"]["attempt"] == 2 and "Hung" in {e.reason for e in again.events}


def test_a_hang_with_no_in_place_restart_left_ends_the_attempt_as_hung():
    message = {"exitCode": exitcodes.HUNG, "reason": "Hung", "message": "the gang hung: rank 1 (pod rank 1) hung",
               "hang": report(restart=0)}
    pods = [pod(r, phase="Failed", exit_code=exitcodes.HUNG, termination=message) for r in (0, 1)]
    action = run(RUNNING, pods)
    st = action.status
    assert action.kind == "restart" and st["reason"] == "Hung" and "pod gpt-1-0 exited 7 (Hung)" in st["message"]
    assert st["restarts"]["failures"] == 1 and st["restarts"]["hangs"] == 1  # a failure: counts toward backoffLimit
    assert st["lastHang"]["pod"] == "gpt-1-1" and not st["lastHang"]["restartedInPlace"]
    assert {c["type"]: c["status"] for c in st["conditions"]} == {"Restarting": "True", "Hung": "True"}


def test_counts_a_trainer_reports_are_believed_only_up_to_what_the_spec_allows():
    """One status read saying 300 in-place restarts made 300 Events; 10^9 an OOM loop. Counted
    up to maxInPlaceRestarts (3), hangs up to the in-place restarts, one event for the lot."""
    pods = [pod(0), pod(1)]
    action = run(RUNNING, pods, live=live(inPlaceRestarts=300, hangs=2**63 - 1, lastHang=report()))
    st = action.status
    assert st["restarts"]["inPlace"] == 3 and st["attemptInPlaceRestarts"] == 3
    assert st["restarts"]["hangs"] == 3 and st["attemptHangs"] == 3
    assert [e.reason for e in action.events] == ["RestartedInPlace", "Hung"]
    assert "restarted 3 times" in action.events[0].message
    again = run(merge(RUNNING, st), pods, live=live(inPlaceRestarts=10**9, hangs=10**9, lastHang=report()))
    assert "restarts" not in again.status and not again.events  # nothing more than the spec allows


def test_a_hang_reports_strings_reach_status_and_events_cut_short():
    """56 KB of hang report made 94 KB of status, one condition message 36 KB."""
    big = report(where="x" * 56_000, stacks="s3://b/" + "y" * 56_000, phase="p" * 1000, state="s" * 1000)
    action = run(RUNNING, [pod(0), pod(1)], live=live(inPlaceRestarts=1, hangs=1, lastHang=big))
    last = action.status["lastHang"]
    assert len(last["where"]) <= 300 and len(last["stacks"]) <= 512 and len(last["phase"]) <= 32
    (hung,) = [c for c in action.status["conditions"] if c["type"] == "Hung"]
    assert len(hung["message"]) < 1500 and all(len(e.message) < 1500 for e in action.events)
    assert len(json.dumps(action.status)) < 8000


def test_a_pod_that_ends_hung_is_named_from_its_termination_message():
    """The operator used to drop the termination message's `hang` key: pods ending Hung (exit 7) never got
    status.lastHang. Read as the API server has the pod."""
    message = json.dumps({"exitCode": exitcodes.HUNG, "reason": "Hung", "message": "the gang hung",
                          "hang": {**report(restart=0), "where": "w" * 3000}})
    pods = [PodView.from_pod({
        "metadata": {"name": f"gpt-1-{r}", "labels": {"kubetron.dev/attempt": "1", "kubetron.dev/rank": str(r)}},
        "spec": {"nodeName": f"gpu-{r}"},
        "status": {"phase": "Failed", "containerStatuses": [{"name": "trainer", "state": {"terminated": {
            "exitCode": exitcodes.HUNG, "message": message, "startedAt": stamp(T0)}}}]}}, T0) for r in (0, 1)]
    assert pods[0].termination["hang"]["rank"] == 1 and len(pods[0].termination["hang"]["where"]) == 300
    st = run(RUNNING, pods).status
    assert st["reason"] == "Hung" and st["restarts"]["hangs"] == 1
    assert (st["lastHang"]["pod"], st["lastHang"]["node"], st["lastHang"]["restartedInPlace"]) == (
        "gpt-1-1", "gpu-1", False)


def test_a_new_attempt_counts_its_own_hangs():
    """attemptHangs was not reset by a new attempt: attempt 2's first hang (rank 0 says hangs 1) went uncounted."""
    first = run(RUNNING, [pod(0), pod(1)], live=live(inPlaceRestarts=1, hangs=1, lastHang=report()))
    held = merge(RUNNING, first.status)
    assert held["attemptHangs"] == 1
    created = decide(JOB, Observed(now=T0, status={**held, "phase": "Restarting"}))
    assert created.kind == "create" and created.status["attemptHangs"] == 0
    second = {**merge(held, created.status), "phase": "Running"}
    pods = [pod(0, attempt=2), pod(1, attempt=2)]
    hung = run(second, pods, live=live(inPlaceRestarts=1, hangs=1, lastHang=report()))
    assert hung.status["restarts"]["hangs"] == 2 and hung.status["lastHang"]["attempt"] == 2


# -- nodes that fail a job (policy/nodes.py) ----------------------------------------------------------------


def ended(rank, node, code=1, message="", attempt=1):
    """Rank `rank`'s pod on `node` ended with exit `code`, its trainer saying `message` (what a tenant controls)."""
    return pod(rank, phase="Failed", attempt=attempt, exit_code=code, node=node,
               termination={"exitCode": code, "reason": exitcodes.reason(code), "message": message})


def peer(rank, node, attempt=1):
    return ended(rank, node, exitcodes.PEER_FAILURE, "a peer rank failed: Connection reset", attempt)


SICK = {"gpu-7": "condition GpuXidError=True (Xid79: GPU has fallen off the bus)"}  # what the node says (NPD)
CAUSE = {"restart": 1, "rank": 1, "nodeRank": 1, "how": "was killed by SIGBUS"}
# What a failure of rank 1 on gpu-7 tells about gpu-7, as evidence for this job: (strike reason, avoided at once).
# Only what points at the node counts; never a crash, an OOM kill, a hang or an in-place restart.
EVIDENCE = [
    ("SIGSEGV", dict(pods=[peer(0, "gpu-3"), ended(1, "gpu-7", 139, "rank 1 was killed by SIGSEGV")]), None),
    ("SIGKILL, an OOM kill", dict(pods=[peer(0, "gpu-3"), ended(1, "gpu-7", 137, "killed")]), None),
    ("a bug: CUDA error", dict(pods=[peer(0, "gpu-3"), ended(1, "gpu-7", 1, "CUDA error: an illegal memory access "
                                                                              "was encountered")]), None),
    ("ZeroDivisionError", dict(pods=[peer(0, "gpu-3"), ended(1, "gpu-7", 1, "ZeroDivisionError")]), None),
    ("a hang, in place", dict(pods=[pod(0), pod(1, node="gpu-7")],
                              live=live(inPlaceRestarts=1, hangs=1, lastHang=report())), None),
    ("a crash restarted in place", dict(pods=[pod(0), pod(1, node="gpu-7")],
                                        live=live(inPlaceRestarts=1, lastRestart=CAUSE)), None),
    ("a hang, ending the attempt", dict(pods=[ended(r, f"gpu-{7 * r}", exitcodes.HUNG, "hung") for r in (0, 1)]),
     None),
    ("a peer failure on a sick node", dict(pods=[ended(0, "gpu-3"), peer(1, "gpu-7")], node_problems=SICK), None),
    ("the trainer's words for a GPU", dict(pods=[peer(0, "gpu-3"), ended(1, "gpu-7", 1, "CUDA error: uncorrectable "
                                                                                       "ECC error (Xid 48)")]),
     ("HardwareError", False)),
    ("a crash on a node that reports a problem", dict(pods=[peer(0, "gpu-3"), ended(1, "gpu-7", 139, "segfault")],
                                                      node_problems=SICK), ("NodeProblem", True)),
]


@pytest.mark.parametrize(("case", "seen", "strike"), EVIDENCE, ids=[e[0] for e in EVIDENCE])
def test_only_evidence_that_points_at_the_node_counts_against_it(case, seen, strike):
    action = run(RUNNING, **seen)
    failing = action.status.get("failingNodes")
    if strike is None:
        assert failing is None and "avoidNodes" not in action.status and not action.taint_nodes, action.status
        return
    reason, at_once = strike
    assert [(f["node"], f["failures"]) for f in failing] == [("gpu-7", 1)]
    if not at_once:
        assert "avoidNodes" not in action.status and not action.taint_nodes
        return
    (avoided,) = action.status["avoidNodes"]
    assert (avoided["node"], avoided["reason"], avoided["time"]) == ("gpu-7", reason, stamp(T0))
    assert "reports condition GpuXidError=True" in avoided["evidence"] and action.taint_nodes == ("gpu-7",)
    (event,) = [e for e in action.events if e.reason == "NodeAvoided"]
    assert "evidence that points at it" in event.message


def test_the_trainers_own_word_twice_avoids_the_node_for_an_hour():
    xid = "CUDA error: uncorrectable ECC error encountered (Xid 48)"
    first = run(RUNNING, [peer(0, "gpu-3"), ended(1, "gpu-7", 1, xid)])
    assert [(f["node"], f["failures"]) for f in first.status["failingNodes"]] == [("gpu-7", 1)]
    second_attempt = {**merge(RUNNING, first.status), "phase": "Running", "attempt": 2}
    later = T0 + timedelta(minutes=10)
    second = run(second_attempt, [ended(0, "gpu-7", 1, xid, attempt=2), peer(1, "gpu-4", 2)], now=later)
    (avoided,) = second.status["avoidNodes"]
    assert (avoided["node"], avoided["reason"]) == ("gpu-7", "HardwareError") and avoided["evidence"].count("Xid") == 2
    (event,) = [e for e in second.events if e.reason == "NodeAvoided"]
    assert "node gpu-7 failed this job 2 times" in event.message and "for 1h" in event.message
    assert second.taint_nodes == ("gpu-7",)  # offered: node_taints.py asks taint_verdict (two namespaces needed)
    restarting = {**merge(second_attempt, second.status), "phase": "Restarting", "nextAttemptTime": None}
    assert decide(JOB, Observed(now=later + timedelta(minutes=5), status=restarting)).avoid_nodes == ("gpu-7",)
    expired = decide(JOB, Observed(now=later + timedelta(hours=1), status=restarting))
    assert expired.kind == "create" and expired.avoid_nodes == () and expired.status["avoidNodes"] == []
    # a strike older than an hour no longer adds up: one more is one, not two
    stale = {**merge(RUNNING, first.status), "phase": "Running", "attempt": 2}
    again = run(stale, [ended(0, "gpu-7", 1, xid, attempt=2), peer(1, "gpu-4", 2)], now=T0 + timedelta(hours=2))
    assert [f["failures"] for f in again.status["failingNodes"]] == [1] and "avoidNodes" not in again.status


def test_an_older_operators_bare_names_and_reasons_are_no_evidence():
    status = {**RUNNING, "avoidNodes": ["gpu-9", {"node": "gpu-8", "reason": "Hung", "evidence": "a hang",
                                                  "time": stamp(T0)}]}
    restarting = {**status, "phase": "Restarting"}
    assert decide(JOB, Observed(now=T0, status=restarting)).avoid_nodes == ("gpu-8",)  # a bare name has expired
    assert avoiders([("team-a", restarting)], "gpu-8", T0) == {}  # Hung: nothing another job is held to


def test_a_straggler_exit_points_at_the_node_of_the_rank_it_names():
    job = Job.from_body(job_body(S3_JOB, gpusPerNode=2, resources={"limits": {"nvidia.com/gpu": 2}}))
    words = "straggler detected at iteration 40: rank 3 at 0.42 of the fastest rank's speed (relative_threshold 0.7)"
    pods = [pod(r, phase="Failed", exit_code=6, termination={"exitCode": 6, "message": words}) for r in (0, 1)]
    action = run(RUNNING, pods, job=job)
    assert [(f["node"], f["failures"]) for f in action.status["failingNodes"]] == [("gpu-1", 1)]  # rank 3: pod 1


def node(name, *, labels=None, taints=(), gpus=8, ready=True, cordoned=False, problems=()):
    return NodeView(name=name, labels={"kubernetes.io/hostname": name, **(labels or {})}, taints=tuple(taints),
                    unschedulable=cordoned, ready=ready, problems=tuple(problems),
                    allocatable={"nvidia.com/gpu": Decimal(gpus), "cpu": Decimal(64), "pods": Decimal(110)})


def gpu_job(nodes=2, **spec):
    return Job.from_body(job_body(S3_JOB, nodes=nodes, gpusPerNode=8, **spec))


def avoiding(*names, minutes=10):
    return {"phase": "Restarting", "attempt": 1, "avoidNodes": [
        {"node": n, "reason": "NodeProblem", "evidence": "x", "time": stamp(T0 - timedelta(minutes=minutes - i))}
        for i, n in enumerate(names)]}


POOL = {"key": "pool", "value": "a", "effect": "NoSchedule"}
# (the job, the cluster, the nodes avoided oldest first) -> (avoided by the next attempt, yielded)
PLANS = [
    ("two nodes, both avoided (a soak)", gpu_job(), [node("a"), node("b")], ("a", "b"), ((), ("a", "b"))),
    ("room left after avoiding", gpu_job(), [node("a"), node("b"), node("c")], ("a",), (("a",), ())),
    ("the oldest yields first", gpu_job(), [node("a"), node("b"), node("c")], ("a", "b"), (("b",), ("a",))),
    ("a node of 16 GPUs holds two pods", gpu_job(), [node("a", gpus=16), node("b")], ("b",), (("b",), ())),
    ("7 healthy GPUs hold no pod of 8", gpu_job(), [node("a", gpus=7), node("b"), node("c")], ("b",),
     ((), ("b",))),
    ("a cordoned node is no room", gpu_job(), [node("a", cordoned=True), node("b"), node("c")], ("b",),
     ((), ("b",))),
    ("nor one that is not ready", gpu_job(), [node("a", ready=False), node("b"), node("c")], ("b",), ((), ("b",))),
    ("nor an untolerated taint", gpu_job(), [node("a", taints=[POOL]), node("b"), node("c")], ("b",),
     ((), ("b",))),
    ("a tolerated one is", gpu_job(scheduling={"tolerations": [{"key": "pool", "operator": "Exists"}]}),
     [node("a", taints=[POOL]), node("b"), node("c")], ("b",), (("b",), ())),
    ("the nodeSelector", gpu_job(scheduling={"nodeSelector": {"zone": "x"}}),
     [node("a", labels={"zone": "x"}), node("b", labels={"zone": "x"}), node("c")], ("b",), ((), ("b",))),
    ("required affinity", gpu_job(scheduling={"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuring"
                                                                           "Execution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["c"]}]}]}}}}),
     [node("a"), node("b"), node("c")], ("b",), ((), ("b",))),
    ("an elastic job needs its smallest size", Job.from_body(job_body(S3_JOB, nodes=2, minNodes=1, gpusPerNode=8)),
     [node("a"), node("b")], ("b",), (("b",), ())),
    ("nodes not listed: nothing yields", gpu_job(), None, ("a", "b"), (("a", "b"), ())),
]


@pytest.mark.parametrize(("case", "job", "cluster", "names", "want"), PLANS, ids=[p[0] for p in PLANS])
def test_an_attempt_avoids_no_more_nodes_than_leave_it_room(case, job, cluster, names, want):
    avoid, yielded, why = plan_avoidance(job, avoiding(*names), cluster, job.spec.nodes, T0)
    assert (avoid, yielded) == want
    assert bool(why) == bool(yielded)


def test_the_next_attempt_yields_and_says_so():
    """On a 2-node cluster both nodes avoided, the next attempt still gets created without
    a node affinity that nothing can meet, and the condition NodesAvoided says which avoidance yielded."""
    job = gpu_job()
    action = decide(job, Observed(now=T0, status=avoiding("a", "b"), nodes=(node("a"), node("b"))))
    assert action.kind == "create" and action.avoid_nodes == ()
    (cond,) = [c for c in action.status["conditions"] if c["type"] == "NodesAvoided"]
    assert (cond["status"], cond["reason"]) == ("False", "Yielded")
    assert "avoiding a, b too would leave room for 0 of the 2 pod(s) it needs" in cond["message"]
    assert "yielding" in action.events[0].message
    kept = decide(job, Observed(now=T0, status=avoiding("a"), nodes=(node("a"), node("b"), node("c"))))
    (cond,) = [c for c in kept.status["conditions"] if c["type"] == "NodesAvoided"]
    assert kept.avoid_nodes == ("a",) and (cond["status"], cond["reason"]) == ("True", "Avoiding")


# what a decision pointing at node `n` taints: (node, namespace asking, avoiders, live taints) -> tainted
VERDICTS = [
    ("the tenant's own evidence alone", node("n"), "team-a", {"team-a": "HardwareError: Xid"}, {}, False),
    ("two namespaces avoid it", node("n"), "team-b", {"team-a": "x", "team-b": "y"}, {}, True),
    ("it reports a problem itself", node("n", problems=["condition GpuXidError=True"]), "team-a", {}, {}, True),
    ("never a control-plane node", node("cp", labels={"node-role.kubernetes.io/control-plane": ""},
                                        problems=["condition GpuXidError=True"]), "team-a", {}, {}, False),
    ("nor one with the control plane's taint", node("cp", taints=[{"key": "node-role.kubernetes.io/control-plane",
                                                                   "effect": "NoSchedule"}],
                                                    problems=["x"]), "team-a", {}, {}, False),
    ("one taint per namespace at a time", node("n", problems=["x"]), "team-a", {}, {"team-a": 1}, False),
    ("another namespace's taints do not count", node("n", problems=["x"]), "team-a", {}, {"team-b": 1}, True),
    ("tainted already", node("n", taints=[{"key": TAINT_KEY, "value": "team-b", "effect": "NoSchedule"}],
                             problems=["x"]), "team-a", {}, {}, False),
]


@pytest.mark.parametrize(("case", "n", "namespace", "who", "live_taints", "tainted"), VERDICTS,
                         ids=[v[0] for v in VERDICTS])
def test_a_node_is_tainted_only_on_evidence_no_single_tenant_controls(case, n, namespace, who, live_taints, tainted):
    ok, why = taint_verdict(n, namespace, who, live_taints)
    assert ok is tainted and why


class Nodes:
    """The API server's nodes, as the operator's Kube sends requests to it (list, get, merge patch)."""

    def __init__(self, *nodes):
        self.nodes = {n["metadata"]["name"]: n for n in nodes}
        self.sent = []

    def __call__(self, method, path, query, body, content_type):
        self.sent.append((method, path))
        name = path.rsplit("/", 1)[-1]
        if method == "GET" and name == "nodes":
            return 200, json.dumps({"items": list(self.nodes.values())}).encode()
        node = self.nodes[name]
        if method == "PATCH":
            meta = body.pop("metadata")
            notes = {**node["metadata"].get("annotations", {}), **meta.get("annotations", {})}
            node["metadata"]["annotations"] = {k: v for k, v in notes.items() if v is not None}
            node["spec"].update(body["spec"])
        return 200, json.dumps(node).encode()


def node_body(name, taint=None, until=None, **labels):
    notes = {TAINT_KEY: json.dumps({"namespace": "team-a", "until": stamp(until)})} if until else {}
    return {"metadata": {"name": name, "labels": labels, "annotations": notes, "resourceVersion": "7"},
            "spec": {"taints": [{"key": "x", "effect": "NoExecute"}] + ([taint] if taint else [])},
            "status": {"conditions": [{"type": "Ready", "status": "True"}, SICK_CONDITION]}}


SICK_CONDITION = {"type": "GpuXidError", "status": "True", "reason": "Xid79"}
OURS = {"key": TAINT_KEY, "value": "team-a", "effect": "NoSchedule"}


def test_the_operator_taints_on_the_verdict_and_takes_its_taints_off_when_due():
    api = Nodes(node_body("sick"), node_body("cp", **{"node-role.kubernetes.io/control-plane": ""}),
                node_body("old", OURS), node_body("due", OURS, until=T0 - timedelta(seconds=1)),
                node_body("live", {**OURS, "value": "team-b"}, until=T0 + timedelta(seconds=90)))
    with pytest.raises(TaintNotGranted, match="failingNodes.taint=true"):
        Kube(api).edit_node("sick", lambda node: {})
    assert api.sent == []  # nothing sent without the role
    taints = Taints(Kube(api, taint_nodes=True), 600.0, lambda: T0)
    assert taints.taint(["sick", "cp"], "team-c", "gpt", [], T0) == ["sick"]  # never the control plane's
    assert api.nodes["sick"]["spec"]["taints"][-1] == {"key": TAINT_KEY, "value": "team-c", "effect": "NoSchedule"}
    note = json.loads(api.nodes["sick"]["metadata"]["annotations"][TAINT_KEY])
    assert (note["job"], note["until"]) == ("team-c/gpt", stamp(T0 + timedelta(seconds=600)))
    assert "reports condition GpuXidError=True" in note["evidence"]
    assert taints.taint(["cp", "sick"], "team-c", "other", [], T0) == []  # one per namespace at a time
    assert taints.sweep() == 90.0  # the one an earlier operator left (no end) and the due one go; "live" stays
    assert [t["key"] for t in api.nodes["old"]["spec"]["taints"]] == ["x"] == [
        t["key"] for t in api.nodes["due"]["spec"]["taints"]]
    assert TAINT_KEY not in api.nodes["due"]["metadata"]["annotations"]
    assert api.nodes["live"]["spec"]["taints"][-1]["value"] == "team-b"


def test_what_a_node_says_about_itself():
    body = {"metadata": {"name": "gpu-7", "labels": {"node-role.kubernetes.io/control-plane": ""}},
            "spec": {"unschedulable": True},
            "status": {"capacity": {"nvidia.com/gpu": "8", "cpu": "64", "hugepages-2Mi": "0"},
                       "allocatable": {"nvidia.com/gpu": "7", "cpu": "63500m", "memory": "500Gi"},
                       "conditions": [{"type": "Ready", "status": "True"},
                                      {"type": "MemoryPressure", "status": "True"},
                                      {"type": "KernelDeadlock", "status": "False"},
                                      {"type": "GpuXidError", "status": "True", "reason": "Xid79",
                                       "message": "GPU has fallen off the bus\x1b[2K"}]}}
    view = NodeView.from_node(body)
    assert view.ready and view.unschedulable and view.control_plane
    assert view.problems == ("condition GpuXidError=True (Xid79: GPU has fallen off the bus\\x1b[2K)",
                             "nvidia.com/gpu: 7 of 8 allocatable (unhealthy devices)")
    assert view.allocatable["cpu"] == Decimal("63.5") and view.allocatable["memory"] == 500 * 2**30
    assert [quantity(q) for q in ("1", "250m", "1Ki", "2e3", "x", "1Zi")] == [1, Decimal("0.25"), 1024, 2000, None,
                                                                             None]


# -- goodput (policy/goodput.py) ----------------------------------------------------------------------------


def trainer(started, steps, train, checkpoint=0.0):
    return {"started": started, "steps": steps, "train": train, "checkpoint": checkpoint, "evaluation": 0.0}


def test_every_rank_second_lands_in_one_bucket_and_they_sum_to_the_jobs_life():
    """A job's life, decision by decision: waiting for placement, training (the trainer's own clock splits it),
    a crash that loses 5 iterations, the recovery, training again. 2 ranks."""
    status: dict = {}
    unplaced, starting = [pod(r, "Pending", node="") for r in (0, 1)], [pod(r, "Pending") for r in (0, 1)]
    steps = [
        (10, [], None, {}),  # created: no attempt yet, pending
        (20, unplaced, None, {}),  # attempt 1's pods not placed: pending
        (30, starting, None, {}),  # placed at 30; up to here pending
        (40, [pod(0), pod(1)], None, {}),  # the containers start (first attempt: other); Running at 40
        (60, [pod(0), pod(1)], trainer("p1", 100, 16.0, 2.0), {"iteration": 100}),  # 20 s: 16 training, 2 saving
        (65, [pod(0), pod(1)], trainer("p1", 130, 20.0, 2.0), {"iteration": 130}),  # 4 training
        (70, [pod(0), ended(1, "gpu-1", 139, "segv")], trainer("p1", 130, 20.0, 2.0), {"iteration": 130}),  # a crash
        (80, [], None, {}),  # Restarting: recovery (the failure's backoff); attempt 2 created
        (82, [pod(r, "Pending", attempt=2) for r in (0, 1)], None, {}),  # not placed until 82: pending
        (90, [pod(0, attempt=2), pod(1, attempt=2)], None, {}),  # starting: recovery; Running at 90
        (100, [pod(0, attempt=2), pod(1, attempt=2)], trainer("p2", 20, 5.0), {"iteration": 145}),
    ]
    written = 0
    for seconds, pods, clock, extra in steps:
        now = T0 + timedelta(seconds=seconds)
        if status.get("phase") == "Restarting":
            status["nextAttemptTime"] = None
        obs_live = live(trainerTime=clock, **extra, lastCheckpoint={"iteration": 125, "time": "t"}) if clock else None
        action = run(status, pods, now=now, live=obs_live)
        status = merge(status, action.status)
        if action.kind == "create":
            status["phase"] = "Pending"
        g = status["goodput"]
        assert abs(sum(g["seconds"].values()) - g["totalSeconds"]) < 0.01
        if g["asOf"] == stamp(now):  # written with this decision (an idle one writes nothing, it catches up later)
            assert g["totalSeconds"] == seconds * 2  # every rank-second since creation
            written += 1
    assert written >= len(steps) - 1 and status["goodput"]["asOf"] == stamp(T0 + timedelta(seconds=100))
    g = status["goodput"]["seconds"]
    step = 20.0 / 130  # the trainer's mean iteration
    assert g["pending"] == (10 + 10 + 10 + 2) * 2 and g["checkpoint"] == 2.0 * 2
    assert abs(g["lostWork"] - 5 * step * 2) < 0.01  # reached 130, resumed from the checkpoint at 125
    assert abs(g["productive"] - ((20.0 - 5 * step) + 5.0) * 2) < 0.01
    assert g["recovery"] == (5 + 10 + 8 + 5) * 2  # the crash's interval, the backoff, the start-up, until a step
    assert g["other"] == (10 + 2 + 1) * 2  # the first start-up, the rest of the first attempt's training
    assert status["goodput"]["ratio"] == round(g["productive"] / (100 * 2), 4) and not status["goodput"]["recovering"]


def test_training_read_twice_within_a_second_is_counted_once_the_second_moves_on():
    """asOf keeps whole seconds: a reading in the same second accounts nothing yet, and loses nothing."""
    status = {**RUNNING, "nodes": 2, "goodput": {"asOf": stamp(T0), "waiting": False}}
    for seconds, clock in ((1.2, trainer("p", 10, 0.5)), (1.7, trainer("p", 20, 1.0)), (3.1, trainer("p", 40, 2.5))):
        action = run(status, [pod(0), pod(1)], now=T0 + timedelta(seconds=seconds), live=live(trainerTime=clock))
        status = merge(status, action.status)
    assert status["goodput"]["seconds"]["productive"] == 2.5 * 2 and status["goodput"]["totalSeconds"] == 3 * 2


def test_a_gang_restarted_in_place_loses_what_it_computed_past_where_its_new_processes_resumed():
    """Seen late (the new rank 0 already saved iteration 20): the lost iterations are counted from where the
    new processes resumed (resumedFrom 10), not from the newest checkpoint."""
    status = {**RUNNING, "nodes": 2, "iteration": 16, "goodput": {
        "asOf": stamp(T0), "waiting": False, "stepSeconds": 0.5, "seconds": {"productive": 20.0},
        "trainer": trainer("p1", 16, 10.0)}}
    action = run(status, [pod(0), pod(1)], now=T0 + timedelta(seconds=10), live=live(
        iteration=22, inPlaceRestarts=1, resumedFrom=10, lastCheckpoint={"iteration": 20, "time": "t"},
        trainerTime=trainer("p2", 4, 2.0)))  # its mean iteration: 0.5 s
    g = action.status["goodput"]
    assert g["seconds"]["lostWork"] == (16 - 10) * 0.5 * 2 and g["seconds"]["productive"] == 20.0 + 2.0 * 2 - 6.0
    assert g["seconds"]["recovery"] == (10 - 2.0) * 2 and g["recovering"]


def test_an_idle_job_writes_no_ledger_a_running_one_does_and_a_finished_one_is_left_alone():
    pending = {"phase": "Pending", "attempt": 1, "attemptStartTime": stamp(T0), "reason": "AttemptCreated",
               "message": "attempt 1 created", "startTime": stamp(T0)}
    pods = [pod(0, phase="Pending", node=""), pod(1, phase="Pending", node="")]
    pending = merge(pending, run(pending, pods, now=T0 + timedelta(seconds=5)).status)
    assert pending["goodput"]["seconds"]["pending"] == 10.0  # written with the status the decision changed
    waiting = run(pending, pods, now=T0 + timedelta(seconds=9))
    assert waiting.status == {}  # no API request for an idle job: its ledger catches up at the next change
    running = run({**RUNNING, "goodput": {"asOf": stamp(T0)}}, [pod(0), pod(1)], now=T0 + timedelta(seconds=5),
                  live=live(trainerTime=trainer("p", 10, 4.0)))
    assert running.status["goodput"]["seconds"]["productive"] == 8.0
    done = {**RUNNING, "phase": "Succeeded", "goodput": {"asOf": stamp(T0), "totalSeconds": 1.0}}
    assert "goodput" not in run(done, [], now=T0 + timedelta(hours=1)).status


def test_the_ledger_never_goes_negative_nor_past_one():
    """`steps: -1, train: 1e308` (the status endpoint refuses it: test_tenancy.py) or a ledger
    already off: every bucket finite and not negative, the ratio within [0, 1], the status patch JSON."""
    status = {**RUNNING, "nodes": 2, "iteration": 16, "goodput": {
        "asOf": stamp(T0), "waiting": False, "stepSeconds": -5.0, "seconds": {"productive": 1e308, "other": -4.0}}}
    crafted = {"started": "p", "steps": -1, "train": 1e308, "checkpoint": 0.0, "evaluation": 0.0}
    action = run(status, [pod(0), pod(1)], now=T0 + timedelta(seconds=10),
                 live=live(iteration=22, inPlaceRestarts=1, resumedFrom=10, trainerTime=crafted))
    g = action.status["goodput"]
    assert all(0 <= v < float("inf") for v in g["seconds"].values()) and 0 <= g["ratio"] <= 1
    json.dumps(action.status, allow_nan=False)
