"""Rank 0's status endpoint (docs/CONTRACT.md): `GET /status` JSON, `GET /metrics` (Prometheus text
format) and `GET /healthz`.

A `ThreadingHTTPServer` on a daemon thread. The training loop calls `update(...)` with the latest
values; the handler serves a snapshot. It never takes the trainer down: a port that cannot be bound
is logged as a warning and the server stays disabled (`update` and `close` still work, as no-ops).
Standard library only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from kubetron.contract.goodput import TrainerTime
from kubetron.contract.live import LiveStatus, jsonable, new_live_status
from kubetron.contract.times import parse_stamp
from kubetron.supervisor.progress_io import hangs, in_place_restarts, restart_cause

logger = logging.getLogger(__name__)

STATUS_PORT_ENV = "KUBETRON_STATUS_PORT"

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
