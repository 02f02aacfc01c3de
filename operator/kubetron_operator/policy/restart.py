"""Restarting after an attempt ended: which counter it goes to, the backoff, and when to give up.

Kinds (status.restarts): preemptions (restart at once, free), failures (count toward backoffLimit),
neverStarted (count toward maxNeverStartedAttempts, not backoffLimit).

Backoff (as Kubernetes Job, failures only): a failed or never-started attempt is followed by
10 s * 2^(n-1), at most 6 min, plus up to 20 % jitter, where n counts the failed or never-started attempts
in a row since an attempt last saved a new checkpoint (status.backoff.attempts; an attempt that saved one
starts it over, as the kubelet forgets a container's CrashLoopBackOff once it ran cleanly); preemptions
restart at once. The "not before" time is status.nextAttemptTime, why that long status.backoff.reason.

Crash loops (NoProgress): only attempts that ended by the job's own doing (a failure, or exit 76) count,
and only when they saved no checkpoint newer than the one they resumed from; maxNoProgressAttempts such
attempts in a row -> Failed (NoProgress). Preemptions and never-started attempts neither count nor
reset the streak (an attempt that saved something new does reset it): being preempted while the model
loads is the cluster's doing, not a crash loop. Free restarts are bounded by a streak of their own:
MAX_PREEMPTIONS_WITHOUT_PROGRESS running attempts in a row preempted without a new checkpoint -> Failed
(NoProgress); any new checkpoint resets it, so a job preempted often while it progresses runs on.
Nodes that rejected a pod at admission are remembered in status.avoidNodes (policy/nodes.py).
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

from kubetron.contract.progress import CheckpointRef
from kubetron.contract.times import format_duration, stamp

from kubetron_operator.job_status import Backoff, JobStatus, RestartKind, Restarts, StatusPatch
from kubetron_operator.model import Job
from kubetron_operator.observe import Observed, PodView
from kubetron_operator.policy.action import Action, Event
from kubetron_operator.policy.hang import carry_hang
from kubetron_operator.policy.lifecycle import fail, overdue
from kubetron_operator.policy.nodes import avoid
from kubetron_operator.policy.status import in_place_news, phase_status, progress_fields, restart_counts
from kubetron_operator.trainer_reports.merge import ckpt_iteration, reached_iteration

BACKOFF_BASE, BACKOFF_CAP, BACKOFF_JITTER = 10.0, 360.0, 0.2  # seconds, seconds, fraction (as Kubernetes Job)
MAX_PREEMPTIONS_WITHOUT_PROGRESS = 10  # free restarts of running attempts in a row that saved nothing new -> NoProgress


def restart(job: Job, obs: Observed, current: list[PodView], ckpt: CheckpointRef | None, *, kind: RestartKind,
            reason: str, message: str, own_doing: bool = False, bad_nodes: tuple[str, ...] = ()) -> Action:
    """End the current attempt. `kind` is the restarts counter it goes to: preemptions | failures | neverStarted."""
    st = obs.status
    attempt = st.get("attempt") or 0
    in_place, restarted = in_place_news(obs, attempt, job.spec.max_in_place_restarts)
    restarts: Restarts = in_place.get("restarts") or restart_counts(st)
    restarts[kind] += 1
    restarts["total"] = restarts["preemptions"] + restarts["failures"] + restarts["neverStarted"]
    progressed = ckpt_iteration(ckpt) > (st.get("attemptStartCheckpoint") or 0) or (
        ckpt is not None and st.get("attemptStartCheckpoint") is None)
    streak = st.get("noProgressAttempts") or 0
    no_progress = 0 if progressed else streak + (1 if kind == "failures" or own_doing else 0)
    # Free restarts are bounded too: a running attempt preempted before it saved anything new, again and again.
    free = kind == "preemptions" and not own_doing and st.get("phase") == "Running"
    free_streak = 0 if progressed else (st.get("preemptionsWithoutProgress") or 0) + int(free)
    backoff = _backoff(job, st, attempt, kind, progressed, ckpt)
    common: StatusPatch = {"restarts": restarts, "noProgressAttempts": no_progress, "lastCheckpoint": ckpt,
                           "preemptionsWithoutProgress": free_streak, "backoff": backoff,
                           "lastAttemptIteration": reached_iteration(obs, attempt, current)}
    if bad_nodes:  # a kubelet's rejection: avoided at once (policy/nodes.py)
        common["avoidNodes"] = avoid(st, bad_nodes, reason, message, obs.now)
    limit = _limit_reached(job, restarts, kind, no_progress, free_streak, ckpt)
    if limit is not None:
        action = fail(obs, limit[0], f"{limit[1]}; last: {message}")
        action.status.update(common)
        return action
    delay = backoff["seconds"]
    status = carry_hang(phase_status(obs, "Restarting", reason, message), in_place)
    status.update(common)
    status.update(progress_fields(obs, ckpt, live=False))
    status["nextAttemptTime"] = stamp(obs.now + timedelta(seconds=delay)) if delay else None
    counted = {"preemptions": "preemption", "failures": f"failure {restarts['failures']}/{job.spec.backoff_limit}",
               "neverStarted": f"never started {restarts['neverStarted']}/{job.spec.max_never_started_attempts}"}
    when = f"in {format_duration(delay)}" if delay else "now"
    return Action("restart", status=status,
                  delete_pods=tuple(p.name for p in current if p.deleting_for is None),
                  force_delete_pods=overdue(obs),
                  events=(*restarted, Event("Warning", reason, f"attempt {attempt} ended ({counted[kind]}): {message}; "
                                            f"restarting from iteration {ckpt_iteration(ckpt)} {when}")))


def _limit_reached(job: Job, restarts: Restarts, kind: RestartKind, no_progress: int, free_streak: int,
                   ckpt: CheckpointRef | None) -> tuple[str, str] | None:
    """(reason, message) when the job gives up instead of restarting: backoffLimit, maxNeverStartedAttempts,
    maxNoProgressAttempts or MAX_PREEMPTIONS_WITHOUT_PROGRESS reached; None while it may restart."""
    if kind == "failures" and restarts[kind] > job.spec.backoff_limit:
        return "BackoffLimitExceeded", f"{restarts[kind]} failures > backoffLimit {job.spec.backoff_limit}"
    if kind == "neverStarted" and restarts[kind] >= job.spec.max_never_started_attempts:
        return "NeverStarted", (f"{restarts[kind]} attempts never started (maxNeverStartedAttempts "
                                f"{job.spec.max_never_started_attempts})")
    if no_progress >= job.spec.max_no_progress_attempts:
        return "NoProgress", (f"{no_progress} attempts in a row ended by the trainer without a new "
                              f"checkpoint (last checkpoint: iteration {ckpt_iteration(ckpt)})")
    if free_streak >= MAX_PREEMPTIONS_WITHOUT_PROGRESS:
        return "NoProgress", (f"{free_streak} running attempts in a row preempted before saving a new "
                              f"checkpoint (last checkpoint: iteration {ckpt_iteration(ckpt)}): save checkpoints "
                              f"more often (checkpoint.save_interval)")
    return None


def _backoff(job: Job, st: JobStatus, attempt: int, kind: RestartKind, progressed: bool,
             ckpt: CheckpointRef | None) -> Backoff:
    """The wait before the next attempt (status.backoff): after the n-th failed or never-started attempt in a
    row since an attempt saved a new checkpoint, 10 s doubling to 6 min, plus up to 20 % jitter; none after a
    preemption. The jitter is drawn from the job's UID and attempt, so decide stays pure."""
    held = (st.get("backoff") or Backoff(attempts=0, seconds=0.0, reason="")).get("attempts") or 0
    n = (0 if progressed else held) + (0 if kind == "preemptions" else 1)
    if kind == "preemptions":
        return {"attempts": n, "seconds": 0.0, "reason": "preempted: restarting at once"}
    base = min(BACKOFF_CAP, BACKOFF_BASE * 2 ** (n - 1))
    digest = hashlib.sha256(f"{job.uid}/{attempt}".encode()).digest()
    seconds = round(base * (1 + BACKOFF_JITTER * digest[0] / 255), 1)
    ended = "failed" if kind == "failures" else "never started"
    if progressed:
        why = (f"attempt {attempt} saved a new checkpoint (iteration {ckpt_iteration(ckpt)}) before it {ended}: "
               f"the backoff starts over at {format_duration(BACKOFF_BASE)}")
    else:
        why = (f"{n} attempt(s) in a row failed or never started without a new checkpoint (newest: iteration "
               f"{ckpt_iteration(ckpt)}): {format_duration(BACKOFF_BASE)} doubled {n - 1} time(s), at most "
               f"{format_duration(BACKOFF_CAP)}")
    return {"attempts": n, "seconds": seconds, "reason": f"{why}, plus jitter: {format_duration(seconds)}"}
