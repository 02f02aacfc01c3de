"""Goodput (docs/goodput.md): where every rank-second of a job went, since it was created.

The operator keeps the ledger in status.goodput; rank 0 tells it how its own time was spent (TrainerTime, on
its status endpoint as `trainerTime`), which splits a running attempt's time into training, checkpoint saves
and the rest. Standard library only, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypedDict

from kubetron.contract.hang import CHECKPOINT

PRODUCTIVE, LOST_WORK, RECOVERY, PENDING, OTHER = "productive", "lostWork", "recovery", "pending", "other"
BUCKETS = (PRODUCTIVE, CHECKPOINT, LOST_WORK, RECOVERY, PENDING, OTHER)
"""status.goodput.seconds' keys (docs/goodput.md defines each)."""


class TrainerTime(TypedDict):
    """Rank 0's own account of its process's time (kubetron.supervisor.heartbeat keeps it; seconds since the process
    started)."""

    started: str  # the process's start (contract.times.stamp): tells one process from the next
    steps: int  # training iterations it completed
    train: float  # seconds in those iterations (forward, backward, optimizer)
    checkpoint: float  # seconds the loop was blocked on checkpoint saves
    evaluation: float  # seconds in evaluations


class Goodput(TypedDict, total=False):
    """status.goodput: rank-seconds (GPU-seconds on GPU jobs) by bucket, their sum and productive / total;
    the rest is the ledger's own bookkeeping (as of when, the trainer counters it last read)."""

    seconds: dict[str, float]
    totalSeconds: float
    ratio: float
    asOf: str  # the ledger covers the job's life up to here
    recovering: bool  # a failure, hang or preemption happened and no iteration has completed since
    recoveringFrom: str | None  # TrainerTime.started of the process that failed (None: not known, or not recovering)
    stepSeconds: float  # a training iteration's mean seconds (the trainer's), for lost work
    trainer: TrainerTime | None  # the newest trainer counters read
    waiting: bool  # as of asOf, the attempt's pods waited for placement (the next interval is pending)


def parse_trainer_time(data: Any) -> TrainerTime | None:
    """A TrainerTime from the endpoint's JSON, or None when a key is missing or of the wrong type."""
    if not isinstance(data, Mapping) or not isinstance(data.get("started"), str):
        return None
    steps = data.get("steps")
    numbers = [_seconds(data.get(k)) for k in ("train", "checkpoint", "evaluation")]
    if not isinstance(steps, int) or isinstance(steps, bool) or None in numbers:
        return None
    train, checkpoint, evaluation = (float(x or 0.0) for x in numbers)
    return TrainerTime(started=data["started"], steps=steps, train=train, checkpoint=checkpoint, evaluation=evaluation)


def _seconds(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return float(value) if ok else None
