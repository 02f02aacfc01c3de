"""When a job's daemon looks again with nothing but time passing: backoffs, deadlines, the start-up timeout,
a shrink, TTL, pods whose deletion or scheduling is overdue, and every `interval` while an attempt runs
(live progress). A change to the job or one of its pods wakes the daemon anyway.

Pure: the clock comes in through Observed, the jitter (which spreads jobs applied together) as an argument.
"""

from __future__ import annotations

from kubetron.contract.resource import FINISHED
from kubetron.contract.times import parse_stamp

from kubetron_operator.model import Job
from kubetron_operator.observe import Observed
from kubetron_operator.policy.elastic import shrink_due
from kubetron_operator.policy.lifecycle import FORCE_DELETE_AFTER
from kubetron_operator.policy.start import NOT_SCHEDULED_AFTER

RESYNC = 300.0  # seconds: an unfinished, unsuspended job is re-decided at least this often (no API request)
SERVICE_RETRY = 10.0  # seconds until a Service that could not be created (a transient error) is tried again
PAST_DUE = 0.05  # seconds past a moment decide() compares with a strict `>`, so it has passed when decided


def next_due(job: Job | None, obs: Observed, interval: float, jitter: float) -> float | None:
    """Seconds until decide() could answer differently with nothing but time passing (None: never), plus
    up to 10% of it (at most 1 s) times `jitter` (a fraction in [0, 1), drawn by the caller)."""
    waits = [w for w in _waits(job, obs, interval) if w > 0]
    if not waits:
        return None
    soonest = min(waits)
    return soonest + PAST_DUE + min(1.0, 0.1 * soonest) * jitter


def at_most(due: float | None, seconds: float) -> float:
    """`due` (None: never) or `seconds`, whichever comes first."""
    return min(due if due is not None else float("inf"), seconds)


def _waits(job: Job | None, obs: Observed, interval: float) -> list[float]:
    """Seconds until each moment that matters to decide() (those in the past included)."""
    st, now, phase = obs.status, obs.now, obs.status.get("phase")
    if job is None:
        return []
    if phase in FINISHED:
        done = parse_stamp(st.get("completionTime"))
        if job.spec.ttl_seconds_after_finished is not None and done:
            return [(done - now).total_seconds() + job.spec.ttl_seconds_after_finished]
        return []
    if job.spec.suspend or phase == "Suspended":
        return [FORCE_DELETE_AFTER - p.deleting_for for p in obs.pods if p.deleting_for is not None]
    waits = [RESYNC]
    if phase == "Running":
        waits.append(interval)  # live progress (rank 0's endpoint) and the store's log
    for key in ("nextAttemptTime", "nextCreateTime"):
        if when := parse_stamp(st.get(key)):
            waits.append((when - now).total_seconds())
    start, deadline = parse_stamp(st.get("startTime")), job.spec.active_deadline_seconds
    if start and deadline:
        waits.append((start - now).total_seconds() + deadline)
    began = parse_stamp(st.get("admittedTime")) or parse_stamp(st.get("attemptStartTime"))  # Kueue: from admission
    if began and phase == "Pending":
        waits.append((began - now).total_seconds() + job.spec.startup_timeout_seconds)
        current = [p for p in obs.pods if p.role == "worker" and str(p.attempt) == str(st.get("attempt"))]
        shrink_in = shrink_due(job, obs, current, began)
        if shrink_in is not None:
            waits.append(shrink_in)
    for p in obs.pods:
        if p.deleting_for is not None:
            waits.append(FORCE_DELETE_AFTER - p.deleting_for)
        elif p.role == "worker" and not p.scheduler_seen:
            waits.append(NOT_SCHEDULED_AFTER - p.created_for)
    return waits
