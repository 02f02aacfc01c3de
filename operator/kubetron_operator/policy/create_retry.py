"""Retrying an attempt whose children could not be created: which API errors are worth a retry, the
exponential backoff (status.createFailures, status.nextCreateTime), and what a retry waits for.

The handler tears down what a failed try created (a partial gang must not hold GPUs); decide() then holds the
retry back (`held_back`): it first deletes what is left of that try's pods (their names are about to be
reused), then waits out the backoff. Anything else than a transient error fails the job, as Kubernetes Job's
controller does with its pods.
"""

from __future__ import annotations

from datetime import timedelta

from kubetron.contract.times import format_duration, stamp

from kubetron_operator.observe import Observed
from kubetron_operator.policy import deadlines
from kubetron_operator.policy.action import Action, Event
from kubetron_operator.policy.lifecycle import fail
from kubetron_operator.policy.status import phase_status

CREATE_BACKOFF = (10.0, 300.0)  # seconds: the first retry's delay, doubling up to the cap (as Kubernetes Job)


def retriable(status: int, message: str) -> bool:
    """An API error that may clear up by itself: throttled (429), a server error (5xx), a quota exceeded (403)."""
    return status == 429 or status >= 500 or (status == 403 and "exceeded quota" in message)


def create_failed(obs: Observed, reason: str, message: str, transient: bool) -> Action:
    """A transient API error (quota exceeded, throttled, server error) retries with exponential backoff,
    shown in status (createFailures, nextCreateTime); anything else fails the job with `reason`."""
    if not transient:
        return fail(obs, reason, message)
    failures = (obs.status.get("createFailures") or 0) + 1
    delay = min(CREATE_BACKOFF[1], CREATE_BACKOFF[0] * 2 ** (failures - 1))
    phase = "Restarting" if obs.status.get("attempt") else "Pending"
    status = phase_status(obs, phase, reason, f"{message}; retry {failures} in {format_duration(delay)}")
    status.update(createFailures=failures, nextCreateTime=stamp(obs.now + timedelta(seconds=delay)))
    return Action("wait", status=status, events=(Event("Warning", reason, status["message"]),))


def held_back(obs: Observed, attempt: int) -> Action | None:
    """After a transient creation failure (status.nextCreateTime set): wait, deleting the pods of attempt
    `attempt` the failed try left (its teardown may still be under way), until they are gone and
    nextCreateTime has passed; None when the creation may go ahead."""
    if not obs.status.get("nextCreateTime"):
        return None
    left = [p for p in obs.pods if p.attempt == attempt]
    if left:
        return Action("wait", delete_pods=tuple(p.name for p in left if p.deleting_for is None),
                      why=f"the failed creation's pods of attempt {attempt} are still there: "
                          f"{', '.join(p.name for p in left)}")
    retry = deadlines.create_retry(obs)
    if not deadlines.passed(retry):
        failures = obs.status.get("createFailures") or 0
        return Action("wait", why=f"creation retry {failures} of attempt {attempt} not before "
                                  f"{obs.status.get('nextCreateTime')}")
    return None
