"""Optimizer, learning-rate schedule, gradient sync and clipping.

Plain torch, the same on CPU and GPU: AdamW/SGD (over fp32 main copies for bf16/fp16 models,
mixed_precision.py), data-parallel gradients all-reduced as one flat bucket after the backward pass,
the grad norm reduced across the model-parallel group. With `ddp.overlap_grad_reduce` or the
distributed optimizer, gradients go through bucketed buffers instead (ddp.py: megatron-core's own
DistributedDataParallel / DistributedOptimizer hard-code CUDA). The loop sees one interface:
`build_optimizer`, `optimizer.zero_grad/step`, and `finalize_model_grads` after the backward pass.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "shared", False)


def _is_replica_on_this_tp_rank(param: torch.nn.Parameter) -> bool:
    """True when this rank's copy counts toward norms (TP-split params, or TP rank 0 for replicated)."""
    return getattr(param, "tensor_model_parallel", False) or parallel_state.get_tensor_model_parallel_rank() == 0


def counts_toward_norms(param: torch.nn.Parameter) -> bool:
    """Whether this rank's copy of `param` enters the grad/params norms (each element counted once)."""
    return param_is_not_shared(param) and _is_replica_on_this_tp_rank(param)


def build_optimizer(cfg, model: list[torch.nn.Module]):
    """AdamW (decoupled weight decay; none on biases and norms) or SGD with momentum.

    A bf16/fp16 model gets a `MainParamsOptimizer`: the optimizer runs over fp32 main copies of
    the parameters (fp32 optimizer state too) and writes the result back to the model.
    """
    decay, no_decay = [], []
    for chunk in model:
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    o = cfg.optimizer
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]

    def make(groups):
        if o.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=o.lr, momentum=o.sgd_momentum)
        fused = all(p.is_cuda for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                 fused=fused or None)

    d = cfg.ddp
    if d.use_distributed_optimizer or d.overlap_grad_reduce:
        from kubetron.training.ddp import DistributedOptimizer, GradBuffers, GradSyncOptimizer

        grads = GradBuffers(model, grad_reduce_in_fp32=d.grad_reduce_in_fp32, overlap=d.overlap_grad_reduce,
                            num_microbatches=cfg.train.num_microbatches, bucket_size=d.bucket_size,
                            shard=d.use_distributed_optimizer)
        if d.use_distributed_optimizer:
            return DistributedOptimizer(model, groups, make, grads, overlap_param_gather=d.overlap_param_gather)
        return GradSyncOptimizer(_plain_optimizer(groups, make), grads)
    return _plain_optimizer(groups, make)


def _plain_optimizer(groups, make):
    if any(p.dtype != torch.float32 for g in groups for p in g["params"]):
        from kubetron.training.mixed_precision import MainParamsOptimizer

        return MainParamsOptimizer(groups, make)
    return make(groups)


def finalize_model_grads(model: list[torch.nn.Module], optimizer, cfg) -> torch.Tensor:
    """After the backward pass: reduce the gradients (DP mean, then the TP/embedding sums), clip
    them to `optimizer.clip_grad`; return the global grad norm (a device tensor, no host sync)."""
    if not hasattr(optimizer, "finish_grad_sync"):
        allreduce_gradients(model, cfg.ddp.grad_reduce_in_fp32)
        return clip_grads(model, cfg.optimizer.clip_grad, optimizer)
    optimizer.finish_grad_sync()
    if not hasattr(optimizer, "grad_norm_squared"):  # GradSyncOptimizer: grads are param.grad again
        return clip_grads(model, cfg.optimizer.clip_grad, optimizer)
    total = _model_parallel_sum(optimizer.grad_norm_squared()).sqrt().squeeze(0)
    _clip(total, cfg.optimizer.clip_grad, optimizer, [])
    return total


def finish_param_sync(optimizer):
    """Wait for overlapped parameter all-gathers (distributed optimizer) before reading all weights."""
    if hasattr(optimizer, "finish_param_sync"):
        optimizer.finish_param_sync()


class LRScheduler:
    """Megatron's OptimizerParamScheduler, counted in iterations: warmup then constant/linear/cosine/..."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg):
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


def _allreduce_flat(grads: list[torch.Tensor], group, divide_by: int = 1, fp32: bool = False):
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    if fp32 and flat.dtype != torch.float32:
        flat = flat.float()  # sum bf16/fp16 grads in fp32 (ddp.grad_reduce_in_fp32)
    dist.all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced.to(g.dtype))


def allreduce_gradients(model: list[torch.nn.Module], grad_reduce_in_fp32: bool = True):
    """What megatron's finalize_model_grads does, for plain `.grad`s, in the same order:

    1. data-parallel mean of all gradients (one flat bucket, one all-reduce);
    2. with sequence parallelism, sum the grads of params replicated across TP ranks that saw only
       their sequence shard (layer norms; megatron marks them `sequence_parallel`) over the TP group;
    3. with pipeline parallelism and tied embeddings, sum the word-embedding grad of the first stage
       and its copy on the last stage (`output_layer.weight`) over the embedding group, so the two
       copies get the same update.
    """
    params = [p for chunk in model for p in chunk.parameters() if p.grad is not None]
    dp = parallel_state.get_data_parallel_world_size()
    if dp > 1:
        _allreduce_flat([p.grad for p in params], parallel_state.get_data_parallel_group(), dp,
                        fp32=grad_reduce_in_fp32)
    weight = None
    if (parallel_state.get_pipeline_model_parallel_world_size() > 1
            and parallel_state.is_rank_in_embedding_group(ignore_virtual=True)):
        from kubetron.training.pipeline import shared_embedding_weight

        weight = shared_embedding_weight(model[0])
    model_parallel_grad_sums(params, lambda p: p.grad, weight)


def model_parallel_grad_sums(params, grad_of, shared_embedding):
    """Steps 2 and 3 above, on the DP-reduced gradients `grad_of(param)` (None: no gradient)."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        sp = [grad_of(p) for p in params if getattr(p, "sequence_parallel", False)]
        _allreduce_flat([g for g in sp if g is not None], parallel_state.get_tensor_model_parallel_group())
    if shared_embedding is not None and grad_of(shared_embedding) is not None:
        dist.all_reduce(grad_of(shared_embedding), group=parallel_state.get_embedding_group())


def _model_parallel_sum(x: torch.Tensor) -> torch.Tensor:
    if parallel_state.get_model_parallel_group() is not None and dist.is_initialized():
        mp = (parallel_state.get_tensor_model_parallel_world_size()
              * parallel_state.get_pipeline_model_parallel_world_size())
        if mp > 1:
            dist.all_reduce(x, group=parallel_state.get_model_parallel_group())
    return x


def grad_norm_squared(params) -> torch.Tensor:
    """Sum of squared grads over the params this rank owns (no host sync)."""
    return sum_of_squares([p.grad for p in params if p.grad is not None and counts_toward_norms(p)])


def sum_of_squares(tensors: list[torch.Tensor], device=None) -> torch.Tensor:
    """The sum of the squared L2 norms of `tensors`, in fp32 (a 0-d tensor; a zero on `device` if none)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm([t.float() for t in tensors])).square().sum()


def clip_grads(model: list[torch.nn.Module], max_norm: float, optimizer=None) -> torch.Tensor:
    """Global grad L2 norm (in fp32) across the model-parallel group; scale grads down if above max_norm.

    With an optimizer that keeps fp32 main grads (`scale_grads`, see mixed_precision.py) the scaling
    is applied there, in fp32, instead of rounding the bf16 model grads once more.
    """
    params = [p for chunk in model for p in chunk.parameters()]
    total = _model_parallel_sum(grad_norm_squared(params).reshape(1)).sqrt().squeeze(0)
    _clip(total, max_norm, optimizer, [p.grad for p in params if p.grad is not None])
    return total


def _clip(total: torch.Tensor, max_norm: float, optimizer, grads: list[torch.Tensor]):
    if max_norm <= 0:
        return
    coeff = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if hasattr(optimizer, "scale_grads"):
        optimizer.scale_grads(coeff)
    elif grads:
        torch._foreach_mul_(grads, coeff.to(grads[0].device))


def params_l2_norm(model: list[torch.nn.Module]) -> torch.Tensor:
    """calc_params_l2_norm: the L2 norm of all parameters across the model-parallel group."""
    params = [p for chunk in model for p in chunk.parameters() if counts_toward_norms(p)]
    sq = sum_of_squares([p.detach() for p in params])
    return _model_parallel_sum(sq.reshape(1)).sqrt().squeeze(0)
