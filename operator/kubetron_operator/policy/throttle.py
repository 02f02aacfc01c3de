"""Holding back status patches that only move live progress (policy.status.LIVE_FIELDS: iteration, progress, ETA,
tokens/s, loss, learning rate; and goodput): at most one every `2 * interval` seconds, so a running job costs the
API server little. And a starting attempt's news (why its pods wait: status.reason and message, and its Warning
event) while the operator is creating other attempts' pods: pods first in a burst of new jobs (the news are a
status patch, the dearest write, and an event each). They go out once no attempt has been created for
events.EVENT_QUIET seconds (handlers wakes the jobs that hold some), at most NEWS_HOLD seconds late. Pure: the
times come in as arguments."""

from __future__ import annotations

import dataclasses

from kubetron_operator.policy.action import Action
from kubetron_operator.policy.status import LIVE_FIELDS

PROGRESS_KEYS = frozenset({*LIVE_FIELDS, "goodput"})  # throttled status fields
NEWS_KEYS = frozenset({"reason", "message", "conditions"})  # a starting attempt's news (policy/start.py)
NEWS_HOLD = 10.0  # seconds news may wait while other attempts are being created (as events.EVENT_HOLD)


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


def hold_news(action: Action, creating: bool, held_for: float | None) -> tuple[Action, float | None]:
    """`action` held back when all it does is tell news (a status patch of NEWS_KEYS and live progress, its
    events) while the operator is creating attempts (`creating`), for at most NEWS_HOLD seconds from the first time
    it was held (`held_for`; None: not held yet). Returns the action to apply and the seconds until the held news
    must go out (None: nothing held)."""
    news = action.kind == "wait" and bool(action.status) and set(action.status) <= NEWS_KEYS | PROGRESS_KEYS \
        and dataclasses.replace(action, status={}, events=(), why="") == Action("wait")
    if not news or not creating or (held_for is not None and held_for >= NEWS_HOLD):
        return action, None
    return Action("wait", why=f"other attempts are being created: {action.status.get('reason')} held back"), \
        NEWS_HOLD - (held_for or 0.0)
