"""Mixture of experts on megatron-core's MoELayer: the load-balancing loss's scale and values.

megatron-core 0.16.1's MoE path assumes CUDA in four places (the router's gating, the router GEMM without TE,
the all-to-all dispatcher's CUDA stream, the collectives' CUDA outputs): kubetron.compat.megatron_core.portable
adapts them, behind the compat seam's version check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_utils

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


def forget_tracked_losses() -> None:
    """Empty megatron's load-balancing-loss tracker, process-wide and sized by the first MoE model's layer count: a
    second model built in the same process (another run, a notebook) with more layers indexed past it."""
    moe_utils.get_moe_layer_wise_logging_tracker().clear()


def _mean_over(values: torch.Tensor, group) -> torch.Tensor:
    """all-reduce AVG, as a sum and a division (gloo has no AVG)."""
    dist.all_reduce(values, group=group)
    return values / dist.get_world_size(group)


def num_moe_layers(m) -> int:
    return sum(m.moe_layer_pattern())
