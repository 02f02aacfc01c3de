"""decide(job, observed) -> Action: the operator's whole policy as one pure function.

The kopf layer gathers observations (the job's status, its pods, the nodes they run on, the progress
log, rank 0's live numbers) and applies the returned action (delete pods, create an attempt, patch
status, post events). Everything decide needs is in `observed`; everything it must remember goes into
the status patch (counters, `nextAttemptTime`, `avoidNodes`), so a restarted operator carries on
exactly where the last one stopped.

A pod's outcome is its trainer container's, found by name (PodView.from_pod): a rank has ended once that
container terminated, whatever sidecars still run or how they exited; pods that still run when the
attempt is over are deleted.

How an attempt ends (gang semantics: the first pod to end ends the attempt):
- config error (exit 2 anywhere)                                  -> Failed now, the trainer's message
- preempted: DisruptionTarget, eviction, node lost, pod deleted by someone else or missing, exit 75
  (saved on SIGTERM) or 76 (exit condition reached, saved); and failures (PeerFailure exits ...) while
  a pod of the attempt sits on a node that is not Ready or gone: the node's doing, not the trainer's.
  (A node that is not Ready while every rank still runs ends nothing by itself: it may recover, and
  the node controller evicts its pods if it does not.)             -> restart at once, free
- never started: a node's kubelet rejected a pod at admission (UnexpectedAdmissionError, OutOf<resource>,
  NodeAffinity ...), or the gang was not all running startupTimeoutSeconds after the attempt was
  created (unschedulable, image pull errors, a missing Secret key, a scheduler nobody runs)
                                                                  -> restart after a backoff; counts
  toward maxNeverStartedAttempts (not backoffLimit); nodes that rejected a pod are avoided next time
- anything else that fails (trainer error, OOMKilled, an eviction for exceeding the pod's own limits:
  ephemeral storage, an emptyDir sizeLimit)                       -> restart after a backoff, counts
  toward backoffLimit
- every rank exited 0 and the progress log (or the ranks' termination messages) says train_iters was
  reached                                                         -> Succeeded
Preemption wins over failures seen in the same attempt: when one rank is killed the others fail with
peer errors. A finished job is never rerun.

Backoff (as Kubernetes Job, failures only): a failed or never-started attempt is followed by
10 s * 2^(n-1), at most 6 min, plus up to 20 % jitter (n = failures + never-started attempts so far);
preemptions restart at once. The "not before" time is status.nextAttemptTime.

Crash loops (NoProgress): only attempts that ended by the job's own doing (a failure, or exit 76) count,
and only when they saved no checkpoint newer than the one they resumed from; maxNoProgressAttempts such
attempts in a row -> Failed (NoProgress). Preemptions and never-started attempts neither count nor
reset the streak (an attempt that saved something new does reset it): being preempted while the model
loads is the cluster's doing, not a crash loop. Free restarts are bounded by a streak of their own:
MAX_PREEMPTIONS_WITHOUT_PROGRESS running attempts in a row preempted without a new checkpoint -> Failed
(NoProgress); any new checkpoint resets it, so a job preempted often while it progresses runs on.

Kueue plain pod groups (one per attempt): the members of a group whose attempt is over are marked
retriable-in-group "false" (Action.release_pods) before any of them is deleted, so Kueue frees the quota.

activeDeadlineSeconds counts from status.startTime, which is reset when a suspended job resumes (as
Kubernetes Job does): time spent suspended does not count.

Elastic node range (spec.minNodes < spec.nodes, docs/elastic.md): an attempt's size is status.nodes. A
starting attempt whose pods are Unschedulable for shrinkAfterSeconds ends (Resized) and the next one
runs on the largest admitted size (spec.sizes) not above the pods the scheduler did place. While an
attempt runs smaller than spec.nodes, one probe pod per missing rank (role probe) asks the scheduler;
once every probe is bound to a node the attempt ends (Resized: its trainers save on SIGTERM) and the
next one runs at spec.nodes. Any other restart tries spec.nodes again. Resizes have no backoff and
count only in status.resizes.

status.iteration follows the current attempt (from the checkpoint it resumed from, forward);
lostIterations adds, once per ended attempt, the last iteration that attempt reached minus the
checkpoint the next attempt resumes from.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from kubetron.contract import exitcodes
from kubetron.contract.termination import parse_termination_message
from kubetron.contract.times import format_duration

from kubetron_operator.build import LABEL_ATTEMPT, LABEL_RANK, LABEL_ROLE, READER_CONTAINER
from kubetron_operator.model import KUEUE_GROUP_LABEL, KUEUE_RETRIABLE_ANNOTATION, TRAINER, Job, PvcStorage

FINISHED = ("Succeeded", "Failed")
PREEMPT_POD_REASONS = frozenset({"Evicted", "NodeLost", "Preempting", "Shutdown", "NodeShutdown", "Terminated"})
ADMISSION_POD_REASONS = frozenset({"UnexpectedAdmissionError", "NodeAffinity", "NodeSelectorMismatching",
                                   "NodePorts", "InvalidNodeInfo", "UnknownNode"})
"""Pod reasons of a kubelet admission rejection; `OutOf<resource>` (OutOfnvidia.com/gpu, OutOfcpu ...) too."""
STUCK_WAITING = frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull",
                           "CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
"""Container waiting reasons that do not clear up by themselves (ContainerCreating does)."""
STARTUP_REASONS = frozenset({"Unschedulable", "NotScheduled", "Starting", "Queued", *STUCK_WAITING})
OWN_LIMIT_EVICTIONS = ("exceeds the total limit of containers", "exceeded its local ephemeral storage limit",
                       "Usage of EmptyDir volume")
"""Words of the kubelet's eviction manager (pkg/kubelet/eviction/helpers.go) when a pod outgrew its *own*
limits (pod or container ephemeral-storage, an emptyDir sizeLimit): the job's doing, a failure. Its
node-pressure evictions ("The node was low on resource: ...") stay free preemptions."""
MAIN_CONTAINER = {"worker": TRAINER, "progress-reader": READER_CONTAINER}
FREE_EXIT_CODES = {exitcodes.SAVED_ON_SIGNAL: "SavedOnSignal", exitcodes.EXIT_CONDITION: "ExitCondition"}
READER_TIMEOUT = 180.0  # seconds a progress-reader pod may take before we go on without it
FORCE_DELETE_AFTER = 60.0  # seconds past a pod's grace period before it is force-deleted (node lost)
NOT_SCHEDULED_AFTER = 20.0  # seconds a pod may wait for any scheduler to look at it before we say so
BACKOFF_BASE, BACKOFF_CAP, BACKOFF_JITTER = 10.0, 360.0, 0.2  # seconds, seconds, fraction (as Kubernetes Job)
MAX_AVOID_NODES = 8  # nodes remembered in status.avoidNodes
MAX_PREEMPTIONS_WITHOUT_PROGRESS = 10  # free restarts of running attempts in a row that saved nothing new -> NoProgress


# -- observations --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodView:
    """What decide needs to know about one child pod."""

    name: str
    attempt: int
    rank: int = 0
    role: str = "worker"  # worker | progress-reader
    phase: str = "Pending"  # Pending | Running | Succeeded | Failed | Unknown; the trainer's once it ended
    pod_phase: str = ""  # the pod's own status.phase (a sidecar may keep it Running); "" means as `phase`
    exit_code: int | None = None  # the trainer container's, once terminated
    reason: str = ""  # the container's terminated reason: OOMKilled, Error, Completed, ...
    pod_reason: str = ""  # status.reason: Evicted, NodeLost, OutOfnvidia.com/gpu, ...
    pod_message: str = ""  # status.message: the kubelet's or the evicter's words
    disrupted: str = ""  # reason of a DisruptionTarget condition that is True, else ""
    deleting_for: float | None = None  # seconds since deletionTimestamp; None when not being deleted
    started: bool = False  # a container of it ever ran
    created_for: float = 0.0  # seconds since creationTimestamp
    termination: Mapping[str, Any] | None = None  # the trainer's termination message (JSON)
    term_text: str = ""  # the last line of a termination message that is not the trainer's JSON
    log: str = ""  # a progress-reader's output (filled by the handler only when it Succeeded)
    ip: str = ""
    node: str = ""  # spec.nodeName, once scheduled
    unschedulable: str = ""  # the message of PodScheduled=False, else ""
    scheduler_seen: bool = False  # any PodScheduled condition at all (a scheduler looked at the pod)
    waiting: str = ""  # "Reason: message" of a container stuck waiting (STUCK_WAITING), else ""
    scheduler: str = ""  # spec.schedulerName
    gates: tuple[str, ...] = ()  # spec.schedulingGates: held back by an admission controller (Kueue), not stuck
    kueue_group: str = ""  # label kueue.x-k8s.io/pod-group-name: a member of a Kueue plain pod group
    retriable: bool = True  # annotation kueue.x-k8s.io/retriable-in-group is not "false" (Kueue keeps the group)

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

    @property
    def alive(self) -> bool:
        """The pod itself still runs (a sidecar may outlive the trainer) and nobody is deleting it."""
        return (self.pod_phase or self.phase) not in ("Succeeded", "Failed") and self.deleting_for is None

    @property
    def over_limit(self) -> bool:
        """Evicted by its kubelet for exceeding its own limits (not for the node's sake)."""
        return self.pod_reason == "Evicted" and any(w in self.pod_message for w in OWN_LIMIT_EVICTIONS)

    @property
    def rejected(self) -> bool:
        """A node's kubelet refused to admit the pod (it never ran there)."""
        return self.phase == "Failed" and not self.started and (
            self.pod_reason in ADMISSION_POD_REASONS or self.pod_reason.startswith("OutOf"))

    @property
    def detail(self) -> str:
        """The best words for why it ended: the trainer's message, else the kubelet's."""
        term = (self.termination or {}).get("message")
        if term:
            return str(term)
        kubelet = ": ".join(x for x in (self.pod_reason, self.pod_message) if x)
        return kubelet or self.term_text or self.reason or "failed"

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any], now: datetime) -> PodView:
        meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        role = labels.get(LABEL_ROLE, "worker")
        # Init containers too (names are unique across both lists): a native sidecar or an init container
        # that cannot be pulled holds the pod as surely as the trainer's image.
        states = {cs.get("name"): cs.get("state") or {} for key in ("initContainerStatuses", "containerStatuses")
                  for cs in status.get(key) or ()}
        started = any("running" in st or (st.get("terminated") or {}).get("startedAt") for st in states.values())
        stuck = [st["waiting"] for st in states.values() if (st.get("waiting") or {}).get("reason") in STUCK_WAITING]
        waiting = f"{stuck[0]['reason']}: {stuck[0].get('message') or ''}".rstrip(": ") if stuck else ""
        # The trainer by name, never by position: containerStatuses are sorted by name, sidecars included.
        term_state = states.get(MAIN_CONTAINER.get(role, TRAINER), {}).get("terminated")
        exit_code = (term_state or {}).get("exitCode")
        reason, message = (term_state or {}).get("reason") or "", (term_state or {}).get("message") or ""
        pod_phase = status.get("phase") or "Pending"
        disrupted, unschedulable, seen = "", "", False
        for cond in status.get("conditions") or ():
            if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
                disrupted = cond.get("reason") or "DisruptionTarget"
            if cond.get("type") == "PodScheduled":
                seen = True
                if cond.get("status") == "False":
                    unschedulable = cond.get("message") or cond.get("reason") or "not schedulable"
        deleting = meta.get("deletionTimestamp")
        termination = parse_termination_message(message)
        return cls(
            name=meta.get("name", ""),
            attempt=_to_int(labels.get(LABEL_ATTEMPT)),
            rank=_to_int(labels.get(LABEL_RANK)),
            role=role,
            phase=_main_phase(pod_phase, term_state),
            pod_phase=pod_phase,
            exit_code=exit_code,
            reason=reason,
            pod_reason=status.get("reason") or "",
            pod_message=status.get("message") or "",
            disrupted=disrupted,
            deleting_for=_age(deleting, now) if deleting else None,
            started=started or pod_phase in ("Running", "Succeeded"),
            created_for=_age(meta.get("creationTimestamp"), now),
            termination=termination,
            term_text="" if termination else _last_line(message),
            ip=status.get("podIP") or "",
            node=spec.get("nodeName") or "",
            unschedulable=unschedulable,
            scheduler_seen=seen or bool(spec.get("nodeName")),
            waiting=waiting,
            scheduler=spec.get("schedulerName") or "default-scheduler",
            gates=tuple(g.get("name", "") for g in spec.get("schedulingGates") or ()),
            kueue_group=labels.get(KUEUE_GROUP_LABEL) or "",
            retriable=(meta.get("annotations") or {}).get(KUEUE_RETRIABLE_ANNOTATION) != "false",
        )


def _main_phase(pod_phase: str, terminated: Mapping[str, Any] | None) -> str:
    """The pod's phase as its main container (the trainer) sees it: once that container terminated, the
    attempt's rank has ended with its exit code, whatever sidecars still run or how they exited. A pod
    whose node is lost (Unknown) stays Unknown."""
    if terminated is None or pod_phase == "Unknown":
        return pod_phase
    return "Succeeded" if terminated.get("exitCode") == 0 else "Failed"


def node_trouble(nodes: Iterable[Mapping[str, Any]], wanted: Iterable[str]) -> dict[str, str]:
    """For each node name in `wanted` that is not Ready or no longer exists: why, in the kubelet's words.

    The handler lists the nodes only when a pod of the current attempt has failed (the one time decide
    asks) and passes the result as Observed.node_trouble.
    """
    by_name = {(n.get("metadata") or {}).get("name"): n for n in nodes}
    out: dict[str, str] = {}
    for name in sorted(set(wanted)):
        node = by_name.get(name)
        if node is None:
            out[name] = f"node {name} no longer exists"
            continue
        conditions = (node.get("status") or {}).get("conditions") or ()
        ready: Mapping[str, Any] = next((c for c in conditions if c.get("type") == "Ready"), {})
        if ready.get("status") != "True":
            words = ": ".join(x for x in (ready.get("reason"), ready.get("message")) if x)
            out[name] = f"node {name} is not Ready ({ready.get('status', 'Unknown')}{': ' + words if words else ''})"
    return out


@dataclass(frozen=True)
class Observed:
    now: datetime
    status: Mapping[str, Any] = field(default_factory=dict)  # the job's current .status
    pods: tuple[PodView, ...] = ()  # every pod labelled with the job
    progress: Mapping[str, Any] | None = None  # summarize_events() of the store's log; None if unread
    live: Mapping[str, Any] | None = None  # rank 0's GET /status
    spec_error: str = ""
    node_trouble: Mapping[str, str] = field(default_factory=dict)  # node_trouble() of the pods' nodes


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
    create_attempt: int | None = None  # create build(job, create_attempt, expected_iteration, avoid_nodes, nodes)
    expected_iteration: int = 0
    avoid_nodes: tuple[str, ...] = ()
    nodes: int = 0  # the size of the attempt to create (0: spec.nodes)
    create_probes: tuple[int, ...] = ()  # ranks whose probe pod to create for the current attempt (docs/elastic.md)
    create_reader: int | None = None  # create the progress-reader pod for this attempt
    release_pods: tuple[str, ...] = ()  # Kueue group members to mark retriable-in-group "false" (before any delete)
    delete_job: bool = False
    events: tuple[Event, ...] = ()

    @property
    def phase(self) -> str | None:
        return self.status.get("phase")


# -- decide ----------------------------------------------------------------------------------------


def decide(job: Job | None, obs: Observed) -> Action:
    """The next step for `job` (None when its spec does not parse; obs.spec_error then says why)."""
    action = _decide(job, obs)
    release = _released(obs, action)
    return replace(action, release_pods=release) if release else action


def _released(obs: Observed, action: Action) -> tuple[str, ...]:
    """Kueue plain pod groups: the members of every group that is over, so Kueue finishes its Workload and
    frees the quota. Each attempt is its own group and is never resumed, so a group is over once its attempt
    ended (or the pod is being deleted): Kueue would otherwise keep the quota for replacement pods that
    never come (failed or deleted members of a group are retriable by default)."""
    st = {**obs.status, **action.status}
    live = _to_int(st.get("attempt")) if st.get("phase") in ("Pending", "Running") else None
    deleting = {*action.delete_pods, *action.force_delete_pods}
    return tuple(p.name for p in obs.pods if p.kueue_group and p.retriable
                 and (p.attempt != live or p.name in deleting or p.deleting_for is not None))


def _decide(job: Job | None, obs: Observed) -> Action:
    st = obs.status or {}
    phase = st.get("phase") or ""
    if phase in FINISHED:
        return _finished(job, obs)
    if job is None:
        error = obs.spec_error or "invalid spec"
        reason = "ConfigError" if error.startswith(("spec.config", "spec.overrides")) else "InvalidSpec"
        return _fail(obs, reason, error)
    deadline = job.spec.active_deadline_seconds
    start = _parse_time(st.get("startTime"))
    # A resuming job's clock restarts (_next_attempt resets startTime), as Kubernetes Job's does.
    running_clock = not job.spec.suspend and phase != "Suspended"
    if deadline and start and running_clock and (obs.now - start).total_seconds() > deadline:
        return _fail(obs, "DeadlineExceeded", f"activeDeadlineSeconds ({deadline}s) exceeded")
    if job.spec.suspend:
        return _suspend(obs)
    attempt = int(st.get("attempt") or 0)
    if attempt == 0 or phase in ("Restarting", "Suspended"):
        return _next_attempt(job, obs)
    return _running(job, obs, attempt)


def _finished(job: Job | None, obs: Observed) -> Action:
    """Never create anything again. Stop what still runs; delete the job once its TTL is up."""
    active = tuple(p.name for p in obs.pods if p.alive)
    ttl = job.spec.ttl_seconds_after_finished if job else None
    done = _parse_time(obs.status.get("completionTime"))
    if ttl is not None and done and obs.now >= done + timedelta(seconds=ttl):
        return Action("delete", delete_job=True, delete_pods=active,
                      events=(Event("Normal", "TTLExpired", f"deleting the job {ttl}s after it finished"),))
    return Action("wait", delete_pods=active)


def _suspend(obs: Observed) -> Action:
    st = obs.status
    alive = [p for p in obs.pods if p.alive or (p.role != "worker" and p.deleting_for is None)]
    deleting = [p for p in obs.pods if p.deleting_for is not None]
    status: dict[str, Any] = {}
    events: tuple[Event, ...] = ()
    if st.get("phase") != "Suspended":
        status = _phase_status(obs, "Suspended", "Suspended", "spec.suspend is true: pods deleted, job kept")
        if st.get("phase") in ("Pending", "Running"):  # the attempt ends here: remember how far it got
            status["lastAttemptIteration"] = _reached(obs, _to_int(st.get("attempt")), [])
        status["nextAttemptTime"] = None
        events = (Event("Normal", "Suspended", "spec.suspend set: deleting the pods; the job resumes from its"
                                               " last checkpoint when unsuspended"),)
    if not alive and not deleting and not status:
        return Action("wait")
    return Action("suspend", status=status, delete_pods=tuple(p.name for p in alive),
                  force_delete_pods=_overdue(obs), events=events)


def _next_attempt(job: Job, obs: Observed) -> Action:
    """Start attempt k+1 once every pod of attempts <= k is gone, the last checkpoint is known and the
    backoff (status.nextAttemptTime) has passed."""
    st = obs.status
    attempt = int(st.get("attempt") or 0)
    old = [p for p in obs.pods if p.role == "worker" and p.attempt <= attempt]
    # Probes hold the capacity the next attempt may need: they go once the old gang is gone.
    old = old or [p for p in obs.pods if p.role == "probe" and p.attempt <= attempt]
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
    not_before = _parse_time(st.get("nextAttemptTime"))
    if not_before and obs.now < not_before:
        return Action("wait")
    nxt = attempt + 1
    size = _to_int(st.get("resizeTo")) or job.spec.nodes  # after a preemption or failure: try the full size
    status = _phase_status(obs, "Pending", "AttemptCreated", f"attempt {nxt} created{unread}")
    lost = _to_int(st.get("lostIterations")) + max(0, _to_int(st.get("lastAttemptIteration")) - _it(ckpt))
    status.update({
        "attempt": nxt,
        "attemptStartCheckpoint": _it(ckpt),
        "attemptStartTime": _iso(obs.now),
        "admittedTime": None,
        "lastCheckpoint": ckpt,
        "restarts": _restarts(st),
        "attemptInPlaceRestarts": 0,
        "lostIterations": lost,
        "lastAttemptIteration": None,
        "nextAttemptTime": None,
        "nodes": size,
        "resizeTo": None,
    })
    if job.spec.elastic and attempt == 0:
        status.update(minNodes=job.spec.sizes[0], sizes=list(job.spec.sizes),
                      minNodesNote=job.spec.min_nodes_note or None)
    if not st.get("startTime") or st.get("phase") == "Suspended":
        status["startTime"] = _iso(obs.now)  # activeDeadlineSeconds counts from here
    status.update(_progress_fields(obs, ckpt))
    status["iteration"] = _it(ckpt)  # the new attempt starts from its checkpoint, not the old maximum
    if status.get("trainIters"):
        status["progress"] = _percent(_it(ckpt), status["trainIters"])
    resume = f", resuming from iteration {_it(ckpt)}" if _it(ckpt) else ""
    avoid = tuple(st.get("avoidNodes") or ())
    avoiding = f", avoiding node(s) {', '.join(avoid)}" if avoid else ""
    events.append(Event("Normal", "AttemptCreated",
                        f"creating attempt {nxt} ({size} pods){resume}{avoiding}"))
    return Action("create", status=status, create_attempt=nxt, expected_iteration=_it(ckpt),
                  avoid_nodes=avoid, delete_pods=delete, events=tuple(events), nodes=size)


def _running(job: Job, obs: Observed, attempt: int) -> Action:
    current = [p for p in obs.pods if p.role == "worker" and p.attempt == attempt]
    stale = tuple(p.name for p in obs.pods if p.attempt != attempt and p.deleting_for is None
                  and (p.role == "worker" or p.attempt < attempt))
    ckpt = _known_checkpoint(obs, attempt)
    ended = _attempt_end(job, current, obs, ckpt)
    if ended is not None:
        return ended
    size = attempt_size(job, obs.status)
    running = len(current) == size and all(p.phase in ("Running", "Succeeded") for p in current)
    if not running:
        return _starting(job, obs, attempt, current, ckpt, stale)
    if size < job.spec.nodes:
        probes = [p for p in obs.pods if p.role == "probe" and p.attempt == attempt]
        if _placed(probes, range(size, job.spec.nodes)):
            return _resize(job, obs, current, ckpt, job.spec.nodes, f"{len(probes)} probe pod(s) scheduled on "
                           f"{', '.join(sorted({p.node for p in probes}))}: capacity for the full size returned")
    status = _phase_status(obs, "Running", "Running", "") if obs.status.get("phase") != "Running" else {}
    status.update(_progress_fields(obs, ckpt))
    status = {k: v for k, v in status.items() if obs.status.get(k) != v}
    events = (Event("Normal", "Running", f"attempt {attempt}: all {size} pods running"),) if (
        "phase" in status) else ()
    restarts, in_place = _in_place_news(obs, attempt)
    action = Action("wait", status={**status, **restarts}, delete_pods=stale, events=events + in_place)
    return _keep_probes(job, obs, attempt, size, action) if size < job.spec.nodes else action


def attempt_size(job: Job, status: Mapping[str, Any]) -> int:
    """Pods of the current attempt: status.nodes (an elastic job's attempt may be smaller than spec.nodes)."""
    return _to_int(status.get("nodes")) or job.spec.nodes


def _placed(probes: list[PodView], ranks: range) -> bool:
    """A live probe for every missing rank, each bound to a node by the scheduler."""
    by_rank = {p.rank: p for p in probes if p.alive and p.node}
    return bool(ranks) and all(r in by_rank for r in ranks)


def _keep_probes(job: Job, obs: Observed, attempt: int, size: int, action: Action) -> Action:
    """While an attempt runs on fewer than spec.nodes pods: one probe pod per missing rank (created, or
    deleted to be created again when it ended), so the real scheduler says when the full size fits."""
    probes = {p.rank: p for p in obs.pods if p.role == "probe" and p.attempt == attempt}
    ended = tuple(p.name for p in probes.values() if not p.alive and p.deleting_for is None)
    missing = tuple(r for r in range(size, job.spec.nodes) if r not in probes)
    return replace(action, delete_pods=action.delete_pods + ended, create_probes=missing)


def _resize(job: Job, obs: Observed, current: list[PodView], ckpt: Mapping | None, to: int, why: str) -> Action:
    """End the current attempt so the next one runs on `to` pods; neither a failure nor a preemption: no
    backoff, no counter but status.resizes. Deleting the pods SIGTERMs the trainers, which save and exit
    (exit 75), so the next attempt resumes from the iteration they reached."""
    st = obs.status
    attempt, size = _to_int(st.get("attempt")), attempt_size(job, st)
    kind = "grows" if to > size else "shrinks"
    resizes = {"shrinks": 0, "grows": 0, **(st.get("resizes") or {})}
    resizes[kind] = _to_int(resizes[kind]) + 1
    message = f"attempt {attempt}: {size} -> {to} nodes: {why}"
    status = _phase_status(obs, "Restarting", "Resized", message)
    status.update(_progress_fields(obs, ckpt, live=False))
    in_place, _ = _in_place_news(obs, attempt)
    status.update(in_place, resizeTo=to, resizes=resizes, lastCheckpoint=ckpt, nextAttemptTime=None,
                  lastAttemptIteration=_reached(obs, attempt, current))
    return Action("restart", status=status, delete_pods=tuple(p.name for p in current if p.deleting_for is None),
                  force_delete_pods=_overdue(obs),
                  events=(Event("Normal", "Resized", f"{message}; restarting from the newest checkpoint"),))


def shrink_due(job: Job, obs: Observed, current: list[PodView], began: datetime | None) -> float | None:
    """Seconds until a starting attempt with Unschedulable pods is shrunk (<= 0: now); None when it is not
    shrinkable (already at the smallest size, no pod Unschedulable)."""
    size = attempt_size(job, obs.status)
    if began is None or size <= (job.spec.sizes or (size,))[0] or not any(p.unschedulable for p in current):
        return None
    return job.spec.shrink_after_seconds - (obs.now - began).total_seconds()


def _shrink_to(job: Job, current: list[PodView], size: int) -> int:
    """The largest size below `size` the scheduler has shown it can place (the pods it bound to nodes);
    the smallest size when it placed fewer than that."""
    placed = len([p for p in current if p.node])
    smaller = [n for n in job.spec.sizes if n < size]
    return max([n for n in smaller if n <= placed], default=smaller[0])


def _starting(job: Job, obs: Observed, attempt: int, current: list[PodView], ckpt: Mapping | None,
              stale: tuple[str, ...]) -> Action:
    """The gang is not all running yet: say what holds it up; end the attempt after startupTimeoutSeconds."""
    st = obs.status
    gated = next((p for p in sorted(current, key=lambda p: p.rank) if p.gates), None)
    if gated:  # queued for quota (Kueue): waiting is the point, so the startup clock does not run yet
        message = (f"attempt {attempt}: waiting for admission "
                   f"(pod {gated.name} has scheduling gates {', '.join(gated.gates)})")
        status = {k: v for k, v in _phase_status(obs, "Pending", "Queued", message).items() if st.get(k) != v}
        return Action("wait", status=status, delete_pods=stale)
    trouble = _startup_trouble(current)
    admitted = {"admittedTime": _iso(obs.now)} if st.get("reason") == "Queued" else {}
    began = max(filter(None, (_parse_time(st.get("attemptStartTime")), _parse_time(st.get("admittedTime")))),
                default=None)
    timeout = job.spec.startup_timeout_seconds
    shrink_in = None if admitted else shrink_due(job, obs, current, began)
    if shrink_in is not None and shrink_in < 0:
        size = attempt_size(job, st)
        stuck = [p for p in sorted(current, key=lambda p: p.rank) if p.unschedulable]
        return _resize(job, obs, current, ckpt, _shrink_to(job, current, size),
                       f"{len(stuck)} pod(s) Unschedulable for more than shrinkAfterSeconds "
                       f"({job.spec.shrink_after_seconds}s): pod {stuck[0].name}: {stuck[0].unschedulable}")
    if began and not admitted and (obs.now - began).total_seconds() > timeout:
        why = trouble[1] if trouble else "the pods were still starting"
        return _restart(job, obs, current, ckpt, kind="neverStarted", reason="StartupTimeout",
                        message=f"attempt {attempt} not running after startupTimeoutSeconds ({timeout}s): {why}")
    if trouble:
        reason, message = trouble
    elif st.get("reason") in STARTUP_REASONS:  # the trouble cleared up
        reason, message = "Starting", f"attempt {attempt}: waiting for the pods to start"
    else:  # as _next_attempt wrote it
        reason, message = st.get("reason") or "AttemptCreated", st.get("message") or ""
    status = _phase_status(obs, "Pending", reason, message)
    status.update(_progress_fields(obs, ckpt), **admitted)
    status = {k: v for k, v in status.items() if st.get(k) != v}
    events = (Event("Warning", reason, message),) if trouble and reason != st.get("reason") else ()
    return Action("wait", status=status, delete_pods=stale, events=events)


def _startup_trouble(current: list[PodView]) -> tuple[str, str] | None:
    """(reason, message) of the first pod that cannot start by itself, or None."""
    for p in sorted(current, key=lambda p: p.rank):
        if p.waiting:
            return p.waiting.split(":")[0], f"pod {p.name}: {p.waiting}"
        if p.unschedulable:
            return "Unschedulable", f"pod {p.name}: {p.unschedulable}"
        if not p.scheduler_seen and p.created_for > NOT_SCHEDULED_AFTER:
            return "NotScheduled", (f"pod {p.name}: no scheduler has looked at it for {NOT_SCHEDULED_AFTER:.0f}s; "
                                    f"is scheduler {p.scheduler!r} running?")
    return None


def _attempt_end(job: Job, current: list[PodView], obs: Observed, ckpt: Mapping | None) -> Action | None:
    """Classify the end of the current attempt, or None while it still runs."""
    nodes = attempt_size(job, obs.status)
    present = {p.rank for p in current}
    missing = sorted(set(range(nodes)) - present)
    preempted: list[str] = [f"pod {job.name}-{obs.status.get('attempt')}-{r} disappeared" for r in missing]
    config_errors, failures, rejected = [], [], []
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
    if config_errors:
        p = config_errors[0]
        msg = (p.termination or {}).get("message") or f"pod {p.name} exited 2 (ConfigError)"
        return _fail(obs, "ConfigError", msg)
    sick = [f"pod {p.name}: {obs.node_trouble[p.node]}" for p in current if p.node in obs.node_trouble]
    if failures and sick:  # peers failing because a node died: the node's doing, not the trainer's
        preempted += sick
    if not preempted and not failures and not rejected:
        if len(current) == nodes and all(p.phase == "Succeeded" for p in current):
            if _completed(obs, current):
                return _succeed(job, obs, ckpt)
            return _restart(job, obs, current, ckpt, kind="failures", reason="IncompleteExit",
                            message="every rank exited 0 but the progress log does not show train_iters reached")
        return None
    if preempted:
        exit_cond = all("ExitCondition" in m for m in preempted)
        reason = "ExitCondition" if exit_cond else ("NodeNotReady" if sick and preempted == sick else "Preempted")
        return _restart(job, obs, current, ckpt, kind="preemptions", reason=reason, message="; ".join(preempted),
                        own_doing=exit_cond)
    if rejected:
        p = rejected[0]
        return _restart(job, obs, current, ckpt, kind="neverStarted", reason="AdmissionRejected",
                        message=f"node {p.node or '?'} rejected pod {p.name}: {p.detail}",
                        bad_nodes=tuple(p.node for p in rejected if p.node))
    reason, message = _failure_reason(failures)
    return _restart(job, obs, current, ckpt, kind="failures", reason=reason, message=message)


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


def _restart(job: Job, obs: Observed, current: list[PodView], ckpt: Mapping | None, *, kind: str,
             reason: str, message: str, own_doing: bool = False, bad_nodes: tuple[str, ...] = ()) -> Action:
    """End the current attempt. `kind` is the restarts counter it goes to: preemptions | failures | neverStarted."""
    st = obs.status
    attempt = _to_int(st.get("attempt"))
    in_place, _ = _in_place_news(obs, attempt)
    restarts = in_place.get("restarts") or _restarts(st)
    restarts[kind] += 1
    restarts["total"] = restarts["preemptions"] + restarts["failures"] + restarts["neverStarted"]
    progressed = _it(ckpt) > _to_int(st.get("attemptStartCheckpoint")) or (
        ckpt is not None and st.get("attemptStartCheckpoint") is None)
    streak = _to_int(st.get("noProgressAttempts"))
    no_progress = 0 if progressed else streak + (1 if kind == "failures" or own_doing else 0)
    # Free restarts are bounded too: a running attempt preempted before it saved anything new, again and again.
    free = kind == "preemptions" and not own_doing and st.get("phase") == "Running"
    free_streak = 0 if progressed else _to_int(st.get("preemptionsWithoutProgress")) + int(free)
    avoid = list(st.get("avoidNodes") or ())
    avoid = ([n for n in avoid if n not in bad_nodes] + list(bad_nodes))[-MAX_AVOID_NODES:]
    common: dict[str, Any] = {"restarts": restarts, "noProgressAttempts": no_progress, "lastCheckpoint": ckpt,
                              "preemptionsWithoutProgress": free_streak,
                              "lastAttemptIteration": _reached(obs, attempt, current)}
    if bad_nodes:
        common["avoidNodes"] = avoid
    if kind == "failures" and restarts[kind] > job.spec.backoff_limit:
        action = _fail(obs, "BackoffLimitExceeded",
                       f"{restarts[kind]} failures > backoffLimit {job.spec.backoff_limit}; last: {message}")
        action.status.update(common)
        return action
    if kind == "neverStarted" and restarts[kind] >= job.spec.max_never_started_attempts:
        action = _fail(obs, "NeverStarted", f"{restarts[kind]} attempts never started (maxNeverStartedAttempts "
                                            f"{job.spec.max_never_started_attempts}); last: {message}")
        action.status.update(common)
        return action
    if no_progress >= job.spec.max_no_progress_attempts:
        action = _fail(obs, "NoProgress", f"{no_progress} attempts in a row ended by the trainer without a new "
                       f"checkpoint (last checkpoint: iteration {_it(ckpt)}); last: {message}")
        action.status.update(common)
        return action
    if free_streak >= MAX_PREEMPTIONS_WITHOUT_PROGRESS:
        action = _fail(obs, "NoProgress", f"{free_streak} running attempts in a row preempted before saving a new "
                       f"checkpoint (last checkpoint: iteration {_it(ckpt)}): save checkpoints more often "
                       f"(checkpoint.save_interval); last: {message}")
        action.status.update(common)
        return action
    delay = 0.0 if kind == "preemptions" else _backoff(job, attempt, restarts["failures"] + restarts["neverStarted"])
    status = _phase_status(obs, "Restarting", reason, message)
    status.update(common)
    status.update(_progress_fields(obs, ckpt, live=False))
    status["nextAttemptTime"] = _iso(obs.now + timedelta(seconds=delay)) if delay else None
    counted = {"preemptions": "preemption", "failures": f"failure {restarts['failures']}/{job.spec.backoff_limit}",
               "neverStarted": f"never started {restarts['neverStarted']}/{job.spec.max_never_started_attempts}"}
    when = f"in {format_duration(delay)}" if delay else "now"
    return Action("restart", status=status,
                  delete_pods=tuple(p.name for p in current if p.deleting_for is None),
                  force_delete_pods=_overdue(obs),
                  events=(Event("Warning", reason, f"attempt {attempt} ended ({counted[kind]}): {message}; "
                                f"restarting from iteration {_it(ckpt)} {when}"),))


def _backoff(job: Job, attempt: int, n: int) -> float:
    """Seconds before the next attempt after the n-th failed or never-started one: 10 s doubling to 6 min,
    plus up to 20 % jitter. The jitter is drawn from the job's UID and attempt, so decide stays pure."""
    base = min(BACKOFF_CAP, BACKOFF_BASE * 2 ** max(0, n - 1))
    digest = hashlib.sha256(f"{job.uid}/{attempt}".encode()).digest()
    return round(base * (1 + BACKOFF_JITTER * digest[0] / 255), 1)


def _succeed(job: Job, obs: Observed, ckpt: Mapping | None) -> Action:
    status = _phase_status(obs, "Succeeded", "Completed", "train_iters reached")
    status.update(_progress_fields(obs, ckpt, live=False))
    train_iters = status.get("trainIters")
    if train_iters:
        status.update(iteration=train_iters, progress="100%")
    status.update(completionTime=_iso(obs.now), eta="0s", lastCheckpoint=ckpt, nextAttemptTime=None)
    status.update(_in_place_news(obs, _to_int(obs.status.get("attempt")))[0])
    return Action("succeed", status=status, delete_pods=tuple(p.name for p in obs.pods if p.alive),
                  events=(Event("Normal", "Succeeded", f"training completed at iteration {status.get('iteration')}"),))


def _fail(obs: Observed, reason: str, message: str) -> Action:
    status = _phase_status(obs, "Failed", reason, message)
    status.update(completionTime=_iso(obs.now), eta=None, nextAttemptTime=None)
    active = tuple(p.name for p in obs.pods if p.alive)
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


def _log_iteration(log: Mapping[str, Any], attempt: int) -> int:
    """The last iteration the progress log mentions for `attempt` (its lines carry job id ns/name/attempt).

    Not the log's overall latest: until the new attempt writes its first line, that is the old attempt's.
    A summary without jobIterations (an older reader image) gives its latest iteration.
    """
    by_job = log.get("jobIterations")
    if not isinstance(by_job, Mapping):
        return _to_int(log.get("iteration"))
    return max([_to_int(it) for job_id, it in by_job.items() if str(job_id).endswith(f"/{attempt}")] or [0])


def _reached(obs: Observed, attempt: int, current: list[PodView]) -> int:
    """The last iteration the current attempt reached (status.iteration follows the current attempt)."""
    terms = [_to_int((p.termination or {}).get("iteration")) for p in current]
    return max([_to_int(obs.status.get("iteration")), _log_iteration(obs.progress or {}, attempt), *terms])


def _percent(iteration: int, train_iters: Any) -> str:
    return f"{min(100, math.floor(100 * iteration / int(train_iters)))}%"


def _progress_fields(obs: Observed, ckpt: Mapping | None, live: bool = True) -> dict[str, Any]:
    """iteration / trainIters / progress / eta / tokensPerSecond / loss / learningRate for `kubectl get`, for the
    current attempt."""
    st, log, now_live = obs.status, obs.progress or {}, (obs.live or {}) if live else {}
    attempt = _to_int(st.get("attempt"))
    iteration = max(_to_int(now_live.get("iteration")), _log_iteration(log, attempt),
                    _to_int(st.get("iteration")), _it(ckpt))
    train_iters = now_live.get("trainIters") or log.get("trainIters") or st.get("trainIters")
    out: dict[str, Any] = {"iteration": iteration, "lastCheckpoint": ckpt}
    if train_iters:
        out["trainIters"] = int(train_iters)
        out["progress"] = _percent(iteration, train_iters)
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
    """The restart counters; `inPlace` (docs/recovery.md) is not in `total`, which counts attempts."""
    r = st.get("restarts") or {}
    p, f, n = _to_int(r.get("preemptions")), _to_int(r.get("failures")), _to_int(r.get("neverStarted"))
    return {"preemptions": p, "failures": f, "neverStarted": n, "total": p + f + n,
            "inPlace": _to_int(r.get("inPlace"))}


def _in_place_news(obs: Observed, attempt: int) -> tuple[dict[str, Any], tuple[Event, ...]]:
    """In-place restarts of the current attempt not counted yet, from rank 0's status endpoint or the
    progress log: the status fields that count them, and an event for each."""
    counted = _to_int(obs.status.get("attemptInPlaceRestarts"))
    by_job = (obs.progress or {}).get("inPlaceRestarts")
    logged = [_to_int(n) for job_id, n in by_job.items() if str(job_id).endswith(f"/{attempt}")] if isinstance(
        by_job, Mapping) else []
    now = max([counted, _to_int((obs.live or {}).get("inPlaceRestarts")), *logged])
    if now <= counted:
        return {}, ()
    restarts = _restarts(obs.status)
    total = restarts["inPlace"] + now - counted
    events = tuple(Event("Warning", "RestartedInPlace", f"attempt {attempt}: a trainer process ended; the gang "
                         f"restarted inside its pods from the newest checkpoint ({n} in this attempt, "
                         f"{total - now + n} in all)") for n in range(counted + 1, now + 1))
    return {"restarts": {**restarts, "inPlace": total}, "attemptInPlaceRestarts": now}, events


def _overdue(obs: Observed) -> tuple[str, ...]:
    """Pods still terminating long past any grace period (their node is gone): force-delete them."""
    return tuple(p.name for p in obs.pods if p.deleting_for is not None and p.deleting_for > FORCE_DELETE_AFTER)


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


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


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
