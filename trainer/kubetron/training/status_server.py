"""Rank 0's status endpoint (docs/CONTRACT.md): `GET /status` JSON, `GET /metrics` (Prometheus text
format) and `GET /healthz`.

A `ThreadingHTTPServer` on a daemon thread. `StatusPublisher`, one of the run's listeners (kubetron.events), calls
`update(...)` with the latest values; the handler serves a snapshot. It never takes the trainer down: a port that
cannot be bound is logged as a warning and the server stays disabled (`update` and `close` still work, as no-ops).

The status is refreshed at every log time (the metrics logger's `Logged`: loss, learning rate, TFLOP/s) and, between
them, at least every `STATUS_EVERY` seconds from host-side numbers only (iteration counter, wall-clock throughput,
ETA), and at once when a checkpoint is durable: the operator's view lags by seconds even when `log_interval` steps
are minutes apart, and no step pays a device sync for it. Standard library only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from kubetron.contract.goodput import TrainerTime
from kubetron.contract.live import LiveStatus, jsonable, new_live_status
from kubetron.contract.times import parse_stamp
from kubetron.events import Checkpoint, CheckpointDurable, Event, Logged, Started, StepDone
from kubetron.supervisor.progress_io import hangs, in_place_restarts, restart_cause

logger = logging.getLogger(__name__)

STATUS_PORT_ENV = "KUBETRON_STATUS_PORT"
STATUS_EVERY = 10.0
"""Seconds: the longest the status endpoint goes without a refresh while steps complete."""

METRICS = (  # (name, status key, help): gauges of GET /metrics
    ("kubetron_trainer_iteration", "iteration", "Last completed training iteration."),
    ("kubetron_trainer_train_iters", "trainIters", "Iterations the run trains for (train.train_iters)."),
    ("kubetron_trainer_consumed_samples", "consumedSamples", "Training samples consumed so far."),
    ("kubetron_trainer_loss", "loss", "Training loss, averaged over the last log interval."),
    ("kubetron_trainer_learning_rate", "learningRate", "Learning rate of the last iteration."),
    ("kubetron_trainer_tokens_per_second", "tokensPerSecond", "Training throughput of the whole job."),
    ("kubetron_trainer_tflops_per_gpu", "tflopsPerGpu", "Model TFLOP/s per GPU over the last log interval."),
    ("kubetron_trainer_eta_seconds", "etaSeconds", "Estimated seconds until train_iters."),
    ("kubetron_trainer_checkpoint_save_seconds", "checkpointSaveSeconds",
     "Seconds the newest durable checkpoint took, from the start of its save until durable."),
    ("kubetron_trainer_checkpoint_blocked_seconds", "checkpointBlockedSeconds",
     "Seconds the training loop waited for the newest durable checkpoint's save."),
)
CONTENT_TYPE_METRICS = "text/plain; version=0.0.4; charset=utf-8"


def metrics_text(status: LiveStatus, now: float | None = None) -> str:
    """The status as Prometheus gauges; unknown values are left out (absent, not 0). The checkpoint's age is
    computed at scrape time, so it grows while no checkpoint is written."""
    lines: list[str] = []

    def gauge(name: str, value: Any, help_text: str) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {float(value)!r}"))

    for name, key, help_text in METRICS:
        gauge(name, status.get(key), help_text)
    ckpt = status.get("lastCheckpoint")
    saved = parse_stamp(ckpt.get("time")) if ckpt else None
    if ckpt:
        gauge("kubetron_trainer_last_checkpoint_iteration", ckpt.get("iteration"),
              "Iteration of the last durable checkpoint.")
    if saved is not None:
        gauge("kubetron_trainer_last_checkpoint_age_seconds", (time.time() if now is None else now) - saved.timestamp(),
              "Seconds since the last durable checkpoint was written.")
    return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    server_version = "kubetron-status"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        if path == "/status":
            body = json.dumps(self.server.status_owner.snapshot()).encode()  # type: ignore[attr-defined]
            self._reply(200, body, "application/json")
        elif path == "/metrics":
            body = metrics_text(self.server.status_owner.snapshot()).encode()  # type: ignore[attr-defined]
            self._reply(200, body, CONTENT_TYPE_METRICS)
        elif path in ("/healthz", "/livez", "/readyz"):
            self._reply(200, b"ok", "text/plain; charset=utf-8")
        else:
            self._reply(404, b"not found", "text/plain; charset=utf-8")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _reply(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: no per-request lines on stderr."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    status_owner: StatusServer

    def handle_error(self, request, client_address) -> None:
        """A dropped client is not worth a traceback on stderr."""
        exc = sys.exc_info()[1]
        logger.debug("status endpoint: error serving %s: %r", client_address, exc)


class StatusServer:
    """Serve `GET /status` on `host:port` (0: an ephemeral port, see `.port`) from a daemon thread."""

    def __init__(self, port: int, host: str = "0.0.0.0", trainer_time: Callable[[], TrainerTime] | None = None):
        self._lock = threading.Lock()
        self._trainer_time = trainer_time  # read at each request: the process's time to the second (docs/goodput.md)
        self._status: LiveStatus = new_live_status(in_place_restarts(), *hangs(), restart_cause())  # docs/recovery.md
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.host = host
        try:
            server = _Server((host, int(port)), _Handler)
        except (OSError, OverflowError, ValueError) as exc:
            logger.warning("status endpoint disabled: cannot listen on %s:%s (%s)", host, port, exc)
            return
        server.status_owner = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="kubetron-status", daemon=True
        )
        self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._server is not None

    @property
    def port(self) -> int | None:
        """The bound port, or None when disabled (bind failed) or closed."""
        return None if self._server is None else int(self._server.server_address[1])

    @property
    def url(self) -> str | None:
        if self._server is None:
            return None
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def update(self, **fields: Any) -> None:
        """Merge `fields` into the status (thread-safe). Values must be JSON-able; NaN/Inf become null."""
        clean = {key: jsonable(value) for key, value in fields.items()}
        with self._lock:
            self._status.update(clean)  # type: ignore[typeddict-item]  # the loop passes LiveStatus keys

    def snapshot(self) -> LiveStatus:
        with self._lock:
            status = self._status.copy()
        if self._trainer_time is not None:
            status["trainerTime"] = self._trainer_time()
        return status

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        try:
            server.shutdown()
            server.server_close()
        except Exception:  # pragma: no cover - shutting down must not raise into the trainer
            logger.debug("status endpoint: error while closing", exc_info=True)
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def status_server_from_env(host: str = "0.0.0.0") -> StatusServer | None:
    """A StatusServer on `KUBETRON_STATUS_PORT`, or None when it is unset, empty, 0 or not a number."""
    raw = os.environ.get(STATUS_PORT_ENV, "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        logger.warning("status endpoint disabled: %s=%r is not a port number", STATUS_PORT_ENV, raw)
        return None
    if port <= 0:
        return None
    return StatusServer(port, host=host)


class Pace:
    """A run's pace from host clocks: throughput over the last `window` iterations (Megatron's report_throughput) and
    the time left to `train_iters` at this process's pace so far (report_runtime)."""

    def __init__(self, window: int, tokens_per_iteration: int, train_iters: int, clock: Callable[[], float]):
        self.tokens_per_iteration, self.train_iters, self.clock = tokens_per_iteration, train_iters, clock
        self._recent: deque[tuple[int, float]] = deque(maxlen=window + 1)  # (iteration, time)
        self._start = clock()
        self._start_iteration: int | None = None

    def step(self, iteration: int, now: float) -> None:
        if self._start_iteration is None:
            self._start_iteration = iteration - 1
        self._recent.append((iteration, now))

    def tokens_per_second(self) -> float:
        if len(self._recent) < 2:
            return 0.0
        (i0, t0), (i1, t1) = self._recent[0], self._recent[-1]
        return (i1 - i0) * self.tokens_per_iteration / max(t1 - t0, 1e-9)

    def remaining_seconds(self, iteration: int) -> float:
        done = iteration - (self._start_iteration or 0)
        if done <= 0:
            return 0.0
        return (self.clock() - self._start) / done * max(self.train_iters - iteration, 0)


class StatusPublisher:
    """A run's listener (kubetron.events): the live status on rank 0's endpoint."""

    def __init__(self, server: StatusServer, cfg, clock: Callable[[], float] = time.perf_counter):
        self.server, self.train_iters, self.clock = server, cfg.train.train_iters, clock
        self.pace = Pace(cfg.logger.throughput_window_size, cfg.train.global_batch_size * cfg.model.seq_length,
                         cfg.train.train_iters, clock)
        self._iteration = self._consumed = 0
        self._last = clock()

    def __call__(self, event: Event) -> None:
        match event:
            case StepDone(iteration=iteration, consumed_samples=consumed):
                now = self.clock()
                self.pace.step(iteration, now)
                self._iteration, self._consumed = iteration, consumed
                if now - self._last >= STATUS_EVERY:
                    self._publish()
            case Logged():
                self._publish(loss=event.loss, learningRate=event.learning_rate, tflopsPerGpu=event.tflops_per_gpu)
            case CheckpointDurable(checkpoint=checkpoint):
                self.server.update(lastCheckpoint=_checkpoint(checkpoint), checkpointSaveSeconds=event.save_seconds,
                                   checkpointBlockedSeconds=event.blocked_seconds)
            case Started(iteration=iteration, consumed_samples=consumed, checkpoint=checkpoint):
                self._iteration, self._consumed = iteration, consumed
                self.server.update(trainIters=self.train_iters, iteration=iteration,
                                   resumedFrom=iteration,  # this process's start: the goodput ledger's
                                   consumedSamples=consumed, lastCheckpoint=_checkpoint(checkpoint))

    def _publish(self, **latest: float | None) -> None:
        """`latest`: loss, learningRate and tflopsPerGpu, known at log time only."""
        self._last = self.clock()
        self.server.update(iteration=self._iteration, trainIters=self.train_iters, consumedSamples=self._consumed,
                           tokensPerSecond=round(self.pace.tokens_per_second(), 1),
                           etaSeconds=round(self.pace.remaining_seconds(self._iteration), 1), **latest)


def _checkpoint(checkpoint: Checkpoint | None) -> dict | None:
    return None if checkpoint is None else {"iteration": checkpoint.iteration, "time": checkpoint.time}
