"""Writing the status patch: phase and conditions, the progress fields `kubectl get` shows, the restart
counters (kubetron_operator.job_status types the fields); the newest known checkpoint and iteration come from
kubetron_operator.trainer_reports.merge.

status.iteration follows the current attempt (from the checkpoint it resumed from, forward);
lostIterations adds, once per ended attempt, the last iteration that attempt reached minus the
checkpoint the next attempt resumes from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from kubetron.contract.progress import CheckpointRef
from kubetron.contract.times import format_duration, stamp

from kubetron_operator.job_status import PHASES, Condition, JobStatus, Restarts, StatusPatch
from kubetron_operator.observe import NO_LIVE, NO_PROGRESS, Observed
from kubetron_operator.policy.action import Event
from kubetron_operator.policy.hang import hang_news
from kubetron_operator.trainer_reports.merge import ckpt_iteration, log_iteration


def phase_status(obs: Observed, phase: str, reason: str, message: str) -> StatusPatch:
    """phase, reason, message and the conditions that go with them."""
    return {"phase": phase, "reason": reason, "message": message,
            "conditions": _conditions(obs.status.get("conditions") or [], phase, reason, message, obs.now)}


def _conditions(old: list[Condition], phase: str, reason: str, message: str, now: datetime) -> list[Condition]:
    """One condition per phase ever reached; the current one True, the others False; other conditions kept
    (StoreReadable: policy/store.py; Hung: policy/hang.py)."""
    out: list[Condition] = []
    seen = False
    for held in old:
        cond = held.copy()
        if cond.get("type") not in PHASES:  # a condition of its own (policy/store.py), not a phase's
            out.append(cond)
            continue
        is_now = cond.get("type") == phase
        seen = seen or is_now
        want = "True" if is_now else "False"
        if cond.get("status") != want:
            cond["lastTransitionTime"] = stamp(now)
        cond["status"] = want
        if is_now:
            cond["reason"], cond["message"] = reason, message
        out.append(cond)
    if not seen:
        out.append({"type": phase, "status": "True", "reason": reason, "message": message,
                    "lastTransitionTime": stamp(now)})
    return out


LIVE_FIELDS = ("iteration", "progress", "eta", "tokensPerSecond", "loss", "learningRate")
"""The fields progress_fields() moves with every read of rank 0's endpoint (policy/throttle.py holds them back)."""


def progress_fields(obs: Observed, ckpt: CheckpointRef | None, live: bool = True) -> StatusPatch:
    """iteration / trainIters / progress / eta / tokensPerSecond / loss / learningRate for `kubectl get`, for the
    current attempt."""
    st, log, now_live = obs.status, obs.progress or NO_PROGRESS, (obs.live or NO_LIVE) if live else NO_LIVE
    attempt = st.get("attempt") or 0
    iteration = max(now_live.get("iteration") or 0, log_iteration(log, attempt),
                    st.get("iteration") or 0, ckpt_iteration(ckpt))
    train_iters = now_live.get("trainIters") or log.get("trainIters") or st.get("trainIters")
    out: StatusPatch = {"iteration": iteration, "lastCheckpoint": ckpt}
    if train_iters:
        out["trainIters"] = int(train_iters)
        out["progress"] = percent(iteration, train_iters)
    if live:
        eta = now_live.get("etaSeconds")
        out["eta"] = format_duration(eta) if isinstance(eta, int | float) else st.get("eta")
        tps = now_live.get("tokensPerSecond")
        if isinstance(tps, int | float):
            out["tokensPerSecond"] = round(float(tps), 1)
        for key in ("loss", "learningRate"):  # as rank 0 last logged them
            if isinstance(now_live.get(key), int | float):
                out[key] = float(f"{now_live[key]:.4g}")
    else:
        out["eta"] = None
    return out


def percent(iteration: int, train_iters: Any) -> str:
    """status.progress: `iteration` of `train_iters` as a whole percentage, at most 100%."""
    return f"{min(100, math.floor(100 * iteration / int(train_iters)))}%"


def restart_counts(st: JobStatus) -> Restarts:
    """The restart counters; `inPlace` (docs/recovery.md) is not in `total`, which counts attempts."""
    r = st.get("restarts") or Restarts()
    p, f, n = r.get("preemptions") or 0, r.get("failures") or 0, r.get("neverStarted") or 0
    counts: Restarts = {"preemptions": p, "failures": f, "neverStarted": n, "total": p + f + n,
                        "inPlace": r.get("inPlace") or 0, "hangs": r.get("hangs") or 0}
    if r.get("podsReplaced"):  # (docs/recovery.md; absent until a pod is)
        counts["podsReplaced"] = r["podsReplaced"]
    return counts


def lost_in_place(obs: Observed) -> int:
    """Iterations a gang restarted in place discards: the iteration it reached less the one its new processes
    resumed from (rank 0's resumedFrom: a memory snapshot, a peer's copy or the store's checkpoint; an older
    trainer: the checkpoint it reports)."""
    live, st = obs.live or NO_LIVE, obs.status
    resumed = live.get("resumedFrom")
    if resumed is None:
        ckpt = live.get("lastCheckpoint") or st.get("lastCheckpoint")
        resumed = ckpt.get("iteration") if isinstance(ckpt, dict) else None
    return max(0, (st.get("iteration") or 0) - (resumed if isinstance(resumed, int) else 0))


def in_place_news(obs: Observed, attempt: int, limit: int) -> tuple[StatusPatch, tuple[Event, ...]]:
    """In-place restarts (and hangs) of the current attempt not counted yet, from rank 0's status endpoint, the
    progress log or the attempt's termination messages (a restart the endpoint never showed: a short run, a read
    that failed): the status fields that count them, and one event for all of them. `limit`: the job's
    maxInPlaceRestarts, the most an attempt can have; a trainer that reports more is not believed beyond it."""
    counted = obs.status.get("attemptInPlaceRestarts") or 0
    by_job = (obs.progress or NO_PROGRESS).get("inPlaceRestarts")
    logged = [n for job_id, n in by_job.items() if str(job_id).endswith(f"/{attempt}")] if isinstance(
        by_job, Mapping) else []
    ended = [p.termination.get("inPlaceRestarts") or 0 for p in obs.pods if p.attempt == attempt and p.termination]
    reported = max([counted, (obs.live or NO_LIVE).get("inPlaceRestarts") or 0, *logged, *ended])
    now = min(reported, max(counted, limit))
    restarts = restart_counts(obs.status)
    news: StatusPatch = {}
    events: tuple[Event, ...] = ()
    if now > counted:
        total = restarts["inPlace"] + now - counted
        which = f"{now} in this attempt" if now == counted + 1 else f"{counted + 1}-{now} of this attempt"
        what = "a trainer process ended; the gang restarted" if now == counted + 1 else \
            f"trainer processes ended; the gang restarted {now - counted} times"
        events = (Event("Warning", "RestartedInPlace", f"attempt {attempt}: {what} inside its pods from the newest "
                        f"checkpoint ({which}, {total} in all)"),)
        restarts = {**restarts, "inPlace": total}
        news = {"restarts": restarts, "attemptInPlaceRestarts": now, "lostIterations": (
            obs.status.get("lostIterations") or 0) + lost_in_place(obs)}
    hangs, hung = hang_news(obs, attempt, restarts, now)  # some of them after the gang hung (policy/hang.py)
    return {**news, **hangs}, events + hung
