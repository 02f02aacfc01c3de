"""Evaluation on the validation or test split (the reference's `training/eval.py`).

`evaluate()` runs `validation.eval_iters` global batches forward-only and reduces the reported losses
as training does; then, as the reference, the non-loss data: `non_loss_data_func(model)` if given,
else with `process_non_loss_data_func` one more global batch through the schedule with
`collect_non_loss_data=True`, where `loss_func(output, non_loss_data=True)` returns anything (the
inference pattern) and the list of those goes to `process_non_loss_data_func(data, iteration, writer)`.

`evaluate_and_print_results()` hands the losses on as an `Evaluated` event (the metrics logger prints the
reference's line and writes its scalars). The loop calls it every `validation.eval_interval` iterations;
`pretrain()` once more after training completes on the validation split and once on the test split
(`final_evaluation`). `time_up()` (train.exit_duration_in_mins) is asked after every batch, as in the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kubetron.contract.hang import EVALUATION
from kubetron.events import PROGRESS, Evaluated, Events
from kubetron.training.schedule import forward_backward
from kubetron.training.utils import prepare_forward_step_func, reduce_losses

log = logging.getLogger("kubetron")


@dataclass
class EvalResult:
    losses: dict[str, torch.Tensor]  # averaged over the eval batches and data-parallel ranks (device tensors)
    non_loss_data: Any = None  # what non_loss_data_func / the collect_non_loss_data pass returned


def evaluate(forward_step_func, data_iterator, model, state, *, events: Events, time_up: Callable[[], bool],
             process_non_loss_data_func: Callable | None = None,
             non_loss_data_func: Callable | None = None) -> EvalResult | None:
    """Forward-only over validation.eval_iters global batches; None if the time limit cut it short."""
    cfg = state.cfg
    fwd = prepare_forward_step_func(forward_step_func, state)
    n = cfg.train.num_microbatches
    for chunk in model:
        chunk.eval()  # no dropout
    try:
        with torch.no_grad():
            reports = []
            for _ in range(cfg.validation.eval_iters):
                reports += forward_backward(fwd, data_iterator, model, n, forward_only=True)
                state.train_state.consumed_valid_samples += cfg.train.global_batch_size
                events.emit(PROGRESS)  # a long evaluation is not a hang (docs/recovery.md)
                if time_up():  # as the reference: after every batch
                    log.info("exiting during evaluation, time limit reached")
                    return None
            result = EvalResult(reduce_losses(reports))
            if non_loss_data_func is not None:
                result.non_loss_data = non_loss_data_func(model)
            elif process_non_loss_data_func is not None:  # every rank: the pipeline stages run together
                result.non_loss_data = forward_backward(fwd, data_iterator, model, n, forward_only=True,
                                                        collect_non_loss_data=True)
    finally:
        for chunk in model:
            chunk.train()
    return result


def evaluate_and_print_results(state, prefix: str, forward_step_func, data_iterator, model, *, events: Events,
                               time_up: Callable[[], bool], label: str = "validation",
                               write_to_tensorboard: bool = True,
                               process_non_loss_data_func: Callable | None = None,
                               non_loss_data_func: Callable | None = None) -> dict[str, torch.Tensor] | None:
    """evaluate(), then ` validation loss at <prefix> | ...` and the `<key> <label>` scalars at the current
    iteration; process_non_loss_data_func runs on the rank holding the TensorBoard writer."""
    with events.phase(EVALUATION), state.timers.time("evaluate", 1):
        result = evaluate(forward_step_func, data_iterator, model, state, events=events, time_up=time_up,
                          process_non_loss_data_func=process_non_loss_data_func, non_loss_data_func=non_loss_data_func)
    if result is None:
        return None
    step = state.train_state.step
    events.emit(Evaluated(step, {k: float(v) for k, v in result.losses.items()}, prefix, label,
                          write_to_tensorboard))
    writer = state.tensorboard_logger if write_to_tensorboard else None
    if process_non_loss_data_func is not None and writer is not None:
        process_non_loss_data_func(result.non_loss_data, step, writer)
    return result.losses


def final_evaluation(state, forward_step_func, model, valid_iterator, test_iterator, *, events: Events,
                     time_up: Callable[[], bool], **non_loss) -> None:
    """After training (or instead of it, validation.skip_train): the validation split if do_valid, the test
    split if do_test, as the reference's pretrain(). An evaluation-only run writes its scalars too (Bridge
    writes none: a logger.tensorboard_dir given to an evaluation is where its results are looked for)."""
    ts = state.train_state
    for on, name, iterator, label in ((ts.do_valid, "validation", valid_iterator, "validation"),
                                      (ts.do_test, "test", test_iterator, "test")):
        if on and evaluate_and_print_results(state, f"iteration {ts.step} on {name} set", forward_step_func,
                                             iterator, model, events=events, time_up=time_up, label=label,
                                             **non_loss) is None:
            return  # the time limit (train.exit_duration_in_mins) was reached
