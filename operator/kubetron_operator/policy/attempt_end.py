"""How an attempt ended (gang semantics: the first pod to end ends the attempt).

- config error (exit 2 anywhere)                                  -> Failed now, the trainer's message
- preempted: DisruptionTarget, eviction, node lost, pod deleted by someone else or missing, exit 75
  (saved on SIGTERM) or 76 (exit condition reached, saved); and failures (PeerFailure exits ...) while
  a pod of the attempt sits on a node that is not Ready or gone: the node's doing, not the trainer's.
  (A node that is not Ready while every rank still runs ends nothing by itself: it may recover, and
  the node controller evicts its pods if it does not.)             -> restart at once, free
- never started: a node's kubelet rejected a pod at admission (UnexpectedAdmissionError, OutOf<resource>,
  NodeAffinity ...)                                                -> restart after a backoff; counts
  toward maxNeverStartedAttempts (not backoffLimit); nodes that rejected a pod are avoided next time
  (an attempt whose gang never all ran within startupTimeoutSeconds: policy/start.py)
- anything else that fails (trainer error, OOMKilled, an eviction for exceeding the pod's own limits:
  ephemeral storage, an emptyDir sizeLimit)                       -> restart after a backoff, counts
  toward backoffLimit
- every rank exited 0 and the progress log (or the ranks' termination messages) says train_iters was
  reached                                                         -> Succeeded
Preemption wins over failures seen in the same attempt: when one rank is killed the others fail with
peer errors. A PeerFailure is no cause of its own: while only PeerFailures ended and another pod of the attempt
still runs, the attempt waits up to PEER_WAIT for that pod's own end to be seen (its exit reported, its node not
Ready, its deletion; a kubelet reports late after an API server outage, a Node goes NotReady only after the node
controller's grace period), then counts a failure. Pods that still run when the attempt is over are deleted.
"""

from __future__ import annotations

from kubetron.contract import exitcodes
from kubetron.contract.progress import CheckpointRef
from kubetron.contract.times import stamp

from kubetron_operator.model import Job
from kubetron_operator.observe import NO_PROGRESS, Observed, PodView, to_int
from kubetron_operator.policy.action import Action, Event
from kubetron_operator.policy.elastic import attempt_size
from kubetron_operator.policy.hang import HUNG, carry_hang, hang_ended_attempt
from kubetron_operator.policy.lifecycle import fail
from kubetron_operator.policy.restart import restart
from kubetron_operator.policy.status import in_place_news, phase_status, progress_fields

PREEMPT_POD_REASONS = frozenset({"Evicted", "NodeLost", "Preempting", "Shutdown", "NodeShutdown", "Terminated"})
FREE_EXIT_CODES = {exitcodes.SAVED_ON_SIGNAL: "SavedOnSignal", exitcodes.EXIT_CONDITION: "ExitCondition"}
PEER_WAIT = 60.0  # seconds a PeerFailure waits for its cause (longer than Kubernetes' node-monitor grace, 40-50 s)


def attempt_end(job: Job, current: list[PodView], obs: Observed, ckpt: CheckpointRef | None) -> Action | None:
    """Classify the end of the current attempt, or None while it still runs."""
    nodes = attempt_size(job, obs.status)
    present = {p.rank for p in current}
    missing = sorted(set(range(nodes)) - present)
    preempted = [f"pod {job.name}-{obs.status.get('attempt')}-{r} disappeared" for r in missing]
    free, config_errors, failures, rejected = _sort_out(current)
    preempted += free
    if config_errors:
        p = config_errors[0]
        msg = (p.termination or {}).get("message") or f"pod {p.name} exited 2 (ConfigError)"
        return fail(obs, "ConfigError", msg)
    sick = [f"pod {p.name}: {obs.node_trouble[p.node]}" for p in current if p.node in obs.node_trouble]
    if failures and sick:  # peers failing because a node died: the node's doing, not the trainer's
        preempted += sick
    if failures and not preempted and not rejected and awaiting_cause(current, failures):
        return None
    if not preempted and not failures and not rejected:
        if len(current) == nodes and all(p.phase == "Succeeded" for p in current):
            if _completed(obs, current):
                return succeed(job, obs, ckpt)
            return restart(job, obs, current, ckpt, kind="failures", reason="IncompleteExit",
                           message="every rank exited 0 but the progress log does not show train_iters reached")
        return None
    if preempted:
        exit_cond = all("ExitCondition" in m for m in preempted)
        reason = "ExitCondition" if exit_cond else ("NodeNotReady" if sick and preempted == sick else "Preempted")
        return restart(job, obs, current, ckpt, kind="preemptions", reason=reason, message="; ".join(preempted),
                       own_doing=exit_cond)
    if rejected:
        p = rejected[0]
        return restart(job, obs, current, ckpt, kind="neverStarted", reason="AdmissionRejected",
                       message=f"node {p.node or '?'} rejected pod {p.name}: {p.detail}",
                       bad_nodes=tuple(p.node for p in rejected if p.node))
    reason, message = _failure_reason(failures)
    action = restart(job, obs, current, ckpt, kind="failures", reason=reason, message=message)
    if reason == HUNG:  # the pods' watchdogs stopped a hung gang with no in-place restart left
        hung = hang_ended_attempt(obs, obs.status.get("attempt") or 0, current, action.status["restarts"])
        action.status["restarts"] = hung["restarts"]
        carry_hang(action.status, hung)
    return action


def _sort_out(current: list[PodView]) -> tuple[list[str], list[PodView], list[PodView], list[PodView]]:
    """The ended ranks by rank order: (why each preempted one ended, config errors, failures, admission
    rejections); ranks still running are in none."""
    preempted: list[str] = []
    config_errors: list[PodView] = []
    failures: list[PodView] = []
    rejected: list[PodView] = []
    for p in sorted(current, key=lambda p: p.rank):
        code = p.code
        if p.over_limit:  # the job outgrew its own limits: it would again, so it counts
            failures.append(p)
        elif p.disrupted:
            preempted.append(f"pod {p.name} disrupted ({p.disrupted})")
        elif p.pod_reason in PREEMPT_POD_REASONS:
            preempted.append(f"pod {p.name}: {p.detail}")
        elif p.phase == "Unknown":
            preempted.append(f"pod {p.name}: node lost")
        elif p.deleting_for is not None:
            preempted.append(f"pod {p.name} was deleted")
        elif p.terminated and code in FREE_EXIT_CODES:
            preempted.append(f"pod {p.name} exited {code} ({FREE_EXIT_CODES[code]})")
        elif p.phase == "Failed" and code == exitcodes.CONFIG_ERROR:
            config_errors.append(p)
        elif p.rejected:
            rejected.append(p)
        elif p.phase == "Failed":
            failures.append(p)
    return preempted, config_errors, failures, rejected


def awaiting_cause(current: list[PodView], failures: list[PodView]) -> bool:
    """Only PeerFailures ended, less than PEER_WAIT ago (by their containers' finishedAt; none said: no wait), and
    another pod of the attempt still runs: its own end (the cause) is yet to be seen."""
    if any(p.code != exitcodes.PEER_FAILURE or p.ended_for is None for p in failures):
        return False
    running = [p for p in current if not p.terminated and p.phase != "Unknown"]
    return bool(running) and max(p.ended_for for p in failures if p.ended_for is not None) < PEER_WAIT


def _failure_reason(failures: list[PodView]) -> tuple[str, str]:
    """(reason, message) of the root cause among failed ranks: a rank's own error beats 'a peer died'."""
    own = [p for p in failures if p.code != exitcodes.PEER_FAILURE] or failures
    p = next((p for p in own if p.over_limit), own[0])
    if p.over_limit:
        return "EvictedOverLimit", (f"pod {p.name} was evicted for exceeding its own limits: "
                f"{p.pod_message.strip()} Raise spec.resources.limits (ephemeral-storage) or write less locally")
    if p.reason == "OOMKilled":
        return "OOMKilled", f"pod {p.name} was OOMKilled: raise spec.resources.limits.memory or lower the batch size"
    if p.code is None:  # no container ever ended: the kubelet (or whoever failed it) has the words
        return p.pod_reason or "PodFailed", f"pod {p.name} failed: {p.detail}"
    name = exitcodes.reason(p.code)
    return name, f"pod {p.name} exited {p.code} ({name}): {p.detail}"


def _completed(obs: Observed, current: list[PodView]) -> bool:
    """train_iters reached: the progress log or a rank's termination message says so.

    When neither says anything about train_iters (log unreadable, no messages), exit code 0 is the
    trainer's word for "completed" (docs/CONTRACT.md) and is taken.
    """
    known = False
    log = obs.progress or NO_PROGRESS
    train_iters = log.get("trainIters")
    if train_iters or log.get("completed"):
        known = True
        if log.get("completed") or (log.get("iteration") or 0) >= int(train_iters or 0):
            return True
    for p in current:
        term = p.termination or {}
        train_iters = term.get("trainIters")
        if train_iters:
            known = True
            if to_int(term.get("iteration")) >= int(train_iters):
                return True
    return not known


def succeed(job: Job, obs: Observed, ckpt: CheckpointRef | None) -> Action:
    """Succeeded: progress at train_iters (100 %), the last in-place restarts counted, live pods deleted."""
    status = phase_status(obs, "Succeeded", "Completed", "train_iters reached")
    status.update(progress_fields(obs, ckpt, live=False))
    train_iters = status.get("trainIters")
    if train_iters:
        status.update(iteration=train_iters, progress="100%")
    status.update(completionTime=stamp(obs.now), eta="0s", lastCheckpoint=ckpt, nextAttemptTime=None)
    in_place, restarted = in_place_news(obs, obs.status.get("attempt") or 0, job.spec.max_in_place_restarts)
    status.update(in_place)
    return Action("succeed", status=status, delete_pods=tuple(p.name for p in obs.pods if p.alive),
                  events=(*restarted, Event("Normal", "Succeeded",
                                            f"training completed at iteration {status.get('iteration')}")))
