"""Hangs, failing nodes and goodput decided as tables, no cluster (policy/hang.py, nodes.py, goodput.py): what a hang
writes into status, which nodes are left out, and where every rank-second of a job goes."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta

import pytest
from kubetron.contract import exitcodes, hang
from kubetron.contract.times import stamp
from kubetron_operator.api_calls import Kube, TaintNotGranted
from kubetron_operator.decide import decide
from kubetron_operator.model import Job
from kubetron_operator.observe import Observed, PodView
from kubetron_operator.policy.nodes import TAINT_KEY

from tests.operator.jobs import S3_JOB, job_body

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
    return hang.HangReport(rank=rank, nodeRank=rank, localRank=0, phase="train", iteration=iteration, idleSeconds=47.2,
                           timeoutSeconds=45.0, state=hang.STOPPED, where="", ranks=2, stacks="s3://b/gpt/hangs/1-1/",
                           restart=restart, **kw)


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
    hung = merge(RUNNING, run(RUNNING, [pod(0), pod(1)], live=live(inPlaceRestarts=1, hangs=1, lastHang=report())).status)
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


# -- nodes that keep failing (policy/nodes.py) --------------------------------------------------------------


def crashed(rank, node, attempt=1):
    words = f"rank {rank} (local rank 0, pid 42) was killed by SIGSEGV and no rank wrote a termination message"
    return pod(rank, phase="Failed", attempt=attempt, exit_code=1, node=node,
               termination={"exitCode": 1, "reason": "TrainerError", "message": words})


def peer(rank, node, attempt=1):
    return pod(rank, phase="Failed", attempt=attempt, exit_code=5, node=node,
               termination={"exitCode": 5, "reason": "PeerFailure", "message": "a peer rank failed: Connection reset"})


def test_a_node_that_failed_the_job_twice_is_avoided_by_its_next_attempt():
    first = run(RUNNING, [peer(0, "gpu-3"), crashed(1, "gpu-7")])
    assert first.status["failingNodes"] == [{"node": "gpu-7", "failures": 1, "evidence": [
        first.status["failingNodes"][0]["evidence"][0]]}]  # gpu-3's PeerFailure is no evidence
    assert "killed by SIGSEGV" in first.status["failingNodes"][0]["evidence"][0] and "avoidNodes" not in first.status
    second_attempt = {**merge(RUNNING, first.status), "phase": "Running", "attempt": 2}
    second = run(second_attempt, [crashed(0, "gpu-7", 2), peer(1, "gpu-4", 2)])
    (avoided,) = second.status["avoidNodes"]
    assert (avoided["node"], avoided["reason"]) == ("gpu-7", "HardwareError")
    assert avoided["evidence"].count("killed by SIGSEGV") == 2
    (event,) = [e for e in second.events if e.reason == "NodeAvoided"]
    assert "node gpu-7 failed this job 2 times" in event.message
    later = decide(JOB, Observed(now=T0 + timedelta(hours=1), status=merge(second_attempt, second.status)))
    assert later.kind == "create" and later.avoid_nodes == ("gpu-7",)


def test_hangs_on_one_node_avoid_it_and_an_older_operators_names_still_count():
    status = {**RUNNING, "avoidNodes": ["gpu-9"]}  # an older operator wrote names
    pods = [pod(0), pod(1)]
    first = run(status, pods, live=live(inPlaceRestarts=1, hangs=1, lastHang=report()))
    status = merge(status, first.status)
    assert status["failingNodes"][0]["failures"] == 1 and status["avoidNodes"] == ["gpu-9"]
    second = run(status, pods, live=live(inPlaceRestarts=2, hangs=2, lastHang=report(restart=2, iteration=55)))
    status = merge(status, second.status)
    assert [(a["node"], a["reason"]) for a in status["avoidNodes"]] == [("gpu-9", ""), ("gpu-1", "Hung")]
    assert status["restarts"]["hangs"] == 2
    later = decide(JOB, Observed(now=T0, status={**status, "phase": "Restarting"}))
    assert later.kind == "create" and later.avoid_nodes == ("gpu-9", "gpu-1")


def test_in_place_restarts_caused_by_a_rank_on_one_node_avoid_it():
    """Rank 0 reports the rank whose crash restarted the gang in place (lastRestart); a peer failure is never one."""
    status, pods = dict(RUNNING), [pod(0), pod(1)]
    for n in (1, 2):
        cause = {"restart": n, "rank": 1, "nodeRank": 1, "how": "was killed by SIGBUS"}
        action = run(status, pods, live=live(inPlaceRestarts=n, lastRestart=cause))
        status = merge(status, action.status)
    assert status["restarts"]["inPlace"] == 2 and status["failingNodes"][0]["failures"] == 2
    (avoided,) = status["avoidNodes"]
    assert (avoided["node"], avoided["reason"]) == ("gpu-1", "Crashed")
    assert "in-place restart 2: rank 1 (pod gpt-1-1) was killed by SIGBUS" in avoided["evidence"]
    again = run(status, pods, live=live(inPlaceRestarts=2, lastRestart=cause))
    assert "failingNodes" not in again.status  # each restart counted once


def test_the_newly_avoided_node_is_tainted_only_by_an_operator_whose_role_allows_it():
    status = {**RUNNING, "failingNodes": [{"node": "gpu-7", "failures": 1, "evidence": ["a hang"]}]}
    action = run(status, [peer(0, "gpu-3"), crashed(1, "gpu-7")])
    assert action.taint_nodes == ("gpu-7",)  # asked for; the handler acts only with --taint-failing-nodes
    calls = []

    def transport(method, path, query, body, content_type):
        calls.append((method, path, body))
        node = {"metadata": {"resourceVersion": "7"}, "spec": {"taints": [{"key": "x", "effect": "NoExecute"}]}}
        return 200, json.dumps(node).encode()

    with pytest.raises(TaintNotGranted, match="failingNodes.taint=true"):
        Kube(transport).taint_node("gpu-7", TAINT_KEY, "gpt")
    assert calls == []  # nothing sent
    assert Kube(transport, taint_nodes=True).taint_node("gpu-7", TAINT_KEY, "gpt")
    (_, _, patch) = calls[-1]
    assert patch == {"metadata": {"resourceVersion": "7"}, "spec": {"taints": [
        {"key": "x", "effect": "NoExecute"}, {"key": TAINT_KEY, "value": "gpt", "effect": "NoSchedule"}]}}


def test_a_straggler_exit_points_at_the_node_of_the_rank_it_names():
    job = Job.from_body(job_body(S3_JOB, gpusPerNode=2, resources={"limits": {"nvidia.com/gpu": 2}}))
    words = "straggler detected at iteration 40: rank 3 at 0.42 of the fastest rank's speed (relative_threshold 0.7)"
    pods = [pod(r, phase="Failed", exit_code=6, termination={"exitCode": 6, "message": words}) for r in (0, 1)]
    action = run(RUNNING, pods, job=job)
    assert [(f["node"], f["failures"]) for f in action.status["failingNodes"]] == [("gpu-1", 1)]  # rank 3: pod 1


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
        (70, [pod(0), crashed(1, "gpu-1")], trainer("p1", 130, 20.0, 2.0), {"iteration": 130}),  # the crash
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
