"""A job's life outside its attempts: finished jobs (never rerun; deleted once ttlSecondsAfterFinished is
up), suspension, the active deadline, failing the job, and pods stuck terminating.

activeDeadlineSeconds counts from status.startTime, which is reset when a suspended job resumes (as
Kubernetes Job does): time spent suspended does not count.
"""

from __future__ import annotations

from kubetron.contract.times import stamp

from kubetron_operator.job_status import StatusPatch
from kubetron_operator.model import Job
from kubetron_operator.observe import Observed
from kubetron_operator.policy import deadlines
from kubetron_operator.policy.action import Action, Event
from kubetron_operator.policy.status import phase_status
from kubetron_operator.trainer_reports.merge import reached_iteration


def finished(job: Job | None, obs: Observed) -> Action:
    """Never create anything again. Stop what still runs; delete the job once its TTL is up."""
    active = tuple(p.name for p in obs.pods if p.alive)
    if job is not None and deadlines.passed(deadlines.ttl(job, obs)):
        ttl = job.spec.ttl_seconds_after_finished
        return Action("delete", delete_job=True, delete_pods=active,
                      events=(Event("Normal", "TTLExpired", f"deleting the job {ttl}s after it finished"),))
    return Action("wait", delete_pods=active)


def invalid_spec(obs: Observed) -> Action:
    """The spec does not parse (obs.spec_error says why): Failed, ConfigError when the trainer config is at fault."""
    error = obs.spec_error or "invalid spec"
    reason = "ConfigError" if error.startswith(("spec.config", "spec.overrides")) else "InvalidSpec"
    return fail(obs, reason, error)


def deadline_exceeded(job: Job, obs: Observed) -> Action | None:
    """Failed (DeadlineExceeded) once activeDeadlineSeconds have passed since status.startTime, else None."""
    # A resuming job's clock restarts (start.next_attempt resets startTime), as Kubernetes Job's does.
    running_clock = not job.spec.suspend and obs.status.get("phase") != "Suspended"
    if running_clock and deadlines.passed(deadlines.active_deadline(job, obs)):
        return fail(obs, "DeadlineExceeded", f"activeDeadlineSeconds ({job.spec.active_deadline_seconds}s) exceeded")
    return None


def suspend(obs: Observed) -> Action:
    """spec.suspend: delete every pod, keep the job; the attempt that ends here remembers how far it got."""
    st = obs.status
    alive = [p for p in obs.pods if p.alive or (p.role != "worker" and p.deleting_for is None)]
    deleting = [p for p in obs.pods if p.deleting_for is not None]
    status: StatusPatch = {}
    events: tuple[Event, ...] = ()
    if st.get("phase") != "Suspended":
        status = phase_status(obs, "Suspended", "Suspended", "spec.suspend is true: pods deleted, job kept")
        if st.get("phase") in ("Pending", "Running"):  # the attempt ends here: remember how far it got
            status["lastAttemptIteration"] = reached_iteration(obs, st.get("attempt") or 0, [])
        status["nextAttemptTime"] = None
        events = (Event("Normal", "Suspended", "spec.suspend set: deleting the pods; the job resumes from its"
                                               " last checkpoint when unsuspended"),)
    if not alive and not deleting and not status:
        return Action("wait")
    return Action("suspend", status=status, delete_pods=tuple(p.name for p in alive),
                  force_delete_pods=overdue(obs), events=events)


def fail(obs: Observed, reason: str, message: str) -> Action:
    """Failed for good (`reason`, `message`): live pods deleted, nothing created again."""
    status = phase_status(obs, "Failed", reason, message)
    status.update(completionTime=stamp(obs.now), eta=None, nextAttemptTime=None)
    active = tuple(p.name for p in obs.pods if p.alive)
    return Action("fail", status=status, delete_pods=active, events=(Event("Warning", reason, message),))


def overdue(obs: Observed) -> tuple[str, ...]:
    """Pods still terminating long past any grace period (their node is gone): force-delete them."""
    return tuple(p.name for p in obs.pods if deadlines.passed(deadlines.force_delete(p)))
