"""This rank's heartbeat and stack dumps, for the hang watchdog of its pod's torchrun agent (docs/recovery.md;
the record and the rules are kubetron.contract.hang, the watchdog kubetron.watchdog).

The launcher names two files per local rank in its messages directory: the heartbeat (KUBETRON_HEARTBEAT), a
record mapped into memory, so a beat is one struct packed into the mapping and no system call; and the stacks
(KUBETRON_STACKS), where faulthandler writes every thread's Python stack on DUMP_SIGNAL. faulthandler's handler
runs at the C level, so it dumps while the main thread is stuck in C (a gloo or NCCL collective, a store read).
Outside the launcher (no KUBETRON_HEARTBEAT) every call is a no-op.

A `Heartbeat` is one of the run's listeners (kubetron.events; the composition root, kubetron.training.run, opens it
with `from_env()`): a step done and a phase entered or left are published, and so is progress inside a long phase
(a checkpoint file written, an evaluation batch done).
"""

from __future__ import annotations

import contextlib
import faulthandler
import mmap
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO

from kubetron.contract.goodput import TrainerTime
from kubetron.contract.hang import CHECKPOINT, EVALUATION, RECORD_SIZE, STARTUP, TEARDOWN, Beat, encode_beat
from kubetron.contract.times import stamp
from kubetron.events import Event, PhaseEntered, PhaseLeft, Progress, Started, StepDone, Stopping
from kubetron.supervisor.startup import CLOCK

HEARTBEAT_ENV = "KUBETRON_HEARTBEAT"  # set by the launcher for each local rank
STACKS_ENV = "KUBETRON_STACKS"  # ditto: where this rank's stacks go on DUMP_SIGNAL
DUMP_SIGNAL = signal.SIGUSR1
RECENT_STEPS = 20  # iterations the slowest recent one is taken over


class Heartbeat:
    """The record of one rank (kubetron.contract.hang.Beat), published on every change."""

    def __init__(self, path: str | None = None, stacks: str | None = None):
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()  # an async save's writer thread marks progress too
        self._stacks: IO[str] | None = None
        self._seq, self.iteration, self.phase, self.steps = 0, 0, STARTUP, 0
        self.phase_since = self.progress_at = time.monotonic()
        self._outer: list[str] = []  # the phases a PhaseEntered interrupted, innermost last
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.slowest_step = self.train_seconds = 0.0
        self.seconds: dict[str, float] = {}  # per phase, the phases already left (goodput: trainer_time)
        if stacks:  # first: the watchdog sends DUMP_SIGNAL only to a rank whose heartbeat it read
            self._stacks = open(stacks, "a", encoding="utf-8")  # noqa: SIM115 - faulthandler writes to it until exit
            faulthandler.register(DUMP_SIGNAL, file=self._stacks, all_threads=True)
        if path:
            with open(path, "w+b") as fh:
                fh.truncate(RECORD_SIZE)
                self._map = mmap.mmap(fh.fileno(), RECORD_SIZE)
            self._publish()

    @classmethod
    def from_env(cls) -> Heartbeat:
        return cls(os.environ.get(HEARTBEAT_ENV) or None, os.environ.get(STACKS_ENV) or None)

    def _publish(self) -> None:
        if self._map is None:
            return
        with self._lock:
            self._seq += 1
            self._map[:RECORD_SIZE] = encode_beat(Beat(self._seq, self.iteration, self.phase, os.getpid(),
                                                       self.phase_since, self.progress_at, self.slowest_step,
                                                       self.steps))

    def enter(self, phase: str) -> str:
        """Begin `phase` now (progress too); returns the phase it replaces."""
        now = time.monotonic()
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + now - self.phase_since
        before, self.phase = self.phase, phase
        self.phase_since = self.progress_at = now
        self._publish()
        return before

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """`phase` for the block, then the phase before it again (leaving a long phase is progress)."""
        before = self.enter(phase)
        try:
            yield
        finally:
            self.enter(before)

    def progress(self) -> None:
        """Progress inside the current phase: a checkpoint file written, an evaluation batch done."""
        self.progress_at = time.monotonic()
        self._publish()

    def resumed(self, iteration: int) -> None:
        """The iteration this process resumed from (its record's iteration until its first step)."""
        self.iteration = iteration
        self._publish()

    def __call__(self, event: Event) -> None:
        """The run's events, as the watchdog reads them (a listener: kubetron.events)."""
        match event:
            case StepDone(iteration=iteration, seconds=seconds):
                self.step_done(iteration, seconds)
            case Progress():
                self.progress()
            case PhaseEntered(phase=phase):
                self._outer.append(self.enter(phase))
            case PhaseLeft():
                self.enter(self._outer.pop() if self._outer else STARTUP)
            case Started(iteration=iteration):
                self.resumed(iteration)
            case Stopping():  # judged again only in a final evaluation
                self._outer.clear()
                self.enter(TEARDOWN)

    def step_done(self, iteration: int, seconds: float) -> None:
        """Iteration `iteration` completed in `seconds`: progress, and its time among the recent ones."""
        now = time.monotonic()
        self._recent.append(seconds)
        self.train_seconds += seconds
        self.slowest_step = max(self._recent)
        self.iteration, self.progress_at = iteration, now
        self.steps += 1
        self._publish()

    def trainer_time(self) -> TrainerTime:
        """This process's time by what it did (docs/goodput.md), as rank 0's endpoint serves it."""
        now = time.monotonic()
        spent = {**self.seconds, self.phase: self.seconds.get(self.phase, 0.0) + now - self.phase_since}
        return TrainerTime(started=stamp(datetime.fromtimestamp(CLOCK.started, UTC)), steps=self.steps,
                           train=round(self.train_seconds, 3), checkpoint=round(spent.get(CHECKPOINT, 0.0), 3),
                           evaluation=round(spent.get(EVALUATION, 0.0), 3))
