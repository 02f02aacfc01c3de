"""Starting an attempt: creating attempt k+1 once the last one is gone and its backoff passed, then
waiting for its gang to run, saying what holds it up.

Never started: the gang was not all running startupTimeoutSeconds after the attempt was created (or
admitted by Kueue): unschedulable, image pull errors, a missing Secret key, a scheduler nobody runs
-> restart after a backoff; counts toward maxNeverStartedAttempts (policy/restart.py).
The next attempt waits for no pod but the last one's to go: it expects the newest checkpoint the operator
knows of, and its rank 0 reports the one it resumed from (an S3 store's log is read by the operator itself).
Children that could not be created (the handler tore down what it had made): policy/create_retry.py.
"""

from __future__ import annotations

from dataclasses import replace

from kubetron.contract.progress import CheckpointRef
from kubetron.contract.times import stamp

from kubetron_operator.build import pod_group_name
from kubetron_operator.job_status import PodGroupRef, StatusPatch
from kubetron_operator.model import POD_GROUP_APIS, Job
from kubetron_operator.observe import STUCK_WAITING, Observed, PodView
from kubetron_operator.policy import create_retry, deadlines
from kubetron_operator.policy.action import Action, Event
from kubetron_operator.policy.deadlines import NOT_SCHEDULED_AFTER
from kubetron_operator.policy.elastic import attempt_size, resize, shrink_after, shrink_due, shrink_to
from kubetron_operator.policy.lifecycle import fail, overdue
from kubetron_operator.policy.nodes import AVOIDED, avoidance_condition, live_avoidance, plan_avoidance
from kubetron_operator.policy.restart import restart
from kubetron_operator.policy.status import percent, phase_status, progress_fields, restart_counts
from kubetron_operator.trainer_reports.merge import ckpt_iteration, known_checkpoint

ENDING_PHASES = frozenset({"Restarting", "Succeeded", "Failed", "Suspended"})
"""Phases an action moves to when the current attempt ends."""
STARTUP_REASONS = frozenset({"Unschedulable", "NotScheduled", "Starting", "Queued", *STUCK_WAITING})


def next_attempt(job: Job, obs: Observed) -> Action:
    """Start attempt k+1 once every pod of attempts <= k is gone, the last checkpoint is known and the
    backoff (status.nextAttemptTime) has passed."""
    st = obs.status
    attempt = st.get("attempt") or 0
    old = [p for p in obs.pods if p.role == "worker" and p.attempt <= attempt]
    # Probes hold the capacity the next attempt may need: they go once the old gang is gone.
    old = old or [p for p in obs.pods if p.role == "probe" and p.attempt <= attempt]
    if old:  # what they saved on the way out (SIGTERM: the step, then a checkpoint) is in their messages
        ckpt = known_checkpoint(obs, attempt)
        saved: StatusPatch = {"lastCheckpoint": ckpt} if ckpt != st.get("lastCheckpoint") else {}
        return Action("wait", status=saved, delete_pods=tuple(p.name for p in old if p.deleting_for is None),
                      force_delete_pods=overdue(obs))
    # The newest checkpoint the operator knows of (status, rank 0's endpoint, the ranks' termination messages,
    # an S3 store's log). No pod is waited for: the new attempt's rank 0 resumes from the newest durable one in
    # the store (never older than this: the trainer refuses a store that holds less) and reports it.
    ckpt = known_checkpoint(obs, attempt)
    nxt = attempt + 1
    backoff = deadlines.restart_backoff(obs)
    if backoff is not None and not deadlines.passed(backoff):
        return Action("wait", why=f"the restart backoff: attempt {nxt} not before {st.get('nextAttemptTime')}")
    retry = create_retry.held_back(obs, nxt)  # a creation that failed: its leftovers go, its backoff passes
    if retry is not None:
        return retry
    gang = job.spec.scheduling.gang
    if gang != "none" and obs.pod_group_api is None:
        return fail(obs, "CreateFailed", f"cannot create the PodGroup of attempt {nxt}: the API server serves none "
                    f"of {', '.join(POD_GROUP_APIS[gang])} (docs/gang.md: Kubernetes 1.36+, the Workload API on)")
    size = st.get("resizeTo") or job.spec.nodes  # after a preemption or failure: try the full size
    status = _attempt_status(job, obs, ckpt, nxt, size)
    resume = f", resuming from iteration {ckpt_iteration(ckpt)}" if ckpt_iteration(ckpt) else ""
    avoid, yielded, why = plan_avoidance(job, st, obs.nodes, size, obs.now)
    avoiding = f", avoiding node(s) {', '.join(avoid)}" if avoid else ""
    avoiding += f"; yielding: {why}" if yielded else ""
    conditions = avoidance_condition(obs, nxt, avoid, yielded, why)
    if conditions is not None:  # phase_status kept the other conditions as they were
        (mine,) = [c for c in conditions if c["type"] == AVOIDED]
        held = [c for c in status["conditions"] if c["type"] != AVOIDED]
        status["conditions"] = held + [mine]
    if st.get("avoidNodes"):  # the expired ones go
        status["avoidNodes"] = live_avoidance(st, obs.now)
    event = Event("Normal", "AttemptCreated", f"creating attempt {nxt} ({size} pods){resume}{avoiding}")
    return Action("create", status=status, create_attempt=nxt, expected_iteration=ckpt_iteration(ckpt),
                  avoid_nodes=avoid, events=(event,), nodes=size)


def _attempt_status(job: Job, obs: Observed, ckpt: CheckpointRef | None, nxt: int, size: int) -> StatusPatch:
    """The status patch that records attempt `nxt` (of `size` pods) as created."""
    st = obs.status
    status = phase_status(obs, "Pending", "AttemptCreated", f"attempt {nxt} created")
    lost = (st.get("lostIterations") or 0) + max(0, (st.get("lastAttemptIteration") or 0) - ckpt_iteration(ckpt))
    status.update({
        "attempt": nxt,
        "attemptStartCheckpoint": ckpt_iteration(ckpt),
        "attemptStartTime": stamp(obs.now),
        "admittedTime": None,
        "lastCheckpoint": ckpt,
        "restarts": restart_counts(st),
        "attemptInPlaceRestarts": 0,
        "attemptHangs": 0,
        "lostIterations": lost,
        "lastAttemptIteration": None,
        "nextAttemptTime": None,
        "nodes": size,
        "resizeTo": None,
    })
    if st.get("nextCreateTime") or st.get("createFailures"):  # the creation that failed before is done now
        status.update(createFailures=None, nextCreateTime=None)
    group = pod_group(job, obs, nxt)
    if group or st.get("podGroup"):
        status["podGroup"] = group
    if job.spec.elastic and nxt == 1:
        status.update(minNodes=job.spec.sizes[0], sizes=list(job.spec.sizes),
                      minNodesNote=job.spec.min_nodes_note or None)
    if not st.get("startTime") or st.get("phase") == "Suspended":
        status["startTime"] = stamp(obs.now)  # activeDeadlineSeconds counts from here
    status.update(progress_fields(obs, ckpt))
    status["iteration"] = ckpt_iteration(ckpt)  # the new attempt starts from its checkpoint, not the old maximum
    if status.get("trainIters"):
        status["progress"] = percent(ckpt_iteration(ckpt), status["trainIters"])
    return status


def pod_group(job: Job, obs: Observed, attempt: int) -> PodGroupRef | None:
    """The gang's PodGroup attempt `attempt` belongs to, in the version the API server serves (None: no gang)."""
    api = obs.pod_group_api
    return {"apiVersion": api, "name": pod_group_name(job, attempt, api)} if api and \
        job.spec.scheduling.gang != "none" else None


def starting(job: Job, obs: Observed, attempt: int, current: list[PodView], ckpt: CheckpointRef | None,
             stale: tuple[str, ...]) -> Action:
    """The gang is not all running yet: say what holds it up; end the attempt after startupTimeoutSeconds."""
    st = obs.status
    gated = next((p for p in sorted(current, key=lambda p: p.rank) if p.gates), None)
    if gated:  # queued for quota (Kueue): waiting is the point, so the startup clock does not run yet
        message = (f"attempt {attempt}: waiting for admission "
                   f"(pod {gated.name} has scheduling gates {', '.join(gated.gates)})")
        status = {k: v for k, v in phase_status(obs, "Pending", "Queued", message).items() if st.get(k) != v}
        return Action("wait", status=status, delete_pods=stale)
    trouble = _startup_trouble(current)
    admitted: StatusPatch = {"admittedTime": stamp(obs.now)} if st.get("reason") == "Queued" else {}
    began = deadlines.attempt_began(obs)
    timeout = job.spec.startup_timeout_seconds
    shrink_in = None if admitted else shrink_due(job, obs, current, began)
    if deadlines.passed(shrink_in):
        size = attempt_size(job, st)
        stuck = [p for p in sorted(current, key=lambda p: p.rank) if p.unschedulable]
        seconds, setting = shrink_after(job)
        return resize(job, obs, current, ckpt, shrink_to(job, current, size),
                      f"{len(stuck)} pod(s) Unschedulable for more than {setting} ({seconds}s): "
                      f"pod {stuck[0].name}: {stuck[0].unschedulable}")
    if not admitted and deadlines.passed(deadlines.startup(job, obs)):
        why = trouble[1] if trouble else "the pods were still starting"
        return restart(job, obs, current, ckpt, kind="neverStarted", reason="StartupTimeout",
                       message=f"attempt {attempt} not running after startupTimeoutSeconds ({timeout}s): {why}")
    if trouble:
        reason, message = trouble
    elif st.get("reason") in STARTUP_REASONS:  # the trouble cleared up
        reason, message = "Starting", f"attempt {attempt}: waiting for the pods to start"
    else:  # as next_attempt wrote it
        reason, message = st.get("reason") or "AttemptCreated", st.get("message") or ""
    status = phase_status(obs, "Pending", reason, message)
    status.update(progress_fields(obs, ckpt), **admitted)
    status = {k: v for k, v in status.items() if st.get(k) != v}
    events = (Event("Warning", reason, message),) if trouble and reason != st.get("reason") else ()
    return Action("wait", status=status, delete_pods=stale, events=events)


def _startup_trouble(current: list[PodView]) -> tuple[str, str] | None:
    """(reason, message) of the first pod that cannot start by itself, or None."""
    for p in sorted(current, key=lambda p: p.rank):
        if p.waiting:
            return p.waiting.split(":")[0], f"pod {p.name}: {p.waiting}"
        if p.unschedulable:
            return "Unschedulable", f"pod {p.name}: {p.unschedulable}"
        if deadlines.passed(deadlines.not_scheduled(p)):
            return "NotScheduled", (f"pod {p.name}: no scheduler has looked at it for {NOT_SCHEDULED_AFTER:.0f}s; "
                                    f"is scheduler {p.scheduler!r} running?")
    return None


def needs_job_objects(obs: Observed, action: Action) -> bool:
    """The job's objects (build.job_objects: rank 0's name, the job's headless Service; the pods' peer token) are
    needed once a worker of the current attempt is placed on a node, and the attempt goes on: the trainers resolve
    the name only once they run, and a kubelet starts a pod only once its token's Secret exists (it retries). A job
    waiting in a queue or for room costs no request for them, nor the Endpoints and EndpointSlice the control
    plane adds for a Service."""
    attempt = obs.status.get("attempt") or 0
    if obs.job_objects or attempt == 0 or action.create_attempt is not None or ENDING_PHASES & {
            obs.status.get("phase"), action.phase}:
        return False
    return any(p.role == "worker" and p.attempt == attempt and p.node and p.deleting_for is None for p in obs.pods)


def job_objects_failed(obs: Observed, action: Action, reason: str, message: str, transient: bool) -> Action:
    """The job's objects could not be created (apply.create_children's verdict): a transient error is tried again
    (an event says so, the rest of `action` goes on); anything else fails the job, as at creation."""
    if not transient:
        return fail(obs, reason, message)
    return replace(action, events=(*action.events, Event("Warning", reason, message)))


def attempt_ended(obs: Observed, action: Action) -> bool:
    """`action` ends the running attempt (restart, success, failure, suspension)."""
    return (int(obs.status.get("attempt") or 0) > 0 and obs.status.get("phase") in ("Pending", "Running")
            and action.phase in ENDING_PHASES)
