"""The merge of what the trainer reports: the newest checkpoint and the last iteration any source knows of.

Every source may lag or be missing: the job's status (what the operator last wrote), the store's progress log
(store_log.py), rank 0's status endpoint (status_endpoint.py) and the ranks' termination messages
(termination.py). Each number here is the greatest any of them reports. Pure: it reads only `Observed`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubetron.contract.progress import CheckpointRef, ProgressSummary
from kubetron.contract.times import stamp

from kubetron_operator.observe import NO_LIVE, NO_PROGRESS, Observed, PodView, to_int


def known_checkpoint(obs: Observed, attempt: int) -> CheckpointRef | None:
    """The newest durable checkpoint any source reports (status, log, live endpoint, termination messages)."""
    best = newer_checkpoint(None, obs.status.get("lastCheckpoint"))
    best = newer_checkpoint(best, (obs.progress or NO_PROGRESS).get("lastCheckpoint"))
    best = newer_checkpoint(best, (obs.live or NO_LIVE).get("lastCheckpoint"))
    for p in obs.pods:
        term_ckpt = (p.termination or {}).get("lastCheckpoint")
        if isinstance(term_ckpt, int) and p.attempt <= attempt:
            best = newer_checkpoint(best, {"iteration": term_ckpt, "time": stamp(obs.now)})
    return best


def newer_checkpoint(a: CheckpointRef | None, b: Any) -> CheckpointRef | None:
    """The newer of checkpoint `a` and `b` (a copy); `b` may be anything (the trainer's JSON included)."""
    if not isinstance(b, Mapping) or not isinstance(b.get("iteration"), int):
        return a.copy() if a else None
    if a is None or b["iteration"] > a["iteration"]:
        return {"iteration": b["iteration"], "time": b.get("time")}
    return a.copy()


def log_iteration(log: ProgressSummary, attempt: int) -> int:
    """The last iteration the progress log mentions for `attempt` (its lines carry job id ns/name/attempt).

    Not the log's overall latest: until the new attempt writes its first line, that is the old attempt's.
    A summary without jobIterations (an older reader image) gives its latest iteration.
    """
    by_job = log.get("jobIterations")
    if not isinstance(by_job, Mapping):
        return log.get("iteration") or 0
    return max([it for job_id, it in by_job.items() if str(job_id).endswith(f"/{attempt}")] or [0])


def reached_iteration(obs: Observed, attempt: int, current: list[PodView]) -> int:
    """The last iteration the current attempt reached (status.iteration follows the current attempt)."""
    terms = [to_int((p.termination or {}).get("iteration")) for p in current]
    return max([obs.status.get("iteration") or 0, log_iteration(obs.progress or NO_PROGRESS, attempt), *terms])


def ckpt_iteration(ckpt: CheckpointRef | None) -> int:
    """The checkpoint's iteration; 0 when there is none (the attempt starts from scratch)."""
    return int(ckpt["iteration"]) if ckpt else 0
