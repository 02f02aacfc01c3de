"""What the operator observes, as typed views: the raw Kubernetes objects (pods, nodes, the job's status)
are read here, once, and decide() (kubetron_operator.policy) reads only these views.

A pod's outcome is its trainer container's, found by name (PodView.from_pod): a rank has ended once that
container terminated, whatever sidecars still run or how they exited.

What a pod says is hostile input (kubetron_operator.untrusted): the trainer's termination message is read
bounded and range-checked (trainer_reports/termination.py; a refused one is PodView.refused, and the pod is
judged by its exit code), and every text taken from a pod has its control characters escaped before decide()
sees it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from kubetron.contract.live import LiveStatus, new_live_status
from kubetron.contract.progress import ProgressSummary, summarize_events
from kubetron.contract.resource import LABEL_ATTEMPT, LABEL_RANK, LABEL_ROLE, TRAINER
from kubetron.contract.termination import TerminationMessage
from kubetron.contract.times import age_seconds

from kubetron_operator.job_status import JobStatus
from kubetron_operator.model import CONFIG_ANNOTATION, KUEUE_GROUP_LABEL, KUEUE_RETRIABLE_ANNOTATION
from kubetron_operator.node_view import NodeView
from kubetron_operator.trainer_reports.termination import trainer_message
from kubetron_operator.untrusted import clean

ADMISSION_POD_REASONS = frozenset({"UnexpectedAdmissionError", "NodeAffinity", "NodeSelectorMismatching",
                                   "NodePorts", "InvalidNodeInfo", "UnknownNode"})
"""Pod reasons of a kubelet admission rejection; `OutOf<resource>` (OutOfnvidia.com/gpu, OutOfcpu ...) too."""
STUCK_WAITING = frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull",
                           "CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
"""Container waiting reasons that do not clear up by themselves (ContainerCreating does)."""
OWN_LIMIT_EVICTIONS = ("exceeds the total limit of containers", "exceeded its local ephemeral storage limit",
                       "Usage of EmptyDir volume")
"""Words of the kubelet's eviction manager (pkg/kubelet/eviction/helpers.go) when a pod outgrew its *own*
limits (pod or container ephemeral-storage, an emptyDir sizeLimit): the job's doing, a failure. Its
node-pressure evictions ("The node was low on resource: ...") stay free preemptions."""
POD_SPEC_READ = ("nodeName", "schedulerName", "schedulingGates")
"""The fields of a pod's spec that PodView.from_pod reads."""


def json_copy(body: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy without managedFields (never read here). Bodies are JSON: a JSON round trip copies them
    several times faster than copy.deepcopy."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    return cast(dict[str, Any], json.loads(json.dumps({**body, "metadata": meta})))


def pod_essentials(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy (json_copy) of the parts of a pod that PodView.from_pod reads: its
    metadata without the trainer's config, POD_SPEC_READ, its status. The operator holds one per watched
    pod and copies one per watch event: a whole pod is several times the bytes."""
    meta = dict(pod.get("metadata") or {})
    if CONFIG_ANNOTATION in (meta.get("annotations") or {}):
        meta["annotations"] = {k: v for k, v in meta["annotations"].items() if k != CONFIG_ANNOTATION}
    spec = {k: v for k, v in (pod.get("spec") or {}).items() if k in POD_SPEC_READ}
    return json_copy({"metadata": meta, "spec": spec, "status": pod.get("status") or {}})


@dataclass(frozen=True)
class PodView:
    """What decide needs to know about one child pod (from_pod reads it off the pod as the API server has it)."""

    name: str
    attempt: int
    rank: int = 0
    role: str = "worker"  # worker | probe
    phase: str = "Pending"  # Pending | Running | Succeeded | Failed | Unknown; the trainer's once it ended
    pod_phase: str = ""  # the pod's own status.phase (a sidecar may keep it Running); "" means as `phase`
    exit_code: int | None = None  # the trainer container's, once terminated
    reason: str = ""  # the container's terminated reason: OOMKilled, Error, Completed, ...
    pod_reason: str = ""  # status.reason: Evicted, NodeLost, OutOfnvidia.com/gpu, ...
    pod_message: str = ""  # status.message: the kubelet's or the evicter's words
    disrupted: str = ""  # reason of a DisruptionTarget condition that is True, else ""
    deleting_for: float | None = None  # seconds since deletionTimestamp; None when not being deleted
    no_grace: bool = False  # being deleted with no grace period (0 s): killed at once, its ranks save nothing
    ended_for: float | None = None  # seconds since the trainer container's finishedAt; None while it runs
    started: bool = False  # a container of it ever ran
    created_for: float = 0.0  # seconds since creationTimestamp
    termination: TerminationMessage | None = None  # the trainer's termination message (JSON), checked
    term_text: str = ""  # the last line of a termination message that is not the trainer's JSON
    refused: str = ""  # why the trainer's termination message was ignored (too big, too deep, a bad number)
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
        """The view of a pod as the API server has it (its ages measured at `now`)."""
        meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        role = labels.get(LABEL_ROLE, "worker")
        # Init containers too (names are unique across both lists): a native sidecar or an init container
        # that cannot be pulled holds the pod as surely as the trainer's image.
        states = {cs.get("name"): cs.get("state") or {} for key in ("initContainerStatuses", "containerStatuses")
                  for cs in status.get(key) or ()}
        started = any("running" in st or (st.get("terminated") or {}).get("startedAt") for st in states.values())
        stuck = [st["waiting"] for st in states.values() if (st.get("waiting") or {}).get("reason") in STUCK_WAITING]
        waiting = clean(f"{stuck[0]['reason']}: {stuck[0].get('message') or ''}".rstrip(": ")) if stuck else ""
        # The trainer by name, never by position: containerStatuses are sorted by name, sidecars included.
        term_state = states.get(TRAINER, {}).get("terminated")
        exit_code = (term_state or {}).get("exitCode")
        reason, message = clean((term_state or {}).get("reason") or "", 100), (term_state or {}).get("message") or ""
        pod_phase = status.get("phase") or "Pending"
        disrupted, unschedulable, seen = "", "", False
        for cond in status.get("conditions") or ():
            if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
                disrupted = cond.get("reason") or "DisruptionTarget"
            if cond.get("type") == "PodScheduled":
                seen = True
                if cond.get("status") == "False":
                    unschedulable = clean(cond.get("message") or cond.get("reason") or "not schedulable")
        deleting = meta.get("deletionTimestamp")
        termination, refused = trainer_message(message)
        return cls(
            name=meta.get("name", ""),
            attempt=to_int(labels.get(LABEL_ATTEMPT)),
            rank=to_int(labels.get(LABEL_RANK)),
            role=role,
            phase=_main_phase(pod_phase, term_state),
            pod_phase=pod_phase,
            exit_code=exit_code,
            reason=reason,
            pod_reason=clean(status.get("reason") or "", 100),
            pod_message=clean(status.get("message") or ""),
            disrupted=clean(disrupted, 100),
            deleting_for=age_seconds(deleting, now) if deleting else None,
            no_grace=bool(deleting) and meta.get("deletionGracePeriodSeconds") == 0,
            ended_for=age_seconds(term_state.get("finishedAt"), now) if term_state else None,
            started=started or pod_phase in ("Running", "Succeeded"),
            created_for=age_seconds(meta.get("creationTimestamp"), now),
            termination=termination,
            term_text="" if termination else clean(_last_line(message), 300),
            refused=refused,
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
    """Everything decide() knows: the clock comes in here too, so decide stays pure."""

    now: datetime
    status: JobStatus = field(default_factory=lambda: JobStatus())  # the job's current .status
    pods: tuple[PodView, ...] = ()  # every pod labelled with the job
    progress: ProgressSummary | None = None  # summarize_events() of the store's log; None if unread
    live: LiveStatus | None = None  # rank 0's GET /status (status_endpoint.read_live); None if unread
    spec_error: str = ""
    node_trouble: Mapping[str, str] = field(default_factory=dict)  # node_trouble() of the pods' nodes
    node_problems: Mapping[str, str] = field(default_factory=dict)  # what those nodes say is wrong (node_view.py)
    nodes: tuple[NodeView, ...] | None = None  # the cluster's nodes, listed before an attempt that avoids some
    job_objects: bool = False  # build.job_objects (Service, peer token) known to exist (made or found by this operator)
    created: datetime | None = None  # the job's metadata.creationTimestamp (the goodput ledger starts there)
    store_unread: tuple[str, str] | None = None  # (reason, message): why the S3 progress log could not be read
    pod_group_api: str | None = None  # the PodGroup apiVersion the API server serves for the job's gang (None: none)


NO_PROGRESS: ProgressSummary = summarize_events([])
"""What decide reads while the progress log is unread: an empty log's summary (nothing known)."""
NO_LIVE: LiveStatus = new_live_status()
"""What decide reads while rank 0's status endpoint is unread: nothing known, no in-place restart."""


def job_status(body: Mapping[str, Any]) -> JobStatus:
    """The job's .status (a copy); the API server has checked it against the CRD's status schema."""
    return cast(JobStatus, dict(body.get("status") or {}))


def to_int(value: Any) -> int:
    """An integer from data the API server did not type-check (labels, the trainer's JSON); 0 if none."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
