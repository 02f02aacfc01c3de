"""The goodput ledger (docs/goodput.md): every rank-second since the job was created, by bucket, in
status.goodput (kubetron.contract.goodput names the buckets).

Each decision advances the ledger from `asOf` to now: the time in between times the attempt's ranks goes to
one bucket by what the job was doing (status.phase, the current attempt's pods), except while an attempt runs,
when rank 0's own account of its time (the status endpoint's trainerTime, read every --interval) splits it into
productive (its training iterations), checkpoint (the loop blocked on saves) and the rest (recovery until an
iteration completes after a failure, hang or preemption; else other: start-up, evaluation, logging). When a
restart discards iterations (the attempt reached iteration I, the next resumes from checkpoint C < I: counted
when the next attempt is created, as status.lostIterations counts them), their time, (I - C) x the trainer's
mean iteration, moves from productive to lostWork.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import cast

from kubetron.contract.goodput import (
    BUCKETS,
    LOST_WORK,
    OTHER,
    PENDING,
    PRODUCTIVE,
    RECOVERY,
    Goodput,
    TrainerTime,
    parse_trainer_time,
)
from kubetron.contract.hang import CHECKPOINT
from kubetron.contract.times import parse_stamp, stamp

from kubetron_operator.job_status import FINISHED, JobStatus, StatusPatch
from kubetron_operator.model import Job
from kubetron_operator.observe import NO_LIVE, Observed
from kubetron_operator.policy.action import Action

MAX_SECONDS = 1e12  # a bucket's rank-seconds beyond this (30,000 rank-years) are not real
NEVER_STARTED = frozenset({"StartupTimeout", "AdmissionRejected", "NeverStarted"})
"""Restart reasons of attempts that never ran: the wait until the next one is pending, not recovery."""


def account(job: Job | None, obs: Observed, action: Action) -> StatusPatch:
    """The ledger as of now ({"goodput": ...}), or {} for a finished job (its ledger stopped at its end) or one
    whose spec does not parse."""
    st = obs.status
    if job is None or st.get("phase") in FINISHED:
        return {}
    held: Goodput = st.get("goodput") or Goodput()
    since = parse_stamp(held.get("asOf")) or obs.created or obs.now
    seconds = {b: float((held.get("seconds") or {}).get(b) or 0.0) for b in BUCKETS}
    trainer = parse_trainer_time((obs.live or NO_LIVE).get("trainerTime"))
    before = parse_trainer_time(held.get("trainer"))
    recovering = bool(held.get("recovering"))
    ranks = (st.get("nodes") or job.spec.nodes) * job.spec.nproc_per_node
    now = obs.now.replace(microsecond=0)  # up to the second asOf keeps: no interval counted twice
    wall = max(0.0, (now - since).total_seconds())
    failed = _attempt_ended(obs, action)  # a failure, a hang, a preemption (or any other end of an attempt)
    waiting = held.get("waiting", True)  # the attempt's pods waited for placement as of `since`
    advanced = (action.status.get("iteration") or 0) > (st.get("iteration") or 0)
    spent = _interval(obs, wall, trainer, before, recovering or failed, waiting, advanced)
    for bucket in spent:
        seconds[bucket] += spent[bucket] * ranks
    hung = _hang_seconds(obs, action) * ranks  # the hang's idle time went to other (no iteration): recovery
    seconds[OTHER], seconds[RECOVERY] = seconds[OTHER] - min(hung, seconds[OTHER]), seconds[RECOVERY] + min(
        hung, seconds[OTHER])
    step = _step_seconds(trainer, held.get("stepSeconds"))
    origin = held.get("recoveringFrom")
    moved = max(0.0, min(seconds[PRODUCTIVE], _lost_iterations(obs, action) * step * ranks))
    seconds[PRODUCTIVE] -= moved
    seconds[LOST_WORK] += moved
    if failed:
        recovering, origin = True, before["started"] if before else None  # the process that failed
    elif recovering and trainer is not None and trainer["steps"] and trainer["started"] != origin:
        recovering, origin = False, None  # a process after the failure completed an iteration
    after = cast(JobStatus, {**st, **action.status})
    baseline = _baseline(trainer, before, spent) if trainer is not None else before
    patch = ledger(seconds, now, recovering, step, baseline, _waiting(obs, after))
    patch["recoveringFrom"] = origin
    return {"goodput": patch}


def ledger(seconds: dict[str, float], now: datetime, recovering: bool, step: float, trainer: TrainerTime | None,
           waiting: bool) -> Goodput:
    """status.goodput: every bucket finite and not negative, the ratio within [0, 1] (the status endpoint's
    check refuses a trainerTime no process can have spent; this holds whatever reached here)."""
    rounded = {b: round(_seconds(seconds[b]), 3) for b in BUCKETS}
    total = round(sum(rounded.values()), 3)
    ratio = min(1.0, round(rounded[PRODUCTIVE] / total, 4)) if total else 0.0
    return Goodput(seconds=rounded, totalSeconds=total, ratio=ratio, asOf=stamp(now), recovering=recovering,
                   stepSeconds=round(_seconds(step), 6), trainer=trainer, waiting=waiting)


def _seconds(value: float) -> float:
    """`value` as seconds status can hold: not negative, finite (at most MAX_SECONDS)."""
    return min(MAX_SECONDS, value) if value > 0 else 0.0  # NaN compares false: 0


def _interval(obs: Observed, wall: float, trainer: TrainerTime | None, before: TrainerTime | None,
              recovering: bool, waiting: bool, advanced: bool) -> dict[str, float]:
    """Where `wall` seconds up to now went, per rank, by what the job was doing at their start (its status as
    held, whether its pods waited for placement). `advanced`: the job's iteration moved meanwhile."""
    st = obs.status
    phase, rest = st.get("phase") or "", RECOVERY if recovering else OTHER
    if phase == "Running":
        return _running(wall, trainer, before, PRODUCTIVE if advanced and trainer is None else rest)
    if phase == "Restarting":
        return {PENDING if st.get("reason") in NEVER_STARTED else RECOVERY: wall}
    if phase == "Suspended":
        return {OTHER: wall}
    return {PENDING if waiting or not st.get("attempt") else rest: wall}


def _running(wall: float, trainer: TrainerTime | None, before: TrainerTime | None, rest: str) -> dict[str, float]:
    """A running attempt: rank 0's counters since the last reading split the time (without them, `rest`:
    productive when the iteration moved, else other, or recovery)."""
    if trainer is None:
        return {rest: wall}
    same = before is not None and before["started"] == trainer["started"]
    train = trainer["train"] - (before["train"] if same and before else 0.0)
    saving = trainer["checkpoint"] - (before["checkpoint"] if same and before else 0.0)
    productive = min(wall, max(0.0, train))
    checkpoint = min(wall - productive, max(0.0, saving))
    return {PRODUCTIVE: productive, CHECKPOINT: checkpoint, rest: wall - productive - checkpoint}


def _baseline(trainer: TrainerTime, before: TrainerTime | None, spent: dict[str, float]) -> TrainerTime:
    """The trainer reading the next interval counts from: as far as this one accounted for (an interval
    shorter than the trainer's growth, e.g. two decisions within the second asOf keeps, leaves the rest to the
    next one, rather than losing it)."""
    same = before is not None and before["started"] == trainer["started"]
    base = before if same and before is not None else TrainerTime(started=trainer["started"], steps=0, train=0.0,
                                                                    checkpoint=0.0, evaluation=0.0)
    return TrainerTime(started=trainer["started"], steps=trainer["steps"],
                       train=round(base["train"] + spent.get(PRODUCTIVE, 0.0), 6),
                       checkpoint=round(base["checkpoint"] + spent.get(CHECKPOINT, 0.0), 6),
                       evaluation=trainer["evaluation"])


def _waiting(obs: Observed, st: JobStatus) -> bool:
    """The current attempt's pods wait for the scheduler or a queue (not all there and bound to nodes, or
    gated); no attempt yet counts too. The next interval's `waiting`."""
    attempt = st.get("attempt") or 0
    current = [p for p in obs.pods if p.role == "worker" and p.attempt == attempt and p.deleting_for is None]
    size = st.get("nodes") or 1
    return not attempt or len(current) < size or any(p.gates or not p.node for p in current)


def _step_seconds(trainer: TrainerTime | None, held: object) -> float:
    """A training iteration's mean seconds: the newest trainer's, else the one the ledger holds."""
    if trainer is not None and trainer["steps"] > 0:
        return trainer["train"] / trainer["steps"]
    return float(held) if isinstance(held, (int, float)) else 0.0


def _attempt_ended(obs: Observed, action: Action) -> bool:
    """This decision ends the running attempt (it records the iteration it reached) or counts a gang restarted
    in place: recovery begins."""
    st, patch = obs.status, action.status
    if patch.get("lastAttemptIteration") is not None and st.get("phase") in ("Pending", "Running"):
        return True
    return (patch.get("attemptInPlaceRestarts") or 0) > (st.get("attemptInPlaceRestarts") or 0)


def _lost_iterations(obs: Observed, action: Action) -> int:
    """Iterations this decision finds discarded: those status.lostIterations counts as the next attempt is
    created (the one before reached lastAttemptIteration, the newest checkpoint known by then, what its
    ranks saved on the way out included, is where the next resumes), or those of a gang restarted in place
    (it reached status.iteration; its new processes resumed from the checkpoint they report)."""
    st, patch = obs.status, action.status
    if "lostIterations" in patch:
        return max(0, int(patch["lostIterations"] or 0) - (st.get("lostIterations") or 0))
    if (patch.get("attemptInPlaceRestarts") or 0) > (st.get("attemptInPlaceRestarts") or 0):
        live = obs.live or NO_LIVE
        resumed = live.get("resumedFrom")
        if resumed is None:  # an older trainer: the checkpoint it reports (newer, once it saved one)
            resumed = _iteration(live.get("lastCheckpoint") or st.get("lastCheckpoint"))
        return max(0, (st.get("iteration") or 0) - resumed)
    return 0


def _hang_seconds(obs: Observed, action: Action) -> float:
    """A hang this decision learned of: the seconds its gang sat without progress before it was found."""
    hang = action.status.get("lastHang")
    if not isinstance(hang, dict) or hang == obs.status.get("lastHang"):
        return 0.0
    idle = hang.get("idleSeconds")
    return float(idle) if isinstance(idle, (int, float)) else 0.0


def _iteration(ckpt: object) -> int:
    value = ckpt.get("iteration") if isinstance(ckpt, dict) else None
    return value if isinstance(value, int) else 0


def with_goodput(job: Job | None, obs: Observed, action: Action) -> Action:
    """`action` with the ledger in its status patch, when the patch goes out anyway, the job runs (its progress
    is patched every few seconds) or its pods were just placed: an idle job's ledger costs no API request, it
    catches up at the next change."""
    running = "Running" in (obs.status.get("phase"), action.phase)
    held = obs.status.get("goodput") or Goodput()
    placed = held.get("waiting", True) != _waiting(obs, obs.status)  # the pods were just placed (or lost)
    if not (action.status or running or placed):
        return action
    patch = account(job, obs, action)
    if not patch or (not action.status and patch["goodput"] == held):
        return action  # nothing changed, nothing written
    return replace(action, status={**action.status, **patch})
