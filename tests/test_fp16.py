"""fp16: float16 parameters, fp32 main weights, dynamic loss scaling with skipped iterations (CPU).

torch 2.13 runs fp16 matmuls, softmax, layer norm and attention on CPU, so the real training loop runs
here; the tiny model at seq 32 keeps it fast.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
from kubetron.contract import exitcodes
from kubetron.training.mixed_precision import LossScaler

from tests.inprocess import in_process_config, run_pretrain
from tests.trainer_utils import tb_scalars

pytestmark = pytest.mark.trainer

SMALL = ["model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4", "logger.log_interval=1",
         "scheduler.lr_warmup_iters=2"]
FP16 = ["mixed_precision.fp16=true"]
TOLERANCE = 1e-3  # |fp16 - fp32| lm loss over 20 iterations (measured 7e-5: test_fp16_follows_fp32 -s)


class Recorder:
    """The default forward step, noting the parameters' dtypes and a weight checksum per iteration."""

    def __init__(self):
        from kubetron.training.gpt_step import forward_step

        self.fwd = forward_step
        self.dtypes: set[torch.dtype] = set()
        self.checksum: dict[int, float] = {}

    def __call__(self, state, data_iterator, model):
        it = state.train_state.step + 1
        if it not in self.checksum:
            self.dtypes |= {p.dtype for p in model.parameters()}
            self.checksum[it] = float(sum(p.detach().double().sum() for p in model.parameters()))
        return self.fwd(state, data_iterator, model)


def _run(tmp_path, name: str, *overrides: str) -> SimpleNamespace:
    rec = Recorder()
    cfg = in_process_config(*SMALL, f"logger.tensorboard_dir={tmp_path}/{name}", *overrides)
    assert run_pretrain(cfg, rec) == exitcodes.COMPLETED
    tb = tmp_path / name
    return SimpleNamespace(rec=rec, loss=tb_scalars(tb), scale=tb_scalars(tb, "loss-scale"),
                           lr=tb_scalars(tb, "learning-rate"), gnorm=tb_scalars(tb, "grad-norm"))


def test_loss_scaler_backs_off_after_hysteresis_and_grows_after_a_window():
    s = LossScaler(1024.0, min_scale=256.0, growth_interval=3, hysteresis=2)
    seen = []
    for found_inf in (True, True, True, True, False, False, False, True):
        s.update(found_inf)
        seen.append(s.scale)
    assert seen == [1024, 512, 256, 256, 256, 256, 512, 512]  # hysteresis 2 again after the growth
    static = LossScaler(8.0, dynamic=False)
    static.update(True)
    assert static.scale == 8.0


def test_forced_overflow_skips_iterations_and_backs_off(tmp_path, capsys):
    """A scale of 2^40 overflows fp16 gradients: iterations are skipped (weights and LR unchanged)
    while the scale halves (after hysteresis 2) until the gradients fit; then training proceeds."""
    r = _run(tmp_path, "overflow", *FP16, "train.train_iters=30", f"mixed_precision.initial_loss_scale={2.0**40}")
    out = capsys.readouterr().out
    assert r.rec.dtypes == {torch.float16}
    scales = {i: r.scale[i] for i in range(1, 31)}
    skipped = [i for i in range(1, 30) if not math.isfinite(r.gnorm[i])]  # overflowed
    assert all(r.rec.checksum[i + 1] == r.rec.checksum[i] for i in skipped)  # no update
    assert skipped[:20] == list(range(1, 21))  # 2^40 needs > 20 halvings to fit fp16
    assert len(skipped) < 29 and r.loss[30] < r.loss[1] - 0.05  # then it trains
    replay = LossScaler(2.0**40, min_scale=1.0, growth_interval=1000, hysteresis=2)
    for i in range(1, 30):  # the scale each backward used follows megatron's rule on the observed overflows
        assert scales[i] == replay.scale, i
        replay.update(found_inf=i in skipped)
        if i in skipped:
            assert r.lr[i] == r.lr.get(i - 1, 0.0)  # no scheduler step either (warmup starts at 0)
    counts = [int(x) for x in re.findall(r"number of skipped iterations:\s+(\d+)", out)]
    assert sum(counts[:29]) == len(skipped) and f"loss scale: {scales[30]:.1f}" in out


def test_fp16_follows_fp32(tmp_path):
    """20 iterations at a scale that never overflows: the fp16 loss stays within TOLERANCE of fp32's."""
    common = ("train.train_iters=20", "optimizer.lr=3e-3")
    fp32 = _run(tmp_path, "fp32", *common)
    fp16 = _run(tmp_path, "fp16", *FP16, *common, "mixed_precision.initial_loss_scale=4096")
    assert fp32.rec.dtypes == {torch.float32} and fp16.rec.dtypes == {torch.float16}
    assert sorted(fp16.loss) == list(range(1, 21)) and set(fp16.scale.values()) == {4096.0}
    diff = max(abs(fp16.loss[i] - fp32.loss[i]) for i in range(1, 21))
    print(f"max |fp16 - fp32| lm loss over 20 iterations: {diff:.5f}")
    assert diff < TOLERANCE
    assert fp16.loss[20] < fp16.loss[1] - 0.1  # it learns


def test_fp16_resume_continues_bit_exactly(tmp_path):
    """The loss scaler's state travels in the checkpoint: a resume continues the same losses and scales."""
    scale = ["mixed_precision.initial_loss_scale=65536", "mixed_precision.loss_scale_window=2"]
    full = _run(tmp_path, "full", *FP16, *scale, "train.train_iters=6")
    cfg = in_process_config(*SMALL, *FP16, *scale, "train.train_iters=6", "train.exit_interval=3",
                            f"checkpoint.save={tmp_path}/ckpt")
    assert run_pretrain(cfg, Recorder()) == exitcodes.EXIT_CONDITION
    resumed = _run(tmp_path, "resumed", *FP16, *scale, "train.train_iters=6", f"checkpoint.load={tmp_path}/ckpt")
    assert sorted(resumed.loss) == [4, 5, 6]
    assert all(resumed.loss[i] == full.loss[i] and resumed.scale[i] == full.scale[i] for i in (4, 5, 6))
    assert full.scale[1] < full.scale[6]  # the dynamic scale grew over the run, and the resume followed


def test_resume_without_optimizer_state_restarts_the_lr_schedule_and_loss_scale(tmp_path):
    """checkpoint.load_optim false, as Megatron: the LR scheduler and the loss scaler are optimizer state,
    so they start afresh (warmup again, the initial scale) while the iteration count resumes."""
    scale = ["mixed_precision.initial_loss_scale=65536", "mixed_precision.loss_scale_window=2"]
    full = _run(tmp_path, "full", *FP16, *scale, "train.train_iters=6")
    cfg = in_process_config(*SMALL, *FP16, *scale, "train.train_iters=6", "train.exit_interval=3",
                            f"checkpoint.save={tmp_path}/ckpt")
    assert run_pretrain(cfg, Recorder()) == exitcodes.EXIT_CONDITION
    fresh = _run(tmp_path, "fresh", *FP16, *scale, "train.train_iters=6", f"checkpoint.load={tmp_path}/ckpt",
                 "checkpoint.load_optim=false")
    assert sorted(fresh.loss) == [4, 5, 6]
    assert full.lr[4] != full.lr[1] and full.scale[4] != full.scale[1]  # what a full resume continues
    assert [fresh.lr[i] for i in (4, 5, 6)] == [full.lr[i] for i in (1, 2, 3)]
    assert [fresh.scale[i] for i in (4, 5, 6)] == [full.scale[i] for i in (1, 2, 3)]


def test_megatron_optimizer_gets_the_loss_scaling_settings():
    """On GPU with ddp.impl megatron, megatron-core's own grad scaler runs with the same settings
    (its construction needs CUDA: make gpu-check)."""
    from kubetron.training.megatron_ddp import optimizer_config

    cfg = in_process_config(*FP16, "mixed_precision.initial_loss_scale=1024", "mixed_precision.min_loss_scale=2",
                            "mixed_precision.loss_scale_window=50", "mixed_precision.hysteresis=3")
    cfg.finalize()
    o = optimizer_config(cfg)
    assert (o.fp16, o.params_dtype, o.loss_scale, o.initial_loss_scale, o.min_loss_scale, o.loss_scale_window,
            o.hysteresis) == (True, torch.float16, None, 1024.0, 2.0, 50, 3)
