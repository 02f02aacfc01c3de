"""The training loop: train() → train_step() → forward/backward over micro-batches.

Reads top to bottom; checkpointing and evaluation live behind small objects it calls, and what happens goes out
as the run's events (kubetron.events: a step done with its figures), which the metrics logger, the status
endpoint and the heartbeat listen to.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import torch

from kubetron.contract.hang import TRAIN
from kubetron.events import PROGRESS, Events, PhaseEntered, StepDone
from kubetron.supervisor.startup import CLOCK
from kubetron.training import moe
from kubetron.training.eval import evaluate_and_print_results
from kubetron.training.optim import finalize_model_grads, params_l2_norm
from kubetron.training.schedule import forward_backward
from kubetron.training.straggler import StragglerDetector, compute_timer
from kubetron.training.utils import (
    num_floating_point_operations,
    prepare_forward_step_func,
    reduce_losses,
)

log = logging.getLogger("kubetron")


class DivergedError(RuntimeError):
    """NaN/Inf loss or gradient, or a spiky loss (exit code 3)."""


@dataclass
class StepResult:
    """What one training iteration hands back to the loop."""

    loss_dict: dict[str, torch.Tensor]  # averaged over micro-batches and DP ranks (device tensors)
    grad_norm: torch.Tensor  # global grad L2 norm (unscaled); non-finite when the update was skipped
    skipped: bool  # fp16 loss-scale overflow (non-finite gradients): no update, no scheduler step
    loss_scale: float  # the factor this iteration's backward pass used (1.0 without fp16)


class LossChecks:
    """train.check_for_nan_in_loss, rerun_state_machine's spiky-loss check (with the loss window) and
    ddp.check_for_nan_in_grad.

    Created once by train(); the window lives in memory only: after a resume it refills before
    spikes are judged again.
    """

    def __init__(self, cfg):
        rs = cfg.rerun_state_machine
        self.check_nan = cfg.train.check_for_nan_in_loss
        self.check_spiky = rs.check_for_spiky_loss
        self.spiky_factor = rs.spiky_loss_factor
        self.window: deque[float] = deque(maxlen=rs.spiky_loss_window)
        self.check_grad = cfg.ddp.check_for_nan_in_grad
        self.fp16 = bool(cfg.mixed_precision.fp16)

    def check(self, iteration: int, losses: dict[str, float]):
        """Raise DivergedError on a NaN/Inf loss or a spike of the first loss."""
        if self.check_nan and not all(math.isfinite(v) for v in losses.values()):
            raise DivergedError(f"loss is NaN/Inf at iteration {iteration}: {losses}")
        first = next(iter(losses.values()), None)
        if not self.check_spiky or first is None or not math.isfinite(first):
            return
        w = self.window
        if len(w) == w.maxlen and first > self.spiky_factor * max(w):
            raise DivergedError(f"spiky loss at iteration {iteration}: {first:.4g} is more than "
                                f"{self.spiky_factor:g}x the maximum {max(w):.4g} of the last {len(w)} "
                                "iterations (rerun_state_machine.check_for_spiky_loss)")
        w.append(first)

    def skip_update(self, iteration: int, grad_norm: float) -> bool:
        """Whether a non-finite grad norm skips the update: only fp16's loss-scale overflow does. In
        fp32/bf16 it raises DivergedError (ddp.check_for_nan_in_grad), or with the check off the update
        is applied, as megatron's optimizer does (the next loss is then NaN)."""
        if math.isfinite(grad_norm):
            return False
        if self.fp16:
            return True
        if self.check_grad:
            raise DivergedError(f"gradient norm is {grad_norm} at iteration {iteration} "
                                "(ddp.check_for_nan_in_grad)")
        return False


def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, global_state,
               checks: LossChecks, straggler: StragglerDetector | None = None) -> StepResult:
    """One iteration: forward/backward over the micro-batches, gradient reduction and clipping, the
    update unless fp16's loss scale overflowed; `checks` judge the loss, then the gradient norm."""
    cfg, timers = global_state.cfg, global_state.timers
    loss_scale = optimizer.loss_scale
    optimizer.zero_grad()
    with compute_timer(straggler), timers.time("forward-backward", 1):  # straggler: no-op if off
        reports = forward_backward(forward_step_func, data_iterator, model, cfg.train.num_microbatches,
                                   forward_only=False, loss_scale=loss_scale, timers=timers)
    with timers.time("grads", 1):
        grad_norm = finalize_model_grads(optimizer, cfg)  # DP mean (+TP/embedding sums), unscale, clip
        loss_dict = reduce_losses(reports)  # on device: averaged over micro-batches and DP ranks
        loss_dict.update(moe.tracked_losses(cfg, grad_norm.device))  # MoE: the load-balancing losses

    # One host sync per step: the losses and the grad norm together.
    host = torch.stack([v.detach().float().reshape(()) for v in loss_dict.values()] + [grad_norm.float()]).tolist()
    iteration = global_state.train_state.step + 1
    checks.check(iteration, dict(zip(loss_dict, host[:-1], strict=True)))
    skipped = checks.skip_update(iteration, host[-1])
    with timers.time("optimizer", 1):
        if not skipped:
            optimizer.step()
            scheduler.step(1)
        optimizer.update_loss_scale(found_inf=skipped)
    return StepResult(loss_dict=loss_dict, grad_norm=grad_norm, skipped=skipped, loss_scale=loss_scale)


def _dummy_train_step(global_state, data_iterator):
    """iterations_to_skip: consume this iteration's data without computing."""
    if data_iterator is not None:
        data_iterator.skip_microbatches(global_state.cfg.train.num_microbatches)


def post_training_step_callbacks(cfg, iteration: int, profiler=None):
    """Manual GC on an interval; profiler stepping."""
    if cfg.train.manual_gc and cfg.train.manual_gc_interval and iteration % cfg.train.manual_gc_interval == 0:
        gc.collect()
    if profiler is not None:
        profiler.step()


def train(forward_step_func, model, optimizer, scheduler, train_data_iterator, valid_data_iterator,
          global_state, checkpoint_manager, *, events: Events | None = None, straggler: StragglerDetector | None = None,
          profiler=None, **non_loss) -> int:
    """Main loop: iterate until train_iters or an exit condition; returns an exit code. `events`: where each
    step goes (the checkpoint manager's, by default); `straggler`: the detector (None: off). `non_loss`:
    process_non_loss_data_func / non_loss_data_func for the evaluations (kubetron.training.eval)."""
    cfg, ts = global_state.cfg, global_state.train_state
    events = checkpoint_manager.events if events is None else events
    fwd = prepare_forward_step_func(forward_step_func, global_state)  # inspect once
    flops_per_iter = num_floating_point_operations(cfg, cfg.train.global_batch_size)
    skip = set(cfg.train.iterations_to_skip)
    for chunk in model:
        chunk.train()
    checks = LossChecks(cfg)
    timers = global_state.timers
    if cfg.train.manual_gc:
        gc.disable()  # no collector pauses mid-step; post_training_step_callbacks collects on an interval
        gc.collect()
    events.emit(PhaseEntered(TRAIN))  # the pod's hang watchdog judges steps from here (docs/recovery.md)

    while ts.step < cfg.train.train_iters:
        if ts.step + 1 in skip:
            _dummy_train_step(global_state, train_data_iterator)
            ts.step += 1
            ts.consumed_train_samples += cfg.train.global_batch_size
            ts.skipped_train_samples += cfg.train.global_batch_size
            events.emit(PROGRESS)
            log.info("iteration %d skipped (iterations_to_skip)", ts.step)
        else:
            started = time.monotonic()
            with timers.time("interval-time", 0):
                result = train_step(fwd, train_data_iterator, model, optimizer, scheduler, global_state, checks,
                                    straggler)
            seconds = time.monotonic() - started
            ts.step += 1
            ts.consumed_train_samples += cfg.train.global_batch_size
            ts.floating_point_operations_so_far += flops_per_iter
            pnorm = None
            if cfg.logger.log_params_norm:
                optimizer.finish_param_sync()  # the distributed optimizer may still be gathering weights
                pnorm = params_l2_norm(model)
            events.emit(StepDone(ts.step, seconds, ts.consumed_train_samples, result.loss_dict,
                                 optimizer.param_groups[0]["lr"], result.grad_norm, result.skipped, pnorm,
                                 result.loss_scale))
            if (startup := CLOCK.finish(ts.step)) is not None:  # this process's first step: how long it took
                log.info("%s", startup)
        post_training_step_callbacks(cfg, ts.step, profiler)
        straggling = straggler is not None and straggler.after_step(ts.step) is not None  # stop_if_detected
        if not straggling and cfg.validation.eval_interval and ts.step % cfg.validation.eval_interval == 0 \
                and valid_data_iterator:
            evaluate_and_print_results(global_state, f"iteration {ts.step}", forward_step_func, valid_data_iterator,
                                       model, events=events, time_up=checkpoint_manager.time_limit_reached,
                                       **non_loss)
        with timers.time("save-checkpoint", 1):  # saves and exits: the manager's schedule
            code = checkpoint_manager.after_step(ts.step, straggler=straggling)
        if code is not None:
            return code

    return checkpoint_manager.finish(ts.step)  # the final iteration durable
