"""The composition root: every part of one run built once, here, and handed on explicitly (`Run`).

entry._run starts the process (distributed state, seeds, `GlobalState`), calls `build_run`, trains and
evaluates what it returns, then closes it. Nothing else builds a model, an optimizer, the data iterators
or the checkpoint manager for a run.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from kubetron.checkpoint.manager import CheckpointManager, open_save_store
from kubetron.contract.hang import DATA
from kubetron.data import build_train_valid_test_data_iterators
from kubetron.data.datasets import check_data_tokenizer
from kubetron.data.loader import DataIterator, build_tokenizer_from_config
from kubetron.supervisor import heartbeat
from kubetron.supervisor.startup import CLOCK
from kubetron.training import first_weights, pipeline
from kubetron.training.metrics import MetricsLogger
from kubetron.training.model import build_model, num_parameters
from kubetron.training.optim import LRScheduler, build_optimizer
from kubetron.training.optimizer_base import TrainingOptimizer
from kubetron.training.state import GlobalState

if TYPE_CHECKING:
    from kubetron.training.status_server import StatusServer

log = logging.getLogger("kubetron")


@dataclass
class Run:
    """One run's parts: the model chunks and what trains them, the data, the checkpointer and the loggers."""

    state: GlobalState  # what the loop and the forward step share
    model: list[torch.nn.Module]  # this rank's model chunks (one per virtual pipeline stage)
    optimizer: TrainingOptimizer
    scheduler: LRScheduler
    train_it: DataIterator | None
    valid_it: DataIterator | None  # None: no validation split, or validation off
    test_it: DataIterator | None
    ckpt: CheckpointManager
    metrics: MetricsLogger
    status: StatusServer | None  # rank 0's live-status endpoint (train.status_port)

    def close(self) -> None:
        """After the loop: the loggers, pending async saves (finalized), the prefetch threads, the endpoint."""
        self.metrics.close()
        self.ckpt.close()
        for it in (self.train_it, self.valid_it, self.test_it):
            if it is not None:
                it.close()
        if self.status is not None:
            self.status.close()


def build_run(state: GlobalState, *, from_pretrained: bool) -> Run:
    """The run's parts on this rank, its checkpoint (or pretrained weights) loaded. `from_pretrained`:
    start from checkpoint.pretrained_checkpoint when checkpoint.load has nothing to resume."""
    cfg = state.cfg
    first_weights.check_before_build(cfg, finetune=from_pretrained)  # what needs no model fails before it is built
    if not cfg.finetuning.data_path:  # indexed data: made by this run's tokenizer?
        check_data_tokenizer(cfg.dataset, build_tokenizer_from_config(cfg))
    model = pipeline.build(cfg, state.device, build_model)  # build_model + PP shared-embedding setup on CPU
    optimizer = build_optimizer(cfg, model)
    scheduler = LRScheduler(optimizer, cfg)
    if state.rank == 0:
        log.info("model: %.2fM parameters on %s (world size %d, dp %d)", num_parameters(model) / 1e6,
                 state.device, state.world_size, cfg.data_parallel_size)
    run_id = _broadcast_str(f"{int(time.time())}-{os.getpid()}")
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    with heartbeat.current().during(DATA):  # the hang watchdog leaves the data build alone (docs/recovery.md)
        train_it, valid_it, test_it = build_train_valid_test_data_iterators(cfg, dp_rank, dp_size)
    CLOCK.mark("model + data")
    ckpt = CheckpointManager(cfg, open_save_store(cfg), model=model, optimizer=optimizer, scheduler=scheduler,
                             train_state=state.train_state, data=(train_it, valid_it), run_id=run_id,
                             world_size=state.world_size, signal_handler=state.signal_handler,
                             start_time=state.start_time, load_hf=first_weights.load_hf)
    state.ckpt = ckpt
    # train with pretrained_checkpoint: its weights when checkpoint.load has nothing to resume (as Bridge)
    ckpt.load(finetune=from_pretrained)
    heartbeat.current().resumed(state.train_state.step)
    CLOCK.mark("checkpoint load")
    status = _status_server(state)
    state.metrics = MetricsLogger(cfg, state, writes=(state.rank == state.world_size - 1), status=status)
    # this run's splits (the flags a loaded checkpoint carries are its run's)
    state.train_state.do_valid, state.train_state.do_test = valid_it is not None, test_it is not None
    return Run(state, model, optimizer, scheduler, train_it, valid_it, test_it, ckpt, state.metrics, status)


def _status_server(state: GlobalState) -> StatusServer | None:
    """Rank 0's live-status endpoint on train.status_port (finalize() resolved it from KUBETRON_STATUS_PORT)."""
    if state.rank != 0 or not state.cfg.train.status_port:
        return None
    from kubetron.training.status_server import StatusServer

    return StatusServer(state.cfg.train.status_port, trainer_time=heartbeat.current().trainer_time)


def _broadcast_str(value: str) -> str:
    objs = [value]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(objs, src=0)
    return objs[0]
