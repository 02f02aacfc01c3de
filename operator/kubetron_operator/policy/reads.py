"""When the operator reads again what a job's trainer reports (trainer_reports/): the store's progress log
whenever an attempt starts or ends and every PROGRESS_REFRESH seconds while one runs; a source that failed
a read (store or rank 0's status endpoint) not before RETRY_AFTER seconds. Pure: ages come in as arguments.
"""

from __future__ import annotations

from collections.abc import Iterable

from kubetron_operator.job_status import JobStatus
from kubetron_operator.model import Job
from kubetron_operator.observe import PodView
from kubetron_operator.policy.elastic import attempt_size

PROGRESS_REFRESH = 30.0  # seconds between progress-log reads while an attempt runs quietly
RETRY_AFTER = 30.0  # seconds before a store or status endpoint that failed a read is read again


def log_read_due(job: Job, status: JobStatus, pods: Iterable[PodView], age: float | None, unread: bool) -> bool:
    """Whether to read the progress log now. `age`: seconds since the last read (None: never read);
    `unread`: that read failed."""
    if age is None:
        return True
    if unread and age < RETRY_AFTER:
        return False
    return eventful(job, status, pods) or (status.get("phase") == "Running" and age >= PROGRESS_REFRESH)


def eventful(job: Job, status: JobStatus, pods: Iterable[PodView]) -> bool:
    """The current attempt is starting or ending (its log may have moved though it is not running)."""
    attempt = int(status.get("attempt") or 0)
    current = [p for p in pods if p.attempt == attempt]
    return status.get("phase") in (None, "Restarting", "Suspended") or any(
        p.terminated or p.deleting_for is not None or p.phase == "Unknown" for p in current
    ) or len([p for p in current if p.role == "worker"]) < attempt_size(job, status)
