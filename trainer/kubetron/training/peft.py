"""LoRA (`peft.scheme: lora`): low-rank adapters on megatron-core's parallel linears, base frozen.

Every targeted linear of every layer (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`) gets a
submodule `adapter` with `linear_in` (A: dim x in) and `linear_out` (B: out x dim); a forward hook adds
(alpha/dim) * B(A(x)) to the linear's output. The base linear keeps its parameter names, so checkpoints,
HF import/export and resharding see the same base tensors; adapter tensors are named
`<linear>.adapter.linear_in.weight` / `<linear>.adapter.linear_out.weight` (Megatron Bridge's names).

Tensor parallelism (the conventions of Bridge's ParallelLinearAdapter):
- column-parallel linear (qkv, fc1: each TP rank holds rows of the output): B is split like the output
  (partition_dim 0; for SwiGLU's fc1 the rows are `[gate_r; up_r]` like the weight's), A is replicated.
  A's output enters the TP region through `copy_to_tensor_model_parallel_region` (identity forward,
  gradient all-reduced), so every rank gets A's full gradient.
- row-parallel linear (proj, fc2: each rank holds columns of the input): A is split like the input
  (partition_dim 1); its partial products are all-reduced (`reduce_from_tensor_model_parallel_region`),
  and B, like the linear's all-reduced output, is replicated.
An MoE expert's linears (`mlp.experts.local_experts.<e>.linear_fc1/fc2`) get adapters like any other;
under expert parallelism the adapters are expert parameters too (`allreduce = False`, as megatron marks
the expert weights), so each expert's adapter sees only its own gradient.
Initialisation is layout-free: A is drawn (xavier normal) for the full TP=1 tensor from a generator
seeded by rng.seed and the tensor's canonical name, then sliced; B is zero, so training starts from the
base model. Dropout uses the default generator, seeded alike on all TP ranks (as megatron's hidden
dropout): a replicated A sees the same mask everywhere.
"""

from __future__ import annotations

import logging
import math
import zlib

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from kubetron.checkpoint.adapters import enabled, is_adapter_name

log = logging.getLogger("kubetron")

class LoRAAdapter(torch.nn.Module):
    """B(A(x)) * alpha/dim for one parallel linear; `row` selects the row-parallel layout."""

    def __init__(self, base: ColumnParallelLinear | RowParallelLinear, row: bool, dim: int, alpha: float,
                 dropout: float, dropout_position: str, seed: int):
        super().__init__()
        tp, r = (parallel_state.get_tensor_model_parallel_world_size(),
                 parallel_state.get_tensor_model_parallel_rank())
        out_local, in_local = base.weight.shape
        in_full = in_local * tp if row else in_local
        kw = dict(bias=False, dtype=base.weight.dtype)
        self.row, self.scale, self.dropout_position = row, alpha / dim, dropout_position
        self.dropout = torch.nn.Dropout(dropout)
        self.linear_in = torch.nn.Linear(in_local, dim, **kw)
        self.linear_out = torch.nn.Linear(dim, out_local, **kw)
        gen = torch.Generator().manual_seed(seed)
        a_full = torch.randn(dim, in_full, generator=gen) * math.sqrt(2.0 / (dim + in_full))  # xavier normal
        with torch.no_grad():
            self.linear_in.weight.copy_(a_full.chunk(tp, dim=1)[r] if row else a_full)
            self.linear_out.weight.zero_()
        split = self.linear_in.weight if row else self.linear_out.weight
        # megatron-core's parameter attributes (torch's stubs have no place for them)
        split.tensor_model_parallel, split.partition_dim, split.partition_stride = (  # type: ignore[attr-defined]
            True, 1 if row else 0, 1)
        expert_parallel = not getattr(base.weight, "allreduce", True)  # an MoE expert's linear under EP
        for p in self.parameters():
            p.is_adapter = True  # type: ignore[attr-defined]  # (a parameter attribute, as megatron's)
            p.allreduce = not expert_parallel  # type: ignore[attr-defined]  # reduced over the experts' DP group, like the base's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout_position == "pre":
            x = self.dropout(x)
        if self.row:  # x: this rank's columns of the input
            h = reduce_from_tensor_model_parallel_region(self.linear_in(x))
        else:
            h = copy_to_tensor_model_parallel_region(self.linear_in(x))
        y = self.linear_out(h) * self.scale
        return self.dropout(y) if self.dropout_position == "post" else y


def _add_adapter(module, _args, kwargs, output):
    x = _args[0] if _args else kwargs["input_"]
    out, bias = output
    return out + module.adapter(x).to(out.dtype), bias


def _seed(base_seed: int, canonical_name: str) -> int:
    return (base_seed * 1_000_003 + zlib.crc32(canonical_name.encode())) % (2**63)


def apply_lora(model: list[torch.nn.Module], cfg) -> None:
    """Attach adapters to the targeted linears and freeze everything else (no-op without peft)."""
    if not enabled(cfg):
        return
    from kubetron.checkpoint import canonical

    p = cfg.peft
    for chunk in model:
        offsets = canonical.layer_offsets(chunk)
        for name, module in list(chunk.named_modules()):
            if name.rsplit(".", 1)[-1] not in p.target_modules or not name.startswith("decoder.layers."):
                continue
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                raise TypeError(f"{name}: LoRA needs megatron's local parallel linears, got {type(module).__name__}")
            seed = _seed(cfg.rng.seed, canonical.canonical_name(name, offsets))
            module.adapter = LoRAAdapter(module, isinstance(module, RowParallelLinear), p.dim, p.alpha,
                                         p.dropout, p.dropout_position, seed)
            module.register_forward_hook(_add_adapter, with_kwargs=True)
        for pname, param in chunk.named_parameters():
            param.requires_grad_(is_adapter_name(pname))
    log.info("%s", summary(model, cfg))


def _state_bytes_per_element(cfg) -> int:
    """Optimizer state per trainable element: Adam's two fp32 moments or SGD's momentum, plus the fp32
    main copy a bf16/fp16 model's optimizer keeps."""
    per = 8 if cfg.optimizer.optimizer == "adam" else 4
    return per + (4 if cfg.mixed_precision.bf16 or cfg.mixed_precision.fp16 else 0)


def summary(model: list[torch.nn.Module], cfg) -> str:
    """Trainable parameters and optimizer-state bytes of this rank, against a full fine-tune."""
    params = [p for chunk in model for p in chunk.parameters()]
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    per = _state_bytes_per_element(cfg)
    return (f"peft lora (dim {cfg.peft.dim}, alpha {cfg.peft.alpha:g}, {', '.join(cfg.peft.target_modules)}): "
            f"trainable parameters {trainable} of {total} ({100.0 * trainable / max(total, 1):.2f}%); "
            f"optimizer state {trainable * per} bytes (full fine-tune: {total * per} bytes)")
