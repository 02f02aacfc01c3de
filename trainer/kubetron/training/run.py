"""The composition root: every part of one run built once, here, and handed on explicitly (`Run`), and the run's
listeners (kubetron.events): the heartbeat, rank 0's status endpoint, the metrics logger, the progress log.

entry._run starts the process (distributed state, seeds, `GlobalState`) with the caller's listeners, calls
`build_run`, trains and evaluates what it returns, then closes it. Nothing else builds a model, an optimizer, the
data iterators, the checkpoint manager or a listener for a run, and nothing else touches the heartbeat.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from kubetron.checkpoint.manager import CheckpointManager, SaveFaults, open_save_store
from kubetron.checkpoint.progress_log import PodFacts, ProgressLog
from kubetron.contract.hang import DATA
from kubetron.contract.recovery import COPIES_ENV
from kubetron.data import build_train_valid_test_data_iterators
from kubetron.data.datasets import check_data_tokenizer
from kubetron.data.loader import DataIterator, build_tokenizer_from_config
from kubetron.events import Checkpoint as DurableCheckpoint
from kubetron.events import Events, Started
from kubetron.supervisor import progress_io
from kubetron.supervisor.heartbeat import Heartbeat
from kubetron.supervisor.startup import CLOCK
from kubetron.training import first_weights, pipeline
from kubetron.training.metrics import MetricsLogger
from kubetron.training.model import build_model, num_parameters
from kubetron.training.optim import LRScheduler, build_optimizer
from kubetron.training.optimizer_base import TrainingOptimizer
from kubetron.training.state import GlobalState, SignalHandler
from kubetron.training.straggler import StragglerDetector

if TYPE_CHECKING:
    from kubetron.training.status_server import StatusServer

log = logging.getLogger("kubetron")


@dataclass
class Run:
    """One run's parts: the model chunks and what trains them, the data, the checkpointer, the events and what
    listens to them."""

    state: GlobalState  # what the forward step is handed (the reference's façade)
    events: Events  # the run's life (kubetron.events), to the listeners built here and the caller's
    rank: int
    world_size: int
    device: torch.device  # this rank's
    model: list[torch.nn.Module]  # this rank's model chunks (one per virtual pipeline stage)
    optimizer: TrainingOptimizer
    scheduler: LRScheduler
    train_it: DataIterator | None
    valid_it: DataIterator | None  # None: no validation split, or validation off
    test_it: DataIterator | None
    ckpt: CheckpointManager
    straggler: StragglerDetector | None  # straggler section (None: off)
    signals: SignalHandler | None  # SIGTERM/SIGINT: save and stop (train.exit_signal_handler)
    metrics: MetricsLogger
    status: StatusServer | None  # rank 0's live-status endpoint (train.status_port)
    start_time: float = field(default_factory=time.time)  # this process's start (train.exit_duration_in_mins)

    def started(self) -> Started:
        """What the run starts from, once its checkpoint is loaded."""
        ts, ck = self.state.train_state, self.ckpt
        checkpoint = DurableCheckpoint(ck.last_durable, ck.last_durable_time) if ck.last_durable is not None else None
        train_iters = self.state.cfg.train.train_iters
        assert train_iters is not None  # finalize() derived it
        recovery = ck.recovery.report(progress_io.in_place_restarts()) if ck.recovery is not None else None
        return Started(ts.step, train_iters, ts.consumed_train_samples,
                       ts.floating_point_operations_so_far, checkpoint, dict(recovery) if recovery else None)

    def close(self) -> None:
        """After the loop: the loggers, pending async saves (finalized), the prefetch threads, the endpoint."""
        first: Exception | None = None
        for part in (self.metrics, self.ckpt, self.train_it, self.valid_it, self.test_it, self.status):
            try:
                if part is not None:
                    part.close()
            except Exception as e:  # every part is closed; the first failure is raised after
                first = first or e
        if first is not None:
            raise first


def build_run(state: GlobalState, events: Events, *, rank: int, world_size: int,
              device: torch.device, from_pretrained: bool, signals: SignalHandler | None = None,
              faults: SaveFaults | None = None, start_time: float | None = None) -> Run:
    """The run's parts on this rank, its checkpoint (or pretrained weights) loaded, its listeners added to
    `events`. `from_pretrained`: start from checkpoint.pretrained_checkpoint when checkpoint.load has nothing to
    resume; `faults`: the checkpoint manager's hook at each point of a save (tests, KUBETRON_CHAOS_KILL_AT)."""
    cfg = state.cfg
    start_time = time.time() if start_time is None else start_time
    heartbeat = Heartbeat.from_env()  # under the launcher: the hang watchdog's record and stack dumps (else no-op)
    events.add(heartbeat)
    first_weights.check_before_build(cfg, finetune=from_pretrained)  # what needs no model fails before it is built
    if not cfg.finetuning.data_path:  # indexed data: made by this run's tokenizer?
        check_data_tokenizer(cfg.dataset, build_tokenizer_from_config(cfg))
    model = pipeline.build(cfg, device, build_model)  # build_model + PP shared-embedding setup on CPU
    optimizer = build_optimizer(cfg, model)
    scheduler = LRScheduler(optimizer, cfg)
    if rank == 0:
        log.info("model: %.2fM parameters on %s (world size %d, dp %d)", num_parameters(model) / 1e6,
                 device, world_size, cfg.data_parallel_size)
    run_id = _broadcast_str(f"{int(time.time())}-{os.getpid()}")
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    with events.phase(DATA):  # the hang watchdog leaves the data build alone (docs/recovery.md)
        train_it, valid_it, test_it = build_train_valid_test_data_iterators(cfg, dp_rank, dp_size)
    CLOCK.mark("model + data")
    store = open_save_store(cfg)
    ckpt = CheckpointManager(cfg, store, model=model, optimizer=optimizer, scheduler=scheduler,
                             train_state=state.train_state, data=(train_it, valid_it), run_id=run_id,
                             world_size=world_size, signal_handler=signals, start_time=start_time,
                             load_hf=first_weights.load_hf, events=events, faults=faults,
                             paced_snapshots=os.environ.get(COPIES_ENV) == "1",  # the pod's agent copies them
                             job=progress_io.job_id().rsplit("/", 1)[0])  # its attempt left out: the same run
    # train with pretrained_checkpoint: its weights when checkpoint.load has nothing to resume (as Bridge)
    ckpt.load(finetune=from_pretrained)
    CLOCK.mark("checkpoint load")
    status = _status_server(cfg, rank, heartbeat)
    if status is not None:  # before the metrics logger: its log-time figures come after the step they follow
        from kubetron.training.status_server import StatusPublisher

        events.add(StatusPublisher(status, cfg))
    metrics = MetricsLogger(cfg, state, writes=(rank == world_size - 1), world_size=world_size, rank=rank,
                            start_time=start_time, emit=events.emit)
    events.add(metrics)
    if rank == 0 and store is not None and cfg.logger.log_progress and not cfg.validation.skip_train:
        # an evaluation only (skip_train) leaves the log alone
        _, hang = progress_io.hangs()
        pod = PodFacts(progress_io.job_id(), progress_io.in_place_restarts(), hang)
        events.add(ProgressLog(cfg, store, world_size, pod))
    # this run's splits (the flags a loaded checkpoint carries are its run's)
    state.train_state.do_valid, state.train_state.do_test = valid_it is not None, test_it is not None
    return Run(state, events, rank, world_size, device, model, optimizer, scheduler, train_it, valid_it, test_it,
               ckpt, StragglerDetector.from_config(cfg, device), signals, metrics, status, start_time)


def _status_server(cfg, rank: int, heartbeat: Heartbeat) -> StatusServer | None:
    """Rank 0's live-status endpoint on train.status_port (finalize() resolved it from KUBETRON_STATUS_PORT)."""
    if rank != 0 or not cfg.train.status_port:
        return None
    from kubetron.training.status_server import StatusServer

    return StatusServer(cfg.train.status_port, trainer_time=heartbeat.trainer_time)


def _broadcast_str(value: str) -> str:
    objs = [value]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(objs, src=0)
    return objs[0]
