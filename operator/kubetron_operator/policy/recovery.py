"""Recovery from memory (docs/recovery.md): a lost pod replaced inside its attempt, and status.lastRecovery.

A lost pod. With memory snapshots and their copies on peers, a pod that vanished (deleted without a grace
period, its node gone: the pod object is gone or its node lost) while every other pod of the attempt still
runs is created again, with the same name, in the same attempt (`replace_lost`): the other pods' agents,
restarting their ranks after the peer failure, wait in their next rendezvous round for it, and the gang then
resumes from the pods' memory, the new pod's ranks from the copies its peers hold. Not when the pod is
rank 0's (it hosts the rendezvous), nor once the attempt's in-place restarts (maxInPlaceRestarts) are spent,
nor for a pod that ends gracefully (a SIGTERM: its ranks save, and the gang restarts from that checkpoint).
Those end the attempt as before (policy/attempt_end.py). The replacement has startupTimeoutSeconds to run.
A pod being deleted with no grace period (0 s: its kubelet kills it at once, nothing is saved) is as good as
gone: the job waits for its object to go (at most VANISHING seconds, then the attempt ends as for any deleted
pod), then creates it again; it is not a preemption because the operator looked while its kubelet confirmed.

status.lastRecovery: rank 0 reports how its process resumed (`recovery` on its status endpoint): from memory,
a peer's copy or the store (and why not from memory). The operator records each new one with its kind
(inPlace, podReplaced, newAttempt) and posts an event: `Recovered`, or a Warning `RecoveredFromStore` when a
snapshot the gang agreed on failed its checks (torn, corrupted). A gang that found nothing to load (the store
held no checkpoint yet) after a restart or a failed snapshot is reported too, from the store at iteration 0.
"""

from __future__ import annotations

from kubetron.contract.recovery import IN_PLACE, NEW_ATTEMPT, POD_REPLACED, STORE, LastRecovery
from kubetron.contract.times import stamp

from kubetron_operator.job_status import StatusPatch
from kubetron_operator.model import Job
from kubetron_operator.observe import NO_LIVE, Observed, PodView
from kubetron_operator.policy.action import Action, Event
from kubetron_operator.policy.elastic import attempt_size
from kubetron_operator.policy.status import restart_counts

VANISHING = 30.0  # seconds a pod deleted with no grace period may linger before its attempt ends as any deleted pod's


def replace_lost(job: Job, obs: Observed, attempt: int, current: list[PodView]) -> Action | None:
    """Create again the pods of the attempt that vanished while the rest still run (module docstring), or
    None: the attempt's end is attempt_end's to classify."""
    spec, st = job.spec, obs.status
    if not spec.peer_copies or attempt < 1:
        return None
    size = attempt_size(job, st)
    vanishing = [p for p in current if p.no_grace and (p.deleting_for or 0.0) < VANISHING]
    others = [p for p in current if p not in vanishing]
    lost = sorted(set(range(size)) - {p.rank for p in others})
    if not lost or 0 in lost or any(not p.alive or p.phase != "Running" for p in others):
        return None
    used = (st.get("attemptInPlaceRestarts") or 0) + (st.get("attemptPodReplacements") or 0)
    if used >= spec.max_in_place_restarts:
        return None
    if vanishing:  # created again once its object is gone (its deletion wakes the job)
        return Action("wait", why=f"pod {', '.join(p.name for p in vanishing)} deleted with no grace period: "
                                  "created again once it is gone")
    names = ", ".join(f"{job.name}-{attempt}-{r}" for r in lost)
    replaced = (st.get("attemptPodReplacements") or 0) + len(lost)
    restarts = restart_counts(st)
    restarts["podsReplaced"] = (restarts.get("podsReplaced") or 0) + len(lost)
    status: StatusPatch = {"attemptPodReplacements": replaced, "restarts": restarts,
                           "attemptStartTime": stamp(obs.now)}  # the replacement has startupTimeoutSeconds to run
    event = Event("Warning", "PodReplaced", f"attempt {attempt}: pod {names} vanished while the others ran: created "
                                            f"again; the gang resumes from the pods' memory (its copies on peers)")
    return Action("wait", status=status, replace_ranks=tuple(lost), events=(event,))


def recovery_news(obs: Observed, attempt: int) -> tuple[StatusPatch, tuple[Event, ...]]:
    """status.lastRecovery when rank 0 reports a recovery not recorded yet, and its event."""
    reported = (obs.live or NO_LIVE).get("recovery")
    st = obs.status
    held: dict = dict(st.get("lastRecovery") or {})
    if reported is None or (held.get("attempt"), held.get("restart")) == (attempt, reported["restart"]):
        return {}, ()
    replaced = st.get("attemptPodReplacements") or 0
    before = held.get("replacements", 0) if held.get("attempt") == attempt else 0
    before = before if isinstance(before, int) else 0
    kind = NEW_ATTEMPT if not reported["restart"] else POD_REPLACED if replaced > before else IN_PLACE
    new = LastRecovery(kind=kind, loadedFrom=reported["loadedFrom"], iteration=reported["iteration"],
                       seconds=reported["seconds"], reason=reported["reason"], attempt=attempt,
                       restart=reported["restart"])
    record = {**new, "replacements": replaced}
    how = {IN_PLACE: "restarted in place", POD_REPLACED: "restarted with a replaced pod",
           NEW_ATTEMPT: "started"}[kind]
    why = f" ({reported['reason']})" if reported["reason"] else ""
    if reported["loadedFrom"] == STORE and not reported["iteration"]:  # nothing anywhere to resume from
        text = (f"attempt {attempt}: the gang {how} at iteration 0 with nothing to resume: not from memory{why}, "
                "and the store holds no checkpoint yet")
    else:
        text = (f"attempt {attempt}: the gang {how}, resumed from the {reported['loadedFrom']}{why} at iteration "
                f"{reported['iteration']} ({reported['seconds']:.1f} s to read its state)")
    if reported["loadedFrom"] == STORE and reported["failed"]:
        return {"lastRecovery": record}, (Event("Warning", "RecoveredFromStore", text),)
    return {"lastRecovery": record}, (Event("Normal", "Recovered", text),)
