"""Kueue plain pod groups (one per attempt): which jobs are queued in Kueue, and the members of a group whose
attempt is over, marked retriable-in-group "false" (Action.release_pods) before any of them is deleted, so
Kueue frees the quota."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubetron_operator.model import QUEUE_LABEL
from kubetron_operator.observe import Observed
from kubetron_operator.policy.action import Action


def released(obs: Observed, action: Action) -> tuple[str, ...]:
    """Kueue plain pod groups: the members of every group that is over, so Kueue finishes its Workload and
    frees the quota. Each attempt is its own group and is never resumed, so a group is over once its attempt
    ended (or the pod is being deleted): Kueue would otherwise keep the quota for replacement pods that
    never come (failed or deleted members of a group are retriable by default)."""
    st = {**obs.status, **action.status}
    live = (st.get("attempt") or 0) if st.get("phase") in ("Pending", "Running") else None
    deleting = {*action.delete_pods, *action.force_delete_pods}
    return tuple(p.name for p in obs.pods if p.kueue_group and p.retriable
                 and (p.attempt != live or p.name in deleting or p.deleting_for is not None))


def queued(body: Mapping[str, Any], **_: Any) -> bool:
    """The job is queued in Kueue (spec.queueName or the queue label): its pods form Kueue pod groups. (Also
    kopf's `when` filter of the handler that cleans up on deletion: hence the ignored keyword arguments.)"""
    labels = (body.get("metadata") or {}).get("labels") or {}
    return bool((body.get("spec") or {}).get("queueName") or labels.get(QUEUE_LABEL))
