"""Whether the operator could read the job's S3 progress log: the `StoreReadable` condition.

False when a read failed (Observed.store_unread): its reason and message say why (SecretKeyMissing naming
the Secret and the key, StoreTimeout, StoreTooLarge, StoreError ...), with a Warning event of that reason
when it turns False or the reason changes; True again once a read succeeds. The job is decided all the
same, from what else is known (termination messages, rank 0's status endpoint). Jobs the operator does not
read (PVC stores, S3 without a secretRef) carry no such condition.
"""

from __future__ import annotations

from dataclasses import replace

from kubetron.contract.times import stamp

from kubetron_operator.job_status import Condition
from kubetron_operator.observe import Observed
from kubetron_operator.policy.action import Action, Event

CONDITION = "StoreReadable"


def store_condition(obs: Observed, action: Action) -> Action:
    """`action` with the StoreReadable condition brought up to date (and its event), when it changed."""
    conditions = list(action.status.get("conditions") or obs.status.get("conditions") or [])
    held = next((c for c in conditions if c.get("type") == CONDITION), None)
    if obs.store_unread is not None:
        want: Condition = {"type": CONDITION, "status": "False", "reason": obs.store_unread[0],
                           "message": obs.store_unread[1]}
    elif held is not None and held.get("status") == "False" and obs.progress is not None:
        want = {"type": CONDITION, "status": "True", "reason": "Read", "message": ""}
    else:
        return action
    if held is not None and all(held.get(k) == v for k, v in want.items()):
        return action
    if held is None or held.get("status") != want["status"]:
        want["lastTransitionTime"] = stamp(obs.now)
    new = [want if c is held else c for c in conditions] if held is not None else [*conditions, want]
    events = (Event("Warning", want["reason"], want["message"]),) if want["status"] == "False" else ()
    return replace(action, status={**action.status, "conditions": new}, events=action.events + events)
