"""GlobalState: what the loop and the forward step share (config, counters, timers, loggers)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from kubetron.config import ConfigContainer


@dataclass
class TrainState:
    """Counters saved in every checkpoint (and in the tracker `latest_train_state.pt`)."""

    step: int = 0  # iterations completed (the checkpoint's iteration)
    consumed_train_samples: int = 0  # global samples, all data-parallel ranks together
    skipped_train_samples: int = 0  # samples consumed by iterations_to_skip
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0.0
    do_train: bool = True
    do_valid: bool = False  # a validation split exists and validation.eval_iters > 0 (set by pretrain)
    do_test: bool = False  # a test split exists and validation.eval_iters > 0 (set by pretrain)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> TrainState:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)

    def load_state_dict(self, d: dict[str, Any]):
        """In place (the loop and the checkpoint manager hold this object): every field from `d`, or its
        default where `d` lacks it (a checkpoint of an older kubetron)."""
        loaded = self.from_state_dict(d)
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(loaded, name))


class SignalHandler:
    """Records SIGTERM/SIGINT; the loop finishes its step, saves, and exits (never mid-step).

    A signal reaches the run through `receive()`: the OS handler installed here calls it, and so do tests that stop
    a run in their own process (`install=False`: no OS handler, tests/inprocess.py).

    Once the loop has ended (`settle()`), a signal changes nothing: the run's exit code is decided, and
    the process goes on to exit with it. `kubetron train` then ignores the signals until the process exits
    (`ignore_until_exit()`), so a SIGTERM during teardown cannot turn a completed run into a killed one (143).
    """

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT), *, install: bool = True):
        self.received: int | None = None
        self._settled = False
        self._previous = {}
        if install and threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.receive(signum)

    def receive(self, signum: int) -> None:
        """`signum` arrived: the loop saves and stops after the step it is in (the first signal counts)."""
        if self.received is None and not self._settled:
            self.received = signum

    def settle(self):
        """The run's outcome is decided: later signals are ignored (not recorded) until `release()`."""
        self._settled = True

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def ignore_until_exit(self):
        """The process is about to exit with its decided code: the signals are ignored from here on.

        Not left to this handler: Python's finalization puts a signal whose handler is a Python function back
        to the default (terminate) before torch's own teardown runs, and a SIGTERM in those few hundred
        milliseconds killed a completed run (-15). An ignored signal stays ignored through finalization.
        """
        self.settle()
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)

    def release(self):
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous = {}


class Timers:
    """The loop's wall-clock timers by name, summed until `pop_all()` (seconds), with Megatron's levels:
    a timer whose level is above `log_level` (logger.timing_log_level) is not run. Cheap: no device
    sync (on GPU a timer measures host time; the loop syncs once a step anyway).

    Level 0: interval-time (a whole iteration); 1: forward-backward, grads (reduction and clipping),
    optimizer, save-checkpoint, evaluate; 2: forward-compute, backward-compute (per micro-batch).
    """

    def __init__(self, log_level: int = 0):
        self.log_level = log_level
        self.elapsed: dict[str, float] = {}

    @contextmanager
    def time(self, name: str, level: int = 0) -> Iterator[None]:
        if level > self.log_level:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.elapsed[name] = self.elapsed.get(name, 0.0) + time.perf_counter() - start

    def pop_all(self) -> dict[str, float]:
        """Seconds per timer since the last call, then reset."""
        out, self.elapsed = self.elapsed, {}
        return out


class StragglerTimer:
    """What Bridge forward steps use as `state.straggler_timer` (megatron-core's StragglerDetector
    interface): `with timer:` around the forward compute, `with timer(bdata=True):` around the batch
    fetch. kubetron's straggler detector (`straggler` section) times each step's whole micro-batch
    schedule, which holds both regions, so they are measured there and add no timing of their own."""

    def __call__(self, bdata: bool = False) -> StragglerTimer:
        return self

    def __enter__(self) -> StragglerTimer:
        return self

    def __exit__(self, *exc) -> Literal[False]:
        return False


@dataclass(slots=True)
class GlobalState:
    """What a forward step is handed when it asks for it (by annotation or a first arg named state): the
    reference's façade (Megatron Bridge's forward-step contract), and nothing else. The run's other parts are
    the composition root's (kubetron.training.run.Run); slots: assigning any other attribute raises.

    As Bridge's GlobalState, `tokenizer`, `tensorboard_logger` and `wandb_logger` are created on first
    use; the two loggers only on the last rank and only when configured (else None). The loop's own
    metrics go through the same writer and run.
    """

    cfg: ConfigContainer
    train_state: TrainState = field(default_factory=TrainState)
    timers: Timers = field(default_factory=Timers)
    _tokenizer: Any = field(default=None, init=False, repr=False)  # kubetron.data.tokenizer's (several kinds)
    _tensorboard_logger: SummaryWriter | None = field(default=None, init=False, repr=False)
    _wandb_logger: ModuleType | None = field(default=None, init=False, repr=False)  # `wandb`, its run started

    @property
    def tokenizer(self):
        """The run's tokenizer (`vocab_size`, `eod`, `pad`, `encode`/`decode`), built on first use."""
        if self._tokenizer is None:
            from kubetron.data.loader import build_tokenizer_from_config

            self._tokenizer = build_tokenizer_from_config(self.cfg)
        return self._tokenizer

    def _logs_here(self, enabled) -> bool:
        """The last rank (it holds the loss) writes the loggers."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return bool(self.cfg is not None and enabled and rank == world - 1)

    @property
    def tensorboard_logger(self):
        """A SummaryWriter on logger.tensorboard_dir on the last rank (None elsewhere or when unset)."""
        if self._tensorboard_logger is None and self._logs_here(self.cfg and self.cfg.logger.tensorboard_dir):
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard_logger = SummaryWriter(log_dir=self.cfg.logger.tensorboard_dir, max_queue=1000)
        return self._tensorboard_logger

    @property
    def wandb_logger(self):
        """The `wandb` module with this run's wandb.init done, on the last rank when logger.wandb_project
        is set (None elsewhere): `state.wandb_logger.log({...}, step)` as in Bridge."""
        if self._wandb_logger is None and self._logs_here(self.cfg and self.cfg.logger.wandb_project):
            import wandb

            lg = self.cfg.logger
            wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name, entity=lg.wandb_entity,
                       dir=lg.wandb_save_dir, config=self.cfg.to_dict())
            self._wandb_logger = wandb
        return self._wandb_logger

    @property
    def straggler_timer(self) -> StragglerTimer:
        """See StragglerTimer."""
        return StragglerTimer()

    def close_loggers(self):
        """Flush and close the TensorBoard writer and finish the wandb run (those that were created)."""
        if self._tensorboard_logger is not None:
            self._tensorboard_logger.close()
            self._tensorboard_logger = None
        if self._wandb_logger is not None:
            self._wandb_logger.finish()
            self._wandb_logger = None
