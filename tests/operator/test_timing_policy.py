"""The operator's time policy as tables, without a cluster: when a job's daemon looks again (policy/wake.py)
and that decide() answers otherwise exactly then (policy/deadlines.py), how a failed creation backs off and what
its retry waits for (policy/create_retry.py), when the store's progress log is read again (policy/reads.py),
and which status patches are held back (policy/throttle.py). Each row is inputs -> the expected answer; the
clock and the jitter are inputs."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from kubetron.contract.live import new_live_status
from kubetron_operator.decide import decide
from kubetron_operator.model import Job
from kubetron_operator.observe import Observed, PodView
from kubetron_operator.policy.action import Action, Event
from kubetron_operator.policy.create_retry import CREATE_BACKOFF, create_failed, retriable
from kubetron_operator.policy.deadlines import FORCE_DELETE_AFTER, NOT_SCHEDULED_AFTER
from kubetron_operator.policy.reads import PROGRESS_REFRESH, RETRY_AFTER, log_read_due
from kubetron_operator.policy.throttle import NEWS_HOLD, PROGRESS_KEYS, hold_news, hold_until, throttle
from kubetron_operator.policy.wake import PAST_DUE, RESYNC, at_most, next_due

from tests.operator.jobs import PVC_JOB, job_body

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)
INTERVAL = 5.0


def ago(seconds: float) -> str:
    return (NOW - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def job(**spec) -> Job:
    return Job.from_body(job_body(PVC_JOB, **spec))


def worker(rank=0, attempt=1, phase="Running", **kw) -> PodView:
    kw.setdefault("scheduler_seen", True)
    return PodView(name=f"gpt-{attempt}-{rank}", attempt=attempt, rank=rank, phase=phase, **kw)


RUNNING = {"phase": "Running", "attempt": 1, "startTime": ago(100), "attemptStartTime": ago(100)}
PENDING = {"phase": "Pending", "attempt": 1, "startTime": ago(100), "attemptStartTime": ago(100)}

# (what, spec, status, pods, the soonest wait before jitter; None: never)
WAKE = [
    ("a spec that does not parse", None, {}, (), None),
    ("finished, no TTL", {}, {"phase": "Succeeded", "completionTime": ago(10)}, (), None),
    ("finished, TTL 60 s, 10 s ago", {"ttlSecondsAfterFinished": 60},
     {"phase": "Succeeded", "completionTime": ago(10)}, (), 50.0),
    ("finished, TTL passed", {"ttlSecondsAfterFinished": 5}, {"phase": "Failed", "completionTime": ago(10)}, (), None),
    ("suspended, nothing deleting", {"suspend": True}, {"phase": "Suspended"}, (), None),
    ("suspended, a pod deleting for 20 s", {"suspend": True}, {"phase": "Suspended"},
     (worker(deleting_for=20.0),), FORCE_DELETE_AFTER - 20.0),
    ("new job: the resync", {}, {}, (), RESYNC),
    ("running: every interval (live progress)", {}, RUNNING, (worker(), worker(1)), INTERVAL),
    ("restart backoff", {}, {**RUNNING, "phase": "Restarting", "nextAttemptTime": ago(-42)}, (), 42.0),
    ("creation retry", {}, {"phase": "Pending", "nextCreateTime": ago(-7)}, (), 7.0),
    ("active deadline", {"activeDeadlineSeconds": 130}, {**PENDING, "attemptStartTime": None}, (), 30.0),
    ("start-up timeout", {"startupTimeoutSeconds": 120}, PENDING, (worker(phase="Pending"),), 20.0),
    ("start-up timeout from Kueue's admission", {"startupTimeoutSeconds": 120},
     {**PENDING, "admittedTime": ago(60)}, (worker(phase="Pending"),), 60.0),
    ("a pod no scheduler looked at", {}, PENDING,
     (worker(phase="Pending", scheduler_seen=False, created_for=5.0),), NOT_SCHEDULED_AFTER - 5.0),
    ("a pod whose deletion is overdue", {}, RUNNING, (worker(deleting_for=FORCE_DELETE_AFTER + 1),), INTERVAL),
    ("moments past count for nothing", {"activeDeadlineSeconds": 50}, {"phase": "Restarting", "startTime": ago(100),
                                                                "nextAttemptTime": ago(1)}, (), RESYNC),
]


@pytest.mark.parametrize(("spec", "status", "pods", "soonest"), [row[1:] for row in WAKE], ids=[r[0] for r in WAKE])
def test_the_daemon_wakes_when_time_itself_matters(spec, status, pods, soonest):
    parsed = None if spec is None else job(**spec)
    obs = Observed(now=NOW, status=status, pods=pods)
    if soonest is None:
        assert next_due(parsed, obs, INTERVAL, 0.5) is None
        return
    assert next_due(parsed, obs, INTERVAL, 0.0) == pytest.approx(soonest + PAST_DUE)
    # the jitter spreads jobs applied together: 10% of the wait, at most a second
    assert next_due(parsed, obs, INTERVAL, 1.0) == pytest.approx(soonest + PAST_DUE + min(1.0, 0.1 * soonest))


@pytest.mark.parametrize(("due", "limit", "expected"), [(None, 10.0, 10.0), (3.0, 10.0, 3.0), (30.0, 10.0, 10.0)])
def test_at_most(due, limit, expected):
    assert at_most(due, limit) == expected


# (failures so far, the delay of the next retry): doubling from 10 s up to 5 minutes, as Kubernetes Job
BACKOFF = [(0, 10.0), (1, 20.0), (2, 40.0), (4, 160.0), (5, 300.0), (9, 300.0)]


@pytest.mark.parametrize(("failures", "delay"), BACKOFF)
def test_a_transient_creation_failure_backs_off_exponentially(failures, delay):
    obs = Observed(now=NOW, status={"phase": "Pending", "createFailures": failures or None})
    action = create_failed(obs, "CreateRetrying", "cannot create Pod ml/gpt-1-0: HTTP 500", True)
    assert action.kind == "wait" and action.status["createFailures"] == failures + 1
    assert action.status["nextCreateTime"] == ago(-delay)
    assert delay <= CREATE_BACKOFF[1]


def test_a_creation_failure_that_is_not_transient_fails_the_job():
    action = create_failed(Observed(now=NOW, status={"attempt": 1}), "CreateFailed", "HTTP 422: bad", False)
    assert action.status["phase"] == "Failed" and action.status["reason"] == "CreateFailed"


@pytest.mark.parametrize(("status", "message", "expected"), [
    (429, "too many requests", True),
    (500, "internal error", True),
    (503, "unavailable", True),
    (403, 'pods "gpt-1-0" is forbidden: exceeded quota: compute', True),
    (403, "forbidden: User cannot create pods", False),
    (422, "invalid", False),
    (409, "already exists", False),
    (404, "namespace not found", False),
])
def test_which_api_errors_are_retried(status, message, expected):
    assert retriable(status, message) is expected


# decide() while a creation retry is pending (status.createFailures, status.nextCreateTime): (what, status, pods,
# kind, pods it deletes, what its wait says; None: it creates the attempt)
FAILED = {"phase": "Restarting", "attempt": 1, "startTime": ago(100), "createFailures": 2}
RETRY = [
    ("no creation failed", {**FAILED, "createFailures": None}, (), "create", (), None),
    ("backing off", {**FAILED, "nextCreateTime": ago(-5)}, (), "wait", (), "creation retry 2 of attempt 2 not before"),
    ("backoff over, the failed try's pod left", {**FAILED, "nextCreateTime": ago(5)}, (worker(attempt=2),), "wait",
     ("gpt-2-0",), "pods of attempt 2 are still there: gpt-2-0"),
    ("its deletion under way", {**FAILED, "nextCreateTime": ago(5)}, (worker(attempt=2, deleting_for=1.0),), "wait",
     (), "pods of attempt 2 are still there"),
    ("backing off, a pod left", {**FAILED, "nextCreateTime": ago(-5)}, (worker(attempt=2),), "wait", ("gpt-2-0",),
     "still there"),
    ("backoff over, nothing left", {**FAILED, "nextCreateTime": ago(5)}, (), "create", (), None),
    ("a new job's first try", {"phase": "Pending", "createFailures": 1, "nextCreateTime": ago(-3)}, (), "wait", (),
     "creation retry 1 of attempt 1"),
]


@pytest.mark.parametrize(("status", "pods", "kind", "deletes", "why"), [r[1:] for r in RETRY],
                         ids=[r[0] for r in RETRY])
def test_decide_holds_a_creation_retry_back_until_its_pods_are_gone_and_its_backoff_passed(status, pods, kind, deletes,
                                                                                             why):
    action = decide(job(), Observed(now=NOW, status=status, pods=pods))
    assert (action.kind, action.delete_pods) == (kind, deletes)
    if why is None:  # the attempt is created, and the retry's record cleared with it
        assert action.create_attempt == (status.get("attempt") or 0) + 1 and not action.why
        assert all(action.status.get(k) is None for k in ("createFailures", "nextCreateTime"))
    else:
        assert action.create_attempt is None and why in action.why


# (what, status, pods, seconds since the last read (None: never), that read failed, read now)
READS = [
    ("never read", RUNNING, (worker(), worker(1)), None, False, True),
    ("running quietly, read 10 s ago", RUNNING, (worker(), worker(1)), 10.0, False, False),
    ("running quietly, refresh due", RUNNING, (worker(), worker(1)), PROGRESS_REFRESH, False, True),
    ("a rank ended", RUNNING, (worker(), worker(1, phase="Failed")), 1.0, False, True),
    ("a pod is being deleted", RUNNING, (worker(), worker(1, deleting_for=1.0)), 1.0, False, True),
    ("a node is lost", RUNNING, (worker(), worker(1, phase="Unknown")), 1.0, False, True),
    ("the gang is short of a pod", PENDING, (worker(phase="Pending"),), 1.0, False, True),
    ("pending, whole gang, no refresh", PENDING, (worker(phase="Pending"), worker(1, phase="Pending")),
     PROGRESS_REFRESH + 1, False, False),
    ("restarting", {**RUNNING, "phase": "Restarting"}, (), 1.0, False, True),
    ("new job", {}, (), 1.0, False, True),
    ("the last read failed, 10 s ago", {}, (), 10.0, True, False),
    ("the last read failed, retry due", {}, (), RETRY_AFTER, True, True),
]


@pytest.mark.parametrize(("status", "pods", "age", "unread", "due"), [r[1:] for r in READS], ids=[r[0] for r in READS])
def test_the_progress_log_is_read_when_an_attempt_starts_or_ends_and_every_refresh(status, pods, age, unread, due):
    assert log_read_due(job(), status, pods, age, unread) is due


PROGRESS = {"iteration": 12, "progress": "30%", "eta": "5m"}
# (status patch, seconds since the last patch, the patch goes out)
THROTTLE = [
    (PROGRESS, 1.0, False),
    ({**PROGRESS, "loss": 2.51, "learningRate": 3e-4}, 1.0, False),  # rank 0's loss and learning rate move every read
    ({"loss": 2.5}, INTERVAL, False),
    ({**PROGRESS, "tokensPerSecond": 812.5, "goodput": {"ratio": 0.9}}, 2 * INTERVAL, True),
    (PROGRESS, 2 * INTERVAL, True),
    (PROGRESS, float("inf"), True),  # never patched by this operator
    ({**PROGRESS, "phase": "Running"}, 1.0, True),  # more than progress: never held
    ({}, 1.0, True),
]


@pytest.mark.parametrize(("status", "since", "goes_out"), THROTTLE)
def test_a_patch_that_only_moves_progress_goes_out_at_most_every_two_intervals(status, since, goes_out):
    action = Action("wait", status=status)
    applied, held = throttle(action, since, INTERVAL)
    assert (applied, held) == ((action, False) if goes_out else (Action("wait"), True))
    assert set(PROGRESS) <= PROGRESS_KEYS and hold_until(INTERVAL) == 2 * INTERVAL


UNSCHEDULABLE = {"reason": "Unschedulable", "message": "pod gpt-1-1: 0/3 nodes are available",
                 "conditions": [{"type": "Pending", "status": "True", "reason": "Unschedulable"}]}
NEWS = Action("wait", status=UNSCHEDULABLE, events=(Event("Warning", "Unschedulable", UNSCHEDULABLE["message"]),))
# (what, action, other attempts being created, seconds the news were held so far (None: not held), held now)
HOLD_NEWS = [
    ("a starting attempt's news during a burst of creations", NEWS, True, None, True),
    ("still held after 4 s", NEWS, True, 4.0, True),
    ("out after NEWS_HOLD", NEWS, True, NEWS_HOLD, False),
    ("nothing being created: at once", NEWS, False, None, False),
    ("a phase change is never held", Action("wait", status={**UNSCHEDULABLE, "phase": "Running"}), True, None, False),
    ("nor news with a pod to delete", dataclasses.replace(NEWS, delete_pods=("gpt-0-0",)), True, None, False),
    ("nor the admission time (the start-up clock)", Action("wait", status={**UNSCHEDULABLE, "admittedTime": ago(0)}),
     True, None, False),
    ("nor a creation", Action("create", status=UNSCHEDULABLE, create_attempt=2), True, None, False),
]


@pytest.mark.parametrize(("action", "creating", "held_for", "held"), [r[1:] for r in HOLD_NEWS],
                         ids=[r[0] for r in HOLD_NEWS])
def test_a_starting_attempts_news_wait_while_other_attempts_are_created(action, creating, held_for, held):
    """Pods first: in a burst of new jobs the status patch and event saying why a new attempt's pods wait go out
    once the creations are done, at most NEWS_HOLD seconds later."""
    applied, due = hold_news(action, creating, held_for)
    if held:
        assert applied.idle and due == pytest.approx(NEWS_HOLD - (held_for or 0.0))
        assert "Unschedulable held back" in applied.why
    else:
        assert (applied, due) == (action, None)


def test_a_running_jobs_live_numbers_are_patched_at_most_every_two_intervals():
    """What rank 0's endpoint moves on every read of a running job (iteration, ETA, tokens/s, loss, learning rate)
    is one status patch per two intervals, not one per interval."""
    live = {**new_live_status(), "iteration": 50, "trainIters": 100, "etaSeconds": 30.0, "tokensPerSecond": 1000.0,
            "loss": 2.5, "learningRate": 3e-4}
    status = {**RUNNING, "iteration": 40, "trainIters": 100, "loss": 2.7, "learningRate": 2e-4}
    action = decide(job(), Observed(now=NOW, status=status, pods=(worker(), worker(1)), live=live))
    assert {"iteration", "loss", "learningRate", "tokensPerSecond"} <= set(action.status)
    assert throttle(action, INTERVAL, INTERVAL) == (Action("wait", status={}), True)  # patched one interval ago
    assert throttle(action, 2 * INTERVAL, INTERVAL) == (action, False)


def later(obs: Observed, seconds: float) -> Observed:
    """The same cluster `seconds` later: the clock and every pod's ages move on."""
    pods = tuple(dataclasses.replace(p, created_for=p.created_for + seconds, deleting_for=None if p.deleting_for is None
                                     else p.deleting_for + seconds) for p in obs.pods)
    return dataclasses.replace(obs, now=obs.now + timedelta(seconds=seconds), pods=pods)


def answer(spec, obs):
    action = decide(None if spec is None else job(**spec), obs)
    return (action.kind, action.status.get("phase"), action.status.get("reason"), action.create_attempt,
            action.delete_pods, action.force_delete_pods, action.delete_job)


UNSEEN = worker(phase="Pending", scheduler_seen=False, created_for=5.0)
GANG = (worker(phase="Pending"), worker(1, phase="Pending"))
STUCK = worker(1, phase="Pending", unschedulable="0/1 nodes are available")
# (what, spec, status, pods): each moment of policy/deadlines.py, where the daemon wakes (wake.py)
MOMENTS = [
    ("TTL", {"ttlSecondsAfterFinished": 60}, {"phase": "Succeeded", "completionTime": ago(10)}, ()),
    ("restart backoff", {}, {**RUNNING, "phase": "Restarting", "nextAttemptTime": ago(-42)}, ()),
    ("creation retry", {}, {"phase": "Pending", "createFailures": 1, "nextCreateTime": ago(-7)}, ()),
    ("active deadline", {"activeDeadlineSeconds": 130}, PENDING, GANG),
    ("start-up timeout", {"startupTimeoutSeconds": 120}, PENDING, GANG),
    ("start-up timeout from Kueue's admission", {"startupTimeoutSeconds": 120}, {**PENDING, "admittedTime": ago(60)},
     GANG),
    ("a pod no scheduler looked at", {}, PENDING, (UNSEEN, worker(1, phase="Pending"))),
    ("a suspended job's pod stuck terminating", {"suspend": True}, {"phase": "Suspended"},
     (worker(deleting_for=20.0),)),
    ("shrink", {"nodes": 2, "minNodes": 1, "shrinkAfterSeconds": 30}, {**PENDING, "attemptStartTime": ago(10)},
     (worker(phase="Pending"), STUCK)),
]


@pytest.mark.parametrize(("spec", "status", "pods"), [r[1:] for r in MOMENTS], ids=[r[0] for r in MOMENTS])
def test_the_daemon_wakes_when_decide_would_answer_otherwise(spec, status, pods):
    """Each moment is defined once (policy/deadlines.py): decide() keeps its answer until the moment the daemon
    is due to look again, and changes it then."""
    obs = Observed(now=NOW, status=status, pods=pods)
    due = next_due(None if spec is None else job(**spec), obs, INTERVAL, 0.0)
    assert due is not None and due < RESYNC
    assert answer(spec, later(obs, due - PAST_DUE - 0.01)) == answer(spec, obs)
    assert answer(spec, later(obs, due)) != answer(spec, obs)
