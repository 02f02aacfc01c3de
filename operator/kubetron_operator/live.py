"""Live numbers from rank 0's status endpoint (`GET http://<pod-ip>:<statusPort>/status`, docs/CONTRACT.md).

The operator reads it every `--interval` seconds while an attempt runs (far inside the 60 s the status
may lag), and on every change to the job's pods, so the pods need no RBAC at all to report progress.
The fetch is injectable for tests.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from kubetron.contract.live import LiveStatus, parse_live_status

from kubetron_operator.observe import PodView

Fetch = Callable[[str], dict[str, Any]]


def http_fetch(url: str, timeout: float = 3.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # cluster-internal http
        data = json.loads(resp.read(65536))
    if not isinstance(data, dict):
        raise TypeError(f"{url} did not return a JSON object")
    return data


def status_url(pods: Iterable[PodView], attempt: int, port: int) -> str | None:
    """Rank 0's endpoint for `attempt`, or None when it is not running (or the endpoint is off)."""
    if not port:
        return None
    for pod in pods:
        if pod.role == "worker" and pod.attempt == attempt and pod.rank == 0 and pod.phase == "Running" and pod.ip:
            return f"http://{pod.ip}:{port}/status"
    return None


def read_live(pods: Iterable[PodView], attempt: int, port: int, fetch: Fetch = http_fetch) -> LiveStatus | None:
    """The endpoint's payload, or None when there is no running rank 0 or it does not answer (yet)."""
    url = status_url(pods, attempt, port)
    if url is None:
        return None
    try:
        return parse_live_status(fetch(url))
    except (OSError, ValueError, TypeError):
        return None  # not listening yet (model still loading) or going away: the log covers it
