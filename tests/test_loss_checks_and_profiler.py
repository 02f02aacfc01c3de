"""rerun_state_machine (spiky loss) and profiling: config sections that must do what they say."""

from __future__ import annotations

import re

import pytest
import torch
from kubetron.contract import exitcodes
from kubetron.training.state import GlobalState

from tests.inprocess import in_process_config, run_pretrain

pytestmark = pytest.mark.trainer


class _SpikeAt:
    """The default GPT forward step, with the loss multiplied by `factor` at one iteration."""

    def __init__(self, iteration: int, factor: float):
        self.iteration, self.factor = iteration, factor

    def __call__(self, state: GlobalState, data_iterator, model):
        from kubetron.training.gpt_step import forward_step

        output, loss_func = forward_step(state, data_iterator, model)
        if state.train_state.step + 1 != self.iteration:
            return output, loss_func

        def spiked(out):
            loss, n, report = loss_func(out)  # report values are [loss_sum, num_tokens]: scale the sum
            scale = torch.tensor([self.factor, 1.0])
            return loss * self.factor, n, {k: v * scale.to(v.device) for k, v in report.items()}

        return output, spiked


def test_spiky_loss_stops_the_run_and_names_the_iteration():
    from kubetron.training.train import DivergedError

    cfg = in_process_config("train.train_iters=12", "scheduler.lr_warmup_iters=1",
                            "rerun_state_machine.check_for_spiky_loss=true",
                            "rerun_state_machine.spiky_loss_window=5", "rerun_state_machine.spiky_loss_factor=3")
    with pytest.raises(DivergedError, match=r"spiky loss at iteration 9\b"):
        run_pretrain(cfg, _SpikeAt(9, 50.0))


def test_the_same_spike_passes_when_the_check_is_off():
    cfg = in_process_config("train.train_iters=12", "scheduler.lr_warmup_iters=1",
                            "rerun_state_machine.spiky_loss_window=5", "rerun_state_machine.spiky_loss_factor=3")
    assert run_pretrain(cfg, _SpikeAt(9, 50.0)) == exitcodes.COMPLETED


class _NanGradAt:
    """The default GPT forward step; at one iteration the backward pass turns every gradient into NaN
    (the loss itself stays finite)."""

    def __init__(self, iteration: int):
        self.iteration = iteration

    def __call__(self, state: GlobalState, data_iterator, model):
        from kubetron.training.gpt_step import forward_step

        output, loss_func = forward_step(state, data_iterator, model)
        if state.train_state.step + 1 == self.iteration:
            output.register_hook(lambda grad: grad * float("nan"))
        return output, loss_func


def test_nan_gradient_stops_the_run_in_fp32_and_bf16():
    """ddp.check_for_nan_in_grad (default on): a NaN gradient is a divergence (exit 3), not a skipped step."""
    from kubetron.training.train import DivergedError

    for precision in ("mixed_precision.bf16=false", "mixed_precision.bf16=true"):
        cfg = in_process_config("train.train_iters=6", "scheduler.lr_warmup_iters=1", "model.seq_length=32",
                                precision)
        with pytest.raises(DivergedError, match=r"gradient norm is nan at iteration 3 \(ddp.check_for_nan_in_grad\)"):
            run_pretrain(cfg, _NanGradAt(3))


def test_nan_gradient_with_the_check_off_is_applied_as_megatron_does():
    """Without the check the update is applied (no skip): the weights turn NaN and the next loss stops the run."""
    from kubetron.training.train import DivergedError

    cfg = in_process_config("train.train_iters=6", "scheduler.lr_warmup_iters=1", "model.seq_length=32",
                            "ddp.check_for_nan_in_grad=false")
    with pytest.raises(DivergedError, match=r"loss is NaN/Inf at iteration 4\b"):
        run_pretrain(cfg, _NanGradAt(3))


def test_nan_gradient_in_fp16_is_an_overflow_that_skips_the_step(capsys):
    cfg = in_process_config("train.train_iters=6", "scheduler.lr_warmup_iters=1", "model.seq_length=32",
                            "logger.log_interval=1", "mixed_precision.fp16=true",
                            "mixed_precision.initial_loss_scale=1024")
    assert run_pretrain(cfg, _NanGradAt(3)) == exitcodes.COMPLETED
    out = capsys.readouterr().out
    assert re.search(r"iteration\s+3/.*number of skipped iterations:\s+1", out), out[-3000:]


def test_profiler_writes_a_trace_for_the_requested_iterations(tmp_path):
    out = tmp_path / "trace"
    cfg = in_process_config("train.train_iters=8", "scheduler.lr_warmup_iters=1",
                            "profiling.use_pytorch_profiler=true", "profiling.profile_step_start=3",
                            "profiling.profile_step_end=5", f"profiling.output_dir={out}")
    from kubetron.training.gpt_step import forward_step

    assert run_pretrain(cfg, forward_step) == exitcodes.COMPLETED
    traces = list(out.glob("*.pt.trace.json*"))
    assert traces, f"no trace in {out}: {list(out.iterdir()) if out.exists() else 'missing'}"
    assert "ProfilerStep#" in traces[0].read_text()
