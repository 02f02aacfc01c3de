"""The run configuration's schema: a pydantic v2 `ConfigContainer` whose sections and field names follow
Megatron Bridge (`megatron.bridge.training.config`) and `megatron.training.config`.

Life cycle, as in the reference:

1. `ConfigContainer.from_dict(data)` type-checks the user's sections (after `apply_overrides` of
   `section.key=value` overrides) and runs `validate()`: each section checks its own keys as it is
   built (`check()`), the container the rules across sections. Pure: no filesystem or torch.
2. `derive(world_size)` computes the derived values (data-parallel size, global batch size, micro-batches
   per step, train_iters from train_samples, scheduler steps, the padded vocabulary of a byte/null
   tokenizer, ...) and re-validates. It is pure: no file, S3, environment or installed-package read, so
   the operator runs it at admission, for the job's world size, before any pod exists.
3. The trainer's `kubetron.config.ConfigContainer` (this schema plus `from_yaml`, `resolve` and
   `finalize` = derive + resolve) reads what lives where the trainer runs: a file-based tokenizer's
   vocabulary, the KUBETRON_* environment defaults, the logger's optional packages, the input paths.
4. `to_yaml()` is the resolved config saved as `run_config.yaml` in every checkpoint;
   `from_dict(yaml.safe_load(cfg.to_yaml())) == cfg` holds exactly.

Every user error is a `kubetron.contract.errors.ConfigError(field, message)` naming the dotted key.
Part of the contract: imports neither torch nor boto3, and reads no file or environment.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import signal
import types
from typing import Annotated, Any, Literal, Self, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict
from pydantic.fields import FieldInfo

from kubetron.contract.errors import ConfigError

BYTE_TOKENIZER_VOCAB = 258
"""The byte tokenizer's base vocabulary: 256 byte values + eod + pad."""

_DERIVED: JsonDict = {"derived": True}


def _f(default: Any, doc: str, **kw: Any) -> Any:
    """A user-settable field with its one-line description."""
    return Field(default=default, description=doc, **kw)


def _d(default: Any, doc: str, **kw: Any) -> Any:
    """A derived field: computed by `ConfigContainer.derive`; an input value is recomputed."""
    return Field(default=default, description=doc, json_schema_extra=_DERIVED, **kw)


def _is_derived(info: FieldInfo) -> bool:
    extra = info.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("derived"))


_TYPES_FIRST = "types_first"
"""Validation context of `ConfigContainer.from_dict`: every key's type first, then `validate()` the rules,
so a wrong type is reported before a rule it may break (as one pass over the whole config)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)

    @model_validator(mode="after")
    def _checked(self, info: ValidationInfo) -> Self:
        if not (info.context or {}).get(_TYPES_FIRST):
            self.check()
        return self

    def check(self) -> None:
        """This section's own rules, as a ConfigError naming the key (run when it is built, and again by
        `ConfigContainer.validate` after `derive` changed values); rules across sections are the container's."""


NonNegInt = Annotated[int, Field(ge=0)]


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


class TrainingConfig(_Section):
    """The training loop: length, batch sizes, exit conditions and the contract's side channels."""

    train_iters: int | None = _f(None, "Total training iterations (optimizer steps); set this or train_samples.", ge=1)
    train_samples: int | None = _f(
        None, "Total training samples (sequences); train_iters = train_samples // global_batch_size.", ge=1)
    micro_batch_size: int = _f(1, "Sequences per micro-batch per data-parallel rank.", ge=1)
    global_batch_size: int | None = _f(
        None, "Sequences per optimizer step over all ranks (None: micro_batch_size * data_parallel_size).", ge=1)
    exit_interval: int | None = _f(
        None, "Save and exit (code 76) when the iteration count is a multiple of this (iterations).", ge=1)
    exit_duration_in_mins: float | None = _f(
        None, "Save and exit (code 76) after this much wall time in this process (minutes).", gt=0)
    exit_signal_handler: bool = _f(True, "On exit_signal finish the step, save a checkpoint, exit 75.")
    exit_signal: str = _f("SIGTERM", "The signal that triggers a save-and-exit (a signal name, e.g. SIGTERM).")
    iterations_to_skip: list[NonNegInt] = _f(
        [], "Iterations whose batch is consumed but whose optimizer step is skipped (iteration numbers).")
    manual_gc: bool = _f(False, "Disable automatic Python GC and collect manually every manual_gc_interval.")
    manual_gc_interval: int = _f(0, "Iterations between manual GC runs when manual_gc is set (0: only at start).",
                                 ge=0)
    check_for_nan_in_loss: bool = _f(True, "Stop with exit code 3 when the loss is NaN or Inf.")
    termination_log: str | None = _f(
        None, "Termination message path (None: env KUBETRON_TERMINATION_LOG, else in a Kubernetes pod "
              "/dev/termination-log if writable, else none).")
    status_port: int | None = _f(
        None, "TCP port for rank 0's GET /status (None: env KUBETRON_STATUS_PORT; 0: off).", ge=0, le=65535)
    num_microbatches: int | None = _d(
        None, "Derived: micro-batches accumulated per optimizer step = gbs / (mbs * dp).")

    def check(self) -> None:
        if self.train_iters is None and self.train_samples is None:
            raise ConfigError("train.train_iters", "set train.train_iters or train.train_samples")
        if self.train_iters is not None and self.train_samples is not None:
            derived = self.global_batch_size and self.train_iters == self.train_samples // self.global_batch_size
            if not derived:
                raise ConfigError("train.train_samples", "set train.train_iters or train.train_samples, not both")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ConfigError("train.global_batch_size", f"{self.global_batch_size} is not divisible by "
                                                         f"micro_batch_size = {self.micro_batch_size}")
        try:
            sig = signal.Signals[self.exit_signal]
        except KeyError:
            raise ConfigError("train.exit_signal", f"unknown signal {self.exit_signal!r} "
                                                   "(expected a name like SIGTERM, SIGINT, SIGUSR1)") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError("train.exit_signal", f"{self.exit_signal} cannot be handled")
        if len(set(self.iterations_to_skip)) != len(self.iterations_to_skip):
            raise ConfigError("train.iterations_to_skip", "contains duplicates")


class ValidationConfig(_Section):
    """Evaluation on the validation and test splits (as Megatron Bridge: periodically on validation, and
    after training once more on validation and once on test, for each split that holds data)."""

    eval_interval: int | None = _f(
        None, "Evaluate on the validation split every this many iterations (None: only after training).", ge=1)
    eval_iters: int = _f(10, "Global batches per evaluation, validation and test (0: no evaluation at all).", ge=0)
    skip_train: bool = _f(False, "Evaluation only: load the checkpoint, skip training, evaluate on validation and "
                                 "test (console and trackers, no TensorBoard), save nothing, exit 0.")

    def check(self) -> None:
        if self.eval_iters == 0 and (self.eval_interval is not None or self.skip_train):
            what = "validation.eval_interval" if self.eval_interval is not None else "validation.skip_train"
            raise ConfigError("validation.eval_iters", f"0 turns evaluation off, but {what} is set")


class GPTModelConfig(_Section):
    """The GPT model (megatron-core GPTModel / TransformerConfig names)."""

    num_layers: int = _f(2, "Transformer layers.", ge=1)
    hidden_size: int = _f(64, "Hidden (embedding) size.", ge=1)
    num_attention_heads: int = _f(4, "Attention heads.", ge=1)
    num_query_groups: int | None = _f(
        None, "Key/value head groups for grouped-query attention (None: = num_attention_heads).", ge=1)
    kv_channels: int | None = _f(
        None, "Channels per attention head (HF head_dim; may differ from hidden_size / num_attention_heads, as in "
        "Qwen3; None: hidden_size / num_attention_heads).", ge=1)
    qk_layernorm: bool = _f(False, "Normalize queries and keys per head before RoPE, with model.normalization "
                                   "(Qwen3's q_norm/k_norm).")
    ffn_hidden_size: int | None = _f(None, "MLP hidden size (None: 4 * hidden_size).", ge=1)
    seq_length: int = _f(64, "Training sequence length (tokens).", ge=1)
    max_position_embeddings: int | None = _f(None, "Maximum sequence length the model supports (None: seq_length).",
                                             ge=1)
    vocab_size: int | None = _f(
        None, "Embedding rows (None: the tokenizer's vocabulary padded to make_vocab_size_divisible_by * tp).", ge=1)
    make_vocab_size_divisible_by: int = _f(128, "Pad the tokenizer vocabulary to a multiple of this (times tp).",
                                           ge=1)
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = _f("rope", "Position embedding kind.")
    rotary_base: int = _f(10000, "RoPE base period.", ge=1)
    rope_scaling: bool = _f(False, "Llama-3 RoPE frequency scaling (the rope_scaling_* keys; HF rope_type llama3).")
    rope_scaling_factor: float = _f(8.0, "Llama-3 RoPE scaling: factor low frequencies are divided by.", gt=0)
    rope_scaling_low_freq_factor: float = _f(1.0, "Llama-3 RoPE scaling: low_freq_factor.", gt=0)
    rope_scaling_high_freq_factor: float = _f(4.0, "Llama-3 RoPE scaling: high_freq_factor.", gt=0)
    rope_scaling_original_max_position_embeddings: int = _f(
        8192, "Llama-3 RoPE scaling: context length (tokens) the unscaled model was trained on.", ge=1)
    normalization: Literal["LayerNorm", "RMSNorm"] = _f("LayerNorm", "Normalization layer kind.")
    activation: Literal["gelu", "swiglu"] = _f("gelu", "MLP activation (swiglu: gated SiLU).")
    add_bias_linear: bool = _f(True, "Biases in the linear layers.")
    add_qkv_bias: bool = _f(False, "Biases in the query/key/value projection only (Qwen2).")
    sliding_window: int | None = _f(
        None, "Sliding-window attention: each token attends to itself and the sliding_window - 1 tokens before "
        "it (HF Mistral's sliding_window; null: all tokens before it).", ge=1)
    share_embeddings_and_output_weights: bool = _f(True, "Tie the input embedding and the output layer.")
    hidden_dropout: float = _f(0.0, "Dropout probability after attention and MLP (fraction).", ge=0, lt=1)
    attention_dropout: float = _f(0.0, "Dropout probability on attention weights (fraction).", ge=0, lt=1)
    init_method_std: float = _f(0.02, "Standard deviation of the normal weight initialisation.", gt=0)
    layernorm_epsilon: float = _f(1e-5, "Epsilon of the normalization layers.", gt=0)
    tensor_model_parallel_size: int = _f(1, "Tensor-parallel ranks (tp).", ge=1)
    pipeline_model_parallel_size: int = _f(1, "Pipeline-parallel stages (pp).", ge=1)
    sequence_parallel: bool = _f(
        False, "Megatron sequence parallelism (needs tp > 1; turned off at tp = 1). Needs the TransformerEngine "
        "layer spec: with the local spec (TE not importable, or transformer_impl local) the run is refused (exit 2).")
    transformer_impl: Literal["auto", "local", "transformer_engine"] = _f(
        "auto", "Layer implementation (auto: TransformerEngine when importable, else local).")
    compile: bool = _f(False, "torch.compile the transformer layers.")
    recompute_granularity: Literal["full", "selective"] | None = _f(
        None, "Activation recompute: full (whole layers, recompute_method/num_layers pick which), selective "
        "(core attention only), null (keep all activations).")
    recompute_method: Literal["uniform", "block"] | None = _f(
        None, "With full recompute: uniform (checkpoint groups of recompute_num_layers layers) or block (the "
        "first recompute_num_layers layers of each pipeline stage).")
    recompute_num_layers: int | None = _f(
        None, "With full recompute: layers per group (uniform) or layers recomputed per stage (block).", ge=1)
    # Mixture of experts (megatron-core's MoELayer; Megatron Bridge's names)
    num_moe_experts: int | None = _f(
        None, "Routed experts per MoE layer (null: a dense model, every layer an MLP).", ge=1)
    moe_router_topk: int = _f(2, "Experts each token is routed to.", ge=1)
    moe_ffn_hidden_size: int | None = _f(None, "Hidden size of each routed expert's MLP (null: ffn_hidden_size).",
                                         ge=1)
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = _f(
        "aux_loss", "Load-balancing loss: aux_loss (GShard/Switch, per micro-batch), seq_aux_loss (per sequence, "
        "DeepSeek), none.")
    moe_aux_loss_coeff: float = _f(0.0, "Weight of the load-balancing loss added to the LM loss (0: none is "
                                        "computed, trained on or logged).", ge=0)
    moe_shared_expert_intermediate_size: int | None = _f(
        None, "Hidden size of the shared expert every token also passes through (null: none; Qwen2-MoE, DeepSeek).",
        ge=1)
    moe_layer_freq: int | list[int] = _f(
        1, "Which layers are MoE: N = every Nth layer from the first (1: all), or one 0 (dense MLP) / 1 (MoE) "
        "per layer.")
    moe_router_pre_softmax: bool = _f(
        False, "Softmax over all experts before top-k (the chosen probabilities are not renormalised); false: top-k "
        "then softmax over the chosen (Mixtral; Qwen3-MoE norm_topk_prob). Required with moe_router_topk 1.")
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = _f(
        "alltoall", "How tokens reach the experts of other EP ranks: alltoall (all-to-all of the routed tokens; runs "
        "on gloo and NCCL) or allgather (every rank sees every token).")
    moe_grouped_gemm: bool = _f(
        False, "All local experts in one grouped GEMM (TransformerEngine's TEGroupedMLP); needs the TE layer spec.")
    moe_per_layer_logging: bool = _f(
        False, "Also write each layer's load-balancing loss to TensorBoard (moe/<name>_layer_<i>).")
    expert_model_parallel_size: int = _f(
        1, "Expert-parallel ranks (ep): each holds num_moe_experts / ep experts; must divide the data-parallel "
        "size.", ge=1)

    def head_size(self) -> int:
        """Channels per attention head: kv_channels, else hidden_size / num_attention_heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def moe_layer_pattern(self) -> list[int]:
        """Per layer 1 for an MoE layer, 0 for a dense one (megatron's reading of moe_layer_freq); all 0
        for a dense model."""
        if self.num_moe_experts is None:
            return [0] * self.num_layers
        freq = self.moe_layer_freq
        return list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(self.num_layers)]

    def check(self) -> None:
        tp = self.tensor_model_parallel_size
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError("model.hidden_size", f"{self.hidden_size} is not divisible by "
                                                   f"num_attention_heads = {self.num_attention_heads} "
                                                   "(set model.kv_channels for another head size)")
        if self.num_attention_heads % tp:
            raise ConfigError("model.num_attention_heads",
                              f"{self.num_attention_heads} is not divisible by tensor_model_parallel_size = {tp}")
        if self.num_layers % self.pipeline_model_parallel_size:
            raise ConfigError("model.num_layers", f"{self.num_layers} is not divisible by "
                                                  f"pipeline_model_parallel_size = {self.pipeline_model_parallel_size}")
        if self.num_query_groups is not None:
            if self.num_attention_heads % self.num_query_groups:
                raise ConfigError("model.num_query_groups", f"num_attention_heads = {self.num_attention_heads} is "
                                                            f"not divisible by num_query_groups = "
                                                            f"{self.num_query_groups}")
            if self.num_query_groups % tp:
                raise ConfigError("model.num_query_groups",
                                  f"{self.num_query_groups} is not divisible by tensor_model_parallel_size = {tp}")
        if self.position_embedding_type == "rope" and self.head_size() % 2:
            raise ConfigError("model.kv_channels" if self.kv_channels else "model.hidden_size",
                              f"rope needs an even head size, not {self.head_size()}")
        if self.max_position_embeddings is not None and self.max_position_embeddings < self.seq_length:
            raise ConfigError("model.max_position_embeddings",
                              f"{self.max_position_embeddings} is smaller than seq_length = {self.seq_length}")
        self._check_recompute()
        self._check_moe()
        if self.ffn_hidden_size is not None and self.ffn_hidden_size % tp:
            raise ConfigError("model.ffn_hidden_size", f"{self.ffn_hidden_size} is not divisible by "
                                                       f"tensor_model_parallel_size = {tp}")
        if self.vocab_size is not None and self.vocab_size % tp:
            raise ConfigError("model.vocab_size", f"{self.vocab_size} is not divisible by "
                                                  f"tensor_model_parallel_size = {tp}")
        if self.rope_scaling and self.position_embedding_type != "rope":
            raise ConfigError("model.rope_scaling", "needs position_embedding_type rope")

    def _check_recompute(self) -> None:
        """The combinations megatron-core's TransformerConfig accepts, as one-line errors."""
        per_stage = self.num_layers // self.pipeline_model_parallel_size
        if self.recompute_granularity is None:
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"model.{name}", "needs model.recompute_granularity full")
        elif self.recompute_granularity == "selective":
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"model.{name}", "must be null with recompute_granularity selective")
        else:
            if self.recompute_method is None:
                raise ConfigError("model.recompute_method", "required (uniform or block) with "
                                                            "recompute_granularity full")
            if self.recompute_num_layers is None or self.recompute_num_layers > per_stage:
                raise ConfigError("model.recompute_num_layers", f"must be between 1 and the layers per pipeline "
                                                                f"stage ({per_stage}) with recompute_granularity full")

    def _check_moe(self) -> None:
        """Mixture of experts: keys that need experts, the router's and the layout's constraints (the
        container checks those that involve data parallelism and checkpoints)."""
        if self.num_moe_experts is None:
            changed = sorted(k for k in MOE_KEYS if getattr(self, k) != GPTModelConfig.model_fields[k].default)
            if changed:
                raise ConfigError(f"model.{changed[0]}", "has no effect without model.num_moe_experts")
            return
        e, ep, tp = self.num_moe_experts, self.expert_model_parallel_size, self.tensor_model_parallel_size
        if self.moe_router_topk > e:
            raise ConfigError("model.moe_router_topk", f"{self.moe_router_topk} is more than num_moe_experts = {e}")
        if self.moe_router_topk == 1 and not self.moe_router_pre_softmax:  # softmax over one expert: no gradient
            raise ConfigError("model.moe_router_pre_softmax", "must be true with moe_router_topk 1")
        if e % ep:
            raise ConfigError("model.expert_model_parallel_size", f"{ep} does not divide num_moe_experts = {e}")
        if self.moe_router_load_balancing_type == "none" and self.moe_aux_loss_coeff:
            raise ConfigError("model.moe_aux_loss_coeff", "has no effect with moe_router_load_balancing_type none")
        if self.moe_per_layer_logging and not self.moe_aux_loss_coeff:
            raise ConfigError("model.moe_per_layer_logging", "has no effect without model.moe_aux_loss_coeff > 0 "
                                                             "(no load-balancing loss is computed)")
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if not 1 <= freq <= self.num_layers:
                raise ConfigError("model.moe_layer_freq", f"{freq} must be between 1 and num_layers = "
                                                          f"{self.num_layers}")
        elif len(freq) != self.num_layers or set(freq) - {0, 1} or 1 not in freq:
            raise ConfigError("model.moe_layer_freq", f"a list needs one 0 (dense) or 1 (MoE) per layer "
                                                      f"({self.num_layers}), at least one 1; got {freq}")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            size = getattr(self, name)
            if size is not None and size % tp:
                raise ConfigError(f"model.{name}", f"{size} is not divisible by tensor_model_parallel_size = {tp}")
        if tp > 1 and not self.sequence_parallel:  # megatron's MoELayer refuses to train so
            raise ConfigError("model.sequence_parallel", "must be true for MoE with tensor_model_parallel_size > 1")
        if self.moe_grouped_gemm and self.transformer_impl == "local":
            raise ConfigError("model.moe_grouped_gemm", "needs the TransformerEngine layer spec "
                                                        "(transformer_impl auto or transformer_engine)")


class OptimizerConfig(_Section):
    """The optimizer (megatron.core.optimizer.OptimizerConfig names)."""

    optimizer: Literal["adam", "sgd"] = _f("adam", "Optimizer kind (adam: AdamW with decoupled weight decay).")
    lr: float = _f(3e-4, "Peak learning rate.", ge=0)
    min_lr: float = _f(0.0, "Learning rate at the end of decay.", ge=0)
    weight_decay: float = _f(0.01, "Weight decay coefficient (not applied to biases and norms).", ge=0)
    adam_beta1: float = _f(0.9, "Adam beta1.", ge=0, lt=1)
    adam_beta2: float = _f(0.95, "Adam beta2.", ge=0, lt=1)
    adam_eps: float = _f(1e-8, "Adam epsilon.", gt=0)
    sgd_momentum: float = _f(0.9, "SGD momentum.", ge=0)
    clip_grad: float = _f(1.0, "Clip the global gradient L2 norm to this (0: off).", ge=0)
    use_distributed_optimizer: bool = _f(
        False, "Shard optimizer state over data-parallel ranks (kept in sync with ddp.use_distributed_optimizer).")

    def check(self) -> None:
        if self.min_lr > self.lr:
            raise ConfigError("optimizer.min_lr", f"{self.min_lr} is larger than optimizer.lr = {self.lr}")


class SchedulerConfig(_Section):
    """The learning-rate schedule, counted in iterations."""

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = _f(
        "cosine", "Learning-rate decay after warmup.")
    lr_warmup_iters: int = _f(0, "Linear warmup length (iterations).", ge=0)
    lr_warmup_fraction: float | None = _f(
        None, "Warmup as a fraction of lr_decay_iters (instead of lr_warmup_iters).", ge=0, le=1)
    lr_warmup_init: float = _f(0.0, "Learning rate at the start of warmup.", ge=0)
    lr_decay_iters: int | None = _f(None, "Iterations over which the rate decays (None: train_iters).", ge=1)
    lr_wsd_decay_iters: int | None = _f(
        None, "WSD: iterations of the final decay phase (required for lr_decay_style WSD).", ge=1)
    lr_warmup_steps: int | None = _d(None, "Derived: warmup length (iterations).")
    lr_decay_steps: int | None = _d(None, "Derived: decay length (iterations).")

    def check(self) -> None:
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters:
            raise ConfigError("scheduler.lr_warmup_fraction", "set lr_warmup_iters or lr_warmup_fraction, not both")
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_iters is None:
            raise ConfigError("scheduler.lr_wsd_decay_iters", "required when lr_decay_style is 'WSD'")


class GPTDatasetConfig(_Section):
    """Training data: Megatron indexed datasets (built by megatron-core), or mock data when no path is set."""

    data_path: list[str] | None = _f(
        None, "Indexed dataset prefixes (.bin/.idx), optionally weighted: [\"0.7\", \"a\", \"0.3\", \"b\"] or "
              "\"0.7 a 0.3 b\"; local paths or s3://bucket/key; divided by split (None: mock data).")
    split: str = _f("969,30,1", "Train,validation,test proportions of the documents of each data_path prefix "
                                "(comma-separated weights; a validation or test share is evaluated after "
                                "training, see the validation section).")
    train_data_path: list[str] | None = _f(
        None, "Per-split blend for training (instead of data_path + split); same forms as data_path.")
    valid_data_path: list[str] | None = _f(None, "Per-split blend for validation (with train_data_path).")
    test_data_path: list[str] | None = _f(
        None, "Per-split blend for testing (with train_data_path): evaluated once after training.")
    reset_position_ids: bool = _f(False, "Restart position ids at every document (after each eod token).")
    reset_attention_mask: bool = _f(
        False, "Attend only within a document (a per-sample attention mask cut at every eod token).")
    eod_mask_loss: bool = _f(False, "No loss on eod tokens.")
    pin_memory: bool = _f(True, "Pin host memory for batches (only with a GPU).")
    prefetch: int = _f(2, "Micro-batches prepared ahead of the training step.", ge=0)
    mock_seed: int | None = _f(None, "Seed of the mock data (None: rng.seed).", ge=0)

    @field_validator("data_path", "train_data_path", "valid_data_path", "test_data_path", mode="before")
    @classmethod
    def _words(cls, v: Any) -> Any:
        """A string is Megatron's space-separated form ("0.3 a 0.7 b" or "a"); list items are split alike."""
        if isinstance(v, str):
            return v.split()
        if isinstance(v, list):
            return [w for item in v for w in (str(item).split() if isinstance(item, str) else [item])]
        return v

    def blends(self) -> dict[str, list[str] | None]:
        """The per-split paths in use, {"train", "valid", "test"} (None: no per-split paths)."""
        return {"train": self.train_data_path, "valid": self.valid_data_path, "test": self.test_data_path}

    @property
    def has_data(self) -> bool:
        return self.data_path is not None or any(v is not None for v in self.blends().values())

    def check(self) -> None:
        fractions = parse_split(self.split)
        per_split = {k: v for k, v in self.blends().items() if v is not None}
        for name, paths in (("data_path", self.data_path), *((f"{k}_data_path", v) for k, v in per_split.items())):
            if paths is not None:
                parse_data_path(paths, field=f"dataset.{name}")
        if per_split:
            if self.data_path is not None:
                raise ConfigError("dataset.data_path", "set data_path (+ split) or train/valid/test_data_path, "
                                                       "not both")
            if "train" not in per_split:
                raise ConfigError("dataset.train_data_path", "required with valid_data_path/test_data_path")
        if self.data_path is not None and fractions[0] == 0:
            raise ConfigError("dataset.split", f"{self.split!r} leaves no training data")


class FinetuningDatasetConfig(_Section):
    """Supervised fine-tuning data (chats or prompt/answer rows) instead of the dataset section's corpus."""

    data_path: str | list[str] | None = _f(
        None, "Training rows: a JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst), Parquet or Arrow file, a datasets "
              "save_to_disk directory, a directory or glob of shards, or a list of these; local or s3:// (None: "
              "train on the dataset section).")
    valid_data_path: str | list[str] | None = _f(
        None, "Validation rows, as data_path (needed when validation.eval_interval is set; also evaluated after "
              "training).")
    input_key: str = _f("input", "Row field holding the prompt (no loss on its tokens).")
    output_key: str = _f("output", "Row field holding the answer (the loss is taken on its tokens only).")
    messages_key: str = _f(
        "messages", "Row field holding a chat ([{role, content}, ...], rendered with the tokenizer's chat "
                    "template; the loss is taken on assistant turns only).")
    chat_template: str | None = _f(
        None, "Name of the tokenizer's chat template to render chats with (one of its "
              "additional_chat_templates/NAME.jinja or tokenizer_config.json's named templates; None: 'default', "
              "or 'tool_use' for rows with tools when it has one, as transformers chooses).")
    packing: bool = _f(
        False, "Pack several examples into each sequence, attention kept inside each example and position ids "
               "reset per example (false: one example per sequence, padded).")
    add_eod: bool = _f(True, "End every prompt/answer row's answer with the tokenizer's end-of-document token "
                             "(chats end their turns as their template writes them).")
    shuffle: bool = _f(True, "Shuffle the sequences every epoch (seeded by rng.seed; resume stays exact).")
    cache_dir: str | None = _f(
        None, "Where the tokenized and packed data is stored once and reused by every rank and restart (local "
              "or s3://; None: <checkpoint.save>/sft_cache, or $TMPDIR/kubetron-sft-cache without checkpoint.save). "
              "Caches are signed with a key kept in the job's store (<checkpoint.save>/sft_cache.key): one another "
              "job or anyone else wrote is rebuilt.")
    max_expansion: int = _f(
        100, "The most bytes of rows one data file may give per byte stored, once decompressed or decoded (and as "
             "many rows); 256 MiB is always allowed. A file past it is refused naming it (a compression bomb).",
        ge=1)

    def check(self) -> None:
        for name in ("data_path", "valid_data_path"):
            value = getattr(self, name)
            if isinstance(value, list) and (not value or not all(value)):
                raise ConfigError(f"finetuning.{name}", "an empty list or an empty path in it")
        if self.cache_dir is not None and not self.cache_dir.strip():
            raise ConfigError("finetuning.cache_dir", "an empty path (leave it unset for the default)")


class TokenizerConfig(_Section):
    """The tokenizer (Megatron's names): bytes, a bare vocabulary size for mock data, or tokenizer files."""

    tokenizer_type: Literal["byte", "null", "HuggingFaceTokenizer", "SentencePieceTokenizer", "GPT2BPETokenizer"] = _f(
        "byte", "byte: UTF-8 bytes + eod + pad (258 ids); null: ids only, for mock data; HuggingFaceTokenizer: "
                "tokenizer.json; SentencePieceTokenizer: .model; GPT2BPETokenizer: vocab.json + merges.txt.")
    tokenizer_model: str | None = _f(
        None, "HuggingFaceTokenizer: a tokenizer.json or a directory holding one; SentencePieceTokenizer: a .model "
              "file (local path or s3://).")
    vocab_file: str | None = _f(None, "GPT2BPETokenizer: vocab.json (local path or s3://).")
    merge_file: str | None = _f(None, "GPT2BPETokenizer: merges.txt (local path or s3://).")
    vocab_size: int | None = _f(None, "Vocabulary size of the null tokenizer (ids; eod = vocab_size - 1).", ge=2)
    _assets: dict[str, bytes] | None = PrivateAttr(default=None)

    def assets(self) -> dict[str, bytes] | None:
        """Tokenizer files adopted from a checkpoint on resume (they win over the paths), else None."""
        return self._assets

    def adopt_assets(self, assets: dict[str, bytes] | None) -> None:
        """Use these files (a checkpoint's tokenizer/) instead of reading the configured paths."""
        self._assets = dict(assets) if assets else None

    @property
    def file_based(self) -> bool:
        return self.tokenizer_type not in ("byte", "null")

    def base_vocab_size(self) -> int:
        """The tokenizer's own vocabulary size, before padding (byte and null; the trainer's subclass reads a
        file-based tokenizer's files)."""
        if self.tokenizer_type == "byte":
            return BYTE_TOKENIZER_VOCAB
        if self.tokenizer_type == "null":
            if self.vocab_size is None:
                raise ConfigError("tokenizer.vocab_size", "required when tokenizer_type is 'null'")
            return self.vocab_size
        raise NotImplementedError("a file-based tokenizer's vocabulary is in its files: the trainer's "
                                  "kubetron.config.TokenizerConfig reads them")

    def validate_fields(self) -> None:
        """Which keys each tokenizer_type needs or ignores (no file is read)."""
        kind = self.tokenizer_type
        needs = {"null": ("vocab_size",), "HuggingFaceTokenizer": ("tokenizer_model",),
                 "SentencePieceTokenizer": ("tokenizer_model",), "GPT2BPETokenizer": ("vocab_file", "merge_file")}
        wanted = needs.get(kind, ())
        for name in ("tokenizer_model", "vocab_file", "merge_file", "vocab_size"):
            value = getattr(self, name)
            if name in wanted and value is None and self._assets is None:
                raise ConfigError(f"tokenizer.{name}", f"required when tokenizer_type is {kind!r}")
            if name not in wanted and value is not None:
                raise ConfigError(f"tokenizer.{name}", f"not used by tokenizer_type {kind!r}")
            if isinstance(value, str) and not value.strip():
                raise ConfigError(f"tokenizer.{name}", "is empty (use null to unset it)")


class LoggerConfig(_Section):
    """Console and TensorBoard logging."""

    log_interval: int = _f(10, "Log training metrics every this many iterations.", ge=1)
    tensorboard_dir: str | None = _f(None, "TensorBoard event directory (None: no TensorBoard).")
    log_progress: bool = _f(True, "Append to the progress log (progress.txt) in checkpoint.save.")
    log_throughput: bool = _f(True, "Log tokens/s and TFLOP/s/GPU.")
    log_memory_to_tensorboard: bool = _f(True, "Write CUDA memory statistics to TensorBoard (GPU only).")
    log_l2_norm_grad_to_tensorboard: bool = _f(False, "Write the gradient L2 norm to TensorBoard.")
    log_params_norm: bool = _f(False, "Compute and log the parameters' L2 norm.")
    throughput_window_size: int = _f(100, "Iterations averaged for the throughput figures.", ge=1)
    logging_level: str = _f("INFO", "Python logging level name (DEBUG, INFO, WARNING, ERROR).")
    timing_log_level: int = _f(0, "Loop timers printed each log_interval: 0 the iteration; 1 also forward-backward, "
                                  "grads, optimizer, save-checkpoint, evaluate; 2 also per-micro-batch "
                                  "forward/backward compute.", ge=0, le=2)
    log_timers_to_tensorboard: bool = _f(False, "Write the loop timers to TensorBoard and the trackers "
                                                "(`iteration-time`, `<name>-time`; seconds per iteration).")
    wandb_project: str | None = _f(None, "Weights & Biases project to log the TensorBoard scalars to (needs the "
                                         "`wandb` extra; WANDB_MODE=offline writes locally).")
    wandb_exp_name: str | None = _f(None, "Weights & Biases run name.")
    wandb_entity: str | None = _f(None, "Weights & Biases entity (team or user).")
    wandb_save_dir: str | None = _f(None, "Directory for the local wandb files (None: the working directory).")
    mlflow_experiment: str | None = _f(None, "MLflow experiment to log the TensorBoard scalars to (needs the "
                                             "`mlflow` extra).")
    mlflow_run_name: str | None = _f(None, "MLflow run name.")
    mlflow_tracking_uri: str | None = _f(None, "MLflow tracking URI (a server, or file:///path; None: MLflow's "
                                               "default / MLFLOW_TRACKING_URI).")
    mlflow_tags: dict[str, str] | None = _f(None, "Tags for the MLflow run.")

    def check(self) -> None:
        if not isinstance(logging.getLevelName(str(self.logging_level).upper()), int):
            raise ConfigError("logger.logging_level", f"unknown level {self.logging_level!r} "
                                                      "(expected DEBUG, INFO, WARNING, ERROR or CRITICAL)")


class CheckpointConfig(_Section):
    """Saving and loading checkpoints (a directory or s3://bucket/prefix store)."""

    save: str | None = _f(None, "Store to save checkpoints and the progress log to (path or s3://; None: no saving).")
    load: str | None = _f(None, "Store to resume from (a missing or empty store: start fresh).")
    save_interval: int | None = _f(None, "Save every this many iterations (None: only at the end and on exit).",
                                   ge=1)
    most_recent_k: int = _f(-1, "Keep this many newest persistent checkpoints (-1: keep all).", ge=-1)
    ckpt_step: int | None = _f(None, "Load this iteration instead of the newest (iteration).", ge=0)
    pretrained_checkpoint: str | None = _f(
        None, "Checkpoint to initialise model weights from (store or iter_* directory; kubetron's, a Hugging Face "
              "model directory, or a torch_dist checkpoint of megatron-core / Megatron-LM / Megatron Bridge): "
              "`finetune`, and `train` when checkpoint.load holds nothing to resume; training starts at iteration 0.")
    async_save: bool | None = _f(
        None, "Write checkpoints in the background while training continues; the loop blocks only for the copy "
              "to host memory (None: on for multi-rank runs with ckpt_format sharded, off otherwise).")
    ckpt_format: Literal["sharded", "kubetron", "torch_dist"] = _f(
        "sharded", "sharded: every rank streams its own part of the canonical tensors to the store and loads "
        "only what its layout needs (any DP/TP/PP); kubetron: canonical unsharded tensors gathered on rank 0; "
        "torch_dist: megatron-core dist_checkpointing (sync only, staged on local disk for S3; see "
        "docs/parallelism.md).")
    dist_staging_dir: str | None = _f(
        None, "Local directory torch_dist checkpoints are staged in on their way to/from the store (None: the "
              "system temp dir).")
    non_persistent_save_interval: int | None = _f(
        None, "Save a non-persistent checkpoint every this many iterations (iterations).", ge=1)
    non_persistent_ckpt_type: Literal["global", "local"] | None = _f(
        None, "Non-persistent kind: global (in save/non_persistent) or local (per-node directory); "
              "None with an interval set: global.")
    non_persistent_local_ckpt_dir: str | None = _f(None, "Directory of local non-persistent checkpoints.")
    exit_on_missing_checkpoint: bool = _f(False, "Fail (config error) when `load` holds no checkpoint.")
    expected_resume_iteration: int | None = _f(
        None, "Exit 4 if the store's newest checkpoint is older (iteration; None: env KUBETRON_EXPECTED_ITERATION).",
        ge=0)
    save_optim: bool = _f(True, "Save optimizer state.")
    save_rng: bool = _f(True, "Save RNG state (false: a resume keeps this run's seeded generators).")
    load_optim: bool = _f(True, "Load optimizer state, and with it the LR scheduler and fp16 loss scale (as "
                                "Megatron); false: those start afresh while weights and iteration resume.")
    load_rng: bool = _f(True, "Load RNG state.")
    s3_endpoint_url: str | None = _f(None, "S3 endpoint URL (None: env AWS_ENDPOINT_URL, else AWS).")
    s3_region: str | None = _f(None, "S3 region (None: env AWS_REGION).")

    def check(self) -> None:
        if self.most_recent_k == 0:
            raise ConfigError("checkpoint.most_recent_k", "must be -1 (keep all) or >= 1, got 0")
        if self.non_persistent_ckpt_type == "local" and not self.non_persistent_local_ckpt_dir:
            raise ConfigError("checkpoint.non_persistent_local_ckpt_dir",
                              "required when non_persistent_ckpt_type is 'local'")
        if self.exit_on_missing_checkpoint and not self.load:
            raise ConfigError("checkpoint.load", "required when exit_on_missing_checkpoint is true")
        if self.ckpt_step is not None and not self.load:
            # As in the reference, a pretrained checkpoint always loads its newest iteration: point
            # pretrained_checkpoint at an iter_ directory to pick another.
            raise ConfigError("checkpoint.ckpt_step", "applies to checkpoint.load, which is not set (for "
                              "pretrained_checkpoint, give the iter_ directory itself)")
        for name in ("save", "load", "pretrained_checkpoint", "non_persistent_local_ckpt_dir"):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                raise ConfigError(f"checkpoint.{name}", "is empty (use null to unset it)")
            if is_remote(value) and len(str(value)) <= len("s3://"):
                raise ConfigError(f"checkpoint.{name}", f"{value!r} names no bucket")
        if is_remote(self.non_persistent_local_ckpt_dir):
            raise ConfigError("checkpoint.non_persistent_local_ckpt_dir", "must be a local directory, not s3://")
        if is_remote(self.dist_staging_dir):
            raise ConfigError("checkpoint.dist_staging_dir", "must be a local directory, not s3://")
        if self.ckpt_format == "torch_dist" and self.async_save is True:
            raise ConfigError("checkpoint.async_save", "is not supported with ckpt_format torch_dist (its save is "
                                                       "collective over all ranks); use ckpt_format sharded")


class DistributedInitConfig(_Section):
    """torch.distributed initialisation."""

    distributed_backend: Literal["nccl", "gloo"] | None = _f(None, "Backend (None: nccl with a GPU, gloo on CPU).")
    distributed_timeout_minutes: float = _f(
        10, "Longest a rank waits in a collective, e.g. for a dead peer, before exiting 5 (minutes).", gt=0)
    use_gpu: bool | None = _f(None, "Train on CUDA (None: when a CUDA device is available).")

    def resolve_device(self, cuda_available: bool) -> None:
        """use_gpu and distributed_backend where unset, for a place with or without CUDA: the one place the
        backend is chosen (idempotent: once set, they stay)."""
        if self.use_gpu is None:
            self.use_gpu = bool(cuda_available)
        elif self.use_gpu and not cuda_available:
            raise ConfigError("dist.use_gpu", "is true but no CUDA device is available")
        if self.distributed_backend is None:
            self.distributed_backend = "nccl" if self.use_gpu else "gloo"
        self.check()

    def check(self) -> None:
        if self.distributed_backend == "nccl" and self.use_gpu is False:
            raise ConfigError("dist.distributed_backend", "nccl needs a GPU but dist.use_gpu is false")


class RNGConfig(_Section):
    """Random seeds."""

    seed: int = _f(1234, "Random seed for initialisation, dropout and mock data.", ge=0)
    data_parallel_random_init: bool = _f(
        False, "Seed each data-parallel rank differently (seed + 10 x DP rank, so dropout differs per replica); "
        "the weights are initialised per rank, then broadcast from DP rank 0 so the replicas are one model "
        "(as Megatron).")


class DistributedDataParallelConfig(_Section):
    """Gradient reduction across data-parallel ranks (megatron.core DistributedDataParallelConfig names)."""

    impl: Literal["auto", "kubetron", "megatron"] = _f(
        "auto", "Data-parallel and optimizer implementation: megatron (megatron-core's DistributedDataParallel, "
        "DistributedOptimizer and pipeline schedules; CUDA only), kubetron (its own; CPU/gloo and GPU), "
        "auto (megatron on CUDA, kubetron elsewhere).")
    use_distributed_optimizer: bool = _f(False, "Shard optimizer state (kept in sync with the optimizer section).")
    overlap_grad_reduce: bool = _f(False, "Overlap gradient reduce-scatter/all-reduce with the backward pass.")
    overlap_param_gather: bool = _f(False, "Overlap parameter all-gather with the forward pass (distributed opt.).")
    grad_reduce_in_fp32: bool = _f(True, "All-reduce data-parallel gradients in fp32 (matters with bf16 parameters).")
    bucket_size: int | None = _f(
        None, "Elements per gradient bucket with overlap_grad_reduce / the distributed optimizer "
        "(null: max(40M, 1M x data-parallel size)).", ge=1)
    check_for_nan_in_grad: bool = _f(
        True, "Stop with exit code 3 when the gradient norm is NaN or Inf (fp32/bf16); false: the update is "
        "applied as megatron does. With fp16 a non-finite gradient is a loss-scale overflow: the update is "
        "skipped (its batch is consumed) and the scale backs off.")


class RerunStateMachineConfig(_Section):
    """Loss sanity checks (NaN/Inf and spiky loss)."""

    check_for_spiky_loss: bool = _f(False, "Stop with exit code 3 on a loss spike.")
    spiky_loss_factor: float = _f(
        10.0, "A loss above this multiple of the window's maximum is a spike (factor).", gt=1)
    spiky_loss_window: int = _f(100, "Recent iterations the loss is compared against (iterations).", ge=1)


class StragglerDetectionConfig(_Section):
    """Detecting slow ranks."""

    log_straggler: bool = _f(False, "Measure and log per-rank step times.")
    straggler_minmax_count: int = _f(1, "Slowest/fastest ranks to report.", ge=1)
    report_interval: int = _f(100, "Compare ranks every this many iterations (iterations).", ge=1)
    relative_threshold: float = _f(
        0.7, "A rank whose speed is below this fraction of the fastest rank's is a straggler (fraction).",
        gt=0, le=1)
    stop_if_detected: bool = _f(False, "Save and exit 6 when a straggler is detected.")


class ProfilingConfig(_Section):
    """The PyTorch profiler."""

    use_pytorch_profiler: bool = _f(False, "Profile iterations profile_step_start..profile_step_end.")
    profile_step_start: int = _f(10, "First profiled iteration.", ge=0)
    profile_step_end: int = _f(12, "Iteration the profiler stops at (exclusive).", ge=0)
    profile_ranks: list[NonNegInt] = _f([0], "Global ranks that profile.")
    record_shapes: bool = _f(False, "Record tensor shapes in the trace.")
    output_dir: str | None = _f(None, "Trace directory (None: <checkpoint.save or logger.tensorboard_dir>/profile).")

    def check(self) -> None:
        if self.use_pytorch_profiler and self.profile_step_end <= self.profile_step_start:
            raise ConfigError("profiling.profile_step_end", f"{self.profile_step_end} must be greater than "
                                                            f"profile_step_start = {self.profile_step_start}")


class MixedPrecisionConfig(_Section):
    """Numeric precision of parameters and compute."""

    bf16: bool = _f(False, "bfloat16 parameters and compute; the optimizer keeps fp32 main weights and state "
                           "(allowed on CPU, but slow there).")
    fp16: bool = _f(False, "float16 parameters and compute with loss scaling; the optimizer keeps fp32 main weights "
                           "and state, an iteration whose gradients overflow is skipped (not together with bf16).")
    loss_scale: float | None = _f(None, "fp16: a static loss scale (None: dynamic loss scaling).", gt=0)
    initial_loss_scale: float = _f(2.0**32, "fp16: the first dynamic loss scale.", gt=0)
    min_loss_scale: float = _f(1.0, "fp16: the dynamic loss scale never backs off below this.", gt=0)
    loss_scale_window: int = _f(1000, "fp16: iterations without overflow before the scale doubles (iterations).",
                                ge=1)
    hysteresis: int = _f(2, "fp16: overflows (counted since the last growth) before the scale halves; after that each "
                            "overflow halves it.", ge=1)
    params_dtype: Literal["float32", "bfloat16", "float16"] | None = _d(None, "Derived: parameter dtype name.")

    def check(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError("mixed_precision.fp16", "bf16 and fp16 cannot both be true")


MOE_KEYS = tuple(k for k in GPTModelConfig.model_fields
                 if k.startswith("moe_") or k == "expert_model_parallel_size")
"""The model keys that only apply to a mixture of experts (num_moe_experts set)."""

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class PeftConfig(_Section):
    """Parameter-efficient fine-tuning (Megatron Bridge's `peft`): LoRA adapters, base weights frozen."""

    scheme: Literal["lora"] | None = _f(
        None, "lora: train low-rank adapters on the target modules, base weights frozen and loaded from "
        "checkpoint.pretrained_checkpoint; checkpoints hold the adapters only (null: full fine-tuning).")
    target_modules: list[str] = _f(
        list(LORA_TARGETS),
        "Linears of every layer that get an adapter (linear_qkv, linear_proj, linear_fc1, linear_fc2).")
    dim: int = _f(32, "Adapter rank (the inner dimension of B x A).", ge=1)
    alpha: float = _f(32.0, "Scale numerator: the adapter's output is multiplied by alpha / dim.", gt=0)
    dropout: float = _f(0.0, "Dropout probability in the adapter (fraction).", ge=0, lt=1)
    dropout_position: Literal["pre", "post"] = _f(
        "pre", "Dropout on the adapter's input (pre) or on its output (post).")

    def check(self) -> None:
        if self.scheme is None:
            changed = sorted(k for k in self.model_fields_set
                             if getattr(self, k) != PeftConfig.model_fields[k].default)
            if changed:
                raise ConfigError(f"peft.{changed[0]}", "has no effect without peft.scheme: lora")
            return
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown or not self.target_modules:
            what = f"unknown module {unknown[0]!r}" if unknown else "is empty"
            raise ConfigError("peft.target_modules", f"{what} (expected some of {', '.join(LORA_TARGETS)})")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ConfigError("peft.target_modules", "contains duplicates")


SECTIONS: dict[str, type[_Section]] = {
    "train": TrainingConfig,
    "validation": ValidationConfig,
    "model": GPTModelConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "dataset": GPTDatasetConfig,
    "tokenizer": TokenizerConfig,
    "finetuning": FinetuningDatasetConfig,
    "logger": LoggerConfig,
    "checkpoint": CheckpointConfig,
    "dist": DistributedInitConfig,
    "rng": RNGConfig,
    "ddp": DistributedDataParallelConfig,
    "rerun_state_machine": RerunStateMachineConfig,
    "straggler": StragglerDetectionConfig,
    "profiling": ProfilingConfig,
    "mixed_precision": MixedPrecisionConfig,
    "peft": PeftConfig,
}


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def is_remote(path: str | None) -> bool:
    """True for an s3:// store."""
    return bool(path) and str(path).startswith("s3://")


def parse_data_path(paths: list[str], field: str = "dataset.data_path") -> list[tuple[float, str]]:
    """Megatron's data_path list as (weight, prefix) pairs: ["a"] or ["0.7", "a", "0.3", "b"]."""
    if not paths:
        raise ConfigError(field, "is empty (leave it unset for mock data)")
    if len(paths) == 1:
        return [(1.0, paths[0])]
    try:
        float(paths[0])
    except ValueError:
        return [(1.0, p) for p in paths]
    if len(paths) % 2:
        raise ConfigError(field, "weighted form needs pairs: [weight, prefix, weight, prefix, ...]")
    out = []
    for w, p in zip(paths[0::2], paths[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ConfigError(field, f"expected a weight, got {w!r}") from None
        if not weight > 0 or not math.isfinite(weight):
            raise ConfigError(field, f"weights must be positive numbers, got {w!r}")
        out.append((weight, p))
    return out


def parse_split(split: str) -> list[float]:
    """'969,30,1' (or '99/1/0') as normalised [train, valid, test] fractions."""
    sep = "," if "," in split else "/"
    parts = [s.strip() for s in str(split).split(sep)]
    try:
        vals = [float(s) for s in parts]
    except ValueError:
        raise ConfigError("dataset.split", f"expected up to 3 comma-separated numbers, got {split!r}") from None
    if not 1 <= len(vals) <= 3 or any(v < 0 or not math.isfinite(v) for v in vals) or sum(vals) <= 0:
        raise ConfigError("dataset.split", f"expected up to 3 non-negative numbers with a positive sum, got {split!r}")
    vals += [0.0] * (3 - len(vals))
    total = sum(vals)
    return [v / total for v in vals]


def padded_vocab_size(cfg: ConfigContainer) -> int:
    """The tokenizer's vocabulary padded up to a multiple of make_vocab_size_divisible_by * tp."""
    base = cfg.tokenizer.base_vocab_size()
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.model.tensor_model_parallel_size
    return -(-base // multiple) * multiple


def _fmt(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        s = yaml.safe_dump(v, default_flow_style=True).strip()
        return s if len(s) <= 60 else "a list"
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "...'"


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _suggest(word: str, options: list[str]) -> str | None:
    m = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return m[0] if m else None


def _unknown_key_message(section: str, key: str) -> str:
    fields = list(SECTIONS[section].model_fields)
    elsewhere = [s for s, cls in SECTIONS.items() if s != section and key in cls.model_fields]
    if elsewhere:
        return f"unknown key (did you mean '{elsewhere[0]}.{key}'?)"
    near = _suggest(key, fields)
    if near:
        return f"unknown key (did you mean '{section}.{near}'?)"
    all_keys = [f"{s}.{k}" for s, cls in SECTIONS.items() for k in cls.model_fields]
    near = _suggest(f"{section}.{key}", all_keys)
    if near:
        return f"unknown key (did you mean '{near}'?)"
    return "unknown key (see `kubetron config --reference`)"


def _unknown_section_message(section: str) -> str:
    owners = [s for s, cls in SECTIONS.items() if section in cls.model_fields]
    if owners:
        return f"unknown section '{section}' (did you mean '{owners[0]}.{section}'?)"
    near = _suggest(section, list(SECTIONS))
    if near:
        return f"unknown section '{section}' (did you mean '{near}'?)"
    return f"unknown section '{section}' (sections: {', '.join(SECTIONS)})"


def _check_keys(data: dict) -> None:
    """Unknown sections and keys, with a suggestion, before pydantic sees them."""
    for section, body in data.items():
        section = str(section)
        if section in _TOP_LEVEL_FIELDS:
            continue
        if section not in SECTIONS:
            first = next(iter(body), None) if isinstance(body, dict) else None
            field = f"{section}.{first}" if first is not None else section
            raise ConfigError(field, _unknown_section_message(section))
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(section, f"expected a mapping of keys, got {_fmt(body)}")
        for key in body:
            if str(key) not in SECTIONS[section].model_fields:
                raise ConfigError(f"{section}.{key}", _unknown_key_message(section, str(key)))


def _convert_validation_error(err: ValidationError) -> ConfigError:
    """The first pydantic error as a one-line ConfigError naming the dotted field."""
    e = err.errors()[0]
    field = _loc(tuple(e.get("loc", ()))) or "config"
    t = e.get("type", "")
    ctx = e.get("ctx") or {}
    got = _fmt(e.get("input"))
    if t in ("int_parsing", "int_type", "int_from_float", "int_parsing_size"):
        msg = f"expected an integer, got {got}"
    elif t in ("float_parsing", "float_type", "finite_number"):
        msg = f"expected a number, got {got}"
    elif t in ("bool_parsing", "bool_type"):
        msg = f"expected true or false, got {got}"
    elif t == "string_type":
        msg = f"expected a string, got {got}"
    elif t == "literal_error":
        msg = f"expected one of {ctx.get('expected')}, got {got}"
    elif t in ("list_type", "tuple_type"):
        msg = f"expected a list, got {got}"
    elif t in ("model_type", "model_attributes_type", "dict_type"):
        msg = f"expected a mapping of keys, got {got}"
    elif t == "greater_than":
        msg = f"must be > {ctx.get('gt')}, got {got}"
    elif t == "greater_than_equal":
        msg = f"must be >= {ctx.get('ge')}, got {got}"
    elif t == "less_than":
        msg = f"must be < {ctx.get('lt')}, got {got}"
    elif t == "less_than_equal":
        msg = f"must be <= {ctx.get('le')}, got {got}"
    elif t == "extra_forbidden":
        parts = field.split(".")
        if len(parts) == 2 and parts[0] in SECTIONS:
            msg = _unknown_key_message(parts[0], parts[1])
        else:
            msg = "unknown key"
    elif t == "missing":
        msg = "required"
    elif t == "value_error":
        msg = str(ctx.get("error", e.get("msg", "invalid value")))
    else:
        msg = e.get("msg", "invalid value")
    return ConfigError(field, msg)


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Apply `section.key=value` overrides (value parsed as YAML) to a copy of `data`."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for item in overrides or ():
        key, eq, raw = str(item).partition("=")
        key = key.strip()
        parts = key.split(".")
        if not eq or len(parts) != 2 or not all(parts):
            raise ConfigError(f"override '{item}'", "expected section.key=value")
        section, name = parts
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or "invalid YAML"
            raise ConfigError(key, f"cannot parse value {raw!r}: {problem}") from None
        if section not in SECTIONS:
            raise ConfigError(key, _unknown_section_message(section))
        if name not in SECTIONS[section].model_fields:
            raise ConfigError(key, _unknown_key_message(section, name))
        body = out.get(section)
        if body is None:
            body = out[section] = {}
        elif not isinstance(body, dict):
            raise ConfigError(section, f"expected a mapping of keys, got {_fmt(body)}")
        body[name] = value
    return out


# --------------------------------------------------------------------------------------------------
# The container
# --------------------------------------------------------------------------------------------------


class ConfigContainer(BaseModel):
    """Top-level container holding all configuration sections."""

    model_config = ConfigDict(extra="forbid")

    train: TrainingConfig = Field(default_factory=TrainingConfig, description="The training loop.")
    validation: ValidationConfig = Field(default_factory=ValidationConfig, description="Evaluation during training.")
    model: GPTModelConfig = Field(default_factory=GPTModelConfig, description="The GPT model.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="The optimizer.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="The learning-rate schedule.")
    dataset: GPTDatasetConfig = Field(default_factory=GPTDatasetConfig, description="Training data.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="The tokenizer.")
    finetuning: FinetuningDatasetConfig = Field(default_factory=FinetuningDatasetConfig,
                                                description="Supervised fine-tuning data.")
    logger: LoggerConfig = Field(default_factory=LoggerConfig, description="Logging.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    dist: DistributedInitConfig = Field(default_factory=DistributedInitConfig,
                                        description="torch.distributed initialisation.")
    rng: RNGConfig = Field(default_factory=RNGConfig, description="Random seeds.")
    ddp: DistributedDataParallelConfig = Field(default_factory=DistributedDataParallelConfig,
                                               description="Data-parallel gradient reduction.")
    rerun_state_machine: RerunStateMachineConfig = Field(default_factory=RerunStateMachineConfig,
                                                         description="Loss sanity checks.")
    straggler: StragglerDetectionConfig = Field(default_factory=StragglerDetectionConfig,
                                                description="Straggler detection.")
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig, description="Profiling.")
    mixed_precision: MixedPrecisionConfig = Field(default_factory=MixedPrecisionConfig,
                                                  description="Numeric precision.")
    peft: PeftConfig = Field(default_factory=PeftConfig, description="Parameter-efficient fine-tuning (LoRA).")
    data_parallel_size: int | None = _d(None, "Derived: world_size // (tp * pp).")

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict | None) -> Self:
        """Type-check `data` (sections of keys) and run `validate()`; errors are ConfigErrors."""
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError("config", f"expected a mapping of sections, got {type(data).__name__}")
        _check_keys(data)
        # every section from the data (an absent one as {}), so each is built under the same context
        data = {**{name: {} for name in SECTIONS}, **{k: ({} if v is None and k in SECTIONS else v)
                                                      for k, v in data.items()}}
        try:
            cfg = cls.model_validate(data, context={_TYPES_FIRST: True})
        except ValidationError as err:
            raise _convert_validation_error(err) from None
        cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        """All sections and keys, derived values included (plain YAML/JSON types)."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        """The resolved config as YAML (saved as run_config.yaml in every checkpoint)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    # ---- validation -----------------------------------------------------------------------------

    # Bridge's name; it hides pydantic's deprecated v1 classmethod `BaseModel.validate(value)`.
    def validate(self) -> None:  # type: ignore[override]
        """Every section's own rules, then the rules across sections; needs neither the world size, the
        filesystem nor torch."""
        for name in SECTIONS:
            getattr(self, name).check()
        self.tokenizer.validate_fields()  # here, not when built: a resume's adopted files stand in for paths
        self._check_vocab()
        self._check_data()
        self._check_devices()
        self._check_moe()
        self._check_peft()

    def _check_vocab(self) -> None:
        """A byte/null tokenizer's vocabulary fits model.vocab_size (a file-based one's: resolve reads it)."""
        m, tok = self.model, self.tokenizer
        if m.vocab_size is not None and not tok.file_based and m.vocab_size < tok.base_vocab_size():
            raise ConfigError("model.vocab_size", f"{m.vocab_size} is smaller than the tokenizer's "
                                                  f"vocabulary ({tok.base_vocab_size()})")
        if self.scheduler.lr_warmup_init > self.optimizer.lr:
            raise ConfigError("scheduler.lr_warmup_init", f"{self.scheduler.lr_warmup_init} is larger than "
                                                          f"optimizer.lr = {self.optimizer.lr}")

    def _check_data(self) -> None:
        """Periodic evaluation needs validation data; packed fine-tuning needs kubetron's attention."""
        d, ft, evaluating = self.dataset, self.finetuning, self.validation.eval_interval is not None
        if evaluating and d.train_data_path is not None and d.valid_data_path is None:
            raise ConfigError("dataset.valid_data_path", "required when validation.eval_interval is set")
        if evaluating and d.data_path is not None and parse_split(d.split)[1] == 0:
            raise ConfigError("dataset.split", f"{d.split!r} leaves no validation data but "
                                               "validation.eval_interval is set")
        if ft.data_path is not None and evaluating and ft.valid_data_path is None:
            raise ConfigError("finetuning.valid_data_path", "required when validation.eval_interval is set")
        if ft.packing and ft.data_path is not None and self.model.transformer_impl == "transformer_engine":
            raise ConfigError("finetuning.packing", "needs model.transformer_impl local or auto (packed "
                                                    "examples are masked in kubetron's SDPA attention)")

    def _check_devices(self) -> None:
        if self.ddp.impl == "megatron" and self.dist.use_gpu is False:
            raise ConfigError("ddp.impl", "megatron needs CUDA but dist.use_gpu is false (use auto or kubetron)")
        if self.ddp.overlap_param_gather and not (self.ddp.use_distributed_optimizer
                                                  or self.optimizer.use_distributed_optimizer):
            raise ConfigError("ddp.overlap_param_gather", "requires use_distributed_optimizer")

    def _check_moe(self) -> None:
        """Expert parallelism's needs of the data-parallel implementation and the checkpoint format."""
        m, d = self.model, self.ddp
        ep = m.expert_model_parallel_size
        if m.num_moe_experts is None or ep == 1:
            return
        if d.impl != "megatron" and (d.use_distributed_optimizer or self.optimizer.use_distributed_optimizer
                                     or d.overlap_grad_reduce):
            # kubetron's bucketed buffers reduce over one DP group; experts need the expert-DP one
            field = "ddp.overlap_grad_reduce" if d.overlap_grad_reduce else "ddp.use_distributed_optimizer"
            raise ConfigError(field, "with model.expert_model_parallel_size > 1 needs ddp.impl megatron (CUDA)")
        if self.checkpoint.ckpt_format == "kubetron":
            raise ConfigError("checkpoint.ckpt_format", "kubetron (one file gathered on rank 0) does not gather the "
                                                        "experts of expert_model_parallel_size > 1: use sharded or "
                                                        "torch_dist")

    def _check_peft(self) -> None:
        """LoRA: a base to adapt, and the layouts its adapter-only checkpoints use."""
        p, m, c = self.peft, self.model, self.checkpoint
        if p.scheme is None:
            return
        if not c.pretrained_checkpoint:
            raise ConfigError("checkpoint.pretrained_checkpoint", "required with peft.scheme lora (the frozen base "
                                                                   "weights the adapters train on)")
        if m.transformer_impl == "transformer_engine":
            raise ConfigError("model.transformer_impl", "LoRA adapters attach to the local spec's linears: use "
                                                        "local or auto")
        if m.sequence_parallel and m.tensor_model_parallel_size > 1:
            raise ConfigError("model.sequence_parallel", "is not supported with peft.scheme lora")
        if c.ckpt_format != "sharded":
            raise ConfigError("checkpoint.ckpt_format", "adapter-only checkpoints (peft.scheme lora) need the "
                                                        "sharded format")
        if c.non_persistent_ckpt_type == "local":
            raise ConfigError("checkpoint.non_persistent_ckpt_type", "local is not supported with peft.scheme "
                                                                     "lora (use global)")

    # ---- derived values -------------------------------------------------------------------------

    def derive(self, world_size: int = 1, cuda_available: bool | None = None) -> Self:
        """Validate and compute the derived values that follow from the config and `world_size` alone
        (idempotent); returns self.

        Pure: reads no file, S3 object, environment variable or installed package, so the operator
        checks a job with it before any pod exists. A file-based tokenizer's vocabulary is resolve()'s.
        `cuda_available` (when given) resolves dist.use_gpu and dist.distributed_backend.
        """
        self.validate()
        t, m, s = self.train, self.model, self.scheduler
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError("world_size", f"must be a positive integer, got {world_size!r}")

        # parallelism and batch sizes
        mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
        if world_size % mp:
            raise ConfigError("model.tensor_model_parallel_size",
                              f"tensor_model_parallel_size*pipeline_model_parallel_size = {mp} does not divide "
                              f"the world size {world_size}")
        dp = world_size // mp
        if m.num_moe_experts is not None and dp % m.expert_model_parallel_size:
            raise ConfigError("model.expert_model_parallel_size",
                              f"{m.expert_model_parallel_size} does not divide the data-parallel size {dp} "
                              f"(world size {world_size} / (tp*pp = {mp}))")
        self.data_parallel_size = dp
        per_step = t.micro_batch_size * dp
        if t.global_batch_size is None:
            t.global_batch_size = per_step
        if t.global_batch_size % per_step:
            raise ConfigError("train.global_batch_size", f"{t.global_batch_size} is not divisible by "
                                                         f"micro_batch_size*data_parallel_size = {per_step}")
        t.num_microbatches = t.global_batch_size // per_step
        if self.checkpoint.async_save is None:  # async by default where ranks would wait on the slowest writer
            self.checkpoint.async_save = world_size > 1 and self.checkpoint.ckpt_format == "sharded"

        # training length
        if t.train_samples is not None:
            iters = t.train_samples // t.global_batch_size
            if iters < 1:
                raise ConfigError("train.train_samples", f"{t.train_samples} is smaller than "
                                                         f"global_batch_size = {t.global_batch_size}")
            t.train_iters = iters
        assert t.train_iters is not None  # validate(): train_iters or train_samples is set

        # scheduler, in iterations
        decay = s.lr_decay_iters if s.lr_decay_iters is not None else t.train_iters
        if s.lr_warmup_fraction is not None:
            warmup = int(s.lr_warmup_fraction * decay)
        else:
            warmup = s.lr_warmup_iters
        if s.lr_decay_style != "constant" and warmup >= decay:
            field = "scheduler.lr_warmup_fraction" if s.lr_warmup_fraction is not None else "scheduler.lr_warmup_iters"
            raise ConfigError(field, f"warmup ({warmup} iterations) must be shorter than lr_decay_iters ({decay})")
        if s.lr_wsd_decay_iters is not None and s.lr_wsd_decay_iters > decay:
            raise ConfigError("scheduler.lr_wsd_decay_iters",
                              f"{s.lr_wsd_decay_iters} is longer than lr_decay_iters ({decay})")
        s.lr_warmup_steps, s.lr_decay_steps = warmup, decay

        # model
        if m.num_query_groups is None:
            m.num_query_groups = m.num_attention_heads
        if m.ffn_hidden_size is None:
            m.ffn_hidden_size = 4 * m.hidden_size
        if m.max_position_embeddings is None:
            m.max_position_embeddings = m.seq_length
        if m.num_moe_experts is not None and m.moe_ffn_hidden_size is None:
            m.moe_ffn_hidden_size = m.ffn_hidden_size
        if not self.tokenizer.file_based:
            self.derive_vocab_size()
        if m.tensor_model_parallel_size == 1:
            m.sequence_parallel = False  # as Megatron: nothing to shard
        if m.ffn_hidden_size % m.tensor_model_parallel_size:
            raise ConfigError("model.hidden_size", f"4*hidden_size = {m.ffn_hidden_size} is not divisible by "
                                                   f"tensor_model_parallel_size = {m.tensor_model_parallel_size}")

        # distributed optimizer: either setting turns both on
        if self.ddp.use_distributed_optimizer or self.optimizer.use_distributed_optimizer:
            self.ddp.use_distributed_optimizer = self.optimizer.use_distributed_optimizer = True

        mp_cfg = self.mixed_precision
        mp_cfg.params_dtype = "bfloat16" if mp_cfg.bf16 else "float16" if mp_cfg.fp16 else "float32"

        # checkpoint
        c = self.checkpoint
        if c.non_persistent_save_interval is not None and c.non_persistent_ckpt_type is None:
            c.non_persistent_ckpt_type = "global"
        if c.non_persistent_ckpt_type == "local" and not c.non_persistent_local_ckpt_dir:
            raise ConfigError("checkpoint.non_persistent_local_ckpt_dir",
                              "required when non_persistent_ckpt_type is 'local'")

        # profiling output
        p = self.profiling
        if p.use_pytorch_profiler and p.output_dir is None:
            base = c.save if c.save and not is_remote(c.save) else self.logger.tensorboard_dir
            p.output_dir = os.path.join(base, "profile") if base else "profile"

        # device
        if cuda_available is not None:
            self.dist.resolve_device(cuda_available)

        self.validate()
        return self

    def derive_vocab_size(self) -> None:
        """model.vocab_size: the tokenizer's vocabulary padded, or the given size checked against it
        (a file-based tokenizer reads its files: resolve() calls this for those, derive() for the rest)."""
        m, tok = self.model, self.tokenizer
        if m.vocab_size is None:
            m.vocab_size = padded_vocab_size(self)
        elif tok.file_based and m.vocab_size < tok.base_vocab_size():
            raise ConfigError("model.vocab_size", f"{m.vocab_size} is smaller than the tokenizer's vocabulary "
                                                  f"({tok.base_vocab_size()})")

    # ---- reporting ------------------------------------------------------------------------------

    def non_default_values(self) -> dict[str, tuple[Any, Any]]:
        """{"section.key": (default, current)} for every user-settable key that differs from its default."""
        out: dict[str, tuple[Any, Any]] = {}
        for section, cls in SECTIONS.items():
            current = getattr(self, section)
            for name, info in cls.model_fields.items():
                if _is_derived(info):
                    continue
                default = info.get_default(call_default_factory=True)
                value = getattr(current, name)
                if value != default:
                    out[f"{section}.{name}"] = (default, value)
        return out

    def log_non_default_values(self, logger) -> None:
        """One line at INFO: how many keys differ from their defaults; then, at DEBUG, each on its own line."""
        diffs = self.non_default_values()
        if not diffs:
            logger.info("Configuration: all values are defaults")
            return
        logger.info("Configuration: %d values differ from the defaults (logger.logging_level DEBUG lists them; each "
                    "checkpoint's run_config.yaml holds the whole config)", len(diffs))
        for key, (old, new) in diffs.items():
            logger.debug("  %s: %s (default %s)", key, _fmt(new), _fmt(old))


_TOP_LEVEL_FIELDS = {"data_parallel_size"}


# --------------------------------------------------------------------------------------------------
# Reference documentation
# --------------------------------------------------------------------------------------------------


def _type_str(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _type_str(args[0])
    if origin is Literal:
        return " | ".join(f'"{a}"' for a in args)
    if origin in (Union, types.UnionType):
        parts = [_type_str(a) for a in args if a is not type(None)]
        if type(None) in args:
            parts.append("null")
        return " | ".join(parts)
    if origin is list:
        return f"list[{_type_str(args[0])}]" if args else "list"
    if isinstance(tp, type):
        return {"str": "string", "int": "int", "float": "float", "bool": "bool"}.get(tp.__name__, tp.__name__)
    return str(tp)


def _default_str(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def config_reference_markdown(level: int = 2) -> str:
    """Markdown reference of every section and key: type, default and description.

    Generated from the models, so the README cannot drift from the code. `level` is the heading
    level of each section.
    """
    h = "#" * level
    lines = [
        "Every key can be set in the YAML file (`section: {key: value}`) or on the command line as",
        "`section.key=value` (the value is parsed as YAML: `train.iterations_to_skip=[3,4]`,",
        "`checkpoint.save=null`). Keys marked *derived* are computed when the run starts and appear in",
        "the `run_config.yaml` saved with each checkpoint.",
        "",
    ]
    for section, cls in SECTIONS.items():
        lines += [f"{h} `{section}`", "", (cls.__doc__ or "").strip(), "",
                  "| key | type | default | description |", "|---|---|---|---|"]
        for name, info in cls.model_fields.items():
            desc = (info.description or "").replace("|", "\\|")
            if _is_derived(info):
                desc = "*derived* " + desc.removeprefix("Derived: ")
            typ = _type_str(info.annotation).replace("|", "\\|")
            default = _default_str(info).replace("|", "\\|")
            lines.append(f"| `{name}` | {typ} | `{default}` | {desc} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


__all__ = [
    "BYTE_TOKENIZER_VOCAB",
    "SECTIONS",
    "CheckpointConfig",
    "ConfigContainer",
    "DistributedDataParallelConfig",
    "DistributedInitConfig",
    "GPTDatasetConfig",
    "GPTModelConfig",
    "LoggerConfig",
    "MixedPrecisionConfig",
    "OptimizerConfig",
    "ProfilingConfig",
    "RNGConfig",
    "RerunStateMachineConfig",
    "SchedulerConfig",
    "StragglerDetectionConfig",
    "TokenizerConfig",
    "TrainingConfig",
    "ValidationConfig",
    "apply_overrides",
    "config_reference_markdown",
    "is_remote",
    "padded_vocab_size",
    "parse_data_path",
    "parse_split",
]
