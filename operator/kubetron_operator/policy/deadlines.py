"""Every moment decide() compares with the clock, defined once: decide() asks whether it has passed (`passed`),
policy/wake.py how long until it does (so the daemon wakes exactly when decide would answer otherwise).

Each function gives the seconds from obs.now until its moment (<= 0: it has passed), or None when the job has
no such moment. The conditions around them (only while Pending, not while suspended) stay with the policy that
uses them; so does an elastic job's shrink (policy.elastic.shrink_due, the same form).
"""

from __future__ import annotations

from datetime import datetime

from kubetron.contract.times import parse_stamp

from kubetron_operator.model import Job
from kubetron_operator.observe import Observed, PodView

FORCE_DELETE_AFTER = 60.0  # seconds past a pod's grace period before it is force-deleted (node lost)
NOT_SCHEDULED_AFTER = 20.0  # seconds a pod may wait for any scheduler to look at it before we say so


def passed(left: float | None) -> bool:
    """The moment `left` seconds away (None: none) has come."""
    return left is not None and left <= 0


def _until(obs: Observed, when: datetime | None, plus: float = 0.0) -> float | None:
    return None if when is None else (when - obs.now).total_seconds() + plus


def ttl(job: Job | None, obs: Observed) -> float | None:
    """A finished job is deleted ttlSecondsAfterFinished after status.completionTime."""
    seconds = job.spec.ttl_seconds_after_finished if job else None
    return None if seconds is None else _until(obs, parse_stamp(obs.status.get("completionTime")), seconds)


def restart_backoff(obs: Observed) -> float | None:
    """The next attempt is not created before status.nextAttemptTime (policy/restart.py's backoff)."""
    return _until(obs, parse_stamp(obs.status.get("nextAttemptTime")))


def create_retry(obs: Observed) -> float | None:
    """A creation that failed transiently is not tried again before status.nextCreateTime (create_retry.py)."""
    return _until(obs, parse_stamp(obs.status.get("nextCreateTime")))


def active_deadline(job: Job, obs: Observed) -> float | None:
    """activeDeadlineSeconds after status.startTime (reset when a suspended job resumes)."""
    seconds = job.spec.active_deadline_seconds
    return _until(obs, parse_stamp(obs.status.get("startTime")), seconds) if seconds else None


def attempt_began(obs: Observed) -> datetime | None:
    """When the current attempt's start-up clock started: its creation, or Kueue's admission if later."""
    return max(filter(None, (parse_stamp(obs.status.get("attemptStartTime")),
                             parse_stamp(obs.status.get("admittedTime")))), default=None)


def startup(job: Job, obs: Observed) -> float | None:
    """A starting attempt's gang must run within startupTimeoutSeconds of attempt_began()."""
    return _until(obs, attempt_began(obs), job.spec.startup_timeout_seconds)


def force_delete(pod: PodView) -> float | None:
    """A pod still terminating FORCE_DELETE_AFTER seconds past its grace period is force-deleted."""
    return None if pod.deleting_for is None else FORCE_DELETE_AFTER - pod.deleting_for


def not_scheduled(pod: PodView) -> float | None:
    """A pod no scheduler looked at for NOT_SCHEDULED_AFTER seconds: we say so (is its scheduler running?)."""
    return None if pod.scheduler_seen else NOT_SCHEDULED_AFTER - pod.created_for
