"""Hangs (docs/recovery.md): a gang whose pods' watchdogs found every rank without progress past the hang
timeout is restarted in place by them (rank 0 then reports it: status endpoint `hangs`/`lastHang`, the progress
log's "Hang detected") or, with no in-place restart left, its pods end with exit 7 (Hung) and the hang in their
termination message. Here: counting them (status.restarts.hangs, apart from total), naming the rank, its pod
and node (status.lastHang, a Warning event Hung, the condition Hung), and ending that condition once training
passes the iteration it hung at.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime

from kubetron.contract import exitcodes
from kubetron.contract.hang import HangReport, describe
from kubetron.contract.times import stamp

from kubetron_operator.job_status import Condition, LastHang, Restarts, StatusPatch
from kubetron_operator.observe import NO_LIVE, NO_PROGRESS, Observed, PodView
from kubetron_operator.policy.action import Event
from kubetron_operator.trainer_reports.termination import capped

HUNG = exitcodes.reason(exitcodes.HUNG)  # the condition's type, the event's and the status reason (as the pod's end)


def hang_news(obs: Observed, attempt: int, restarts: Restarts, limit: int) -> tuple[StatusPatch, tuple[Event, ...]]:
    """Hangs of the current attempt not counted yet (rank 0's endpoint, the progress log), on top of
    `restarts`: the status fields that count and name them, and an event for the newest. `limit`: the most
    this attempt can have had (each restarted the gang in place: its in-place restarts counted so far); what
    a trainer reports beyond it is not counted."""
    counted = obs.status.get("attemptHangs") or 0
    live = obs.live or NO_LIVE
    now = min(max([counted, live.get("hangs") or 0, *_logged(obs, attempt)]), max(counted, limit))
    if now <= counted:
        return _passed(obs), ()
    patch: StatusPatch = {"restarts": {**restarts, "hangs": (restarts.get("hangs") or 0) + now - counted},
                          "attemptHangs": now}
    report = live.get("lastHang")
    if report is None:  # only the log said so: counted, not named
        return patch, ()
    named, event = name_hang(obs, attempt, report, in_place=True)
    return {**patch, **named}, (event,)


def hang_ended_attempt(obs: Observed, attempt: int, current: list[PodView], restarts: Restarts) -> StatusPatch:
    """An attempt whose pods ended Hung (exit 7, no in-place restart left): one more hang, named from the
    termination messages. `restarts`: the counters the restart wrote."""
    report = next((p.termination.get("hang") for p in sorted(current, key=lambda p: p.rank)
                   if p.termination and isinstance(p.termination.get("hang"), Mapping)), None)
    patch: StatusPatch = {"restarts": {**restarts, "hangs": (restarts.get("hangs") or 0) + 1}}
    if report is not None:
        patch.update(name_hang(obs, attempt, report, in_place=False)[0])
    return patch


def name_hang(obs: Observed, attempt: int, report: HangReport, in_place: bool) -> tuple[StatusPatch, Event]:
    """status.lastHang and the Hung condition for `report`, and its event: the rank, its pod and node."""
    pod = next((p for p in obs.pods if p.role == "worker" and p.attempt == attempt and p.rank == report["nodeRank"]),
               None)
    report = capped(report)
    last = LastHang(time=stamp(obs.now), attempt=attempt, rank=report["rank"], pod=pod.name if pod else "",
                    node=pod.node if pod else "", phase=report["phase"], iteration=report["iteration"],
                    idleSeconds=report["idleSeconds"], timeoutSeconds=report["timeoutSeconds"],
                    state=report["state"], where=report["where"], stacks=report["stacks"], restartedInPlace=in_place)
    where = f"(pod {last['pod']} on node {last['node'] or '?'})" if pod else f"(pod rank {report['nodeRank']})"
    then = "restarted in place from the newest checkpoint" if in_place else "no in-place restart left: a new attempt"
    stacks = f"; stacks in {report['stacks']}" if report["stacks"] else ""
    named = describe(report).replace(f"(pod rank {report['nodeRank']})", where, 1)
    message = f"attempt {attempt}: {named}{stacks}; {then}"
    conditions = set_condition(obs.status.get("conditions") or [], HUNG, "True", HUNG, message, obs.now)
    return {"lastHang": last, "conditions": conditions}, Event("Warning", HUNG, message)


def _logged(obs: Observed, attempt: int) -> list[int]:
    by_job = (obs.progress or NO_PROGRESS).get("hangs")
    return [n for job_id, n in by_job.items() if str(job_id).endswith(f"/{attempt}")] if isinstance(
        by_job, Mapping) else []


def _passed(obs: Observed) -> StatusPatch:
    """The Hung condition goes False once the job trains past the iteration it hung at."""
    last, held = obs.status.get("lastHang") or {}, _condition(obs.status.get("conditions") or [], HUNG)
    iteration = (obs.live or NO_LIVE).get("iteration") or 0
    if not held or held.get("status") != "True" or iteration <= (last.get("iteration") or 0):
        return {}
    message = f"training again: iteration {iteration}, past the hang at iteration {last.get('iteration')}"
    return {"conditions": set_condition(obs.status.get("conditions") or [], HUNG, "False", "Progressing", message,
                                        obs.now)}


def _condition(conditions: Iterable[Condition], kind: str) -> Condition | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def set_condition(conditions: list[Condition], kind: str, status: str, reason: str, message: str,
                  now: datetime) -> list[Condition]:
    """`conditions` with the one of type `kind` set (added when missing; its transition time moves only when
    its status changes)."""
    out = [c.copy() for c in conditions if c.get("type") != kind]
    held = _condition(conditions, kind) or {}
    moved = held.get("status") != status
    out.append({"type": kind, "status": status, "reason": reason, "message": message,
                "lastTransitionTime": stamp(now) if moved else held.get("lastTransitionTime") or stamp(now)})
    return out


def carry_hang(status: StatusPatch, news: StatusPatch) -> StatusPatch:
    """`status` (a patch with its own conditions: a phase change) with what the hang `news` carries:
    lastHang and the Hung condition."""
    if "lastHang" in news:
        status["lastHang"] = news["lastHang"]
    held = _condition(news.get("conditions") or [], HUNG)
    if held is not None:
        status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != HUNG] + [held]
    return status
