"""Time on the contract: one way to write a timestamp, read it back, and show a duration.

Timestamps in status, checkpoint markers and the live status are ISO 8601 in UTC with a `Z`
(`2026-11-25T19:30:00Z`). The progress log keeps Megatron's own `%Y-%m-%d %H:%M:%S` (contract.progress).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

STAMP_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def stamp(when: datetime | None = None) -> str:
    """`when` (default: now) as `YYYY-MM-DDTHH:MM:SSZ`; a naive datetime is taken to be UTC already."""
    if when is None:
        when = datetime.now(UTC)
    elif when.tzinfo is not None and when.tzinfo is not UTC:
        when = when.astimezone(UTC)
    # by hand, not strftime: a progress summary stamps every line of the log
    return f"{when.year:04d}-{when.month:02d}-{when.day:02d}T{when.hour:02d}:{when.minute:02d}:{when.second:02d}Z"


def parse_stamp(text: Any) -> datetime | None:
    """An ISO 8601 timestamp (`Z` or an offset) as an aware datetime; None for anything else."""
    if not isinstance(text, str) or not text:
        return None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def age_seconds(text: Any, now: datetime) -> float:
    """Seconds from the timestamp `text` to `now` (never negative; 0 when `text` is not a timestamp)."""
    when = parse_stamp(text)
    return max(0.0, (now - when).total_seconds()) if when else 0.0


def format_duration(seconds: float) -> str:
    """1d2h, 1h2m, 3m20s, 45s."""
    s = max(0, round(seconds))
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60}m"
    if s >= 60:
        return f"{s // 60}m{s % 60}s"
    return f"{s}s"
