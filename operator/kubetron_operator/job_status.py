"""The TrainingJob's `.status` as typed dicts: the fields the CRD's status schema declares
(crds/trainingjob.yaml), so the API server has checked every value's type before the operator reads it.

decide() reads a JobStatus (Observed.status) and answers with a merge patch of the same fields
(StatusPatch: a field set to None is deleted).
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from kubetron.contract.goodput import Goodput
from kubetron.contract.progress import CheckpointRef
from kubetron.contract.resource import FINISHED

PHASES = ("Pending", "Running", "Restarting", "Suspended", *FINISHED)
"""Every phase a job may be in (the CRD's enum); a condition of another type is not a phase's."""

StatusPatch = dict[str, Any]
"""A JSON merge patch for .status: JobStatus's fields, None deletes one."""


class Restarts(TypedDict, total=False):
    """Attempts ended, by kind; `total` counts attempts (not `inPlace`, docs/recovery.md)."""

    preemptions: int
    failures: int
    neverStarted: int
    total: int
    inPlace: int
    hangs: int  # gangs that hung (restarted in place, or as a new attempt); not in total


class Resizes(TypedDict, total=False):
    shrinks: int
    grows: int


class LastHang(TypedDict, total=False):
    """The newest hang (docs/recovery.md): the rank its pods' watchdogs named, its pod and node."""

    time: str
    attempt: int
    rank: int
    pod: str
    node: str
    phase: str
    iteration: int
    idleSeconds: float
    timeoutSeconds: float
    state: str  # stopped | unresponsive | elsewhere | collective (kubetron.contract.hang.STATES)
    where: str
    stacks: str
    restartedInPlace: bool


class Backoff(TypedDict):
    """The wait before the next attempt after the last restart (policy/restart.py)."""

    attempts: int  # failed or never-started attempts in a row since an attempt saved a new checkpoint
    seconds: float  # the wait (0 after a preemption); status.nextAttemptTime is when it ends
    reason: str  # why that long


class PodGroupRef(TypedDict):
    """The gang's PodGroup of the current attempt (spec.scheduling.gang): its apiVersion and name."""

    apiVersion: str
    name: str


class AvoidedNode(TypedDict):
    """A node later attempts are kept off (policy/nodes.py) until policy.nodes.AVOID_SECONDS after `time`."""

    node: str
    reason: str  # NodeProblem | AdmissionRejected | HardwareError | StragglerDetected
    evidence: str
    time: str


class FailingNode(TypedDict):
    """Failures of this job that pointed at a node (policy/nodes.py); policy.nodes.STRIKES of them avoid it."""

    node: str
    failures: int
    evidence: list[str]  # the newest few
    time: str  # the newest; the strikes expire policy.nodes.AVOID_SECONDS after it


class Condition(TypedDict, total=False):
    type: str
    status: str  # "True" | "False"
    reason: str
    message: str
    lastTransitionTime: str


class JobStatus(TypedDict, total=False):
    """What the operator keeps in .status (every counter decide() must remember lives here)."""

    phase: str  # Pending | Running | Restarting | Suspended | Succeeded | Failed
    reason: str
    message: str
    conditions: list[Condition]
    attempt: int
    nodes: int  # the current attempt's size (elastic jobs: may be below spec.nodes)
    resizeTo: int | None
    resizes: Resizes
    minNodes: int
    minNodesNote: str | None
    sizes: list[int]
    restarts: Restarts
    attemptInPlaceRestarts: int
    attemptHangs: int  # hangs of the current attempt already counted in restarts.hangs
    lastHang: LastHang
    goodput: Goodput  # where every rank-second went (policy/goodput.py)
    iteration: int
    trainIters: int
    progress: str
    eta: str | None
    tokensPerSecond: float
    loss: float
    learningRate: float
    lastCheckpoint: CheckpointRef | None
    lostIterations: int
    lastAttemptIteration: int | None
    noProgressAttempts: int
    backoff: Backoff
    podGroup: PodGroupRef | None
    preemptionsWithoutProgress: int
    attemptStartCheckpoint: int
    avoidNodes: list[AvoidedNode]  # (an older operator's bare names read as expired)
    failingNodes: list[FailingNode]
    startTime: str  # timestamps: kubetron.contract.times.stamp
    attemptStartTime: str
    admittedTime: str | None
    nextAttemptTime: str | None
    completionTime: str
    createFailures: int | None  # these two are not in the CRD's schema (kept as unknown fields)
    nextCreateTime: str | None


RestartKind = Literal["preemptions", "failures", "neverStarted"]
"""The Restarts counter an ended attempt goes to (policy/restart.py)."""
