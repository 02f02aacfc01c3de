"""What the handlers use (Deps, passed to kopf as its `memo`, injectable for tests): the API, the view of the
watches, the readers of what trainers report, the thread pools and the watch over them (PoolWatch).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from kubetron_operator.api_calls import Kube
from kubetron_operator.events import Activity, EventPoster
from kubetron_operator.model import Job
from kubetron_operator.node_taints import Taints
from kubetron_operator.pod_cache import PodCache
from kubetron_operator.trainer_reports import status_endpoint
from kubetron_operator.trainer_reports.store_log import ProgressRead, read_s3_progress
from kubetron_operator.view import View

RECONCILE_THREADS = 16  # jobs reconciled at once (each mostly waits for the API server)
IO_THREADS = 16  # reads of what pods and stores serve, at once (gather)


class PoolWatch:
    """How long work handed to the thread pools has waited for a thread: `oldest()` is the longest wait of
    what waits now (0 when nothing waits). /healthz fails beyond handlers.STARVED_AFTER."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[object, float] = {}

    async def run(self, executor: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in `executor`, its wait for a thread watched."""
        ticket, loop = object(), asyncio.get_running_loop()
        with self._lock:
            self._waiting[ticket] = time.monotonic()

        def started() -> Any:
            with self._lock:
                self._waiting.pop(ticket, None)
            return fn(*args)

        try:
            return await loop.run_in_executor(executor, started)
        finally:
            with self._lock:
                self._waiting.pop(ticket, None)

    def oldest(self) -> float:
        now = time.monotonic()
        with self._lock:
            return max((now - t for t in self._waiting.values()), default=0.0)


@dataclasses.dataclass
class Deps:
    """What the handlers use, injectable for tests (passed to kopf as its `memo`)."""

    kube: Kube
    interval: float = 5.0  # seconds between live-progress reads of a running job
    read_progress: Callable[[Job, Kube], ProgressRead] = read_s3_progress
    fetch_live: status_endpoint.Fetch = status_endpoint.http_fetch
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)
    view: View = dataclasses.field(default_factory=View)  # what the operator holds per job (JobMemory)
    # Reconciles wait on the API server, not the CPU: more threads than asyncio's default (cores + 4).
    executor: ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: ThreadPoolExecutor(RECONCILE_THREADS, thread_name_prefix="reconcile"))
    io_executor: ThreadPoolExecutor = dataclasses.field(  # what pods and stores serve (gather)
        default_factory=lambda: ThreadPoolExecutor(IO_THREADS, thread_name_prefix="read"))
    io_slots: dict[str, asyncio.Semaphore] = dataclasses.field(default_factory=dict)  # namespace -> its reads
    pools: PoolWatch = dataclasses.field(default_factory=PoolWatch)
    activity: Activity = dataclasses.field(default_factory=Activity)  # actions in flight
    creating: Activity = dataclasses.field(default_factory=Activity)  # those that create an attempt
    news_waker: asyncio.Future[None] | None = None  # wakes the jobs whose news wait, once no attempt is created
    poster: EventPoster = dataclasses.field(init=False)  # the jobs' Events, through `kube`
    namespaces: tuple[str, ...] = ()  # the watched namespaces (empty: the whole cluster)
    pods: PodCache | None = None  # the jobs' pods, once listed (start_pod_cache)
    taints: Taints | None = None  # with --taint-failing-nodes: the nodes' taints (node_taints.py)

    def __post_init__(self) -> None:
        self.poster = EventPoster(self.kube, self.activity)
