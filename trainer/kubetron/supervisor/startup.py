"""How long this process took from its start to the end of its first training step, by phase.

Start-up is most of an in-place restart's recovery time (docs/recovery.md), so the trainer measures it
every time: rank 0 logs one line after its first step,

    start-up: 5.62 s from process start to the end of iteration 11: python + config 0.31 s, imports 2.40 s, ...

Phases end where the trainer calls `mark(phase)`, in PHASES order; `bench/recovery.py` reads the line.
Process start is the kernel's (the fork by torchrun, before the interpreter started), from /proc on
Linux; elsewhere the import of this module. Torch-free, I/O only at import (two /proc reads).
"""

from __future__ import annotations

import os
import re
import time

PHASES = ("python + config", "imports", "distributed init", "model + data", "checkpoint load", "first step")
LINE_RE = re.compile(r"start-up: ([0-9.]+) s from process start to the end of iteration (\d+): (.*)$")


def process_start_time() -> float:
    """This process's start, seconds since the epoch (10 ms resolution on Linux)."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks since boot
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class StartupClock:
    """Wall-clock ends of the start-up phases of one process."""

    def __init__(self, started: float):
        self.started = started
        self.ends: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """`phase` ended now (the first time only: a second pretrain() in one process is not a start-up)."""
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}")
        self.ends.setdefault(phase, time.time())

    def durations(self) -> dict[str, float]:
        """Seconds per marked phase, each from the end of the one before (process start for the first)."""
        out, last = {}, self.started
        for phase in PHASES:
            if phase in self.ends:
                out[phase], last = self.ends[phase] - last, self.ends[phase]
        return out

    def finish(self, iteration: int) -> str | None:
        """Mark the first step done and return the start-up line; None after the first call."""
        if "first step" in self.ends:
            return None
        self.mark("first step")
        return self.line(iteration)

    def line(self, iteration: int) -> str:
        total = max(self.ends.values(), default=self.started) - self.started
        phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.durations().items())
        return f"start-up: {total:.2f} s from process start to the end of iteration {iteration}: {phases}"


def parse_line(text: str) -> tuple[float, int, dict[str, float]] | None:
    """(total seconds, iteration, {phase: seconds}) from a log line holding `StartupClock.line`."""
    m = LINE_RE.search(text.rstrip())
    if m is None:
        return None
    phases = {}
    for part in m.group(3).split(", "):
        name, _, seconds = part.rpartition(" ")[0].rpartition(" ")
        phases[name] = float(seconds)
    return float(m.group(1)), int(m.group(2)), phases


CLOCK = StartupClock(process_start_time())  # this process's
