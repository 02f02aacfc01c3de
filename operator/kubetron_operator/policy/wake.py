"""When a job's daemon looks again with nothing but time passing: the soonest moment of policy/deadlines.py
(backoffs, deadlines, the start-up timeout, TTL, pods whose deletion or scheduling is overdue), a shrink, and
every `interval` while an attempt runs (live progress). A change to the job or one of its pods wakes the
daemon anyway.

Pure: the clock comes in through Observed, the jitter (which spreads jobs applied together) as an argument.
"""

from __future__ import annotations

from kubetron.contract.resource import FINISHED

from kubetron_operator.model import Job
from kubetron_operator.observe import Observed
from kubetron_operator.policy import deadlines
from kubetron_operator.policy.elastic import shrink_due

RESYNC = 300.0  # seconds: an unfinished, unsuspended job is re-decided at least this often (no API request)
JOB_OBJECTS_RETRY = 10.0  # seconds until job objects that could not be created (a transient error) are tried again
PAST_DUE = 0.05  # seconds past a moment, so it has passed when decided (whatever the clocks' rounding)


def next_due(job: Job | None, obs: Observed, interval: float, jitter: float) -> float | None:
    """Seconds until decide() could answer differently with nothing but time passing (None: never), plus
    up to 10% of it (at most 1 s) times `jitter` (a fraction in [0, 1), drawn by the caller)."""
    waits = [w for w in _waits(job, obs, interval) if w is not None and w > 0]
    if not waits:
        return None
    soonest = min(waits)
    return soonest + PAST_DUE + min(1.0, 0.1 * soonest) * jitter


def at_most(due: float | None, seconds: float) -> float:
    """`due` (None: never) or `seconds`, whichever comes first."""
    return min(due if due is not None else float("inf"), seconds)


def _waits(job: Job | None, obs: Observed, interval: float) -> list[float | None]:
    """Seconds until each moment that matters to decide() (those in the past included; None: none)."""
    phase = obs.status.get("phase")
    if job is None:
        return []
    if phase in FINISHED:
        return [deadlines.ttl(job, obs)]
    if job.spec.suspend or phase == "Suspended":
        return [deadlines.force_delete(p) for p in obs.pods]
    waits = [RESYNC, deadlines.restart_backoff(obs), deadlines.create_retry(obs), deadlines.active_deadline(job, obs)]
    if phase == "Running":
        waits.append(interval)  # live progress (rank 0's endpoint) and the store's log
    if phase == "Pending":
        waits.append(deadlines.startup(job, obs))
        current = [p for p in obs.pods if p.role == "worker" and str(p.attempt) == str(obs.status.get("attempt"))]
        waits.append(shrink_due(job, obs, current, deadlines.attempt_began(obs)))
    for p in obs.pods:
        waits.append(deadlines.force_delete(p))
        if p.role == "worker" and p.deleting_for is None:
            waits.append(deadlines.not_scheduled(p))
    return waits
