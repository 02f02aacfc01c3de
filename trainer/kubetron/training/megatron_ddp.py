"""`ddp.impl: megatron` (and `auto` on CUDA): megatron-core 0.16.1's DistributedDataParallel,
get_megatron_optimizer (its DistributedOptimizer with `ddp.use_distributed_optimizer`, else
Float16OptimizerWithFloat16Params / FP32Optimizer) and its pipeline schedules, behind kubetron's
optimizer interface (optimizer_base.py).

CUDA only: megatron-core allocates grad buffers on `torch.cuda.current_device()` and asserts CUDA
tensors in get_megatron_optimizer (docs/parallelism.md). CI has no GPU, so this module is kept thin:
it maps the config (`ddp_config`, `optimizer_config`, unit-tested on CPU) and calls megatron's own
pieces in the order Megatron-LM's `train_step` does:

    zero_grad():        model_chunk.zero_grad_buffer() for each chunk; optimizer.zero_grad()
    schedule:           get_forward_backward_func() with `config.no_sync_func` = the chunks' no_sync
                        (gradients of all but the last micro-batch stay local) and no
                        finalize_model_grads_func (the loop calls finish_grad_sync instead)
    finish_grad_sync(): megatron.core.distributed.finalize_model_grads(chunks): DP reduce (waits for
                        overlapped buckets), layer-norm grads over TP, tied embedding over PP
    clip_grad_norm():   optimizer.prepare_grads() (main_grad -> fp32 main grads), get_grad_norm(),
                        clip_grad_by_total_norm_fp32 -- megatron's step() split so the loop sees the
                        norm before the update (its NaN check and skipped iterations)
    step():             optimizer.step_with_ready_grads() (then the param all-gather)

The model chunks the loop and the checkpointer see stay the unwrapped GPTModels: DDP hooks live on
the parameters and submodules, so calling the inner module trains through them, and parameter
names stay those of the other implementations (checkpoints move between implementations).
Checkpoints: `state` / `set_param_state` give the same canonical, parameter-shaped state as
kubetron's optimizers (fp32 `main_param` + AdamW/SGD state), gathered over DP for the
distributed optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params

from kubetron.compat.megatron_core import optimizer as optimizer_internals
from kubetron.training.optimizer_base import TrainingOptimizer, take_main_param

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def ddp_config(cfg) -> DistributedDataParallelConfig:
    """kubetron's `ddp` section as megatron-core's DistributedDataParallelConfig. `check_for_nan_in_grad`
    stays off here: the loop checks the global grad norm (train.LossChecks), so a NaN exits 3 and an fp16
    overflow skips the step rather than raising in the bucket's reduction."""
    d = cfg.ddp
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=d.grad_reduce_in_fp32, overlap_grad_reduce=d.overlap_grad_reduce,
        overlap_param_gather=d.overlap_param_gather, use_distributed_optimizer=d.use_distributed_optimizer,
        bucket_size=d.bucket_size, check_for_nan_in_grad=False)


def optimizer_config(cfg) -> OptimizerConfig:
    """kubetron's `optimizer` section as megatron-core's OptimizerConfig (AdamW: decoupled decay)."""
    o, mp = cfg.optimizer, cfg.mixed_precision
    return OptimizerConfig(
        optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, sgd_momentum=o.sgd_momentum,
        decoupled_weight_decay=True, clip_grad=o.clip_grad, bf16=bool(mp.bf16), fp16=bool(mp.fp16),
        params_dtype=_DTYPES[mp.params_dtype or "float32"], loss_scale=mp.loss_scale,
        initial_loss_scale=mp.initial_loss_scale, min_loss_scale=mp.min_loss_scale,
        loss_scale_window=mp.loss_scale_window, hysteresis=mp.hysteresis,
        use_distributed_optimizer=cfg.ddp.use_distributed_optimizer,
        overlap_param_gather=cfg.ddp.overlap_param_gather)


def build_megatron_optimizer(cfg, model: list[torch.nn.Module]) -> MegatronOptimizer:
    """Wrap each chunk in megatron's DDP (as Megatron-LM: bucketing only for the first chunk), build
    megatron's optimizer over the wrapped chunks, and point the schedules' no_sync at the wrappers."""
    config: Any = model[0].config  # megatron's TransformerConfig
    ddp_cfg = ddp_config(cfg)
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_cfg, module=chunk, disable_bucketing=i > 0)
              for i, chunk in enumerate(model)]
    if cfg.rng.data_parallel_random_init:
        for c in chunks:
            c.broadcast_params()
    inner = get_megatron_optimizer(optimizer_config(cfg), chunks)
    config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
    config.finalize_model_grads_func = None  # the loop calls optimizer.finish_grad_sync()
    config.grad_scale_func = inner.scale_loss  # fp16's loss scale; 1 for bf16/fp32
    return MegatronOptimizer(inner, chunks, model, overlap_param_gather=cfg.ddp.overlap_param_gather)


def _parts(inner) -> list:
    return list(inner.chained_optimizers) if isinstance(inner, ChainedOptimizer) else [inner]


class MegatronOptimizer(TrainingOptimizer):
    """megatron-core's DDP + optimizer behind optimizer_base's interface; see the module docstring."""

    inner: Any  # megatron-core's optimizer (a ChainedOptimizer or one of its parts)

    def __init__(self, inner, chunks, model, *, overlap_param_gather: bool):
        self.inner, self.chunks = inner, chunks
        self.params = [p for chunk in model for p in chunk.parameters() if p.requires_grad]
        self.overlap_param_gather = overlap_param_gather
        self._found_inf = False
        self._mains = {p: (part, m) for part in _parts(inner) if not isinstance(part, DistributedOptimizer)
                       for p, m in _main_of(part).items()}
        self.dp_group = parallel_state.get_data_parallel_group()

    @property
    def defaults(self) -> dict:
        return _parts(self.inner)[0].optimizer.defaults

    def zero_grad(self):
        for c in self.chunks:
            c.zero_grad_buffer()
        self.inner.zero_grad()

    def finish_grad_sync(self):
        finalize_model_grads(self.chunks)

    @property
    def loss_scale(self) -> float:
        """megatron's grad scaler (fp16); prepare_grads() in clip_grad_norm updates it."""
        return float(self.inner.get_loss_scale())

    def update_loss_scale(self, found_inf: bool):
        """megatron's optimizer updated its scaler when it checked the gradients."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        self._found_inf = self.inner.prepare_grads()
        device = self.params[0].device
        if self._found_inf:
            return torch.tensor(float("nan"), device=device)  # the loop skips the update
        norm = self.inner.get_grad_norm()
        if max_norm > 0:
            for part in _parts(self.inner):
                params = part.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm, norm, False)
        return torch.tensor(float(norm), device=device)

    def step(self):
        self.inner.step_with_ready_grads()

    def finish_param_sync(self):
        if self.overlap_param_gather:  # as Megatron-LM's force_param_sync before a save
            for c in self.chunks:
                c.start_param_sync(force_sync=True)

    def reload_model_params(self):
        self.inner.reload_model_params()

    # -- checkpoints: canonical, parameter-shaped state ---------------------------------------------
    def _locate(self, p):
        """(sub-optimizer, main param or None, flat range of p this rank holds or None)."""
        for part in _parts(self.inner):
            if isinstance(part, DistributedOptimizer) and p in part.model_param_group_index_map:
                return part, optimizer_internals.main_param(part, p), optimizer_internals.owned_range(part, p)
        if p in self._mains:
            return (*self._mains[p], None)
        return None, None, None

    @property
    @torch.no_grad()
    def state(self) -> dict:
        """{model param: {state key: full fp32 tensor, "main_param": fp32 weight}}; collective over DP
        with the distributed optimizer (each rank adds its ranges, an all-reduce sums them)."""
        self.finish_param_sync()
        out = {}
        for p in self.params:
            part, main, rng = self._locate(p)
            inner_state = part.optimizer.state.get(main, {}) if part is not None else {}
            entry = {"main_param": main}
            entry.update({k: v for k, v in inner_state.items() if torch.is_tensor(v) and v.ndim > 0})
            if any(isinstance(q, DistributedOptimizer) for q in _parts(self.inner)):
                entry = self._gather_full(p, entry, rng)
            out[p] = {k: v.view(p.shape) if v.ndim else v for k, v in entry.items()}
            if "step" in inner_state:
                out[p]["step"] = inner_state["step"]
        return out

    def _gather_full(self, p, entry: dict, rng) -> dict:
        keys = sorted(k for k in entry if entry[k] is not None)
        everyone: list[Any] = [None] * dist.get_world_size(self.dp_group)  # each rank's keys
        dist.all_gather_object(everyone, keys, group=self.dp_group)
        full = {}
        for k in sorted({k for ks in everyone for k in ks}):
            flat = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            if rng is not None and entry.get(k) is not None:
                flat[rng[0]:rng[1]].copy_(entry[k].reshape(-1))
            dist.all_reduce(flat, group=self.dp_group)  # the ranges are disjoint: the sum is the whole
            full[k] = flat
        return full

    @torch.no_grad()
    def set_param_state(self, model_param: torch.nn.Parameter, state: dict):
        """Restore one parameter from full (canonical) state: this rank takes its range."""
        state, saved_main = take_main_param(model_param, state)
        part, main, rng = self._locate(model_param)
        if part is None:
            return
        lo, hi = rng if rng is not None else (0, model_param.numel())
        if saved_main is not None:
            main.copy_(saved_main.reshape(-1)[lo:hi].view_as(main))
        entry = {k: (v.reshape(-1)[lo:hi].view_as(main).clone() if torch.is_tensor(v) and v.ndim > 0 else v)
                 for k, v in state.items()}
        if entry:
            part.optimizer.state[main] = entry

    def _owned(self) -> list[tuple] | None:
        """[(param, lo, hi, sub-optimizer, main)] with megatron's distributed optimizer (parameters
        outside this rank's shard are left out); None without it (state per whole parameter)."""
        out = []
        for p in self.params:
            part, main, rng = self._locate(p)
            if part is not None and rng is None:
                return None  # a non-distributed sub-optimizer: whole parameters
            if part is not None and rng[1] > rng[0]:
                out.append((p, *rng, part, main))
        return out

    def owned_ranges(self) -> list[tuple[torch.nn.Parameter, int, int]] | None:
        owned = self._owned()
        return None if owned is None else [(p, lo, hi) for p, lo, hi, _, _ in owned]

    def owned_state(self) -> list[tuple[torch.nn.Parameter, int, int, dict]] | None:
        owned = self._owned()
        if owned is None:
            return None
        self.finish_param_sync()
        out = []
        for p, lo, hi, part, main in owned:
            state = {k: v.view(-1) if torch.is_tensor(v) and v.ndim > 0 else v
                     for k, v in part.optimizer.state.get(main, {}).items()}
            out.append((p, lo, hi, {"main_param": main.detach().view(-1), **state}))
        return out

    @torch.no_grad()
    def set_owned_state(self, model_param: torch.nn.Parameter, lo: int, hi: int, state: dict):
        part, main, rng = self._locate(model_param)
        if part is None or rng != (lo, hi):
            raise ValueError(f"this rank owns no range [{lo}, {hi}) of a parameter of shape {list(model_param.shape)}")
        state = dict(state)
        saved_main = state.pop("main_param", None)
        main.copy_((saved_main if saved_main is not None else model_param.detach().reshape(-1)[lo:hi]).view_as(main))
        if state:
            part.optimizer.state[main] = {k: v.to(main.device).view_as(main) if torch.is_tensor(v) and v.ndim > 0
                                          else v for k, v in state.items()}

    def state_dict(self) -> dict:
        """This rank's own pieces, by parameter position (same-layout, node-local checkpoints): the fp32
        main and the optimizer state of each parameter's range this rank holds. (megatron's own
        DistributedOptimizer.state_dict() leaves the parameter state out.)"""
        pieces = []
        for p in self.params:
            part, main, _ = self._locate(p)
            pieces.append({} if part is None else
                          {"main_param": main.detach().clone(), **part.optimizer.state.get(main, {})})
        return {"param_state": pieces}

    @torch.no_grad()
    def load_state_dict(self, sd: dict):
        """The inverse of state_dict (the model's weights come from the model's own state dict)."""
        if len(sd["param_state"]) != len(self.params):
            raise ValueError(f"state dict has {len(sd['param_state'])} parameters, this optimizer {len(self.params)}")
        for p, saved in zip(self.params, sd["param_state"], strict=True):
            part, main, _ = self._locate(p)
            if part is None or not saved:
                continue
            saved = dict(saved)
            main.copy_(saved.pop("main_param"))
            if saved:
                part.optimizer.state[main] = saved


def _main_of(part) -> dict:
    """model param -> the fp32 param megatron's non-distributed optimizer steps."""
    if isinstance(part, Float16OptimizerWithFloat16Params):
        pairs = [(m, f) for mg, fg in zip(part.float16_groups, part.fp32_from_float16_groups, strict=True)
                 for m, f in zip(mg, fg, strict=True)]
        pairs += [(p, p) for g in part.fp32_from_fp32_groups for p in g]
        return dict(pairs)
    return {p: p for g in part.optimizer.param_groups for p in g["params"]}  # FP32Optimizer
