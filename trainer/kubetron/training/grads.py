"""Gradient reductions every optimizer shares: megatron's `finalize_model_grads` steps for plain
`.grad`s, the model-parallel sums, and the norms (each element counted once across TP/PP ranks).

Leaf module (torch + parallel_state only): ddp.py and optim.py both build on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state

if TYPE_CHECKING:
    from megatron.core.models.common.language_module.language_module import LanguageModule


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "shared", False)


def _is_replica_on_this_tp_rank(param: torch.nn.Parameter) -> bool:
    """True when this rank's copy counts toward norms (TP-split params, or TP rank 0 for replicated)."""
    return getattr(param, "tensor_model_parallel", False) or parallel_state.get_tensor_model_parallel_rank() == 0


def counts_toward_norms(param: torch.nn.Parameter) -> bool:
    """Whether this rank's copy of `param` enters the grad/params norms (each element counted once)."""
    return param_is_not_shared(param) and _is_replica_on_this_tp_rank(param)


def shared_embedding_weight(chunk: LanguageModule) -> torch.nn.Parameter | None:
    """The word-embedding weight this stage shares with the other end of the pipeline, if any."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    if not getattr(chunk, "share_embeddings_and_output_weights", False):
        return None
    if not (chunk.pre_process or chunk.post_process):
        return None
    return chunk.shared_embedding_or_output_weight()


def embedding_group_weight(model: list[torch.nn.Module]) -> torch.nn.Parameter | None:
    """The tied embedding weight whose gradient is summed over the embedding group (PP > 1), or None."""
    if (parallel_state.get_pipeline_model_parallel_world_size() > 1
            and parallel_state.is_rank_in_embedding_group(ignore_virtual=True)):
        return shared_embedding_weight(model[0])
    return None


def is_expert_parallel(param: torch.nn.Parameter) -> bool:
    """An MoE expert's parameter under expert parallelism (megatron marks them `allreduce = False` when
    expert_model_parallel_size > 1): each EP rank holds other experts, so its gradient is averaged over
    the expert-data-parallel group only, and its squares add up over the EP group in the norms."""
    return not getattr(param, "allreduce", True)


def norm_squared(params, value_of) -> torch.Tensor:
    """This rank's share of a global squared L2 norm (shape (1,), fp32), to be summed over TP x PP by the
    caller: `value_of(param)` (None: skipped) squared and summed over the parameters that count toward
    norms; the expert-parallel ones' sum is first added up over the EP group (other ranks, other experts)."""
    dense = [value_of(p) for p in params if counts_toward_norms(p) and not is_expert_parallel(p)]
    experts = [value_of(p) for p in params if counts_toward_norms(p) and is_expert_parallel(p)]
    device = params[0].device if params else None
    total = sum_of_squares([v for v in dense if v is not None], device=device)
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        own = sum_of_squares([v for v in experts if v is not None], device=device)
        dist.all_reduce(own, group=parallel_state.get_expert_model_parallel_group())
        total = total + own
    return total.reshape(1)


def summed_over_tp(param: torch.nn.Parameter) -> bool:
    """A parameter replicated over TP whose gradient each TP rank has only a part of: the layer norms
    under sequence parallelism (megatron marks them `sequence_parallel`) and the q/k layer norms, which
    each rank applies to its own heads (model.mark_qk_layernorm)."""
    return bool(getattr(param, "sequence_parallel", False) or getattr(param, "qk_layernorm", False))


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

    1. data-parallel mean of all gradients (one flat bucket, one all-reduce; expert-parallel experts'
       over the expert-data-parallel group);
    2. sum the grads of params replicated across TP ranks that saw only a part of the data (their
       sequence shard, their heads: `summed_over_tp`) over the TP group;
    3. with pipeline parallelism and tied embeddings, sum the word-embedding grad of the first stage
       and its copy on the last stage (`output_layer.weight`) over the embedding group, so the two
       copies get the same update.
    """
    with_grad = [(p, p.grad) for chunk in model for p in chunk.parameters() if p.grad is not None]
    params = [p for p, _ in with_grad]
    dp = parallel_state.get_data_parallel_world_size()
    if dp > 1:
        _allreduce_flat([g for p, g in with_grad if not is_expert_parallel(p)],
                        parallel_state.get_data_parallel_group(), dp, fp32=grad_reduce_in_fp32)
        # experts: summed over the ranks holding the same experts, divided by the whole DP size (each
        # already holds the gradient of the tokens the EP group routed to it; megatron's DDP the same)
        _allreduce_flat([g for p, g in with_grad if is_expert_parallel(p)],
                        parallel_state.get_expert_data_parallel_group(), dp, fp32=grad_reduce_in_fp32)
    model_parallel_grad_sums(params, lambda p: p.grad, embedding_group_weight(model))


def model_parallel_grad_sums(params, grad_of, shared_embedding):
    """Steps 2 and 3 above, on the DP-reduced gradients `grad_of(param)` (None: no gradient)."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        sp = [grad_of(p) for p in params if summed_over_tp(p)]
        _allreduce_flat([g for g in sp if g is not None], parallel_state.get_tensor_model_parallel_group())
    if shared_embedding is not None and grad_of(shared_embedding) is not None:
        dist.all_reduce(grad_of(shared_embedding), group=parallel_state.get_embedding_group())


def model_parallel_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` (a device tensor) over the model-parallel (TP x PP) group, in place."""
    if parallel_state.get_model_parallel_group() is not None and dist.is_initialized():
        mp = (parallel_state.get_tensor_model_parallel_world_size()
              * parallel_state.get_pipeline_model_parallel_world_size())
        if mp > 1:
            dist.all_reduce(x, group=parallel_state.get_model_parallel_group())
    return x


def sum_of_squares(tensors: list[torch.Tensor], device=None) -> torch.Tensor:
    """The sum of the squared L2 norms of `tensors`, in fp32 (a 0-d tensor; a zero on `device` if none)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm([t.float() for t in tensors])).square().sum()


class FlatGradSync:
    """The default gradient sync: after the whole backward pass, one flat all-reduce of `.grad`s
    (allreduce_gradients). `GradBuffers` (ddp.py) is the bucketed, overlapped alternative."""

    def __init__(self, model: list[torch.nn.Module], grad_reduce_in_fp32: bool):
        self.model, self.grad_reduce_in_fp32 = model, grad_reduce_in_fp32

    def zero(self):
        pass  # the optimizer clears `.grad`

    def finish(self):
        allreduce_gradients(self.model, self.grad_reduce_in_fp32)
