"""decide(job, observed) -> Action: the operator's whole policy as one pure function.

The kopf layer gathers observations (the job's status, its pods, the progress log, rank 0's live
numbers) and applies the returned action (delete pods, create an attempt, patch status, post events).
Everything decide needs is in `observed`; everything it must remember goes into the status patch, so a
restarted operator carries on exactly where the last one stopped.

How an attempt ends (gang semantics: the first pod to end ends the attempt):
- config error (exit 2 anywhere)                                  -> Failed now, the trainer's message
- preempted: DisruptionTarget, eviction, node lost, pod deleted by someone else or missing, exit 75
  (saved on SIGTERM) or 76 (exit condition reached, saved)        -> restart, free
- anything else that fails (trainer error, OOMKilled, ...)        -> restart, counts toward backoffLimit
- every rank exited 0 and the progress log (or the ranks' termination messages) says train_iters was
  reached                                                         -> Succeeded
Preemption wins over failures seen in the same attempt: when one rank is killed the others fail with
peer errors. Attempts that ran but ended with no new checkpoint, maxNoProgressAttempts in a row, are a
crash loop -> Failed (NoProgress). A finished job is never rerun.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from kubetron import exitcodes

from kubetron_operator.build import LABEL_ATTEMPT, LABEL_RANK, LABEL_ROLE
from kubetron_operator.model import Job, PvcStorage

FINISHED = ("Succeeded", "Failed")
PREEMPT_POD_REASONS = frozenset({"Evicted", "NodeLost", "Preempting", "Shutdown", "NodeShutdown", "Terminated",
                                 "NodeAffinity", "UnexpectedAdmissionError"})
FREE_EXIT_CODES = {exitcodes.SAVED_ON_SIGNAL: "SavedOnSignal", exitcodes.EXIT_CONDITION: "ExitCondition"}
READER_TIMEOUT = 180.0  # seconds a progress-reader pod may take before we go on without it
FORCE_DELETE_AFTER = 60.0  # seconds past a pod's grace period before it is force-deleted (node lost)


# -- observations --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodView:
    """What decide needs to know about one child pod."""

    name: str
    attempt: int
    rank: int = 0
    role: str = "worker"  # worker | progress-reader
    phase: str = "Pending"  # Pending | Running | Succeeded | Failed | Unknown
    exit_code: int | None = None  # the trainer container's, once terminated
    reason: str = ""  # the container's terminated reason: OOMKilled, Error, Completed, ...
    pod_reason: str = ""  # status.reason: Evicted, NodeLost, ...
    disrupted: str = ""  # reason of a DisruptionTarget condition that is True, else ""
    deleting_for: float | None = None  # seconds since deletionTimestamp; None when not being deleted
    started: bool = False  # a container of it ever ran
    created_for: float = 0.0  # seconds since creationTimestamp
    termination: Mapping[str, Any] | None = None  # the trainer's termination message (JSON)
    log: str = ""  # a progress-reader's output (filled by the handler only when it Succeeded)
    ip: str = ""

    @property
    def code(self) -> int | None:
        """The trainer's exit code: its termination message says it best (torchrun may mask it)."""
        term = self.termination or {}
        if isinstance(term.get("exitCode"), int) and self.phase in ("Failed", "Succeeded"):
            return term["exitCode"]
        return self.exit_code

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any], now: datetime) -> PodView:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        term_state, started, exit_code, reason, message = {}, False, None, "", ""
        for cs in status.get("containerStatuses") or ():
            state = cs.get("state") or {}
            started = started or "running" in state or bool((state.get("terminated") or {}).get("startedAt"))
            if "terminated" in state:
                term_state = state["terminated"] or {}
                exit_code = term_state.get("exitCode")
                reason = term_state.get("reason") or ""
                message = term_state.get("message") or ""
        disrupted = ""
        for cond in status.get("conditions") or ():
            if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
                disrupted = cond.get("reason") or "DisruptionTarget"
        deleting = meta.get("deletionTimestamp")
        return cls(
            name=meta.get("name", ""),
            attempt=_to_int(labels.get(LABEL_ATTEMPT)),
            rank=_to_int(labels.get(LABEL_RANK)),
            role=labels.get(LABEL_ROLE, "worker"),
            phase=status.get("phase") or "Pending",
            exit_code=exit_code,
            reason=reason,
            pod_reason=status.get("reason") or "",
            disrupted=disrupted,
            deleting_for=_age(deleting, now) if deleting else None,
            started=started or status.get("phase") in ("Running", "Succeeded"),
            created_for=_age(meta.get("creationTimestamp"), now),
            termination=parse_termination_message(message),
            ip=status.get("podIP") or "",
        )


def parse_termination_message(text: str) -> dict[str, Any] | None:
    """The trainer's one-line JSON (docs/CONTRACT.md); None for anything else (e.g. a log tail)."""
    for line in reversed((text or "").strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("exitCode"), int):
            return data
    return None


@dataclass(frozen=True)
class Observed:
    now: datetime
    status: Mapping[str, Any] = field(default_factory=dict)  # the job's current .status
    pods: tuple[PodView, ...] = ()  # every pod labelled with the job
    progress: Mapping[str, Any] | None = None  # summarize_events() of the store's log; None if unread
    live: Mapping[str, Any] | None = None  # rank 0's GET /status
    spec_error: str = ""


# -- actions ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Action:
    kind: str  # create | restart | succeed | fail | suspend | wait | delete
    status: dict[str, Any] = field(default_factory=dict)  # merge patch for .status
    delete_pods: tuple[str, ...] = ()
    force_delete_pods: tuple[str, ...] = ()
    create_attempt: int | None = None  # create build(job, create_attempt, expected_iteration)
    expected_iteration: int = 0
    create_reader: int | None = None  # create the progress-reader pod for this attempt
    delete_job: bool = False
    events: tuple[Event, ...] = ()

    @property
    def phase(self) -> str | None:
        return self.status.get("phase")


# -- decide ----------------------------------------------------------------------------------------


def decide(job: Job | None, obs: Observed) -> Action:
    """The next step for `job` (None when its spec does not parse; obs.spec_error then says why)."""
    st = obs.status or {}
    phase = st.get("phase") or ""
    if phase in FINISHED:
        return _finished(job, obs)
    if job is None:
        return _fail(obs, "InvalidSpec", obs.spec_error or "invalid spec")
    deadline = job.spec.active_deadline_seconds
    start = _parse_time(st.get("startTime"))
    if deadline and start and (obs.now - start).total_seconds() > deadline and not job.spec.suspend:
        return _fail(obs, "DeadlineExceeded", f"activeDeadlineSeconds ({deadline}s) exceeded")
    if job.spec.suspend:
        return _suspend(obs)
    attempt = int(st.get("attempt") or 0)
    if attempt == 0 or phase in ("Restarting", "Suspended"):
        return _next_attempt(job, obs)
    return _running(job, obs, attempt)


def _finished(job: Job | None, obs: Observed) -> Action:
    """Never create anything again. Stop what still runs; delete the job once its TTL is up."""
    active = tuple(p.name for p in obs.pods if not p.terminated and p.deleting_for is None)
    ttl = job.spec.ttl_seconds_after_finished if job else None
    done = _parse_time(obs.status.get("completionTime"))
    if ttl is not None and done and obs.now >= done + timedelta(seconds=ttl):
        return Action("delete", delete_job=True, delete_pods=active,
                      events=(Event("Normal", "TTLExpired", f"deleting the job {ttl}s after it finished"),))
    return Action("wait", delete_pods=active)


def _suspend(obs: Observed) -> Action:
    st = obs.status
    alive = [p for p in obs.pods if p.deleting_for is None and not (p.role == "worker" and p.terminated)]
    deleting = [p for p in obs.pods if p.deleting_for is not None]
    status: dict[str, Any] = {}
    events: tuple[Event, ...] = ()
    if st.get("phase") != "Suspended":
        status = _phase_status(obs, "Suspended", "Suspended", "spec.suspend is true: pods deleted, job kept")
        events = (Event("Normal", "Suspended", "spec.suspend set: deleting the pods; the job resumes from its"
                                               " last checkpoint when unsuspended"),)
    if not alive and not deleting and not status:
        return Action("wait")
    return Action("suspend", status=status, delete_pods=tuple(p.name for p in alive),
                  force_delete_pods=_overdue(obs), events=events)


def _next_attempt(job: Job, obs: Observed) -> Action:
    """Start attempt k+1 once every pod of attempts <= k is gone and the last checkpoint is known."""
    st = obs.status
    attempt = int(st.get("attempt") or 0)
    old = [p for p in obs.pods if p.role == "worker" and p.attempt <= attempt]
    if old:
        return Action("wait", delete_pods=tuple(p.name for p in old if p.deleting_for is None),
                      force_delete_pods=_overdue(obs))
    ckpt = _known_checkpoint(obs, attempt)
    events: list[Event] = []
    delete: tuple[str, ...] = ()
    unread = ""  # why the progress log could not be read (PVC stores), shown in status.message too
    if isinstance(job.spec.storage, PvcStorage) and attempt > 0:
        reader = next((p for p in obs.pods if p.role == "progress-reader" and p.attempt == attempt), None)
        if reader is None:
            return Action("wait", create_reader=attempt)
        summary = _parse_json(reader.log) if reader.phase == "Succeeded" else None
        if summary is not None:
            ckpt = _max_ckpt(ckpt, summary.get("lastCheckpoint"))
        elif reader.phase in ("Succeeded", "Failed") or reader.created_for > READER_TIMEOUT:
            unread = (f"; progress log unread (pod {reader.name}: {_reader_trouble(reader)}), resuming from the "
                      f"last checkpoint seen ({_it(ckpt)})")
            events.append(Event("Warning", "ProgressUnread", unread[2:]))
        else:
            return Action("wait")
        delete = (reader.name,)
    nxt = attempt + 1
    status = _phase_status(obs, "Pending", "AttemptCreated", f"attempt {nxt} created{unread}")
    status.update({
        "attempt": nxt,
        "attemptStartCheckpoint": _it(ckpt),
        "attemptStartTime": _iso(obs.now),
        "lastCheckpoint": ckpt,
        "restarts": _restarts(st),
    })
    if not st.get("startTime"):
        status["startTime"] = _iso(obs.now)
    status.update(_progress_fields(obs, ckpt))
    resume = f", resuming from iteration {_it(ckpt)}" if _it(ckpt) else ""
    events.append(Event("Normal", "AttemptCreated", f"creating attempt {nxt} ({job.spec.nodes} pods){resume}"))
    return Action("create", status=status, create_attempt=nxt, expected_iteration=_it(ckpt),
                  delete_pods=delete, events=tuple(events))


def _running(job: Job, obs: Observed, attempt: int) -> Action:
    current = [p for p in obs.pods if p.role == "worker" and p.attempt == attempt]
    stale = tuple(p.name for p in obs.pods if p.attempt != attempt and p.deleting_for is None
                  and (p.role == "worker" or p.attempt < attempt))
    ckpt = _known_checkpoint(obs, attempt)
    ended = _attempt_end(job, current, obs, ckpt)
    if ended is not None:
        return ended
    phase = "Running" if len(current) == job.spec.nodes and all(
        p.phase in ("Running", "Succeeded") for p in current) else "Pending"
    status = _phase_status(obs, phase, phase, "") if phase != obs.status.get("phase") else {}
    status.update(_progress_fields(obs, ckpt))
    status = {k: v for k, v in status.items() if obs.status.get(k) != v}
    events = (Event("Normal", phase, f"attempt {attempt}: all {job.spec.nodes} pods running"),) if (
        phase == "Running" and "phase" in status) else ()
    return Action("wait", status=status, delete_pods=stale, events=events)


def _attempt_end(job: Job, current: list[PodView], obs: Observed, ckpt: Mapping | None) -> Action | None:
    """Classify the end of the current attempt, or None while it still runs."""
    nodes = job.spec.nodes
    present = {p.rank for p in current}
    missing = sorted(set(range(nodes)) - present)
    preempted: list[str] = [f"pod {job.name}-{obs.status.get('attempt')}-{r} disappeared" for r in missing]
    config_errors, failures = [], []
    for p in sorted(current, key=lambda p: p.rank):
        code = p.code
        if p.disrupted:
            preempted.append(f"pod {p.name} disrupted ({p.disrupted})")
        elif p.pod_reason in PREEMPT_POD_REASONS:
            preempted.append(f"pod {p.name}: {p.pod_reason}")
        elif p.phase == "Unknown":
            preempted.append(f"pod {p.name}: node lost")
        elif p.deleting_for is not None:
            preempted.append(f"pod {p.name} was deleted")
        elif p.terminated and code in FREE_EXIT_CODES:
            preempted.append(f"pod {p.name} exited {code} ({FREE_EXIT_CODES[code]})")
        elif p.phase == "Failed" and code == exitcodes.CONFIG_ERROR:
            config_errors.append(p)
        elif p.phase == "Failed":
            failures.append(p)
    if config_errors:
        p = config_errors[0]
        msg = (p.termination or {}).get("message") or f"pod {p.name} exited 2 (ConfigError)"
        return _fail(obs, "ConfigError", msg)
    if not preempted and not failures:
        if len(current) == nodes and all(p.phase == "Succeeded" for p in current):
            if _completed(obs, current):
                return _succeed(job, obs, ckpt)
            return _restart(job, obs, current, ckpt, free=False, reason="IncompleteExit",
                            message="every rank exited 0 but the progress log does not show train_iters reached")
        return None
    if preempted:
        reason = "ExitCondition" if all("ExitCondition" in m for m in preempted) else "Preempted"
        return _restart(job, obs, current, ckpt, free=True, reason=reason, message="; ".join(preempted))
    return _restart(job, obs, current, ckpt, free=False, **_failure_reason(failures))


def _failure_reason(failures: list[PodView]) -> dict[str, str]:
    """The root cause among failed ranks: a rank's own error beats 'a peer died'."""
    own = [p for p in failures if p.code != exitcodes.PEER_FAILURE] or failures
    p = own[0]
    if p.reason == "OOMKilled":
        return {"reason": "OOMKilled", "message": f"pod {p.name} was OOMKilled: raise "
                "spec.resources.limits.memory or lower the batch size"}
    name = exitcodes.NAMES.get(p.code, "TrainerError") if p.code is not None else "TrainerError"
    detail = (p.termination or {}).get("message") or p.reason or "failed"
    return {"reason": name, "message": f"pod {p.name} exited {p.code} ({name}): {detail}"}


def _restart(job: Job, obs: Observed, current: list[PodView], ckpt: Mapping | None, *, free: bool,
             reason: str, message: str) -> Action:
    st = obs.status
    restarts = _restarts(st)
    restarts["preemptions" if free else "failures"] += 1
    restarts["total"] = restarts["preemptions"] + restarts["failures"]
    reached = max([_to_int(st.get("iteration"))] + [_to_int((p.termination or {}).get("iteration"))
                                                     for p in current])
    lost = _to_int(st.get("lostIterations")) + max(0, reached - _it(ckpt))
    ran = any(p.started for p in current)
    progressed = _it(ckpt) > _to_int(st.get("attemptStartCheckpoint")) or (
        ckpt is not None and st.get("attemptStartCheckpoint") is None)
    no_progress = 0 if progressed else _to_int(st.get("noProgressAttempts")) + (1 if ran else 0)
    common = {"restarts": restarts, "lostIterations": lost, "noProgressAttempts": no_progress,
              "lastCheckpoint": ckpt}
    attempt = _to_int(st.get("attempt"))
    if not free and restarts["failures"] > job.spec.backoff_limit:
        action = _fail(obs, "BackoffLimitExceeded",
                       f"{restarts['failures']} failures > backoffLimit {job.spec.backoff_limit}; last: {message}")
        action.status.update(common)
        return action
    if no_progress >= job.spec.max_no_progress_attempts:
        action = _fail(obs, "NoProgress", f"{no_progress} attempts in a row ended without a new checkpoint "
                       f"(last checkpoint: iteration {_it(ckpt)}); last: {message}")
        action.status.update(common)
        return action
    status = _phase_status(obs, "Restarting", reason, message)
    status.update(common)
    status.update(_progress_fields(obs, ckpt, live=False))
    kind = "preemption" if free else f"failure {restarts['failures']}/{job.spec.backoff_limit}"
    return Action("restart", status=status,
                  delete_pods=tuple(p.name for p in current if p.deleting_for is None),
                  force_delete_pods=_overdue(obs),
                  events=(Event("Warning", reason, f"attempt {attempt} ended ({kind}): {message}; "
                                f"restarting from iteration {_it(ckpt)}"),))


def _succeed(job: Job, obs: Observed, ckpt: Mapping | None) -> Action:
    status = _phase_status(obs, "Succeeded", "Completed", "train_iters reached")
    status.update(_progress_fields(obs, ckpt, live=False))
    train_iters = status.get("trainIters")
    if train_iters:
        status.update(iteration=train_iters, progress="100%")
    status.update(completionTime=_iso(obs.now), eta="0s", lastCheckpoint=ckpt)
    return Action("succeed", status=status,
                  events=(Event("Normal", "Succeeded", f"training completed at iteration {status.get('iteration')}"),))


def _fail(obs: Observed, reason: str, message: str) -> Action:
    status = _phase_status(obs, "Failed", reason, message)
    status.update(completionTime=_iso(obs.now), eta=None)
    active = tuple(p.name for p in obs.pods if not p.terminated and p.deleting_for is None)
    return Action("fail", status=status, delete_pods=active, events=(Event("Warning", reason, message),))


def _reader_trouble(reader: PodView) -> str:
    if reader.phase == "Pending":
        return f"not finished after {READER_TIMEOUT:.0f}s"
    detail = reader.log.strip().splitlines()[-1][:200] if reader.log.strip() else reader.reason or "no output"
    return f"{reader.phase.lower()}, exit {reader.exit_code}: {detail}"


# -- children that could not be created (the handler tore down what it had made) ----------------------

CREATE_BACKOFF = (10.0, 300.0)  # seconds: the first retry's delay, doubling up to the cap (as Kubernetes Job)


def create_failed(obs: Observed, reason: str, message: str, transient: bool) -> Action:
    """A transient API error (quota exceeded, throttled, server error) retries with exponential backoff,
    shown in status (createFailures, nextCreateTime); anything else fails the job with `reason`."""
    if not transient:
        return _fail(obs, reason, message)
    failures = _to_int(obs.status.get("createFailures")) + 1
    delay = min(CREATE_BACKOFF[1], CREATE_BACKOFF[0] * 2 ** (failures - 1))
    phase = "Restarting" if _to_int(obs.status.get("attempt")) else "Pending"
    status = _phase_status(obs, phase, reason, f"{message}; retry {failures} in {format_duration(delay)}")
    status.update(createFailures=failures, nextCreateTime=_iso(obs.now + timedelta(seconds=delay)))
    return Action("wait", status=status, events=(Event("Warning", reason, status["message"]),))


# -- helpers -------------------------------------------------------------------------------------------


def _completed(obs: Observed, current: list[PodView]) -> bool:
    """train_iters reached: the progress log or a rank's termination message says so.

    When neither says anything about train_iters (log unreadable, no messages), exit code 0 is the
    trainer's word for "completed" (docs/CONTRACT.md) and is taken.
    """
    known = False
    log = obs.progress or {}
    if log.get("trainIters") or log.get("completed"):
        known = True
        if log.get("completed") or _to_int(log.get("iteration")) >= int(log["trainIters"]):
            return True
    for p in current:
        term = p.termination or {}
        if term.get("trainIters"):
            known = True
            if _to_int(term.get("iteration")) >= int(term["trainIters"]):
                return True
    return not known


def _known_checkpoint(obs: Observed, attempt: int) -> dict[str, Any] | None:
    """The newest durable checkpoint any source reports (status, log, live endpoint, termination messages)."""
    best = _max_ckpt(None, obs.status.get("lastCheckpoint"))
    best = _max_ckpt(best, (obs.progress or {}).get("lastCheckpoint"))
    best = _max_ckpt(best, (obs.live or {}).get("lastCheckpoint"))
    for p in obs.pods:
        term_ckpt = (p.termination or {}).get("lastCheckpoint")
        if isinstance(term_ckpt, int) and p.attempt <= attempt:
            best = _max_ckpt(best, {"iteration": term_ckpt, "time": _iso(obs.now)})
    return best


def _max_ckpt(a: Mapping | None, b: Any) -> dict[str, Any] | None:
    if not isinstance(b, Mapping) or not isinstance(b.get("iteration"), int):
        return dict(a) if a else None
    if a is None or b["iteration"] > a["iteration"]:
        return {"iteration": b["iteration"], "time": b.get("time")}
    return dict(a)


def _progress_fields(obs: Observed, ckpt: Mapping | None, live: bool = True) -> dict[str, Any]:
    """iteration / trainIters / progress / eta / tokensPerSecond for `kubectl get`."""
    st, log, now_live = obs.status, obs.progress or {}, (obs.live or {}) if live else {}
    iteration = max(_to_int(now_live.get("iteration")), _to_int(log.get("iteration")),
                    _to_int(st.get("iteration")), _it(ckpt))
    train_iters = now_live.get("trainIters") or log.get("trainIters") or st.get("trainIters")
    out: dict[str, Any] = {"iteration": iteration, "lastCheckpoint": ckpt}
    if train_iters:
        out["trainIters"] = int(train_iters)
        out["progress"] = f"{min(100, math.floor(100 * iteration / int(train_iters)))}%"
    if live:
        eta = now_live.get("etaSeconds")
        out["eta"] = format_duration(eta) if isinstance(eta, int | float) else st.get("eta")
        tps = now_live.get("tokensPerSecond")
        if isinstance(tps, int | float):
            out["tokensPerSecond"] = round(float(tps), 1)
    else:
        out["eta"] = None
    return out


def _phase_status(obs: Observed, phase: str, reason: str, message: str) -> dict[str, Any]:
    return {"phase": phase, "reason": reason, "message": message,
            "conditions": _conditions(obs.status.get("conditions") or [], phase, reason, message, obs.now)}


def _conditions(old: list, phase: str, reason: str, message: str, now: datetime) -> list[dict[str, Any]]:
    """One condition per phase ever reached; the current one True, the others False."""
    out, seen = [], False
    for cond in old:
        cond = dict(cond)
        is_now = cond.get("type") == phase
        seen = seen or is_now
        want = "True" if is_now else "False"
        if cond.get("status") != want:
            cond["lastTransitionTime"] = _iso(now)
        cond["status"] = want
        if is_now:
            cond.update(reason=reason, message=message)
        out.append(cond)
    if not seen:
        out.append({"type": phase, "status": "True", "reason": reason, "message": message,
                    "lastTransitionTime": _iso(now)})
    return out


def _restarts(st: Mapping[str, Any]) -> dict[str, int]:
    r = st.get("restarts") or {}
    p, f = _to_int(r.get("preemptions")), _to_int(r.get("failures"))
    return {"preemptions": p, "failures": f, "total": p + f}


def _overdue(obs: Observed) -> tuple[str, ...]:
    """Pods still terminating long past any grace period (their node is gone): force-delete them."""
    return tuple(p.name for p in obs.pods if p.deleting_for is not None and p.deleting_for > FORCE_DELETE_AFTER)


def format_duration(seconds: float) -> str:
    """1h2m, 3m20s, 45s."""
    s = max(0, round(seconds))
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60}m"
    if s >= 60:
        return f"{s // 60}m{s % 60}s"
    return f"{s}s"


def _it(ckpt: Mapping | None) -> int:
    return int(ckpt["iteration"]) if ckpt else 0


def _to_int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _parse_json(text: str) -> dict[str, Any] | None:
    """The JSON object a reader pod printed. Its log (pods/log) holds stderr too, so a warning line
    before or after the object must not make it unreadable: the last object that starts a line wins."""
    decoder = json.JSONDecoder()
    text = text or ""
    starts = [i for i in range(len(text)) if text[i] == "{" and (i == 0 or text[i - 1] == "\n")]
    for start in reversed(starts):
        try:
            data, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(data, dict):
            return data
    return None


def _iso(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def _age(stamp: Any, now: datetime) -> float:
    when = _parse_time(stamp)
    return max(0.0, (now - when).total_seconds()) if when else 0.0
