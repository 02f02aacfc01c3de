"""Live numbers from rank 0's status endpoint (`GET http://<pod-ip>:<statusPort>/status`, docs/CONTRACT.md).

The operator reads it every `--interval` seconds while an attempt runs (far inside the 60 s the status
may lag), and on every change to the job's pods, so the pods need no RBAC at all to report progress.
What a tenant's rank 0 serves is hostile input: the fetch (http_get) goes only to the pod's own IP, follows
no redirect, stops at LIVE_DEADLINE seconds and LIVE_LIMIT bytes; the JSON is bounded (untrusted.load_json)
and its numbers range-checked. A refused answer is a `problem` (a warning Event; the job is decided from
what else is known, and the endpoint is left alone for a while). The fetch is injectable for tests.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kubetron.contract.hang import RestartCause
from kubetron.contract.live import LiveStatus, parse_live_status
from kubetron.contract.progress import CheckpointRef
from kubetron.contract.times import parse_stamp, stamp

from kubetron_operator.observe import PodView
from kubetron_operator.trainer_reports import http_get
from kubetron_operator.trainer_reports.termination import capped
from kubetron_operator.untrusted import Untrusted, clean, count, load_json

Fetch = Callable[[str], dict[str, Any]]
LIVE_DEADLINE = 2.0  # seconds for one fetch, all of it
LIVE_LIMIT = 64 * 1024  # bytes of answer
MAX_SECONDS = 10 * 365 * 86400.0  # an ETA beyond ten years is not one
CLOCK_SKEW = 300.0  # seconds the pod's clock may run ahead of the operator's (trainerTime.started)
_COUNTS = ("iteration", "trainIters", "consumedSamples", "inPlaceRestarts", "hangs")
_RANGES = {"etaSeconds": (0.0, MAX_SECONDS), "tokensPerSecond": (0.0, 1e15), "tflopsPerGpu": (0.0, 1e9),
           "loss": (-1e300, 1e300), "learningRate": (-1e300, 1e300)}


class Redirected(OSError):
    """The endpoint answered with a redirect; the operator follows none."""


def http_fetch(url: str) -> dict[str, Any]:
    answer = http_get.get(url, limit=LIVE_LIMIT, deadline=LIVE_DEADLINE, ip_only=True)
    if 300 <= answer.status < 400:
        raise Redirected(f"answered HTTP {answer.status} (a redirect, not followed)")
    if answer.status != 200:
        raise ConnectionError(f"answered HTTP {answer.status}")  # not serving (yet): nothing to warn about
    data = load_json(answer.body.decode("utf-8", "replace"), LIVE_LIMIT)
    if not isinstance(data, dict):
        raise Untrusted(f"a JSON {type(data).__name__}, not an object")
    return data


@dataclass(frozen=True)
class LiveRead:
    """The endpoint's payload (None: no running rank 0, or it does not answer yet), or why it was refused."""

    status: LiveStatus | None = None
    problem: str = ""


def status_url(pods: Iterable[PodView], attempt: int, port: int) -> str | None:
    """Rank 0's endpoint for `attempt` at the pod's own IP, or None when it is not running (or the endpoint
    is off, or the pod has no IP address)."""
    if not port:
        return None
    for pod in pods:
        if pod.role == "worker" and pod.attempt == attempt and pod.rank == 0 and pod.phase == "Running" and pod.ip:
            try:
                ip = ipaddress.ip_address(pod.ip)
            except ValueError:
                return None
            return f"http://{ip if ip.version == 4 else f'[{ip}]'}:{port}/status"
    return None


def read_live(pods: Iterable[PodView], attempt: int, port: int, fetch: Fetch = http_fetch, *,
              max_in_place: int | None = None, now: datetime | None = None) -> LiveRead:
    """Fetch and check rank 0's status (see the module docstring). `max_in_place`: the job's maxInPlaceRestarts
    (a count beyond it is refused); `now`: the operator's clock, which trainerTime may not run ahead of."""
    url = status_url(pods, attempt, port)
    if url is None:
        return LiveRead()
    try:
        data = fetch(url)
        trainer_time(data.get("trainerTime") if isinstance(data, Mapping) else None, now)
        return LiveRead(status=checked(parse_live_status(data), max_in_place))
    except OverflowError:  # a number beyond a double (from a fetch that did not bound it)
        return LiveRead(problem=f"rank 0's status endpoint ({url}): a number beyond the range of a double")
    except (Untrusted, Redirected, http_get.TooLarge, TimeoutError) as exc:
        return LiveRead(problem=f"rank 0's status endpoint ({url}): {clean(exc, 300)}")
    except (OSError, ValueError, TypeError):
        return LiveRead()  # not listening yet (model still loading) or going away: the log covers it


def checked(status: LiveStatus | None, max_in_place: int | None = None) -> LiveStatus | None:
    """`status` when its numbers are in range (counts: int64, not negative, in-place restarts within the job's
    maxInPlaceRestarts and hangs within those; the ETA and speeds not negative and bounded), else Untrusted
    naming the field; its hang report's and restart cause's strings cut short."""
    if status is None:
        return None
    values: dict[str, Any] = dict(status)
    for key in _COUNTS:
        count(values.get(key), key)
    restarts = status["inPlaceRestarts"]
    if max_in_place is not None and restarts > max_in_place:
        raise Untrusted(f"inPlaceRestarts {restarts} is more than the job's maxInPlaceRestarts {max_in_place}")
    if status["hangs"] > restarts:
        raise Untrusted(f"hangs {status['hangs']} is more than its inPlaceRestarts {restarts}")
    if status["lastHang"] is not None:
        status["lastHang"] = capped(status["lastHang"])
    if status["lastRestart"] is not None:
        cause = status["lastRestart"]
        status["lastRestart"] = RestartCause(restart=cause["restart"], rank=cause["rank"], nodeRank=cause["nodeRank"],
                                             how=clean(cause["how"], 200))
    for key, (low, high) in _RANGES.items():
        if values.get(key) is not None and not low <= values[key] <= high:
            raise Untrusted(f"{key} is out of range")
    ckpt = status["lastCheckpoint"]
    if ckpt is not None:
        count(ckpt.get("iteration"), "lastCheckpoint.iteration")
        status["lastCheckpoint"] = CheckpointRef(iteration=ckpt["iteration"], time=_time(ckpt.get("time")))
    return status


def trainer_time(data: Any, now: datetime | None) -> None:
    """Untrusted, naming what is wrong, unless `data` (the payload's trainerTime) is absent or a time a process
    can have spent: its start a timestamp not ahead of `now` (give or take CLOCK_SKEW), its iterations a count,
    its seconds finite, not negative, and together no more than have passed since its start."""
    if data is None:
        return
    started = parse_stamp(data.get("started")) if isinstance(data, Mapping) else None
    if started is None:
        raise Untrusted("trainerTime.started is not a timestamp")
    count(data.get("steps"), "trainerTime.steps")
    spent = 0.0
    for key in ("train", "checkpoint", "evaluation"):
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_SECONDS:
            raise Untrusted(f"trainerTime.{key} is not a number of seconds")
        spent += value
    if now is not None:
        alive = (now - started).total_seconds() + CLOCK_SKEW
        if alive < 0 or spent > alive:
            raise Untrusted(f"trainerTime counts {spent:.0f} s, more than its process has run ({max(0.0, alive):.0f} s "
                            f"since {stamp(started)}, with {CLOCK_SKEW:.0f} s of clock skew)")


def _time(value: Any) -> str | None:
    """A checkpoint's time as status may hold it: a short timestamp without control characters."""
    return clean(value, 40) if isinstance(value, str) else None
