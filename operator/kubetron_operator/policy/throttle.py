"""Holding back status patches that only move live progress (policy.status.LIVE_FIELDS: iteration, progress, ETA,
tokens/s, loss, learning rate; and goodput): at most one every `2 * interval` seconds, so a running job costs the
API server little. Pure: the time since the last patch comes in as an argument."""

from __future__ import annotations

import dataclasses

from kubetron_operator.policy.action import Action
from kubetron_operator.policy.status import LIVE_FIELDS

PROGRESS_KEYS = frozenset({*LIVE_FIELDS, "goodput"})  # throttled status fields


def throttle(action: Action, since_patch: float, interval: float) -> tuple[Action, bool]:
    """`action` without its status patch when that only moves live progress and the job's status was patched
    less than `2 * interval` seconds ago (`since_patch`). Returns the action to apply and whether something
    was held back."""
    if not action.status or not set(action.status) <= PROGRESS_KEYS:
        return action, False
    if since_patch >= hold_until(interval):
        return action, False
    return dataclasses.replace(action, status={}), True


def hold_until(interval: float) -> float:
    """Seconds until a held-back progress patch may go out."""
    return 2 * interval
