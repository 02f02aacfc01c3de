"""The pieces of megatron-core 0.16.1 that hard-code CUDA, made to run on whatever device the model is on
(NOTES-megatron-core.md). Import it after `kubetron.compat.megatron_core.install()`; each function here is
called by the model build, only where its adaptation applies:

- `rope(model, llama3_scaling)`, every device: RoPE's `get_emb` moves `inv_freq` to CUDA;
  `PortableRotaryEmbedding` computes on `inv_freq`'s device (the model moves it).
- `PortableTopKRouter`, the MoE layer spec's router on every device: `TopKRouter.gating` moves CPU-held router
  weights to `torch.cuda.current_device()` (the model is moved as a whole here); this one leaves them where they
  are (its `gating` is megatron's, less the move).
- `router_gemm_without_te()`, every MoE model: `moe_utils.router_gating_linear` names `te_general_gemm`,
  which is undefined without TransformerEngine (a NameError where its torch.mm fallback was meant to run).
- `moe_on_host()` before building MoE layers where torch has no CUDA, `dispatch_on_host(model)` after:
  `MoEAlltoAllTokenDispatcher` makes a CUDA stream in `__init__` and copies the split sizes to the host on
  it; `tensor_parallel.mappings` allocates the outputs of the all-gather, reduce-scatter and all-to-all the
  dispatchers use on `torch.cuda.current_device()` (the collectives themselves are gloo's: gloo has
  all_to_all_single with uneven splits, all_gather_into_tensor and reduce_scatter_tensor).
- `recompute_rng_on_host()`: activation recompute saves and restores the CUDA RNG state.
- `embedding_sync_skipped()`: under PP, LanguageModule copies the shared embedding with `.cuda()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings import rotary_pos_embedding as mcore_rope
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


class PortableRotaryEmbedding(mcore_rope.RotaryEmbedding):
    """mcore's RoPE without the hard-coded move of `inv_freq` to CUDA (the model moves it)."""

    inv_freq: torch.Tensor

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # (s, dim/2)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]  # (s, 1, 1, dim)

    def _apply(self, fn, *args, **kwargs):
        # inv_freq is a plain attribute in mcore, not a buffer: move it with the module.
        self.inv_freq = fn(self.inv_freq)
        return super()._apply(fn, *args, **kwargs)


def rope(model: torch.nn.Module, llama3_scaling: dict | None = None) -> None:
    """Make `model`'s RoPE (GPTModel builds mcore's own) a PortableRotaryEmbedding, its frequencies scaled
    by mcore's llama3 scaling when `llama3_scaling` (its keyword arguments) is given; no-op without RoPE."""
    emb = getattr(model, "rotary_pos_emb", None)
    if emb is None:
        return
    emb.__class__ = PortableRotaryEmbedding
    if llama3_scaling:
        emb.inv_freq = emb._apply_scaling(emb.inv_freq, **llama3_scaling)


class PortableTopKRouter(TopKRouter):
    """mcore's top-k router without its move of CPU-held weights to CUDA in `gating`."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return moe_utils.router_gating_linear(input, self.weight, self.bias, dtype)  # (tokens, experts)


def router_gemm_without_te() -> None:
    """Before an MoE model runs: the router GEMM falls back to torch.mm when TransformerEngine is absent."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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


def dispatch_on_host(model: torch.nn.Module) -> None:
    """Make `model`'s MoE layers dispatch on the host. Call `moe_on_host` before building it."""
    for module in model.modules():
        if type(getattr(module, "token_dispatcher", None)) is MoEAlltoAllTokenDispatcher:
            module.token_dispatcher.__class__ = HostAlltoAllTokenDispatcher


def moe_on_host() -> None:
    """Before MoE layers are built where torch has no CUDA: the all-to-all dispatcher's __init__ makes a
    CUDA stream once per process unless one is there (HostAlltoAllTokenDispatcher never uses it), and the
    dispatchers' collectives must allocate on the host."""
    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim
    mappings._AllToAll.forward = staticmethod(_all_to_all_forward)


def recompute_rng_on_host() -> None:
    """Where torch has no CUDA: megatron's recompute (tensor_parallel.checkpoint) saves and restores the
    CUDA RNG state around the recomputed forward; there is none, so only the CPU and tracker states are."""
    mcore_random._get_cuda_rng_state = _no_cuda_rng_state
    mcore_random._set_cuda_rng_state = _no_cuda_rng_state


def _no_cuda_rng_state(*args, **kwargs):
    return None


@contextlib.contextmanager
def embedding_sync_skipped() -> Iterator[None]:
    """While inside, LanguageModule.setup_embeddings_and_output_layer skips its CUDA copy + all-reduce of
    the shared embedding (the caller does the same all-reduce on the model's own device)."""
    original = LanguageModule._is_in_embd_group
    LanguageModule._is_in_embd_group = lambda self: False
    try:
        yield
    finally:
        LanguageModule._is_in_embd_group = original


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
