"""Elastic node range (spec.minNodes < spec.nodes, docs/elastic.md): an attempt's size is status.nodes.

A starting attempt whose pods are Unschedulable for shrinkAfterSeconds ends (Resized) and the next one
runs on the largest admitted size (spec.sizes) not above the pods the scheduler did place. While an
attempt runs smaller than spec.nodes, one probe pod per missing rank (role probe) asks the scheduler;
once every probe is bound to a node the attempt ends (Resized: its trainers save on SIGTERM) and the
next one runs at spec.nodes. Any other restart tries spec.nodes again. Resizes have no backoff and
count only in status.resizes.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Literal

from kubetron.contract.progress import CheckpointRef

from kubetron_operator.job_status import JobStatus, Resizes
from kubetron_operator.model import Job
from kubetron_operator.observe import Observed, PodView
from kubetron_operator.policy.action import Action, Event
from kubetron_operator.policy.lifecycle import overdue
from kubetron_operator.policy.status import in_place_news, phase_status, progress_fields
from kubetron_operator.trainer_reports.merge import reached_iteration


def attempt_size(job: Job, status: JobStatus) -> int:
    """Pods of the current attempt: status.nodes (an elastic job's attempt may be smaller than spec.nodes)."""
    return status.get("nodes") or job.spec.nodes


def placed(probes: list[PodView], ranks: range) -> bool:
    """A live probe for every missing rank, each bound to a node by the scheduler."""
    by_rank = {p.rank: p for p in probes if p.alive and p.node}
    return bool(ranks) and all(r in by_rank for r in ranks)


def keep_probes(job: Job, obs: Observed, attempt: int, size: int, action: Action) -> Action:
    """While an attempt runs on fewer than spec.nodes pods: one probe pod per missing rank (created, or
    deleted to be created again when it ended), so the real scheduler says when the full size fits."""
    probes = {p.rank: p for p in obs.pods if p.role == "probe" and p.attempt == attempt}
    ended = tuple(p.name for p in probes.values() if not p.alive and p.deleting_for is None)
    missing = tuple(r for r in range(size, job.spec.nodes) if r not in probes)
    return replace(action, delete_pods=action.delete_pods + ended, create_probes=missing)


def resize(job: Job, obs: Observed, current: list[PodView], ckpt: CheckpointRef | None, to: int, why: str) -> Action:
    """End the current attempt so the next one runs on `to` pods; neither a failure nor a preemption: no
    backoff, no counter but status.resizes. Deleting the pods SIGTERMs the trainers, which save and exit
    (exit 75), so the next attempt resumes from the iteration they reached."""
    st = obs.status
    attempt, size = st.get("attempt") or 0, attempt_size(job, st)
    kind: Literal["grows", "shrinks"] = "grows" if to > size else "shrinks"
    resizes: Resizes = {"shrinks": 0, "grows": 0, **(st.get("resizes") or Resizes())}
    resizes[kind] = (resizes.get(kind) or 0) + 1
    message = f"attempt {attempt}: {size} -> {to} nodes: {why}"
    status = phase_status(obs, "Restarting", "Resized", message)
    status.update(progress_fields(obs, ckpt, live=False))
    in_place, _ = in_place_news(obs, attempt, job.spec.max_in_place_restarts)
    status.update(in_place, resizeTo=to, resizes=resizes, lastCheckpoint=ckpt, nextAttemptTime=None,
                  lastAttemptIteration=reached_iteration(obs, attempt, current))
    return Action("restart", status=status, delete_pods=tuple(p.name for p in current if p.deleting_for is None),
                  force_delete_pods=overdue(obs),
                  events=(Event("Normal", "Resized", f"{message}; restarting from the newest checkpoint"),))


def shrink_due(job: Job, obs: Observed, current: list[PodView], began: datetime | None) -> float | None:
    """Seconds until a starting attempt with Unschedulable pods is shrunk (<= 0: now); None when it is not
    shrinkable (already at the smallest size, no pod Unschedulable)."""
    size = attempt_size(job, obs.status)
    if began is None or size <= (job.spec.sizes or (size,))[0] or not any(p.unschedulable for p in current):
        return None
    return shrink_after(job)[0] - (obs.now - began).total_seconds()


def shrink_after(job: Job) -> tuple[int, str]:
    """(seconds, the setting they come from) pods the elastic rule waits on may stay Unschedulable before the
    job shrinks: shrinkAfterSeconds, or startupTimeoutSeconds when that is shorter (it would otherwise end
    every attempt at full size as StartupTimeout first, and the job would never shrink)."""
    return min((job.spec.shrink_after_seconds, "shrinkAfterSeconds"),
               (job.spec.startup_timeout_seconds, "startupTimeoutSeconds"))


def shrink_to(job: Job, current: list[PodView], size: int) -> int:
    """The largest size below `size` the scheduler has shown it can place (the pods it bound to nodes);
    the smallest size when it placed fewer than that."""
    placed = len([p for p in current if p.node])
    smaller = [n for n in job.spec.sizes if n < size]
    return max([n for n in smaller if n <= placed], default=smaller[0])
