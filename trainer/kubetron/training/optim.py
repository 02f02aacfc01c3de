"""Optimizer, learning-rate schedule, gradient sync and clipping.

`build_optimizer` picks the implementation (`ddp.impl`, see `resolve_ddp_impl`) and returns a
`TrainingOptimizer` (optimizer_base.py: the one interface the loop and the checkpointer use):

- kubetron (CPU/gloo, and the GPU fallback): AdamW/SGD over the fp32 parameters (`PlainOptimizer`)
  or over fp32 main copies of bf16/fp16 ones (mixed_precision.MainParamsOptimizer), with gradients
  all-reduced as one flat bucket after the backward pass (grads.FlatGradSync) or through bucketed,
  overlapped buffers (ddp.GradBuffers, `ddp.overlap_grad_reduce`); or ZeRO-1 (ddp.DistributedOptimizer);
- megatron (CUDA): megatron-core's DistributedDataParallel + get_megatron_optimizer (megatron_ddp.py).

The loop calls `optimizer.zero_grad()`, the schedule, `finalize_model_grads(optimizer, cfg)`, `step()`.
"""

from __future__ import annotations

import math

import torch

from kubetron.contract.errors import ConfigError
from kubetron.training.ddp import DistributedOptimizer, GradBuffers, broadcast_params
from kubetron.training.grads import FlatGradSync, model_parallel_sum, norm_squared
from kubetron.training.mixed_precision import LossScaler, MainParamsOptimizer
from kubetron.training.optimizer_base import GradSync, OptimizerOverCopies, PlainOptimizer, TrainingOptimizer


def resolve_ddp_impl(cfg, device: torch.device) -> str:
    """`ddp.impl` for this device: auto -> megatron on CUDA, kubetron elsewhere; megatron off CUDA is
    a config error (megatron-core's DDP and optimizers hard-code CUDA)."""
    impl = cfg.ddp.impl
    if impl == "megatron" and device.type != "cuda":
        raise ConfigError("ddp.impl", f"megatron needs CUDA (megatron-core's DDP and optimizers hard-code it); "
                                      f"this run is on {device.type}: use auto or kubetron")
    if impl == "auto":
        return "megatron" if device.type == "cuda" else "kubetron"
    return impl


def param_groups(model: list[torch.nn.Module], weight_decay: float) -> list[dict]:
    """Decoupled weight decay on matrices; none on biases and norms (as megatron)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for chunk in model:
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(cfg, model: list[torch.nn.Module], device: torch.device | None = None) -> TrainingOptimizer:
    """AdamW (decoupled weight decay; none on biases and norms) or SGD with momentum, over the
    implementation `resolve_ddp_impl` picks. A bf16/fp16 model's optimizer keeps fp32 main weights."""
    device = device or next(model[0].parameters()).device
    if resolve_ddp_impl(cfg, device) == "megatron":
        from kubetron.training.megatron_ddp import build_megatron_optimizer  # imports CUDA-only paths

        return build_megatron_optimizer(cfg, model)
    if cfg.rng.data_parallel_random_init:
        broadcast_params(model)  # before any copy of the weights (grad buffers, fp32 mains) is made
    o, d = cfg.optimizer, cfg.ddp
    groups = param_groups(model, o.weight_decay)

    def make(groups):
        if o.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=o.lr, momentum=o.sgd_momentum)
        fused = all(p.is_cuda for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                 fused=fused or None)

    grad_sync: GradSync
    if d.use_distributed_optimizer or d.overlap_grad_reduce:
        grad_sync = GradBuffers(model, grad_reduce_in_fp32=d.grad_reduce_in_fp32, overlap=d.overlap_grad_reduce,
                                num_microbatches=cfg.train.num_microbatches, bucket_size=d.bucket_size,
                                shard=d.use_distributed_optimizer)
    else:
        grad_sync = FlatGradSync(model, d.grad_reduce_in_fp32)
    opt: OptimizerOverCopies
    if d.use_distributed_optimizer:
        assert isinstance(grad_sync, GradBuffers)  # use_distributed_optimizer picked them above
        opt = DistributedOptimizer(model, groups, make, grad_sync, overlap_param_gather=d.overlap_param_gather)
    elif any(p.dtype != torch.float32 for g in groups for p in g["params"]):
        opt = MainParamsOptimizer(groups, make, grad_sync)
    else:
        return PlainOptimizer(make(groups), grad_sync)
    opt.loss_scaler = LossScaler.from_config(cfg)  # fp16 only
    config = getattr(model[0], "config", None)  # megatron's TransformerConfig
    if opt.loss_scaler is not None and config is not None:  # megatron's schedule (GPU, PP > 1)
        config.grad_scale_func = lambda loss: loss * opt.loss_scale
    return opt


def finalize_model_grads(optimizer: TrainingOptimizer, cfg) -> torch.Tensor:
    """After the backward pass: reduce the gradients (DP mean, then the TP/embedding sums), clip
    them to `optimizer.clip_grad`; return the global grad norm (a device tensor, no host sync)."""
    optimizer.finish_grad_sync()
    return optimizer.clip_grad_norm(cfg.optimizer.clip_grad)


class LRScheduler:
    """Megatron's OptimizerParamScheduler, counted in iterations: warmup then constant/linear/cosine/..."""

    def __init__(self, optimizer: TrainingOptimizer, cfg):
        s = cfg.scheduler
        self.optimizer = optimizer
        self.max_lr = cfg.optimizer.lr
        self.min_lr = cfg.optimizer.min_lr
        self.init_lr = s.lr_warmup_init
        self.warmup_steps = s.lr_warmup_steps
        self.decay_steps = max(s.lr_decay_steps, 1)
        self.style = s.lr_decay_style
        self.wsd_decay_steps = s.lr_wsd_decay_iters or 0
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        n = self.num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * n / self.warmup_steps
        if self.style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        if self.style == "inverse-square-root":
            warm = max(self.warmup_steps, 1)
            return max(self.min_lr, self.max_lr * math.sqrt(warm) / math.sqrt(max(n, 1)))
        ratio = (n - self.warmup_steps) / max(self.decay_steps - self.warmup_steps, 1)
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        elif self.style == "WSD":
            anneal_start = self.decay_steps - self.wsd_decay_steps
            coeff = 1.0 if n <= anneal_start else 1.0 - (n - anneal_start) / max(self.wsd_decay_steps, 1)
        else:
            raise ValueError(f"unknown lr_decay_style {self.style!r}")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1):
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps, "style": self.style}

    def load_state_dict(self, d: dict):
        self.num_steps = 0
        self.step(int(d["num_steps"]))


def params_l2_norm(model: list[torch.nn.Module]) -> torch.Tensor:
    """calc_params_l2_norm: the L2 norm of all parameters across the model-parallel group."""
    params = [p for chunk in model for p in chunk.parameters()]
    return model_parallel_sum(norm_squared(params, lambda p: p.detach())).sqrt().squeeze(0)
