"""decide(job, observed) -> Action: the operator's whole policy as one pure function.

The kopf layer (handlers.py) gathers observations (gather.py into kubetron_operator.observe's views: the
job's status, its pods, the nodes they run on, the progress log, rank 0's live numbers) and applies the
returned action (apply.py: delete pods, create an attempt, patch status, post events). Everything decide
needs is in `observed`, the clock too; everything it must remember goes into the status patch (counters,
`nextAttemptTime`, `avoidNodes`), so a restarted operator carries on exactly where the last one stopped.

This module only dispatches; each concern has its own module under policy/ (see policy/__init__.py):
what decides a restart is policy/restart.py, how an attempt ended policy/attempt_end.py, start-up
policy/start.py, elastic sizes policy/elastic.py, finished and suspended jobs policy/lifecycle.py.
A finished job is never rerun.
"""

from __future__ import annotations

from dataclasses import replace

from kubetron.contract.resource import FINISHED

from kubetron_operator.job_status import StatusPatch
from kubetron_operator.model import Job
from kubetron_operator.observe import Observed
from kubetron_operator.policy import elastic, lifecycle, start
from kubetron_operator.policy.action import Action, Event
from kubetron_operator.policy.attempt_end import attempt_end
from kubetron_operator.policy.goodput import with_goodput
from kubetron_operator.policy.kueue import released
from kubetron_operator.policy.nodes import with_node_strikes
from kubetron_operator.policy.recovery import recovery_news, replace_lost
from kubetron_operator.policy.status import in_place_news, phase_status, progress_fields
from kubetron_operator.policy.store import store_condition
from kubetron_operator.trainer_reports.merge import known_checkpoint


def decide(job: Job | None, obs: Observed) -> Action:
    """The next step for `job` (None when its spec does not parse; obs.spec_error then says why)."""
    action = store_condition(obs, _decide(job, obs))
    action = with_node_strikes(job, obs, action)  # nodes that keep failing are left out
    action = with_goodput(job, obs, action)  # the ledger of where the job's time went (policy/goodput.py)
    release = released(obs, action)
    if release:
        action = replace(action, release_pods=release)
    return replace(action, create_job_objects=True) if start.needs_job_objects(obs, action) else action


def _decide(job: Job | None, obs: Observed) -> Action:
    st = obs.status
    phase = st.get("phase") or ""
    if phase in FINISHED:
        return lifecycle.finished(job, obs)
    if job is None:
        return lifecycle.invalid_spec(obs)
    deadline = lifecycle.deadline_exceeded(job, obs)
    if deadline is not None:
        return deadline
    if job.spec.suspend:
        return lifecycle.suspend(obs)
    attempt = st.get("attempt") or 0
    if attempt == 0 or phase in ("Restarting", "Suspended"):
        return start.next_attempt(job, obs)
    return _running(job, obs, attempt)


def _running(job: Job, obs: Observed, attempt: int) -> Action:
    """The current attempt exists: has it ended, is it still starting, may it grow; else its progress."""
    current = [p for p in obs.pods if p.role == "worker" and p.attempt == attempt]
    stale = tuple(p.name for p in obs.pods if p.attempt != attempt and p.deleting_for is None
                  and (p.role == "worker" or p.attempt < attempt))
    ckpt = known_checkpoint(obs, attempt)
    replaced = replace_lost(job, obs, attempt, current)  # a vanished pod created again (policy/recovery.py)
    if replaced is not None:
        return replaced
    ended = attempt_end(job, current, obs, ckpt)
    if ended is not None:
        return ended
    size = elastic.attempt_size(job, obs.status)
    running = len(current) == size and all(p.phase in ("Running", "Succeeded") for p in current)
    if not running:
        return start.starting(job, obs, attempt, current, ckpt, stale)
    if size < job.spec.nodes:
        probes = [p for p in obs.pods if p.role == "probe" and p.attempt == attempt]
        if elastic.placed(probes, range(size, job.spec.nodes)):
            nodes = ", ".join(sorted({p.node for p in probes}))
            return elastic.resize(job, obs, current, ckpt, job.spec.nodes, f"{len(probes)} probe pod(s) scheduled "
                                  f"on {nodes}: capacity for the full size returned")
    status: StatusPatch = phase_status(obs, "Running", "Running", "") if obs.status.get("phase") != "Running" else {}
    status.update(progress_fields(obs, ckpt))
    status = {k: v for k, v in status.items() if obs.status.get(k) != v}
    events = (Event("Normal", "Running", f"attempt {attempt}: all {size} pods running"),) if (
        "phase" in status) else ()
    restarts, in_place = in_place_news(obs, attempt, job.spec.max_in_place_restarts)
    recovered, recovery_events = recovery_news(obs, attempt)
    action = Action("wait", status={**status, **restarts, **recovered}, delete_pods=stale,
                    events=events + in_place + recovery_events)
    return elastic.keep_probes(job, obs, attempt, size, action) if size < job.spec.nodes else action
