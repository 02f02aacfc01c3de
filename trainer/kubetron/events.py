"""A run's life as typed events: what the training loop and the checkpoint manager tell the parts that watch a
run (the metrics logger, rank 0's status endpoint, the progress log, the hang watchdog's heartbeat, the
termination message) and what tests act on (tests/inprocess.py: "at step k, do X").

    Started -> (PhaseEntered/PhaseLeft, Progress, StepDone, SaveScheduled, CheckpointDurable, SnapshotWritten,
                Logged, Evaluated)* -> Stopping -> Ended

The composition root (kubetron.training.run) builds the listeners and hands the emitters one `Events`. A listener is
a callable taking one event; it runs in the emitter's thread (a save's `Progress` comes from an async save's writer
thread, `SnapshotWritten` from the memory snapshot's, everything else from the loop's). A listener that raises is
reported (a warning naming it, the event and the error, with its traceback) and dropped: it never ends the run nor
keeps the others from hearing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kubetron")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A durable checkpoint: its iteration and when its commit marker was written (contract.times stamp)."""

    iteration: int
    time: str | None


@dataclass(frozen=True, slots=True)
class Started:
    """The run's parts are built and its checkpoint (or pretrained weights) loaded; the loop starts next."""

    iteration: int  # the iteration resumed from (0: a fresh start)
    train_iters: int
    consumed_samples: int  # global samples consumed before this process's first step
    floating_point_operations: float  # ... and FLOPs done
    checkpoint: Checkpoint | None  # the durable checkpoint resumed from (None: none)
    recovery: dict[str, Any] | None = None  # how it resumed (contract.recovery.TrainerRecovery; None: a first start)


@dataclass(frozen=True, slots=True)
class PhaseEntered:
    """The rank begins a phase of kubetron.contract.hang (DATA, TRAIN, CHECKPOINT, EVALUATION, TEARDOWN)."""

    phase: str


@dataclass(frozen=True, slots=True)
class PhaseLeft:
    """The phase entered last ends; the one before it goes on."""

    phase: str


@dataclass(frozen=True, slots=True)
class Progress:
    """Progress inside a long phase: a checkpoint file written, an evaluation batch done, an iteration skipped."""


PROGRESS = Progress()


@dataclass(frozen=True, slots=True)
class StepDone:
    """Iteration `iteration` completed. The losses and norms stay on the device (reading them is a sync)."""

    iteration: int
    seconds: float  # the iteration's wall time (monotonic)
    consumed_samples: int  # global samples consumed so far
    losses: dict[str, Any]  # name -> 0-dim device tensor, averaged over micro-batches and DP ranks
    learning_rate: float
    grad_norm: Any  # 0-dim device tensor (non-finite: the update was skipped)
    skipped: bool  # fp16: the loss scale overflowed, no update
    params_norm: Any  # 0-dim device tensor with logger.log_params_norm, else None
    loss_scale: float  # the factor this iteration's backward pass used


@dataclass(frozen=True, slots=True)
class Logged:
    """The metrics logger's figures at a log interval (host values, read with one sync)."""

    iteration: int
    loss: float | None  # the first loss key's mean over the interval's finite values
    learning_rate: float
    tflops_per_gpu: float


@dataclass(frozen=True, slots=True)
class Evaluated:
    """An evaluation's losses (host floats) at the current iteration."""

    iteration: int
    losses: dict[str, float]
    prefix: str  # `iteration N`, or `iteration N on validation set` / `... on test set`
    label: str  # the scalars' suffix: validation, test
    tensorboard: bool  # also to TensorBoard (an evaluation during training; the final ones too)


@dataclass(frozen=True, slots=True)
class SaveScheduled:
    """An async save of `iteration` left the loop: its host copy is taken, its write runs in the background (a
    `CheckpointDurable` follows once it is committed)."""

    iteration: int


@dataclass(frozen=True, slots=True)
class CheckpointDurable:
    """A checkpoint's commit marker and tracker are written on every rank: a resume finds it."""

    checkpoint: Checkpoint
    taken: float  # wall time (time.time()) of its snapshot
    train_state: dict[str, Any]  # the counters as of the snapshot (TrainState.state_dict())
    save_seconds: float  # from the start of its save until durable
    blocked_seconds: float  # ... of which the loop waited
    async_save: bool


@dataclass(frozen=True, slots=True)
class SnapshotWritten:
    """This rank's memory snapshot of `iteration` is in the pod's memory volume, whole (checkpoint/snapshot.py; from
    its writer thread). A restart can load it once every rank has it (and, for a lost pod, its copies are on peers)."""

    iteration: int
    seconds: float  # its write in the background


@dataclass(frozen=True, slots=True)
class Stopping:
    """The loop stopped: how the run ends unless what follows (the final evaluation, teardown) fails."""

    code: int  # kubetron.contract.exitcodes
    message: str


@dataclass(frozen=True, slots=True)
class Ended:
    """The run is over (teardown done): its exit code and one-line message, the iteration it reached."""

    code: int
    message: str
    iteration: int | None  # None: it ended before its state existed


Event = (Started | PhaseEntered | PhaseLeft | Progress | StepDone | Logged | Evaluated | SaveScheduled
         | CheckpointDurable | SnapshotWritten | Stopping | Ended)
Listener = Callable[[Event], object]


class Events:
    """The run's listeners, in the order added; `emit` calls each with the event."""

    def __init__(self, listeners: Sequence[Listener] = ()):
        self._listeners: tuple[Listener, ...] = tuple(listeners)
        self._lock = threading.Lock()

    def add(self, listener: Listener) -> None:
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def emit(self, event: Event) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception as exc:
                self._drop(listener, event, exc)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """`name` for the block, then the phase before it again."""
        self.emit(PhaseEntered(name))
        try:
            yield
        finally:
            self.emit(PhaseLeft(name))

    def _drop(self, listener: Listener, event: Event, exc: Exception) -> None:
        with self._lock:
            if listener not in self._listeners:
                return
            self._listeners = tuple(x for x in self._listeners if x is not listener)
        log.warning("run listener %s failed on %s and is dropped (the run goes on): %s: %s",
                    _name(listener), type(event).__name__, type(exc).__name__, exc, exc_info=exc)


def _name(listener: Listener) -> str:
    return getattr(listener, "__qualname__", None) or type(listener).__qualname__
