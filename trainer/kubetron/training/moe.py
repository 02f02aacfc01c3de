"""Mixture of experts on megatron-core's MoELayer: the pieces that make it run without CUDA.

megatron-core 0.16.1's MoE path assumes CUDA in four places; on a CUDA machine none of this is used:
- `TopKRouter.gating` moves CPU-held router weights to `torch.cuda.current_device()` (the model is moved
  as a whole here): `PortableTopKRouter` leaves them where they are;
- `moe_utils.router_gating_linear` names `te_general_gemm`, which is undefined without TransformerEngine
  (a NameError where its torch.mm fallback was meant to run): it is set to None when absent;
- `MoEAlltoAllTokenDispatcher` makes a CUDA stream in `__init__` and copies the split sizes to the host
  on it: `HostAlltoAllTokenDispatcher` takes them as they are, converted as the CUDA path converts them;
- `tensor_parallel.mappings` allocates the outputs of the all-gather, reduce-scatter and all-to-all the
  dispatchers use on `torch.cuda.current_device()`: `host_collectives()` rebinds those three functions
  to copies that allocate on the input's device (the collectives themselves are gloo's: gloo has
  all_to_all_single with uneven splits, all_gather_into_tensor and reduce_scatter_tensor).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

if not hasattr(moe_utils, "te_general_gemm"):  # undefined without TE in mcore 0.16.1, then NameErrors
    moe_utils.te_general_gemm = None  # where its router GEMM would fall back to torch.mm


class PortableTopKRouter(TopKRouter):
    """mcore's top-k router without its move of CPU-held weights to CUDA in `gating`."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return moe_utils.router_gating_linear(input, self.weight, self.bias, dtype)  # (tokens, experts)


class HostAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """mcore's all-to-all token dispatcher on CPU tensors: at its device-to-host point the split sizes
    become numpy arrays as on CUDA, without a stream (they are on the host already)."""

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
        if self.drop_and_pad or point != self.cuda_dtoh_point:
            return tokens_per_expert
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
        return tokens_per_expert


def without_cuda(model: torch.nn.Module) -> None:
    """Make `model`'s MoE layers dispatch on the host. Call `before_build_without_cuda` first."""
    for module in model.modules():
        if type(getattr(module, "token_dispatcher", None)) is MoEAlltoAllTokenDispatcher:
            module.token_dispatcher.__class__ = HostAlltoAllTokenDispatcher


def before_build_without_cuda() -> None:
    """Before MoE layers are built where torch has no CUDA: the all-to-all dispatcher's __init__ makes a
    CUDA stream once per process unless one is there (HostAlltoAllTokenDispatcher never uses it), and the
    dispatchers' collectives must allocate on the host."""
    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim
    mappings._AllToAll.forward = staticmethod(_all_to_all_forward)


# --- megatron-core 0.16.1's tensor_parallel.mappings functions, allocating on the input's device --------

def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
    world_size = group.size()
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    if output_split_sizes is None:
        dim_size[0] *= world_size
        output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
        dist.all_gather_into_tensor(output, input_.contiguous(), group=group)
    else:
        dim_size[0] = sum(output_split_sizes)
        output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
        dist.all_gather(list(torch.split(output, output_split_sizes, dim=0)), input_, group=group)
    return output


def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    world_size = group.size()
    if world_size == 1:
        return input_
    if input_split_sizes is None:
        dim_size = list(input_.size())
        assert dim_size[0] % world_size == 0, "the first dimension must divide over the group"
        dim_size[0] //= world_size
        output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
        dist.reduce_scatter_tensor(output, input_.contiguous(), group=group)
    else:
        inputs = list(torch.split(input_, input_split_sizes, dim=0))
        output = torch.empty_like(inputs[group.rank()])
        dist.reduce_scatter(output, inputs, group=group)
    return output


def _all_to_all_forward(ctx, group, input, output_split_sizes, input_split_sizes):
    ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, output_split_sizes, input_split_sizes
    if group.size() == 1:
        return input
    input = input.contiguous()
    if output_split_sizes is None:
        output = torch.empty_like(input)
    else:
        output = input.new_empty(size=[int(sum(output_split_sizes))] + list(input.size()[1:]))
    dist.all_to_all_single(output, input, output_split_sizes=_sizes(output_split_sizes),
                           input_split_sizes=_sizes(input_split_sizes), group=group)
    return output


def _sizes(splits):
    return None if splits is None else [int(n) for n in splits]


# --- the load-balancing loss: its gradient's scale, and its values for the metrics ------------------

def scale_aux_loss(model: list[torch.nn.Module], loss_scale: float, num_microbatches: int) -> None:
    """Before kubetron's own schedules' backward passes: the factor the load-balancing loss's gradient gets,
    as megatron's schedule sets it (the main loss's fp16 scale / the micro-batches per step)."""
    if getattr(getattr(model[0], "config", None), "num_moe_experts", None) is None:
        return
    device = next(model[0].parameters()).device
    scale = torch.tensor(loss_scale / num_microbatches, dtype=torch.float32, device=device)
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(scale)


def tracked_names(m) -> list[str]:
    """The tracker names megatron's router logs under for `model` section `m` (Megatron-LM's training_log)."""
    if m.num_moe_experts is None or not m.moe_aux_loss_coeff:
        return []  # the router computes no load-balancing loss at coefficient 0
    return {"aux_loss": ["load_balancing_loss"], "seq_aux_loss": ["seq_load_balancing_loss"]}.get(
        m.moe_router_load_balancing_type, [])


def tracked_losses(cfg, device: torch.device) -> dict[str, torch.Tensor]:
    """This step's load-balancing losses as megatron's `track_moe_metrics` reports them (collective: every
    rank calls it once per step): `<name>` = the per-layer values summed over the pipeline stages, over
    the router's reduce group and averaged over DP, divided by the micro-batches, averaged over the MoE
    layers; with model.moe_per_layer_logging also `moe/<name>_layer_<i>` for every layer. The tracker is
    cleared. Device tensors (no host sync)."""
    from megatron.core import parallel_state

    m = cfg.model
    names = tracked_names(m)
    if not names:
        return {}
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    out = {}
    for name in names:
        entry = tracker.setdefault(name, {"values": torch.zeros(m.num_layers, device=device), "reduce_group": None,
                                          "avg_group": None, "reduce_group_has_dp": False})
        values = entry["values"].float()
        dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
        if entry.get("reduce_group") is not None:
            dist.all_reduce(values, group=entry["reduce_group"])
            if not entry.get("reduce_group_has_dp"):
                values = _mean_over(values, parallel_state.get_data_parallel_group())
        if entry.get("avg_group") is not None:
            values = _mean_over(values, entry["avg_group"])
        values = values / cfg.train.num_microbatches
        out[name] = values.sum() / num_moe_layers(m)
        if m.moe_per_layer_logging:
            out.update({f"moe/{name}_layer_{i}": v for i, v in enumerate(values)})
    moe_utils.clear_aux_losses_tracker()
    return out


def _mean_over(values: torch.Tensor, group) -> torch.Tensor:
    """all-reduce AVG, as a sum and a division (gloo has no AVG)."""
    dist.all_reduce(values, group=group)
    return values / dist.get_world_size(group)


def num_moe_layers(m) -> int:
    return sum(m.moe_layer_pattern())
