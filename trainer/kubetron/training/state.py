"""GlobalState: what the loop and the forward step share (config, counters, timers, loggers)."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TrainState:
    """Counters saved in every checkpoint (and in the tracker `latest_train_state.pt`)."""

    step: int = 0  # iterations completed (the checkpoint's iteration)
    consumed_train_samples: int = 0  # global samples, all data-parallel ranks together
    skipped_train_samples: int = 0  # samples consumed by iterations_to_skip
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0.0
    do_train: bool = True
    do_valid: bool = False

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> TrainState:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


class SignalHandler:
    """Records SIGTERM/SIGINT; the loop finishes its step, saves, and exits (never mid-step)."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.received: int | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def release(self):
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous = {}


class Timers:
    """Wall-clock timers by name (seconds). Cheap: no device sync (the loop syncs at log time)."""

    def __init__(self):
        self._start: dict[str, float] = {}
        self.elapsed: dict[str, float] = {}

    def start(self, name: str):
        self._start[name] = time.perf_counter()

    def stop(self, name: str) -> float:
        dt = time.perf_counter() - self._start.pop(name)
        self.elapsed[name] = self.elapsed.get(name, 0.0) + dt
        return dt

    def pop(self, name: str) -> float:
        return self.elapsed.pop(name, 0.0)


@dataclass
class GlobalState:
    """Handed to forward-step functions that ask for it (by annotation or a first arg named state)."""

    cfg: Any
    train_state: TrainState = field(default_factory=TrainState)
    timers: Timers = field(default_factory=Timers)
    signal_handler: SignalHandler | None = None
    metrics: Any = None  # kubetron.training.metrics.MetricsLogger
    start_time: float = field(default_factory=time.time)  # this process's start (seconds)
    rank: int = 0
    world_size: int = 1
    device: Any = None  # torch.device
