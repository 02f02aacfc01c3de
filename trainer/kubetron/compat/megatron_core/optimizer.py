"""What kubetron reads of megatron-core 0.16.1's DistributedOptimizer that it keeps private: where a model
parameter lives on this rank (its flat range in the DP-sharded buffer, its fp32 main parameter). Checkpoints need
both to save and restore the optimizer's state by parameter (kubetron.training.megatron_ddp); megatron's own
checkpoints reach them through the same private methods. Behind the version check of `install()`."""

from __future__ import annotations

import torch


def owned_range(optimizer, param: torch.nn.Parameter) -> tuple[int, int]:
    """[start, end) of `param`'s flattened elements this rank's `optimizer` part holds."""
    found = optimizer._get_model_param_range_map(param)["param"]
    return found.start, found.end


def main_param(optimizer, param: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 main parameter `optimizer` steps for this rank's range of `param` (its state is keyed by it)."""
    return optimizer._get_main_param_and_optimizer_states(param)["param"]
