"""Canonical (layout-free) checkpoint tensors: gather from this rank's shards, scatter back.

Canonical form = the state dict a TP=1, PP=1 model has: full tensors, global layer numbers.
With data parallelism only, every rank already holds the full tensors, so gather/scatter are
copies and a checkpoint saved at DP=N loads at any DP=M.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state


def _check_supported():
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if tp != 1 or pp != 1:
        raise NotImplementedError(f"checkpoints with tensor/pipeline parallelism (tp={tp}, pp={pp}) are not "
                                  "supported yet: use data parallelism only")


def _skip(name: str) -> bool:
    return name.endswith("_extra_state")


def gather_model_state(model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Full tensors on the host, keyed by canonical name (only rank 0's result is written)."""
    _check_supported()
    return {k: v.detach().to("cpu", copy=True) for k, v in model[0].state_dict().items() if not _skip(k)}


def load_model_state(model: list[torch.nn.Module], full: dict[str, torch.Tensor]):
    """Copy canonical tensors into this rank's parameters; names must match exactly."""
    _check_supported()
    own = {k: v for k, v in model[0].state_dict().items() if not _skip(k)}
    missing = sorted(set(own) - set(full))
    unexpected = sorted(set(full) - set(own))
    if missing or unexpected:
        from kubetron.errors import CheckpointError

        raise CheckpointError(f"checkpoint tensors do not match the model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    with torch.no_grad():
        for k, t in own.items():
            src = full[k]
            if src.shape != t.shape:
                from kubetron.errors import CheckpointError

                raise CheckpointError(f"{k}: checkpoint shape {tuple(src.shape)} != model shape {tuple(t.shape)}")
            t.copy_(src.to(t.dtype))


def gather_optimizer_state(model, by_name: dict) -> dict:
    """Optimizer state in canonical form (host memory)."""
    _check_supported()
    state = {n: {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v) for k, v in s.items()}
             for n, s in by_name["state"].items()}
    return {"state": state, "param_groups": by_name["param_groups"]}


def scatter_optimizer_state(model, saved: dict) -> dict:
    """This rank's share of a canonical optimizer state."""
    _check_supported()
    return saved
