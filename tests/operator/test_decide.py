"""decide(job, observed) as tables: every pod outcome, mixed ranks, operator restarts, finished jobs."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubetron.contract import exitcodes
from kubetron.contract.termination import parse_termination_message
from kubetron.contract.times import format_duration
from kubetron_operator.build import build
from kubetron_operator.decide import decide
from kubetron_operator.model import Job
from kubetron_operator.observe import Observed, PodView, node_trouble
from kubetron_operator.policy import attempt_end
from kubetron_operator.policy.restart import MAX_PREEMPTIONS_WITHOUT_PROGRESS
from kubetron_operator.policy.start import job_objects_failed

from tests.operator.jobs import PVC_JOB, S3_JOB, job_body

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)
JOB = Job.from_body(S3_JOB)  # 2 nodes, backoffLimit 2
RUNNING = {"phase": "Running", "attempt": 1, "startTime": "2026-11-22T11:00:00Z", "attemptStartCheckpoint": 0,
           "restarts": {"preemptions": 0, "failures": 0, "neverStarted": 0, "total": 0, "inPlace": 0, "hangs": 0}}


def pod(rank, phase="Running", attempt=1, **kw):
    kw.setdefault("started", phase != "Pending")
    return PodView(name=f"gpt-{attempt}-{rank}", attempt=attempt, rank=rank, phase=phase, **kw)


def term(code, **kw):
    return {"exitCode": code, **kw}


def run(status=RUNNING, pods=(), job=JOB, **kw):
    return decide(job, Observed(now=NOW, status=status, pods=tuple(pods), **kw))


# -- one rank's outcome, the other still running ----------------------------------------------------

PREEMPTED = [
    ("DisruptionTarget", pod(1, disrupted="PreemptionByScheduler")),
    ("evicted", pod(1, phase="Failed", pod_reason="Evicted")),
    ("node lost", pod(1, phase="Unknown")),
    ("deleted by someone else", pod(1, deleting_for=3.0)),
    ("saved on SIGTERM (75)", pod(1, phase="Failed", exit_code=75)),
    ("exit condition (76)", pod(1, phase="Failed", exit_code=76)),
    ("75 in the message, torchrun said 1", pod(1, phase="Failed", exit_code=1, termination=term(75))),
]


@pytest.mark.parametrize(("case", "rank1"), PREEMPTED, ids=[c for c, _ in PREEMPTED])
def test_preemption_restarts_free(case, rank1):
    action = run(pods=[pod(0), rank1])
    assert action.kind == "restart"
    assert action.phase == "Restarting"
    assert action.status["restarts"] == {"preemptions": 1, "failures": 0, "neverStarted": 0, "total": 1,
                                         "inPlace": 0, "hangs": 0}
    assert set(action.delete_pods) == ({"gpt-1-0", "gpt-1-1"} if rank1.deleting_for is None else {"gpt-1-0"})
    assert action.create_attempt is None  # the next attempt waits until every pod is gone
    assert action.events and action.events[0].type == "Warning"


@pytest.mark.parametrize("job, present", [
    (Job.from_body(job_body(S3_JOB, memorySnapshots={"enabled": False})), [pod(0)]),  # no copies to resume from
    (JOB, [pod(1)]),  # rank 0's pod hosts the rendezvous
    (Job.from_body(job_body(S3_JOB, maxInPlaceRestarts=0)), [pod(0)]),  # the other pods cannot restart in place
], ids=["snapshots off", "rank 0's pod", "no in-place restarts"])
def test_missing_pod_is_a_preemption(job, present):
    action = run(pods=present, job=job)
    gone = ({0, 1} - {p.rank for p in present}).pop()
    assert action.kind == "restart" and action.status["restarts"]["preemptions"] == 1
    assert f"gpt-1-{gone} disappeared" in action.status["message"]


def test_a_pod_that_vanished_is_created_again_in_its_attempt_while_the_others_run():
    """docs/recovery.md: the gang resumes from the pods' memory, the new pod's ranks from their copies on peers;
    at most maxInPlaceRestarts times an attempt (in-place restarts and replacements together)."""
    action = run(pods=[pod(0)])
    assert action.kind == "wait" and action.replace_ranks == (1,) and action.create_attempt is None
    assert action.status["attemptPodReplacements"] == 1 and action.status["restarts"]["podsReplaced"] == 1
    assert action.status["attemptStartTime"] == NOW.isoformat().replace("+00:00", "Z")  # its own startup timeout
    (event,) = [e for e in action.events if e.reason == "PodReplaced"]
    assert "pod gpt-1-1 vanished while the others ran: created again" in event.message
    spent = run(status={**RUNNING, "attemptInPlaceRestarts": 2, "attemptPodReplacements": 1}, pods=[pod(0)])
    assert spent.kind == "restart" and not spent.replace_ranks  # 3 = maxInPlaceRestarts: the attempt ends
    ended = run(pods=[pod(0, phase="Failed", exit_code=5)])  # the rest did not keep running
    assert ended.kind == "restart" and not ended.replace_ranks


def test_a_pod_deleted_with_no_grace_period_is_waited_for_then_created_again_not_counted_a_preemption():
    """Deleted with gracePeriodSeconds 0 (a lost node's pod, `kubectl delete --grace-period=0`): its kubelet kills it
    at once and nothing is saved, so while its object lingers (the kubelet confirming) the job waits, and replaces it
    once it is gone; never a new attempt because the operator looked in between. A pod that lingers past VANISHING,
    or one deleted with a grace period (its ranks save on SIGTERM), ends the attempt as before."""
    from kubetron_operator.policy.recovery import VANISHING

    lingering = run(pods=[pod(0), pod(1, deleting_for=0.3, no_grace=True)])
    assert lingering.kind == "wait" and not lingering.replace_ranks and not lingering.delete_pods, lingering
    assert "restarts" not in lingering.status and "gone" in lingering.why
    gone = run(pods=[pod(0)])
    assert gone.replace_ranks == (1,)
    stuck = run(pods=[pod(0), pod(1, deleting_for=VANISHING + 1, no_grace=True)])
    assert stuck.kind == "restart" and "gpt-1-1 was deleted" in stuck.status["message"]
    graceful = run(pods=[pod(0), pod(1, deleting_for=0.3)])
    assert graceful.kind == "restart" and "gpt-1-1 was deleted" in graceful.status["message"]
    rank0 = run(pods=[pod(0, deleting_for=0.3, no_grace=True), pod(1)])
    assert rank0.kind == "restart"  # rank 0's pod hosts the rendezvous: never replaced


def test_a_pod_view_knows_a_deletion_with_no_grace_period():
    raw = raw_pod("Running")
    raw["metadata"].update(deletionTimestamp="2026-11-22T11:59:59Z", deletionGracePeriodSeconds=0)
    assert PodView.from_pod(raw, NOW).no_grace
    raw["metadata"]["deletionGracePeriodSeconds"] = 30
    assert not PodView.from_pod(raw, NOW).no_grace


FAILURES = [
    ("trainer error", pod(1, phase="Failed", exit_code=1), "TrainerError"),
    ("diverged", pod(1, phase="Failed", exit_code=3), "Diverged"),
    ("resume mismatch", pod(1, phase="Failed", exit_code=4), "ResumeMismatch"),
    ("straggler", pod(1, phase="Failed", exit_code=6), "StragglerDetected"),
    ("unknown code", pod(1, phase="Failed", exit_code=139), "TrainerError"),
    ("OOMKilled", pod(1, phase="Failed", exit_code=137, reason="OOMKilled"), "OOMKilled"),
]


@pytest.mark.parametrize(("case", "rank1", "reason"), FAILURES, ids=[c for c, _, _ in FAILURES])
def test_failures_count_toward_backoff(case, rank1, reason):
    action = run(pods=[pod(0), rank1])
    assert action.kind == "restart" and action.status["reason"] == reason
    assert action.status["restarts"] == {"preemptions": 0, "failures": 1, "neverStarted": 0, "total": 1,
                                         "inPlace": 0, "hangs": 0}
    if reason == "OOMKilled":
        assert "OOMKilled" in action.status["message"] and "memory" in action.status["message"]


def test_config_error_fails_at_once_with_the_trainers_message():
    msg = "optimizer.lr: must be > 0"
    action = run(pods=[pod(0, phase="Failed", exit_code=2, termination=term(2, message=msg)), pod(1)])
    assert action.kind == "fail" and action.phase == "Failed"
    assert action.status["reason"] == "ConfigError" and action.status["message"] == msg
    assert action.delete_pods == ("gpt-1-1",)
    assert action.status["completionTime"] == "2026-11-22T12:00:00Z"


def test_backoff_limit_exceeded_fails():
    status = {**RUNNING, "restarts": {"preemptions": 3, "failures": 2, "total": 5}}
    action = run(status, pods=[pod(0), pod(1, phase="Failed", exit_code=1)])
    assert action.kind == "fail" and action.status["reason"] == "BackoffLimitExceeded"
    assert action.status["restarts"]["failures"] == 3


def test_preemptions_never_spend_backoff():
    status = {**RUNNING, "restarts": {"preemptions": 50, "failures": 2, "total": 52}}
    action = run(status, pods=[pod(0), pod(1, phase="Failed", exit_code=75)],
                 progress={"lastCheckpoint": {"iteration": 30, "time": "t"}})
    assert action.kind == "restart" and action.status["restarts"]["preemptions"] == 51


# -- mixed outcomes across ranks ----------------------------------------------------------------------

MIXED = [
    ("preempted + peer failure", [pod(0, phase="Failed", exit_code=5), pod(1, disrupted="EvictionByEvictionAPI")],
     "restart", "Preempted", (1, 0)),
    ("saved on signal + NCCL error", [pod(0, phase="Failed", exit_code=75), pod(1, phase="Failed", exit_code=1)],
     "restart", "Preempted", (1, 0)),
    ("peer failure + own error", [pod(0, phase="Failed", exit_code=5), pod(1, phase="Failed", exit_code=3)],
     "restart", "Diverged", (0, 1)),
    ("config error + preempted", [pod(0, phase="Failed", exit_code=2), pod(1, phase="Failed", pod_reason="Evicted")],
     "fail", "ConfigError", None),
    ("one done, one running", [pod(0, phase="Succeeded", exit_code=0), pod(1)], "wait", None, None),
    ("one done, one failed", [pod(0, phase="Succeeded", exit_code=0), pod(1, phase="Failed", exit_code=1)],
     "restart", "TrainerError", (0, 1)),
    ("both exit conditions", [pod(0, phase="Failed", exit_code=76), pod(1, phase="Failed", exit_code=76)],
     "restart", "ExitCondition", (1, 0)),
]


@pytest.mark.parametrize(("case", "pods", "kind", "reason", "counts"), MIXED, ids=[m[0] for m in MIXED])
def test_mixed_outcomes(case, pods, kind, reason, counts):
    action = run(pods=pods, progress={"lastCheckpoint": {"iteration": 10, "time": "t"}, "trainIters": 40})
    assert action.kind == kind
    if reason:
        assert action.status["reason"] == reason
    if counts:
        r = action.status["restarts"]
        assert (r["preemptions"], r["failures"]) == counts


# -- success -----------------------------------------------------------------------------------------


def done(**kw):
    return [pod(r, phase="Succeeded", exit_code=0, **kw) for r in range(2)]


def test_all_exit_zero_and_log_complete_succeeds():
    log = {"completed": True, "trainIters": 40, "iteration": 40, "lastCheckpoint": {"iteration": 40, "time": "t"}}
    action = run(pods=done(), progress=log)
    assert action.kind == "succeed" and action.phase == "Succeeded"
    assert action.status["progress"] == "100%" and action.status["iteration"] == 40
    assert action.status["lastCheckpoint"] == {"iteration": 40, "time": "t"}
    assert action.delete_pods == ()  # finished pods stay for their logs


def test_exit_zero_but_log_short_of_train_iters_is_a_failure():
    log = {"completed": False, "trainIters": 40, "iteration": 12, "lastCheckpoint": {"iteration": 10, "time": "t"}}
    action = run(pods=done(), progress=log)
    assert action.kind == "restart" and action.status["reason"] == "IncompleteExit"
    assert action.status["restarts"]["failures"] == 1


def test_pvc_job_succeeds_from_termination_messages():
    job = Job.from_body(PVC_JOB)
    msg = term(0, reason="Completed", iteration=40, trainIters=40, lastCheckpoint=40)
    action = run(pods=done(termination=msg), job=job)
    assert action.kind == "succeed" and action.status["lastCheckpoint"]["iteration"] == 40


# -- progress, lost iterations, no-progress -----------------------------------------------------------


def test_running_reports_live_progress():
    live = {"iteration": 12, "trainIters": 40, "tokensPerSecond": 1234.56, "etaSeconds": 200.0,
            "lastCheckpoint": {"iteration": 10, "time": "2026-11-22T11:59:00Z"}, "loss": 7.123456,
            "learningRate": 0.000299999, "tflopsPerGpu": 3.5}
    action = run({**RUNNING, "phase": "Pending"}, pods=[pod(0, ip="10.0.0.1"), pod(1)], live=live)
    assert action.status["loss"] == 7.123 and action.status["learningRate"] == 0.0003
    assert action.kind == "wait" and action.phase == "Running"
    assert action.status["iteration"] == 12 and action.status["progress"] == "30%"
    assert action.status["eta"] == "3m20s" and action.status["tokensPerSecond"] == 1234.6
    assert action.status["lastCheckpoint"]["iteration"] == 10
    assert action.events[0].reason == "Running"
    again = run({**RUNNING, **action.status}, pods=[pod(0), pod(1)], live=live)
    assert again.status == {} and again.events == ()  # nothing changed, nothing written


def test_pending_pods_keep_phase_pending():
    action = run({**RUNNING, "phase": "Pending"}, pods=[pod(0), pod(1, phase="Pending")])
    assert action.kind == "wait" and action.phase is None


def test_lost_iterations_recorded():
    status = {**RUNNING, "iteration": 17, "lastCheckpoint": {"iteration": 10, "time": "t"}}
    action = run(status, pods=[pod(0), pod(1, phase="Failed", pod_reason="Evicted")])
    assert action.status["lastAttemptIteration"] == 17
    created = run({**status, **action.status}, pods=[])  # counted once the resume checkpoint is known
    assert created.status["lostIterations"] == 7 and created.status["iteration"] == 10


def test_no_progress_attempts_fail_the_job():
    status = {**RUNNING, "attempt": 4, "attemptStartCheckpoint": 10, "noProgressAttempts": 2,
              "lastCheckpoint": {"iteration": 10, "time": "t"}}
    pods = [pod(0, attempt=4), pod(1, attempt=4, phase="Failed", exit_code=1)]
    action = run(status, pods=pods, progress={"lastCheckpoint": {"iteration": 10, "time": "t"}})
    assert action.kind == "fail" and action.status["reason"] == "NoProgress"
    progressed = run(status, pods=pods, progress={"lastCheckpoint": {"iteration": 20, "time": "t"}})
    assert progressed.kind == "restart" and progressed.status["noProgressAttempts"] == 0


def test_attempt_that_never_ran_is_not_a_no_progress_attempt():
    status = {**RUNNING, "attemptStartCheckpoint": 10, "noProgressAttempts": 2,
              "lastCheckpoint": {"iteration": 10, "time": "t"}}
    action = run(status, pods=[pod(0, phase="Pending"), pod(1, phase="Failed", pod_reason="Evicted", started=False)])
    assert action.kind == "restart" and action.status["noProgressAttempts"] == 2


# -- attempts: create, restart, operator restarts mid-way ---------------------------------------------


def test_new_job_creates_attempt_one():
    action = run({}, pods=[])
    assert action.kind == "create" and action.create_attempt == 1 and action.expected_iteration == 0
    assert action.phase == "Pending" and action.status["attempt"] == 1
    assert action.status["startTime"] == "2026-11-22T12:00:00Z"
    assert action.status["restarts"] == {"preemptions": 0, "failures": 0, "neverStarted": 0, "total": 0,
                                         "inPlace": 0, "hangs": 0}


def test_restarting_waits_for_every_old_pod_to_go():
    status = {**RUNNING, "phase": "Restarting", "lastCheckpoint": {"iteration": 20, "time": "t"}}
    action = run(status, pods=[pod(0, deleting_for=5.0), pod(1, phase="Failed", exit_code=1)])
    assert action.kind == "wait" and action.create_attempt is None
    assert action.delete_pods == ("gpt-1-1",)


def test_restarting_creates_next_attempt_from_the_progress_log():
    status = {**RUNNING, "phase": "Restarting", "lastCheckpoint": {"iteration": 20, "time": "t"}}
    action = run(status, pods=[], progress={"lastCheckpoint": {"iteration": 25, "time": "t2"}})
    assert action.kind == "create" and action.create_attempt == 2 and action.expected_iteration == 25
    assert action.status["attempt"] == 2 and action.status["attemptStartCheckpoint"] == 25
    assert action.status["restarts"] == RUNNING["restarts"]  # counted once, when the attempt ended


def test_stuck_terminating_pods_are_force_deleted():
    status = {**RUNNING, "phase": "Restarting"}
    action = run(status, pods=[pod(0, deleting_for=600.0, phase="Unknown")])
    assert action.force_delete_pods == ("gpt-1-0",)


def test_operator_restart_after_pods_created_but_before_status():
    # status still says Restarting attempt 1, attempt 2's pods already exist: recreate (409s), adopt.
    status = {**RUNNING, "phase": "Restarting"}
    action = run(status, pods=[pod(0, attempt=2), pod(1, attempt=2, phase="Pending")])
    assert action.kind == "create" and action.create_attempt == 2


def test_operator_restart_after_counting_before_deleting():
    # The attempt ended and was counted (status Restarting), then the operator died before deleting:
    # the next round only deletes; it does not count again.
    status = {**RUNNING, "phase": "Restarting", "restarts": {"preemptions": 0, "failures": 1, "total": 1}}
    action = run(status, pods=[pod(0), pod(1, phase="Failed", exit_code=1)])
    assert action.kind == "wait" and set(action.delete_pods) == {"gpt-1-0", "gpt-1-1"}
    assert action.status == {}


def test_pods_of_older_attempts_are_cleaned_up_while_running():
    status = {**RUNNING, "attempt": 2}
    action = run(status, pods=[pod(0, attempt=2), pod(1, attempt=2), pod(1, attempt=1, phase="Failed")])
    assert action.kind == "wait" and action.delete_pods == ("gpt-1-1",)


# -- PVC: the next attempt waits for no pod but the last one's ------------------------------------------

PVC = Job.from_body(PVC_JOB)
RESTARTING_PVC = {**RUNNING, "phase": "Restarting", "lastCheckpoint": {"iteration": 10, "time": "t"}}


def test_pvc_restart_creates_the_next_attempt_at_once_from_the_known_checkpoint():
    """No progress-reader pod to schedule first (a full cluster held the restart 180 s): attempt 2 expects the
    newest checkpoint the operator knows of; its rank 0 resumes from the newest durable one in the store."""
    action = run(RESTARTING_PVC, pods=[], job=PVC)
    assert action.kind == "create" and action.create_attempt == 2 and action.expected_iteration == 10
    assert action.status["attempt"] == 2 and action.status["message"] == "attempt 2 created"
    built = {m["metadata"]["name"] for m in build(PVC, 2, 10) if m["kind"] == "Pod"}
    assert built == {"gpt-2-0", "gpt-2-1"}  # the attempt's own pods, nothing else


def test_what_the_old_pods_saved_on_their_way_out_is_what_the_next_attempt_expects():
    """A stopped gang saves on SIGTERM after the attempt ended (a resize, a suspension): its messages, read
    while its pods go, are the newest checkpoint (no pod reads the store), so nothing counts as lost."""
    ended = {**RESTARTING_PVC, "lastAttemptIteration": 50, "lastCheckpoint": {"iteration": 40, "time": "t"}}
    saved = term(75, iteration=51, lastCheckpoint=51, message="received SIGTERM at iteration 51; saved iter_0000051")
    going = run(ended, pods=[pod(0, phase="Failed", exit_code=75, termination=saved, deleting_for=1.0)], job=PVC)
    assert going.kind == "wait" and going.status["lastCheckpoint"]["iteration"] == 51
    created = run({**ended, **going.status}, pods=[], job=PVC)
    assert created.expected_iteration == 51 and created.status["lostIterations"] == 0


def test_pvc_termination_messages_carry_the_checkpoint():
    msg = term(75, iteration=17, lastCheckpoint=17, message="received SIGTERM")
    action = run(pods=[pod(0, phase="Failed", exit_code=75, termination=msg), pod(1)], job=PVC)
    assert action.status["lastCheckpoint"]["iteration"] == 17


# -- suspend, deadline, finished jobs ----------------------------------------------------------------


def test_suspend_deletes_pods_and_keeps_the_job():
    suspended = Job.from_body(job_body(S3_JOB, suspend=True))
    action = run(pods=[pod(0), pod(1)], job=suspended)
    assert action.kind == "suspend" and action.phase == "Suspended"
    assert set(action.delete_pods) == {"gpt-1-0", "gpt-1-1"}
    assert "restarts" not in action.status
    quiet = run({**RUNNING, "phase": "Suspended"}, pods=[], job=suspended)
    assert quiet.kind == "wait" and quiet.status == {}


def test_unsuspend_resumes_with_a_new_attempt():
    status = {**RUNNING, "phase": "Suspended", "lastCheckpoint": {"iteration": 12, "time": "t"}}
    action = run(status, pods=[])
    assert action.kind == "create" and action.create_attempt == 2 and action.expected_iteration == 12
    assert action.status["restarts"]["total"] == 0


def test_suspended_before_start_creates_nothing():
    action = run({}, pods=[], job=Job.from_body(job_body(S3_JOB, suspend=True)))
    assert action.kind == "suspend" and action.create_attempt is None and action.phase == "Suspended"


def test_deadline_exceeded():
    job = Job.from_body(job_body(S3_JOB, activeDeadlineSeconds=60))
    action = run(pods=[pod(0), pod(1)], job=job)
    assert action.kind == "fail" and action.status["reason"] == "DeadlineExceeded"
    assert set(action.delete_pods) == {"gpt-1-0", "gpt-1-1"}


FINISHED_EVENTS = [
    ("pods vanish", []),
    ("a pod fails later", [pod(0, phase="Succeeded", exit_code=0), pod(1, phase="Failed", exit_code=1)]),
    ("a pod is evicted", [pod(0, phase="Failed", pod_reason="Evicted")]),
    ("all succeeded", done()),
]


@pytest.mark.parametrize("final", ["Succeeded", "Failed"])
@pytest.mark.parametrize(("case", "pods"), FINISHED_EVENTS, ids=[c for c, _ in FINISHED_EVENTS])
def test_finished_jobs_never_rerun(final, case, pods):
    status = {**RUNNING, "phase": final, "completionTime": "2026-11-22T11:59:00Z"}
    for job in (JOB, Job.from_body(job_body(S3_JOB, suspend=True))):
        action = run(status, pods=pods, job=job)
        assert action.kind == "wait" and action.create_attempt is None and action.status == {}


def test_finished_job_stops_pods_that_still_run():
    status = {**RUNNING, "phase": "Failed", "completionTime": "2026-11-22T11:59:00Z"}
    assert run(status, pods=[pod(0), pod(1, phase="Failed")]).delete_pods == ("gpt-1-0",)


def test_ttl_after_finished_deletes_the_job():
    job = Job.from_body(job_body(S3_JOB, ttlSecondsAfterFinished=30))
    early = {**RUNNING, "phase": "Succeeded", "completionTime": "2026-11-22T11:59:45Z"}
    late = {**early, "completionTime": "2026-11-22T11:59:00Z"}
    assert not run(early, job=job).delete_job
    assert run(late, job=job).delete_job


def test_invalid_spec_fails_with_the_field():
    action = decide(None, Observed(now=NOW, status={}, spec_error="spec.storage: needs exactly one of s3 or pvc"))
    assert action.kind == "fail" and action.status["reason"] == "InvalidSpec"
    assert "spec.storage" in action.status["message"]


def test_termination_message_parsing_and_durations():
    assert parse_termination_message('{"exitCode": 75, "iteration": 3}') == {"exitCode": 75, "iteration": 3}
    assert parse_termination_message("Traceback...\nKeyError") is None
    assert [format_duration(s) for s in (5, 200, 3700, 90000)] == ["5s", "3m20s", "1h1m", "1d1h"]


# -- pods stuck before starting (2), restart pacing (3), preemptions vs NoProgress (4) ---------

PENDING = {**RUNNING, "phase": "Pending", "reason": "AttemptCreated", "attemptStartTime": "2026-11-22T11:59:00Z"}

STUCK = [
    ("unschedulable", pod(1, phase="Pending", unschedulable="0/1 nodes are available: 1 Insufficient nvidia.com/gpu."),
     "Unschedulable", "Insufficient nvidia.com/gpu"),
    ("image pull", pod(1, phase="Pending", node="n1", scheduler_seen=True,
                       waiting="ImagePullBackOff: Back-off pulling image \"nope:1\""), "ImagePullBackOff", "nope:1"),
    ("missing secret key", pod(1, phase="Pending", node="n1", scheduler_seen=True,
                               waiting="CreateContainerConfigError: couldn't find key AWS_ACCESS_KEY_ID"),
     "CreateContainerConfigError", "AWS_ACCESS_KEY_ID"),
    ("no scheduler", pod(1, phase="Pending", created_for=45.0, scheduler="volcano"), "NotScheduled", "'volcano'"),
]


@pytest.mark.parametrize(("case", "rank1", "reason", "words"), STUCK, ids=[c[0] for c in STUCK])
def test_stuck_pods_are_surfaced_once(case, rank1, reason, words):
    action = run(PENDING, pods=[pod(0), rank1])
    assert action.kind == "wait" and action.status.get("phase", "Pending") == "Pending"
    assert action.status["reason"] == reason and words in action.status["message"]
    assert [(e.type, e.reason) for e in action.events] == [("Warning", reason)]
    again = run({**PENDING, **action.status}, pods=[pod(0), rank1])
    assert again.events == () and "reason" not in again.status  # one event per distinct reason


def test_pod_waiting_for_a_scheduler_briefly_is_not_trouble():
    action = run(PENDING, pods=[pod(0), pod(1, phase="Pending", created_for=5.0)])
    assert action.events == () and "reason" not in action.status


def test_startup_timeout_ends_the_attempt_as_never_started():
    status = {**PENDING, "attemptStartTime": "2026-11-22T11:49:00Z"}  # 11 min ago; default timeout 600 s
    stuck = pod(1, phase="Pending", unschedulable="0/1 nodes are available: 1 node(s) didn't match selector")
    action = run(status, pods=[pod(0), stuck])
    assert action.kind == "restart" and action.status["reason"] == "StartupTimeout"
    assert "didn't match selector" in action.status["message"] and "600s" in action.status["message"]
    assert action.status["restarts"] == {"preemptions": 0, "failures": 0, "neverStarted": 1, "total": 1,
                                         "inPlace": 0, "hangs": 0}
    assert set(action.delete_pods) == {"gpt-1-0", "gpt-1-1"}  # the partial gang lets go of its GPUs
    assert action.status["nextAttemptTime"] > "2026-11-22T12:00:09Z"  # backoff: 10 s + jitter
    job = Job.from_body(job_body(S3_JOB, startupTimeoutSeconds=3600))
    assert run(status, pods=[pod(0), stuck], job=job).kind == "wait"


def test_pods_gated_for_admission_are_queued_not_stuck():
    """Kueue holds a pod group back with a scheduling gate until the quota admits it. That wait is the
    queue doing its job: the attempt stays Pending (reason Queued, no Warning), the startup timeout does not
    end it, and once admitted the pods get a full startupTimeoutSeconds from then on."""
    old = {**PENDING, "attemptStartTime": "2026-11-22T10:00:00Z"}  # 2 h ago; default timeout 600 s
    gated = [pod(r, phase="Pending", gates=("kueue.x-k8s.io/admission",),
                 unschedulable="waiting for scheduling gates") for r in (0, 1)]
    action = run(old, pods=gated)
    assert action.kind == "wait" and action.events == ()
    queued = {**old, **action.status}
    assert queued["phase"] == "Pending" and queued["reason"] == "Queued"
    assert queued["message"] == ("attempt 1: waiting for admission (pod gpt-1-0 has scheduling gates "
                                 "kueue.x-k8s.io/admission)")
    admitted = run(queued, pods=[pod(0, phase="Pending"), pod(1, phase="Pending")])
    assert admitted.kind == "wait" and admitted.status["admittedTime"] == "2026-11-22T12:00:00Z"
    assert admitted.status["reason"] == "Starting"
    later = {**queued, **admitted.status}
    assert run(later, pods=[pod(0, phase="Pending"), pod(1, phase="Pending")]).kind == "wait"
    expired = {**later, "admittedTime": "2026-11-22T11:49:00Z"}
    assert run(expired, pods=[pod(0, phase="Pending"), pod(1, phase="Pending")]).status["reason"] == "StartupTimeout"


def test_never_started_attempts_are_capped():
    status = {**PENDING, "attemptStartTime": "2026-11-22T11:00:00Z",
              "restarts": {"preemptions": 0, "failures": 0, "neverStarted": 4, "total": 4, "inPlace": 0, "hangs": 0}}
    action = run(status, pods=[pod(0, phase="Pending"), pod(1, phase="Pending")])
    assert action.kind == "fail" and action.status["reason"] == "NeverStarted"
    assert "5 attempts never started (maxNeverStartedAttempts 5)" in action.status["message"]


ADMISSION = [
    ("OutOf gpu", "OutOfnvidia.com/gpu", "Node didn't have enough resource: nvidia.com/gpu, requested: 8, capacity: 0"),
    ("device plugin", "UnexpectedAdmissionError", "Allocate failed due to no healthy devices present"),
]


@pytest.mark.parametrize(("case", "reason", "msg"), ADMISSION, ids=[c[0] for c in ADMISSION])
def test_admission_rejection_backs_off_and_avoids_the_node(case, reason, msg):
    rejected = pod(1, phase="Failed", pod_reason=reason, pod_message=msg, node="gpu-7", started=False)
    action = run(pods=[pod(0, node="gpu-3"), rejected])
    assert action.kind == "restart" and action.status["reason"] == "AdmissionRejected"
    assert msg in action.status["message"] and "gpu-7" in action.status["message"]
    assert "None" not in action.status["message"]
    assert action.status["restarts"]["neverStarted"] == 1 and action.status["restarts"]["preemptions"] == 0
    (avoided,) = action.status["avoidNodes"]  # the node, why, and the kubelet's words as evidence
    assert avoided["node"] == "gpu-7" and avoided["reason"] == "AdmissionRejected" and msg in avoided["evidence"]
    assert action.status["nextAttemptTime"] >= "2026-11-22T12:00:10Z"
    waiting = run({**RUNNING, **action.status}, pods=[])  # the backoff holds the next attempt back
    assert waiting.kind == "wait" and waiting.create_attempt is None
    later = decide(JOB, Observed(now=NOW + timedelta(seconds=13), status={**RUNNING, **action.status}))
    assert later.kind == "create" and later.avoid_nodes == ("gpu-7",)


CRASHED = (pod(0), pod(1, phase="Failed", exit_code=1))
REJECTED = (pod(0), pod(1, phase="Failed", pod_reason="OutOfcpu", started=False, node="n1"))
EVICTED = (pod(0), pod(1, phase="Failed", pod_reason="Evicted"))
# The restart backoff: 10 s doubling to 6 min over the failed or never-started attempts in a row since an attempt
# saved a new checkpoint (status.backoff.attempts). (what, backoff.attempts before (None: an older operator's
# job), checkpoint the ending attempt saved (it resumed from 10), how it ended, backoff.attempts after)
BACKOFF_STREAK = [
    ("the first failure", 0, 10, CRASHED, 1),
    ("the third failure in a row without a new checkpoint", 2, 10, CRASHED, 3),
    ("the eighth: at the cap", 7, 10, CRASHED, 8),
    ("a failure after the attempt saved a new checkpoint starts over", 5, 20, CRASHED, 1),
    ("never started counts too", 2, 10, REJECTED, 3),
    ("a preemption waits for nothing and keeps the count", 2, 10, EVICTED, 2),
    ("a preemption after a new checkpoint resets the count", 2, 20, EVICTED, 0),
    ("a job an older operator restarted 9 times", None, 10, CRASHED, 1),
]


@pytest.mark.parametrize(("held", "saved", "pods", "after"), [r[1:] for r in BACKOFF_STREAK],
                         ids=[r[0] for r in BACKOFF_STREAK])
def test_the_restart_backoff_counts_failures_since_the_last_new_checkpoint(held, saved, pods, after):
    status = {**RUNNING, "attemptStartCheckpoint": 10, "lastCheckpoint": {"iteration": saved, "time": "t"},
              "restarts": {**RUNNING["restarts"], "failures": 9, "neverStarted": 2, "total": 11}}
    if held is not None:
        status["backoff"] = {"attempts": held, "seconds": 0.0, "reason": "r"}
    job = Job.from_body(job_body(S3_JOB, backoffLimit=20, maxNeverStartedAttempts=20))
    action = run(status, pods=pods, job=job)
    backoff = action.status["backoff"]
    assert action.kind == "restart" and backoff["attempts"] == after
    if pods is EVICTED:  # preemptions restart at once
        assert backoff["seconds"] == 0 and action.status["nextAttemptTime"] is None
        assert backoff["reason"] == "preempted: restarting at once"
        return
    base = min(360, 10 * 2 ** (after - 1))
    assert base <= backoff["seconds"] <= base * 1.2
    waited = (datetime.fromisoformat(action.status["nextAttemptTime"]) - NOW).total_seconds()
    assert abs(waited - backoff["seconds"]) <= 1  # nextAttemptTime is stamped to the second
    assert (f"saved a new checkpoint (iteration {saved})" if saved > 10 else f"{after} attempt") in backoff["reason"]
    assert format_duration(backoff["seconds"]) in backoff["reason"]


def test_crashes_spread_over_a_healthy_run_each_wait_the_first_backoff():
    """Five crashes of attempts that each trained and saved new checkpoints wait 10 s (+ jitter) each,
    where counting every failure in the job's life made them wait 10, 20, 40, 80, 160 s."""
    job = Job.from_body(job_body(S3_JOB, backoffLimit=10))
    status: dict[str, Any] = dict(RUNNING)
    waits = []
    for attempt in range(1, 6):
        saved = {"iteration": 100 * attempt, "time": "t"}
        status = {**status, "phase": "Running", "attempt": attempt, "lastCheckpoint": saved,
                  "attemptStartCheckpoint": 100 * (attempt - 1)}
        action = run(status, pods=[pod(0, attempt=attempt), pod(1, phase="Failed", exit_code=1, attempt=attempt)],
                     job=job)
        waits.append(action.status["backoff"]["seconds"])
        status = {**status, **action.status}
    assert status["restarts"]["failures"] == 5 and all(10 <= w <= 12 for w in waits), waits


def test_preemptions_while_loading_are_not_no_progress():
    status = {**RUNNING, "attemptStartCheckpoint": 10, "noProgressAttempts": 2,
              "lastCheckpoint": {"iteration": 10, "time": "t"}}
    for rank1 in (pod(1, phase="Failed", pod_reason="Evicted"), pod(1, disrupted="PreemptionByScheduler"),
                  pod(1, phase="Failed", exit_code=75)):
        action = run(status, pods=[pod(0), rank1])
        assert action.kind == "restart" and action.status["noProgressAttempts"] == 2
    own = run(status, pods=[pod(0), pod(1, phase="Failed", exit_code=76)])  # exit condition: the job's doing
    assert own.kind == "fail" and own.status["reason"] == "NoProgress"


# -- suspend vs deadline (5), node trouble (8), spec errors (10), iterations (13) ------------------------


def test_suspended_past_the_deadline_resumes_and_runs():
    job = Job.from_body(job_body(S3_JOB, activeDeadlineSeconds=600))
    status = {**RUNNING, "phase": "Suspended", "startTime": "2026-11-22T10:00:00Z"}  # 2 h ago, 1 h+ suspended
    action = run(status, pods=[], job=job)
    assert action.kind == "create" and action.status["startTime"] == "2026-11-22T12:00:00Z"
    resumed = {**status, **action.status, "phase": "Running"}
    assert run(resumed, pods=[pod(0, attempt=2), pod(1, attempt=2)], job=job).kind == "wait"
    late = decide(job, Observed(now=NOW + timedelta(seconds=601), status=resumed,
                                pods=(pod(0, attempt=2), pod(1, attempt=2))))
    assert late.kind == "fail" and late.status["reason"] == "DeadlineExceeded"


def test_peer_failures_after_a_node_died_are_a_preemption():
    pods = [pod(0, phase="Failed", exit_code=5, node="n0"), pod(1, node="n1")]
    trouble = {"n1": "node n1 is not Ready (Unknown: NodeStatusUnknown: Kubelet stopped posting node status.)"}
    action = run(pods=pods, node_trouble=trouble)
    assert action.kind == "restart" and action.status["reason"] == "NodeNotReady"
    assert "Kubelet stopped posting" in action.status["message"]
    assert action.status["restarts"]["preemptions"] == 1 and action.status["restarts"]["failures"] == 0
    assert run(pods=pods).status["reason"] == "PeerFailure"  # without node trouble: a failure
    assert run(pods=[pod(0, node="n0"), pod(1, node="n1")], node_trouble=trouble).kind == "wait"


def test_a_peer_failure_waits_for_its_cause_then_counts_a_failure():
    """Pod 0 ended with PeerFailure 5 s ago while pod 1 still runs (its own end not reported yet: a kubelet after
    an API server outage, a node not yet NotReady): the attempt waits for the cause. Pod 1's own failure seen, it
    is the reason; its node NotReady, a preemption; nothing seen for PEER_WAIT, a failure (PeerFailure)."""
    peer = pod(0, phase="Failed", exit_code=exitcodes.PEER_FAILURE, node="n0", ended_for=5.0)
    assert run(pods=[peer, pod(1, node="n1")]).kind == "wait"
    crashed = pod(1, phase="Failed", exit_code=137, node="n1", ended_for=4.0)
    action = run(pods=[peer, crashed])
    assert action.kind == "restart" and action.status["restarts"]["failures"] == 1 and "gpt-1-1" in \
        action.status["message"]
    trouble = {"n1": "node n1 is not Ready (Unknown: NodeStatusUnknown: Kubelet stopped posting node status.)"}
    assert run(pods=[peer, pod(1, node="n1")], node_trouble=trouble).status["reason"] == "NodeNotReady"
    late = dataclasses.replace(peer, ended_for=attempt_end.PEER_WAIT + 1)
    action = run(pods=[late, pod(1, node="n1")])
    assert action.kind == "restart" and action.status["reason"] == "PeerFailure"
    assert action.status["restarts"]["failures"] == 1


def test_pod_failed_by_the_kubelet_says_why_not_exited_none():
    failed = pod(1, phase="Failed", pod_reason="NodeShutdownFailed", pod_message="Pod was terminated: disk pressure")
    action = run(pods=[pod(0), failed])
    assert "exited None" not in action.status["message"] and "disk pressure" in action.status["message"]


def test_node_trouble_from_node_objects():
    nodes = [{"metadata": {"name": "ok"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}},
             {"metadata": {"name": "bad"}, "status": {"conditions": [
                 {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "PLEG is not healthy"}]}}]
    assert node_trouble(nodes, ["ok", "bad", "gone"]) == {
        "bad": "node bad is not Ready (False: KubeletNotReady: PLEG is not healthy)",
        "gone": "node gone no longer exists"}


def test_spec_config_errors_fail_as_config_error():
    action = decide(None, Observed(now=NOW, status={}, spec_error="spec.config: optimizer.lr: must be > 0"))
    assert action.kind == "fail" and action.status["reason"] == "ConfigError"
    assert action.create_attempt is None


def test_iteration_follows_the_new_attempt_and_lost_is_counted_once():
    # attempt 1 reached 400 and saved 300; attempt 2 resumed at 300, reached 320, preempted, resumes at 300
    status = {**RUNNING, "attempt": 2, "iteration": 320, "attemptStartCheckpoint": 300, "lostIterations": 100,
              "lastCheckpoint": {"iteration": 300, "time": "t"}}
    log = {"iteration": 320, "trainIters": 1000, "lastCheckpoint": {"iteration": 300, "time": "t"},
           "jobIterations": {"ml/gpt/1": 400, "ml/gpt/2": 320}}
    ended = run(status, pods=[pod(0, attempt=2), pod(1, attempt=2, phase="Failed", pod_reason="Evicted")],
                progress=log)
    assert ended.status["lastAttemptIteration"] == 320
    created = run({**status, **ended.status}, pods=[], progress=log)
    assert created.status["lostIterations"] == 120 and created.status["iteration"] == 300
    assert created.status["progress"] == "30%"
    again = run({**status, **ended.status, **created.status, "phase": "Pending"},
                pods=[pod(0, attempt=3), pod(1, attempt=3)], progress=log)
    assert again.status.get("iteration", 300) == 300  # the old maximum (400) is not shown again


def test_cleared_trouble_is_no_longer_shown():
    status = {**PENDING, "reason": "Unschedulable", "message": "pod gpt-1-1: 0/1 nodes are available"}
    action = run(status, pods=[pod(0), pod(1, phase="Pending", node="n1", scheduler_seen=True)])
    assert action.status["reason"] == "Starting" and action.events == ()


# -- sidecars, evictions the job caused, bounded free restarts, Kueue pod groups ----------------


def raw_pod(phase: str, *containers: tuple[str, dict], **status: Any) -> dict[str, Any]:
    """A pod as the API server stores it: containerStatuses sorted by name, as the kubelet writes them."""
    return {"metadata": {"name": "gpt-1-0", "labels": {"kubetron.dev/attempt": "1", "kubetron.dev/rank": "0"}},
            "status": {"phase": phase, **status, "containerStatuses": [
                {"name": n, "state": state} for n, state in sorted(containers, key=lambda c: c[0])]}}


RUN = {"running": {"startedAt": "2026-11-22T11:00:00Z"}}


def ended(code: int, message: str = "") -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "reason": "Error" if code else "Completed", "message": message,
                           "startedAt": "2026-11-22T11:00:00Z"}}


@pytest.mark.parametrize(("containers", "pod_phase", "phase", "code"), [
    ([("trainer", RUN), ("zz-exporter", ended(1))], "Running", "Running", None),  # the sidecar's 1 is not ours
    ([("aa-proxy", ended(0)), ("trainer", ended(3))], "Failed", "Failed", 3),
    ([("trainer", ended(0)), ("zz-exporter", RUN)], "Running", "Succeeded", 0),  # the sidecar keeps the pod up
    ([("trainer", ended(0)), ("zz-exporter", ended(1))], "Failed", "Succeeded", 0),  # the trainer's word counts
    ([("trainer", ended(1)), ("zz-exporter", RUN)], "Unknown", "Unknown", 1),  # node lost stays node lost
])
def test_the_trainer_container_is_found_by_name(containers, pod_phase, phase, code):
    view = PodView.from_pod(raw_pod(pod_phase, *containers), NOW)
    assert (view.phase, view.code, view.pod_phase) == (phase, code, pod_phase)
    assert view.alive == (pod_phase in ("Running", "Unknown"))


def test_a_native_sidecar_that_cannot_be_pulled_says_so():
    raw = raw_pod("Pending", ("trainer", {"waiting": {"reason": "PodInitializing"}}),
                  initContainerStatuses=[{"name": "log-shipper", "state": {"waiting": {
                      "reason": "ImagePullBackOff", "message": 'Back-off pulling image "fluent/fluent-bit:nope"'}}}])
    view = PodView.from_pod(raw, NOW)
    assert view.waiting == 'ImagePullBackOff: Back-off pulling image "fluent/fluent-bit:nope"'
    action = run({**RUNNING, "phase": "Pending"}, pods=[view, pod(1, phase="Pending")])
    assert action.status["reason"] == "ImagePullBackOff" and "fluent-bit" in action.status["message"]


def test_trainers_done_while_sidecars_run_succeed_and_the_pods_are_stopped():
    done = term(0, iteration=40, trainIters=40)
    pods = [pod(r, phase="Succeeded", pod_phase="Running", exit_code=0, termination=done) for r in (0, 1)]
    action = run(pods=pods)
    assert action.kind == "succeed" and set(action.delete_pods) == {"gpt-1-0", "gpt-1-1"}
    finished = run({**RUNNING, **action.status}, pods=pods)  # the deletes were lost: the finished job retries
    assert set(finished.delete_pods) == {"gpt-1-0", "gpt-1-1"}
    one_left = run(pods=[pods[0], pod(1)])  # one trainer still runs: the attempt goes on
    assert one_left.kind == "wait" and not one_left.delete_pods


OWN_LIMIT = [
    "Pod ephemeral local storage usage exceeds the total limit of containers 1Gi. ",
    'Container trainer exceeded its local ephemeral storage limit "500Mi". ',
    'Usage of EmptyDir volume "scratch" exceeds the limit "10Gi". ',
]


@pytest.mark.parametrize("message", OWN_LIMIT)
def test_an_eviction_for_the_pods_own_limit_is_a_failure(message):
    evicted = pod(1, phase="Failed", pod_reason="Evicted", pod_message=message, exit_code=137)
    action = run(pods=[pod(0, phase="Failed", exit_code=exitcodes.PEER_FAILURE), evicted])
    assert action.kind == "restart" and action.status["reason"] == "EvictedOverLimit"
    assert action.status["restarts"] == {"preemptions": 0, "failures": 1, "neverStarted": 0, "total": 1,
                                         "inPlace": 0, "hangs": 0}
    assert message.strip() in action.status["message"] and "gpt-1-1" in action.status["message"]
    assert action.status["nextAttemptTime"]  # backoff, as any failure


def test_node_pressure_and_api_evictions_stay_free():
    node_low = ("The node was low on resource: memory. Threshold quantity: 100Mi, available: 50Mi. Container "
                "trainer was using 30Gi, request is 16Gi, has larger consumption of memory. ")
    for rank1 in (pod(1, phase="Failed", pod_reason="Evicted", pod_message=node_low, disrupted="TerminationByKubelet"),
                  pod(1, disrupted="EvictionByEvictionAPI"), pod(1, disrupted="PreemptionByScheduler"),
                  pod(1, disrupted="DeletionByTaintManager")):
        action = run(pods=[pod(0), rank1])
        assert action.kind == "restart" and action.status["restarts"]["preemptions"] == 1, rank1


def test_free_restarts_that_never_save_anything_new_are_bounded():
    stuck = {**RUNNING, "attemptStartCheckpoint": 10, "lastCheckpoint": {"iteration": 10, "time": "t"}}
    preempted = [pod(0), pod(1, disrupted="PreemptionByScheduler")]
    status, kinds = stuck, []
    for _ in range(MAX_PREEMPTIONS_WITHOUT_PROGRESS):
        action = run(status, pods=preempted)
        kinds.append(action.kind)
        status = {**stuck, **{k: v for k, v in action.status.items() if k != "phase"}}
    assert kinds == ["restart"] * (MAX_PREEMPTIONS_WITHOUT_PROGRESS - 1) + ["fail"]
    assert action.status["reason"] == "NoProgress" and "preempted before saving" in action.status["message"]
    # Preempted as often while making progress: never bounded.
    progressed = run({**stuck, "preemptionsWithoutProgress": MAX_PREEMPTIONS_WITHOUT_PROGRESS - 1}, pods=preempted,
                     progress={"lastCheckpoint": {"iteration": 20, "time": "t"}})
    assert progressed.kind == "restart" and progressed.status["preemptionsWithoutProgress"] == 0
    # Preempted before the gang ever ran (queue and scheduling churn): not counted.
    pending = run({**stuck, "phase": "Pending", "preemptionsWithoutProgress": 9}, pods=[pod(0, phase="Pending")])
    assert pending.kind == "restart" and pending.status["preemptionsWithoutProgress"] == 9


def queued(rank, attempt=1, **kw):
    return pod(rank, attempt=attempt, kueue_group=f"gpt-{attempt}", **kw)


def test_an_ended_kueue_pod_group_is_marked_not_retriable():
    assert run(pods=[queued(0), queued(1)]).release_pods == ()  # running: the group is alive
    restart = run(pods=[queued(0), queued(1, deleting_for=2.0)])  # Kueue preempted it (deletes the pods)
    assert restart.kind == "restart" and set(restart.release_pods) == {"gpt-1-0", "gpt-1-1"}
    failed = run({**RUNNING, "phase": "Failed"}, pods=[queued(0, phase="Failed", exit_code=1),
                                                        queued(1, retriable=False)])
    assert failed.release_pods == ("gpt-1-0",)  # kept for its logs, but its group is over; 1 was marked
    stale = run({**RUNNING, "attempt": 2}, pods=[queued(0, attempt=2), queued(1, attempt=2),
                                                 queued(0, deleting_for=1.0)])
    assert stale.release_pods == ("gpt-1-0",)
    assert run(pods=[pod(0), pod(1, deleting_for=1.0)]).release_pods == ()  # no queue, nothing to mark


# -- in-place restarts (docs/recovery.md) ---------------------------------------------------------------

def _log_with_restarts(*lines: tuple[int, int]) -> dict:
    """A progress-log summary with `Restarted in place` lines (attempt, count in that attempt)."""
    from kubetron.contract import progress as progress_log

    text = "".join(progress_log.restarted_in_place_line(10, n, 40, num_gpus=2, job_id=f"ns/gpt/{attempt}") + "\n"
                   for attempt, n in lines)
    summary = progress_log.summarize_events(progress_log.parse_progress(text))
    summary.pop("events")
    return summary


def test_in_place_restarts_are_counted_apart_with_one_event():
    """The log shows two restarts inside the pods of attempt 1: inPlace 2, one event saying both; `total`
    (attempts) stays."""
    action = run(pods=[pod(0), pod(1)], progress=_log_with_restarts((1, 1), (1, 2)))
    assert action.kind == "wait" and not action.delete_pods
    assert action.status["restarts"] == {**RUNNING["restarts"], "inPlace": 2}
    assert action.status["attemptInPlaceRestarts"] == 2
    (event,) = action.events
    assert event.reason == "RestartedInPlace" and "restarted 2 times" in event.message
    assert "(1-2 of this attempt, 2 in all)" in event.message


def test_in_place_restarts_from_rank_0s_status_endpoint():
    """A PVC store's log is not read while running: rank 0's endpoint says how often its gang restarted."""
    action = run(pods=[pod(0), pod(1)], live={"iteration": 12, "inPlaceRestarts": 1})
    assert action.status["restarts"]["inPlace"] == 1 and len(action.events) == 1


def test_in_place_restarts_the_endpoint_never_showed_are_counted_from_the_pods_termination_messages():
    """A PVC job's short run restarted in place while rank 0's endpoint did not answer, then completed: the ranks'
    termination messages say the attempt restarted once, so the success counts it, with its event; a message that
    says more than maxInPlaceRestarts (2 here) is believed only up to it."""
    msg = term(0, iteration=40, trainIters=40, lastCheckpoint=40, inPlaceRestarts=1)
    action = run(pods=done(termination=msg), job=PVC)
    assert action.kind == "succeed" and action.status["restarts"]["inPlace"] == 1
    assert action.status["attemptInPlaceRestarts"] == 1
    assert [e.reason for e in action.events] == ["RestartedInPlace", "Succeeded"]
    hostile = run(pods=done(termination={**msg, "inPlaceRestarts": 10**9}), job=PVC)
    assert hostile.status["restarts"]["inPlace"] == PVC.spec.max_in_place_restarts
    old_attempt = run({**RUNNING, "attempt": 2}, pods=[*done(termination=msg), pod(0, attempt=2), pod(1, attempt=2)],
                      job=PVC)
    assert "restarts" not in old_attempt.status  # attempt 1's pods say nothing of attempt 2


def test_in_place_restarts_already_counted_post_nothing():
    status = {**RUNNING, "restarts": {**RUNNING["restarts"], "inPlace": 2}, "attemptInPlaceRestarts": 2}
    action = run(status, pods=[pod(0), pod(1)], progress=_log_with_restarts((1, 1), (1, 2)),
                 live={"inPlaceRestarts": 2})
    assert "restarts" not in action.status and not action.events


def test_in_place_restarts_add_up_over_attempts_and_survive_the_attempts_end():
    """Attempt 1 restarted once in place, attempt 2 once so far; then attempt 2 fails: the count is kept,
    and the next attempt starts its own count from 0."""
    status = {**RUNNING, "attempt": 2, "restarts": {**RUNNING["restarts"], "failures": 1, "total": 1,
                                                    "inPlace": 1, "hangs": 0},
              "attemptInPlaceRestarts": 0}
    log = _log_with_restarts((1, 1), (2, 1))
    running = run(status, pods=[pod(0, attempt=2), pod(1, attempt=2)], progress=log)
    assert running.status["restarts"]["inPlace"] == 2 and len(running.events) == 1
    failed = run(status, pods=[pod(0, attempt=2), pod(1, attempt=2, phase="Failed", exit_code=1)], progress=log)
    assert failed.kind == "restart" and failed.status["restarts"]["inPlace"] == 2
    assert failed.status["restarts"]["total"] == 2  # the failure counts as an attempt, the in-place restarts not
    created = run({**status, **failed.status, "nextAttemptTime": None}, pods=[], progress=log)
    assert created.kind == "create" and created.status["attemptInPlaceRestarts"] == 0
    assert created.status["restarts"]["inPlace"] == 2


def test_a_gang_that_found_nothing_to_resume_is_recorded_and_warned_of():
    """docs/recovery.md: rank 0 reports a start at iteration 0 after its snapshots failed their checks while the
    store held no checkpoint yet (kubetron.checkpoint.gang.Recovery.report): status.lastRecovery says so, and a
    Warning RecoveredFromStore; one that found nothing after an in-place restart (no snapshot yet) a Normal one."""
    from kubetron.contract.recovery import parse_trainer_recovery

    failed = parse_trainer_recovery({"loadedFrom": "store", "iteration": 0, "seconds": 0.01, "failed": True,
                                     "reason": "rank 1: snap_0000008 do not match their checksum", "restart": 1})
    action = run(pods=[pod(0), pod(1)], live={"iteration": 3, "inPlaceRestarts": 1, "recovery": failed})
    assert action.status["lastRecovery"] == {
        "kind": "inPlace", "loadedFrom": "store", "iteration": 0, "seconds": 0.01, "attempt": 1, "restart": 1,
        "reason": "rank 1: snap_0000008 do not match their checksum", "replacements": 0}
    (event,) = [e for e in action.events if e.reason.startswith("Recovered")]
    assert (event.type, event.reason) == ("Warning", "RecoveredFromStore")
    assert event.message == ("attempt 1: the gang restarted in place at iteration 0 with nothing to resume: not from "
                             "memory (rank 1: snap_0000008 do not match their checksum), and the store holds no "
                             "checkpoint yet")
    nothing = {**failed, "failed": False, "reason": "no snapshot in the pods' memory"}
    (event,) = [e for e in run(pods=[pod(0), pod(1)], live={"recovery": nothing}).events
                if e.reason.startswith("Recovered")]
    assert event.type == "Normal" and "at iteration 0 with nothing to resume" in event.message


# -- rank 0's Service: once a pod is placed ---------------------------------------------------------

PENDING = {**RUNNING, "phase": "Pending", "reason": "AttemptCreated"}


@pytest.mark.parametrize(("case", "pods", "known", "wanted"), [
    ("no pod placed yet (queued, or no room)", [pod(0, "Pending"), pod(1, "Pending", unschedulable="0/3 nodes")],
     False, False),
    ("rank 1 bound to a node", [pod(0, "Pending"), pod(1, "Pending", node="n1")], False, True),
    ("the Service is known already", [pod(0, "Running", node="n1"), pod(1, "Running", node="n2")], True, False),
    ("an old attempt's pod on a node", [pod(0, "Pending", attempt=0, node="n1")], False, False),
    ("placed, but being deleted", [pod(0, "Pending", node="n1", deleting_for=1.0), pod(1, "Pending")], False, False),
])
def test_the_service_is_asked_for_once_a_pod_of_the_attempt_is_placed(case, pods, known, wanted):
    action = run(PENDING, pods, job_objects=known)
    assert action.create_job_objects is wanted, case


def test_no_service_for_an_attempt_that_ends():
    action = run(RUNNING, [pod(0, node="n1"), pod(1, "Failed", node="n2", exit_code=1)])
    assert action.phase == "Restarting" and not action.create_job_objects
    assert run({}, []).create_attempt == 1 and not run({}, []).create_job_objects  # a new attempt: its pods first
    done = {**RUNNING, "phase": "Succeeded", "completionTime": "2026-11-22T11:30:00Z"}
    assert not run(done, [pod(0, "Succeeded", node="n1"), pod(1, "Succeeded", node="n2")]).create_job_objects


def test_a_service_that_cannot_be_created_fails_the_job_or_is_tried_again():
    obs = Observed(now=NOW, status=PENDING, pods=(pod(0, "Pending", node="n1"), pod(1, "Pending", node="n2")))
    asked = decide(JOB, obs)
    assert asked.create_job_objects
    again = job_objects_failed(obs, asked, "CreateRetrying", "cannot create Service ml/gpt: HTTP 500", transient=True)
    assert again.kind == asked.kind and again.events[-1].reason == "CreateRetrying" and not again.phase
    failed = job_objects_failed(obs, asked, "NameConflict", "Service ml/gpt already exists", transient=False)
    assert failed.phase == "Failed" and failed.status["reason"] == "NameConflict"
    assert set(failed.delete_pods) == {"gpt-1-0", "gpt-1-1"}
