"""The micro-batch schedule one iteration (or one evaluation batch) runs: forward (+ backward) over the
micro-batches, megatron's pipeline schedule when there are stages (training/pipeline.py)."""

from __future__ import annotations

from kubetron.training import moe, pipeline
from kubetron.training.state import Timers
from kubetron.training.utils import unpack_loss


def forward_backward(forward_step_func, data_iterator, model, num_microbatches: int, *, forward_only: bool,
                     loss_scale: float = 1.0, timers: Timers | None = None, collect_non_loss_data: bool = False):
    """No-pipelining schedule: forward (+ backward) each micro-batch; return their loss reports.

    The backward pass uses loss / num_tokens / num_microbatches (token-aware pattern) or
    loss / num_microbatches, so gradients are the mean over the global batch on this rank (times
    `loss_scale`, fp16's loss scale; the optimizer divides it out).
    `collect_non_loss_data` (with forward_only, megatron's inference pattern): the list of
    `loss_func(output, non_loss_data=True)`, whatever it returns (on the last pipeline stage).
    """
    if collect_non_loss_data and not forward_only:
        raise ValueError("collect_non_loss_data needs forward_only=True")
    if pipeline.runs_schedule(model):  # PP > 1 (megatron's on GPU, GPipe over gloo on CPU), or megatron's DDP
        return pipeline.forward_backward(forward_step_func, data_iterator, model, num_microbatches,
                                         forward_only=forward_only, loss_scale=loss_scale,
                                         collect_non_loss_data=collect_non_loss_data)
    timers = timers or Timers(log_level=0)
    if not forward_only:
        moe.scale_aux_loss(model, loss_scale, num_microbatches)
    reports = []
    for _ in range(num_microbatches):
        with timers.time("forward-compute", 2):
            output, loss_func = forward_step_func(data_iterator, model[0])
            if collect_non_loss_data:
                reports.append(loss_func(output, non_loss_data=True))
                continue
            loss, num_tokens, report = unpack_loss(loss_func(output))
        if not forward_only:
            with timers.time("backward-compute", 2):
                scaled = loss / num_tokens.clamp(min=1) if num_tokens is not None else loss
                (scaled * (loss_scale / num_microbatches)).backward()
        reports.append(report)
    return reports
