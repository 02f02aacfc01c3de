"""Tests that train in the pytest process: a world of one rank (gloo) with megatron's parallel_state, the tiny
example config, `pretrain()`/`finetune()`, and the driver that says "at step k, do X" (`Driver`, `drive`).

The driver is one of the run's listeners (kubetron.events): at `StepDone(k)` (or when a phase starts) it acts
through the run's own seams, deterministically, with no pipe and no process: a signal is handed to the run's
`SignalHandler.receive` (what the OS handler calls), a peer's failure is raised by the next forward step (where a
collective would raise it), a save is stopped at a point of kubetron.checkpoint.manager.SAVE_POINTS (the fault
hook the CLI fills from KUBETRON_CHAOS_KILL_AT). `drive` runs `kubetron train`'s own path (`run_from_cli`: the exit
code, the one line, the termination message) in this process, with megatron imported once for the session.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.trainer_utils import TINY, free_port

PEER_FAILURE = "Connection reset by peer"  # what gloo raises in a collective whose peer died


def ensure_world_of_one():
    """A gloo process group of 1 and parallel_state at tp = pp = 1 (idempotent)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if parallel_state.model_parallel_is_initialized():  # groups of a process group that is gone
            parallel_state.destroy_model_parallel()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def in_process_config(*overrides: str):
    """The tiny example config for an in-process run: no saving, no signal handlers in pytest."""
    from kubetron.config import ConfigContainer

    return ConfigContainer.from_yaml(TINY, ["checkpoint.save=null", "validation.eval_interval=null",
                                            "train.exit_signal_handler=false", *overrides])


def run_pretrain(cfg, forward_step_func, mode: str = "pretrain", **non_loss) -> int:
    """`pretrain()` / `finetune()` in this process (the entry point sets parallel_state up itself);
    `non_loss`: process_non_loss_data_func / non_loss_data_func."""
    import torch.distributed as dist
    from kubetron.training import entry
    from megatron.core import parallel_state

    ensure_world_of_one()  # keeps one process group for the whole session
    parallel_state.destroy_model_parallel()  # pretrain() initializes it for its config
    try:
        return (entry.finetune if mode == "finetune" else entry.pretrain)(cfg, forward_step_func, **non_loss)
    finally:
        assert dist.is_initialized()
        ensure_world_of_one()


class SaveStopped(BaseException):  # noqa: N818 - a stop, as a SIGKILL is, not an error the run handles
    """Raised at a point of a save: the run ends there, its transaction left as a killed process leaves it (a
    BaseException: no `except Exception` of the trainer aborts the transaction or reports an ending)."""


@dataclass
class Driver:
    """What to do at which step of an in-process run, and what the run told its listeners (`events`)."""

    signals: Any = None  # the run's SignalHandler, not installed (set by `drive`)
    actions: dict[int, list[Callable[[], object]]] = field(default_factory=dict)
    on_phase: dict[str, list[Callable[[], object]]] = field(default_factory=dict)
    events: list = field(default_factory=list)
    fail_forward_after: int | None = None  # the forward steps after this iteration raise a peer's failure
    stop_save: tuple[str, int] | None = None  # (point, iteration): the save stops there (SaveStopped)
    _iteration: int = 0

    def at(self, iteration: int, action: Callable[[], object]) -> Driver:
        self.actions.setdefault(iteration, []).append(action)
        return self

    def signal_at(self, iteration: int, sig: int = signal.SIGTERM) -> Driver:
        """`sig` reaches the run right after `iteration` completed (through the handler the OS would call)."""
        return self.at(iteration, lambda: self.signals.receive(sig))

    def signal_in_phase(self, phase: str, sig: int = signal.SIGTERM) -> Driver:
        """`sig` reaches the run as soon as it enters `phase` (kubetron.contract.hang), e.g. an evaluation."""
        self.on_phase.setdefault(phase, []).append(lambda: self.signals.receive(sig))
        return self

    def peer_fails_after(self, iteration: int) -> Driver:
        """The next iteration's first collective raises what gloo raises when a peer died."""
        self.fail_forward_after = iteration
        return self

    def stop_save_at(self, point: str, iteration: int) -> Driver:
        """The save of `iteration` stops at `point` (kubetron.checkpoint.manager.SAVE_POINTS), as a kill would."""
        self.stop_save = (point, iteration)
        return self

    def __call__(self, event) -> None:
        from kubetron.events import PhaseEntered, StepDone

        self.events.append(event)
        if isinstance(event, StepDone):
            self._iteration = event.iteration
            for action in self.actions.pop(event.iteration, []):
                action()
        elif isinstance(event, PhaseEntered):
            for action in self.on_phase.pop(event.phase, []):
                action()

    def faults(self, point: str, iteration: int) -> None:
        if self.stop_save == (point, iteration):
            raise SaveStopped(f"save of iteration {iteration} stopped {point}")

    def forward_step(self, forward_step_func):
        """`forward_step_func`, failing as a dead peer makes it fail once `peer_fails_after` is passed."""
        def step(state, data_iterator, model, return_schedule_plan: bool = False):
            if self.fail_forward_after is not None and self._iteration >= self.fail_forward_after:
                raise RuntimeError(f"[gloo/transport/tcp/pair.cc:534] {PEER_FAILURE}")
            return forward_step_func(state, data_iterator, model)
        return step

    def of(self, kind: type) -> list:
        """The events of one kind the run emitted, in order."""
        return [e for e in self.events if isinstance(e, kind)]


@dataclass
class Outcome:
    code: int  # the exit code `kubetron train` would exit with
    termination: dict | None  # the termination message it wrote
    driver: Driver


def drive_argv(tmp_path: Path, argv: Sequence[str], *, driver: Driver | None = None) -> Outcome:
    """`kubetron train|finetune [--config FILE] OVERRIDES...`, as `drive` runs it."""
    mode = {"train": "pretrain", "finetune": "finetune"}[argv[0]]
    rest, config = list(argv[1:]), None
    if "--config" in rest:
        at = rest.index("--config")
        config = rest[at + 1]
        del rest[at:at + 2]
    return drive(tmp_path, *rest, driver=driver, mode=mode, config=config)


def drive(tmp_path: Path, *overrides: str, driver: Driver | None = None, mode: str = "pretrain",
          forward_step_func=None, config: str | None = TINY, listeners: Sequence[Callable] = ()) -> Outcome:
    """`kubetron train --config CONFIG OVERRIDES` (or finetune) in this process, acted on by `driver`: the same
    path as the command (`run_from_cli`), with a signal handler the driver delivers to instead of the OS's.
    `listeners`: more of the run's listeners, after the driver."""
    import torch.distributed as dist
    from kubetron.config import ConfigContainer
    from kubetron.training import entry
    from kubetron.training.gpt_step import forward_step
    from kubetron.training.state import SignalHandler
    from megatron.core import parallel_state

    driver = driver or Driver()
    term = tmp_path / f"termination-{len(list(tmp_path.glob('termination-*')))}.json"
    cfg = ConfigContainer.from_yaml(config, [f"train.termination_log={term}", *overrides])
    driver.signals = SignalHandler(entry.exit_signals(cfg), install=False)
    if dist.is_initialized():  # the run makes its own world of one, as the command does
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    try:
        code = entry.run_from_cli(cfg, mode, signals=driver.signals, faults=driver.faults,
                                  listeners=[driver, *listeners],
                                  forward_step_func=driver.forward_step(forward_step_func or forward_step))
    finally:
        _restore_world()  # (the command's own process group is gone, or left behind by a SaveStopped)
    termination = json.loads(term.read_text()) if term.exists() else None
    return Outcome(code, termination, driver)


def _restore_world():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    ensure_world_of_one()


def command(capsys, *argv: str) -> tuple[int, str, str]:
    """`kubetron ARGV` in this process (kubetron.cli.main, as the console script calls it): exit code, stdout,
    stderr. A training command runs `run_from_cli` with the signal handler installed and released again."""
    from kubetron import cli

    capsys.readouterr()
    try:
        code = cli.main(list(argv))
    finally:
        _restore_world()
    out = capsys.readouterr()
    return code, out.out, out.err


@contextlib.contextmanager
def console() -> Iterator[io.StringIO]:
    """What a run prints and logs, as `kubetron train` shows it on its console (for fixtures, which cannot take
    capsys): stdout and the `kubetron` logger's records, in order, into the yielded buffer."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logging.Formatter("[kubetron] %(message)s"))
    logger = logging.getLogger("kubetron")
    logger.addHandler(handler)
    try:
        with contextlib.redirect_stdout(buffer):
            yield buffer
    finally:
        logger.removeHandler(handler)


@dataclass
class Ran:
    """What `run_command` gives back, as subprocess.run's CompletedProcess would."""

    returncode: int
    stdout: str  # what the command printed, and the `kubetron` logger's records (its console in a process)
    stderr: str


def run_command(argv: Sequence[str], tmp: Path) -> Ran:
    """`kubetron ARGV` in this process, as a user runs it (kubetron.cli.main), with its own termination log under
    `tmp` (KUBETRON_TERMINATION_LOG): exit code, console, stderr. For tests that check what a command does, not
    what only a process shows (its exit status as the OS reports it, its interpreter's teardown)."""
    import os
    import time

    from kubetron import cli

    err = io.StringIO()
    saved = os.environ.get("KUBETRON_TERMINATION_LOG")
    os.environ["KUBETRON_TERMINATION_LOG"] = str(tmp / f"termination-{time.monotonic_ns()}.log")
    try:
        with console() as out, contextlib.redirect_stderr(err):
            code = cli.main(list(argv))
    finally:
        _restore_world()
        if saved is None:
            os.environ.pop("KUBETRON_TERMINATION_LOG", None)
        else:
            os.environ["KUBETRON_TERMINATION_LOG"] = saved
    return Ran(code, out.getvalue(), err.getvalue())
