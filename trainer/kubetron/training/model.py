"""The GPT model on megatron-core, with a layer spec that runs on CPU and is fast on GPU without TE.

megatron-core's local spec allocates its attention buffer on CUDA (NOTES-megatron-core.md). Our spec
swaps in `SDPACoreAttention`: core attention on `F.scaled_dot_product_attention` (flash/cuDNN on GPU).
The other CUDA-only pieces (RoPE, MoE dispatch, recompute's RNG) are adapted by
kubetron.compat.megatron_core.portable.
TransformerEngine's spec is used when TE is importable and `model.transformer_impl` allows it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

from kubetron.compat.megatron_core import portable
from kubetron.contract.errors import ConfigError
from kubetron.training import moe

log = logging.getLogger(__name__)


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401

        return True
    except Exception:  # ImportError, or a broken install (missing CUDA libs)
        return False


class SDPACoreAttention(MegatronModule):
    """Causal self-attention on torch SDPA, in a sliding window when the config has one (window_size).
    Takes/returns mcore's layout: [s, b, heads, dim] → [s, b, h]."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type=None,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__(config=config)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.window = config.window_size[0] if config.window_size else None  # keys before the query's own

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        assert packed_seq_params is None, "packed sequences need TransformerEngine"
        s, b, heads, dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, dim)
        # mcore's mask (dataset.reset_attention_mask): (b, 1, s, s) bool, True = masked, causal included
        keep = None if attention_mask is None else ~attention_mask
        if self.window is not None:
            band = _causal_window(s, self.window, query.device)  # (s, s)
            keep = band if keep is None else keep & band
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, is_causal=keep is None, dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.softmax_scale, enable_gqa=k.shape[1] != heads,
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * dim)  # (s, b, h)


def _causal_window(s: int, window: int, device) -> torch.Tensor:
    """(s, s) bool, True = query i may attend key j: j <= i and i - j <= window."""
    i = torch.arange(s, device=device)
    dist = i[:, None] - i[None, :]
    return (dist >= 0) & (dist <= window)


def moe_config(m) -> dict:
    """TransformerConfig's mixture-of-experts fields (none for a dense model: megatron asserts so)."""
    if m.num_moe_experts is None:
        return {}
    return dict(
        num_moe_experts=m.num_moe_experts,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_layer_freq=m.moe_layer_freq,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_grouped_gemm=m.moe_grouped_gemm,
        expert_model_parallel_size=m.expert_model_parallel_size,
        moe_per_layer_logging=m.moe_per_layer_logging,
        moe_router_dtype="fp32",  # routing probabilities in fp32 under bf16 too (Bridge's MoE recipes)
    )


def transformer_config(cfg, use_gpu: bool) -> TransformerConfig:
    """Map kubetron's model section onto megatron-core's TransformerConfig."""
    m = cfg.model
    swiglu = m.activation == "swiglu"
    bf16, fp16 = bool(cfg.mixed_precision.bf16), bool(cfg.mixed_precision.fp16)
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.head_size(),
        qk_layernorm=m.qk_layernorm,  # the spec's q/k_layernorm (layer_spec), per head, before RoPE
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        sequence_parallel=m.sequence_parallel,
        normalization=m.normalization,
        layernorm_epsilon=m.layernorm_epsilon,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        # megatron's (left, right) window, as TE and flash-attention take it: i attends [i - left, i + right]
        window_size=(m.sliding_window - 1, 0) if m.sliding_window else None,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        use_cpu_initialization=True,  # deterministic from the seed, on CPU and GPU alike
        perform_initialization=True,
        params_dtype=dtype,
        bf16=bf16,
        fp16=fp16,
        pipeline_dtype=dtype,
        # Fusions that need apex/TE or CUDA extensions are off; torch.compile fuses instead.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        # Activation recompute (config.py validates the combinations as megatron does).
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        **moe_config(m),
    )


def rope_scaling(m) -> dict | None:
    """mcore's llama3 RoPE scaling, with all four of the HF config's parameters; None without scaling."""
    if not m.rope_scaling:
        return None
    return dict(factor=m.rope_scaling_factor, low_freq_factor=m.rope_scaling_low_freq_factor,
                high_freq_factor=m.rope_scaling_high_freq_factor,
                original_max_position_embeddings=m.rope_scaling_original_max_position_embeddings)


def use_te_spec(cfg) -> bool:
    """TE's spec when importable (and not disabled), not under LoRA (adapters hook the local linears)."""
    impl = cfg.model.transformer_impl
    lora = getattr(getattr(cfg, "peft", None), "scheme", None) is not None
    return impl == "transformer_engine" or (impl == "auto" and te_available() and not lora)


def layer_spec(cfg, config: TransformerConfig | None = None):
    """One layer's spec for a dense model; the block's per-layer specs (dense or MoE by
    model.moe_layer_freq, this pipeline stage's) for a mixture of experts, which needs `config`."""
    te = use_te_spec(cfg)
    if cfg.model.moe_grouped_gemm and not te:
        raise ConfigError("model.moe_grouped_gemm", "needs TransformerEngine, which is not importable here")
    if cfg.model.num_moe_experts is not None:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=cfg.model.normalization)
        log.info("layer spec: %s, mixture of experts", "TransformerEngine" if te else "local")
        for spec in block.layer_specs:
            _portable_layer(cfg, spec, te)
        return block
    if te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        log.info("layer spec: TransformerEngine")
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.model.qk_layernorm)
    spec = get_gpt_layer_local_spec(normalization=cfg.model.normalization, qk_layernorm=cfg.model.qk_layernorm)
    _portable_layer(cfg, spec, te)
    return spec


def _portable_layer(cfg, spec: ModuleSpec, te: bool) -> None:
    """Swap the CUDA-only pieces of a local layer spec for ours; an MoE layer's router on either spec."""
    mlp = spec.submodules.mlp
    if mlp.module is MoELayer:
        mlp.submodules.router = portable.PortableTopKRouter
    if te:
        return
    if cfg.model.sequence_parallel and spec.submodules.input_layernorm is WrappedTorchNorm:  # megatron asserts
        raise ConfigError("model.sequence_parallel", "needs TransformerEngine (model.transformer_impl auto with TE "
                                                     "installed, or transformer_engine): the local layer spec's "
                                                     "torch norms do not support it")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention


def build_model(cfg, device: torch.device) -> list[torch.nn.Module]:
    """One model chunk for this pipeline stage (list, as megatron's loop expects)."""
    use_gpu = device.type == "cuda"
    config = transformer_config(cfg, use_gpu)
    if not use_gpu and not torch.cuda.is_available() and cfg.model.recompute_granularity is not None:
        portable.recompute_rng_on_host()
    if cfg.model.num_moe_experts is not None:
        portable.router_gemm_without_te()
        moe.forget_tracked_losses()
    host_moe = cfg.model.num_moe_experts is not None and not torch.cuda.is_available()
    if host_moe:
        portable.moe_on_host()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(cfg, config),
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=cfg.model.share_embeddings_and_output_weights,
        position_embedding_type=cfg.model.position_embedding_type,
        rotary_base=cfg.model.rotary_base,
    )
    if host_moe:
        portable.dispatch_on_host(model)
    portable.rope(model, rope_scaling(cfg.model))
    if getattr(model, "output_layer", None) is not None:
        mask_vocab_padding(model.output_layer, cfg)
    mark_qk_layernorm(model)
    from kubetron.training.peft import apply_lora

    apply_lora([model], cfg)  # peft: adapters on the target linears, everything else frozen
    model.to(device)
    if cfg.mixed_precision.fp16:  # as megatron's Float16Module: every parameter fp16, the norms' too
        for p in model.parameters():
            p.data = p.data.half()
    if cfg.model.compile:
        for layer in model.decoder.layers:
            layer.compile()
    return [model]


def mark_qk_layernorm(model: torch.nn.Module):
    """q/k_layernorm weights are replicated over TP while each TP rank normalizes its own heads: their
    gradient is the sum over the TP group (megatron's finalize_model_grads finds them by name; kubetron's
    grad sync, grads.summed_over_tp, by this mark)."""
    for name, p in model.named_parameters():
        if ".q_layernorm." in name or ".k_layernorm." in name:
            p.qk_layernorm = True  # type: ignore[attr-defined]  # a parameter attribute, as megatron's (no stub)


def mask_vocab_padding(output_layer: torch.nn.Module, cfg):
    """Logits of the padded vocabulary rows (beyond the tokenizer's) become the dtype's minimum, so the
    loss ignores them: it then does not depend on how much padding TP adds (a checkpoint resumes at
    another TP with the same losses), and a padding token is never predicted."""
    try:
        real = cfg.tokenizer.base_vocab_size()
    except Exception:  # a null tokenizer without vocab_size: no padding is known
        return
    if real >= cfg.model.vocab_size:
        return

    def hook(_module, _args, output):
        logits, bias = output  # (s, b, vocab / tp): this TP rank's slice of the padded vocabulary
        start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
        if start + logits.shape[-1] <= real:
            return output
        padding = torch.arange(start, start + logits.shape[-1], device=logits.device) >= real
        return logits.masked_fill(padding, torch.finfo(logits.dtype).min), bias

    output_layer.register_forward_hook(hook)


def num_parameters(model: list[torch.nn.Module]) -> int:
    return sum(p.numel() for chunk in model for p in chunk.parameters())
