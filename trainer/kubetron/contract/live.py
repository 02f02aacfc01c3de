"""Rank 0's status endpoint payload (`GET /status`, docs/CONTRACT.md), for the trainer that serves it
(training/status_server.py) and the operator that reads it (kubetron_operator/live.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypedDict

from kubetron.contract.goodput import TrainerTime, parse_trainer_time
from kubetron.contract.hang import HangReport, RestartCause, parse_cause, parse_report
from kubetron.contract.progress import CheckpointRef
from kubetron.contract.recovery import TrainerRecovery, parse_trainer_recovery


class LiveStatus(TypedDict):
    """Every key is always there, null until known (`inPlaceRestarts`: 0 before any, from the start)."""

    iteration: int | None  # last completed training iteration
    resumedFrom: int | None  # the iteration this process resumed from (0: from scratch; a lost iteration's bound)
    trainIters: int | None
    consumedSamples: int | None
    tokensPerSecond: float | None  # the whole job's
    etaSeconds: float | None  # until train_iters
    lastCheckpoint: CheckpointRef | None  # the newest durable checkpoint this run knows of
    loss: float | None  # as of the last console log line
    learningRate: float | None
    tflopsPerGpu: float | None
    inPlaceRestarts: int  # this attempt's restarts of the gang inside its pods (docs/recovery.md)
    hangs: int  # of those, the ones after the gang hung (the pods' watchdogs stopped it)
    lastHang: HangReport | None  # the newest of them: the rank named, where the stacks are
    lastRestart: RestartCause | None  # the rank whose crash caused the newest other in-place restart
    trainerTime: TrainerTime | None  # where this process's time went (docs/goodput.md), read at each request
    checkpointSaveSeconds: float | None  # the newest durable checkpoint: from its save's start until durable
    checkpointBlockedSeconds: float | None  # ... of which the training loop waited (an async save: the copy)
    recovery: TrainerRecovery | None  # how this process resumed: memory, a peer's copy or the store (docs/recovery.md)


STATUS_KEYS: tuple[str, ...] = tuple(LiveStatus.__annotations__)
"""The keys `GET /status` always carries, in the order it serves them."""

_INTS = ("iteration", "resumedFrom", "trainIters", "consumedSamples")
_NUMBERS = ("tokensPerSecond", "etaSeconds", "loss", "learningRate", "tflopsPerGpu", "checkpointSaveSeconds",
            "checkpointBlockedSeconds")


def new_live_status(in_place_restarts: int = 0, hangs: int = 0, last_hang: HangReport | None = None,
                    last_restart: RestartCause | None = None) -> LiveStatus:
    """The payload before the first step: nothing known but this attempt's in-place restarts and their causes."""
    return LiveStatus(iteration=None, resumedFrom=None, trainIters=None, consumedSamples=None, tokensPerSecond=None,
                      etaSeconds=None, lastCheckpoint=None, loss=None, learningRate=None, tflopsPerGpu=None,
                      inPlaceRestarts=in_place_restarts, hangs=hangs, lastHang=last_hang, lastRestart=last_restart,
                      trainerTime=None, checkpointSaveSeconds=None, checkpointBlockedSeconds=None, recovery=None)


def jsonable(value: Any) -> Any:
    """A value as the payload carries it: NaN/Inf become null (they are not JSON); containers are copied;
    numpy / torch scalars become numbers; other objects become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        try:
            return jsonable(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def parse_live_status(data: Any) -> LiveStatus | None:
    """The endpoint's JSON object as a LiveStatus, or None when it is not an object. A key it lacks, or
    whose value has the wrong type, reads as unknown (null; inPlaceRestarts and hangs 0); other keys are dropped."""
    if not isinstance(data, Mapping):
        return None
    status = new_live_status(_as_int(data.get("inPlaceRestarts")) or 0, _as_int(data.get("hangs")) or 0,
                             parse_report(data.get("lastHang")), parse_cause(data.get("lastRestart")))
    for key in _INTS:
        status[key] = _as_int(data.get(key))  # type: ignore[literal-required]
    for key in _NUMBERS:
        status[key] = _as_number(data.get(key))  # type: ignore[literal-required]
    status["lastCheckpoint"] = _as_checkpoint(data.get("lastCheckpoint"))
    status["trainerTime"] = parse_trainer_time(data.get("trainerTime"))
    status["recovery"] = parse_trainer_recovery(data.get("recovery"))
    return status


def _as_int(value: Any) -> int | None:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _as_number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


def _as_checkpoint(value: Any) -> CheckpointRef | None:
    iteration = _as_int(value.get("iteration")) if isinstance(value, Mapping) else None
    if iteration is None:
        return None
    when = value.get("time")
    return CheckpointRef(iteration=iteration, time=when if isinstance(when, str) else None)
