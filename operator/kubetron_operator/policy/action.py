"""What decide() asks for: an Action (one status patch, pods to delete or create) and its Events."""

from __future__ import annotations

from dataclasses import dataclass, field

from kubetron_operator.job_status import StatusPatch


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Action:
    kind: str  # create | restart | succeed | fail | suspend | wait | delete
    status: StatusPatch = field(default_factory=dict)  # merge patch for .status
    delete_pods: tuple[str, ...] = ()
    force_delete_pods: tuple[str, ...] = ()
    create_attempt: int | None = None  # create build(job, create_attempt, expected_iteration, avoid_nodes, nodes)
    expected_iteration: int = 0
    avoid_nodes: tuple[str, ...] = ()
    nodes: int = 0  # the size of the attempt to create (0: spec.nodes)
    create_probes: tuple[int, ...] = ()  # ranks whose probe pod to create for the current attempt (docs/elastic.md)
    replace_ranks: tuple[int, ...] = ()  # ranks of the current attempt whose pod to create again (docs/recovery.md)
    create_job_objects: bool = False  # create build.job_objects (peer token, rank 0's Service), before anything else
    release_pods: tuple[str, ...] = ()  # Kueue group members to mark retriable-in-group "false" (before any delete)
    taint_nodes: tuple[str, ...] = ()  # nodes this job just left out: tainted cluster-wide if the chart allows it
    delete_job: bool = False
    events: tuple[Event, ...] = ()
    why: str = ""  # for a wait that holds something back: what it waits for (logged at debug level)

    @property
    def phase(self) -> str | None:
        return self.status.get("phase")

    @property
    def idle(self) -> bool:
        """Nothing to apply: no status patch, no pod or object to create or delete, no event."""
        return not (self.status or self.delete_pods or self.force_delete_pods or self.events or self.release_pods
                    or self.create_attempt is not None or self.delete_job
                    or self.create_probes or self.create_job_objects or self.taint_nodes or self.replace_ranks)
