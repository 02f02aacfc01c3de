"""train_utils: forward-step injection, metric reductions, FLOPs, memory reports."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from kubetron.training.state import GlobalState

MEMORY_KEYS: dict[str, str] = {
    "allocated_bytes.all.current": "mem-allocated-bytes",
    "active_bytes.all.current": "mem-active-bytes",
    "inactive_split_bytes.all.current": "mem-inactive-bytes",
    "reserved_bytes.all.current": "mem-reserved-bytes",
    "allocated_bytes.all.peak": "mem-max-allocated-bytes",
    "active_bytes.all.peak": "mem-max-active-bytes",
    "inactive_split_bytes.all.peak": "mem-max-inactive-bytes",
    "reserved_bytes.all.peak": "mem-max-reserved-bytes",
    "num_alloc_retries": "mem-alloc-retires",
}


# --- the forward-step contract -------------------------------------------------------------------

def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    if inspect.isfunction(fn) or inspect.ismethod(fn) or isinstance(fn, partial):
        return inspect.signature(fn)
    return inspect.signature(fn.__call__)  # type: ignore[operator]  # (mypy reads a Callable's __call__ as not one)


def needs_global_state_injection(forward_step_func: Callable) -> bool:
    """GlobalState annotation on any parameter, else a first parameter named state/global_state."""
    params = list(_signature(forward_step_func).parameters.values())
    for p in params:
        ann = p.annotation
        if ann is GlobalState or (isinstance(ann, str) and ann.split(".")[-1] == "GlobalState"):
            return True
    return bool(params) and params[0].name in ("state", "global_state")


def maybe_inject_state(forward_step_func: Callable, state: GlobalState, needs_injection: bool | None = None):
    if needs_injection is None:
        needs_injection = needs_global_state_injection(forward_step_func)
    return partial(forward_step_func, state) if needs_injection else forward_step_func


def prepare_forward_step_func(forward_step_func: Callable, state: GlobalState):
    """Inspect once, wrap once (a functor keeps its own state: partial holds the instance)."""
    return maybe_inject_state(forward_step_func, state, needs_global_state_injection(forward_step_func))


# --- reductions ------------------------------------------------------------------------------------

def unpack_loss(result) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """Normalize the two loss patterns: (loss, dict) and (loss, num_tokens, dict)."""
    if isinstance(result, tuple) and len(result) == 3:
        return result[0], result[1], result[2]
    if isinstance(result, tuple) and len(result) == 2:
        return result[0], None, result[1]
    raise TypeError("loss_func must return (loss, dict) or (loss, num_tokens, dict)")


def reduce_losses(per_microbatch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Average each reported loss over micro-batches and data-parallel ranks (on device, no sync).

    A 2-element value [sum, count] is a token-weighted loss: sums and counts add up first.
    A scalar value is averaged over micro-batches and ranks.
    """
    if not per_microbatch:
        return {}
    out = {}
    dp_group = parallel_state.get_data_parallel_group()
    dp = parallel_state.get_data_parallel_world_size()
    for key in per_microbatch[0]:
        vals = torch.stack([d[key].detach().float().reshape(-1) for d in per_microbatch])
        if vals.shape[1] == 2:
            acc = vals.sum(0)
            if dp > 1:
                dist.all_reduce(acc, group=dp_group)
            out[key] = acc[0] / acc[1].clamp(min=1)
        else:
            acc = vals.mean(0).reshape(())
            if dp > 1:
                dist.all_reduce(acc, group=dp_group)
                acc = acc / dp
            out[key] = acc
    return out


# --- throughput accounting -------------------------------------------------------------------------

def num_floating_point_operations(cfg, batch_size: int) -> float:
    """Training FLOPs for `batch_size` sequences (fwd + bwd = 3x fwd; causal attention counted half).

    Per token and layer, forward: 2*(QKV + proj + MLP weights) + 2*2*s*q/2 for QK^T and AV, where
    q = heads * head size (= h unless model.kv_channels says otherwise); an MoE layer's MLP weights are
    its router's, its top-k experts' and its shared expert's. Plus the logits layer 2*h*V.
    The same formula is used for the plain-PyTorch baseline in bench/.
    """
    m = cfg.model
    h, s, L, V = m.hidden_size, m.seq_length, m.num_layers, m.vocab_size
    q = m.num_attention_heads * m.head_size()
    kv = 2 * (m.num_query_groups or m.num_attention_heads) * m.head_size()
    ffn = m.ffn_hidden_size or 4 * h
    gated = 3 if m.activation == "swiglu" else 2  # number of h x ffn matrices
    attention = 2 * (h * (q + kv) + q * h) + 2 * s * q  # causal: 4*s*q/2
    mlp = sum(_mlp_weights(m, moe, gated, ffn) for moe in m.moe_layer_pattern())
    per_token = L * attention + 2 * mlp + 2 * h * V
    return 3.0 * per_token * s * batch_size


def _mlp_weights(m, moe: int, gated: int, ffn: int) -> int:
    """Weights one token multiplies in a layer's MLP: the dense MLP's, or an MoE layer's router, its
    top-k experts and its shared expert (as megatron's num_floating_point_operations counts them)."""
    h = m.hidden_size
    if not moe:
        return gated * h * ffn
    routed = (m.moe_ffn_hidden_size or ffn) * m.moe_router_topk
    return h * m.num_moe_experts + gated * h * (routed + (m.moe_shared_expert_intermediate_size or 0))


def report_memory(memory_keys: dict[str, str] | None = None, stats: dict | None = None) -> dict[str, float]:
    """CUDA allocator statistics as the reference reports them ({} on CPU): byte counts in GB
    (1e9 bytes, 5 significant digits) under the name with "bytes" -> "gigabytes"
    (`mem-max-allocated-gigabytes`), counts as they are (`mem-alloc-retires`)."""
    if stats is None:
        if not torch.cuda.is_available():
            return {}
        stats = torch.cuda.memory_stats()
    out = {}
    for key, name in (memory_keys or MEMORY_KEYS).items():
        if key not in stats:
            continue
        if "bytes" in key:
            gb = stats[key] / 1.0e9
            out[name.replace("bytes", "gigabytes")] = float(f"{gb:.5g}")
        else:
            out[name] = float(stats[key])
    return out
