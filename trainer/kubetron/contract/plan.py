"""`kubetron plan`: parameters and an estimate of the per-GPU memory of a run config at a world size.

The accounting follows Megatron-LM's `megatron/training/theoretical_memory_usage.py`:

- **Weights, gradients, optimizer state** per parameter: the model's dtype (bf16/fp16: 2 bytes, fp32: 4),
  gradients in fp32 (`ddp.grad_reduce_in_fp32`, or an fp32 model) else the model's dtype, and for a
  bf16/fp16 model fp32 main weights; Adam keeps two fp32 moments (SGD one, with momentum). The
  distributed optimizer shards the main weights and moments over data-parallel ranks (Megatron's
  `6 + 12 / dp` bytes for bf16 Adam). Parameters are split by TP (norms replicated, as in
  megatron-core) and by PP (the most loaded stage is reported). LoRA: base weights are frozen (weights
  only); the adapters train.
- **Activations**: what the forward pass saves for the backward pass, per micro-batch. Megatron's
  `s*b*h*(34 + 5*a*s/h)` (Korthikanti et al., Table 2) assumes materialized attention scores and
  dropout masks; kubetron's layers use flash/SDPA attention (no s x s scores), so the per-layer terms
  here are the tensors kubetron's layer spec saves: layer input, norm outputs (RMSNorm also its
  normalized input), the fused QKV output, q/k after RoPE, attention output and softmax statistics,
  the MLP's fc1 output and activation intermediates, hidden-dropout masks, RoPE cos/sin. Attention
  dropout keeps no mask in flash attention and is not counted.
  Tensor parallelism splits the attention/MLP terms; the h-sized terms too with sequence parallelism.
  The first pipeline stage holds min(pp, micro-batches) micro-batches in flight (1F1B). The output
  layer's logits are kept in fp32 by the cross entropy (Megatron's `4*s*b*v`). Full recompute keeps
  each recompute group's input plus, during the backward pass, one group's activations.
  tests/test_plan.py checks these terms against the bytes measured for tiny models on CPU.
- **Mixture of experts** (megatron-core's MoE layer): an MoE layer's experts are split over EP ranks
  and by TP (expert TP = TP), the router and a shared expert are dense; with the distributed optimizer
  the experts' fp32 state is sharded over the expert-data-parallel group (DP / EP ranks), the dense
  parameters' over DP. Its activations: the router's tensors per token, then per routed copy (top-k
  per token, routing taken as balanced over EP ranks) the dispatched token, its index and probability
  and the expert MLP's activations. Parameters are reported in total and active per token.

It is an estimate: the CUDA context, NCCL buffers, allocator fragmentation and transient tensors
(matmul workspaces, the gradients flowing through the backward pass, optimizer temporaries) are not in
it; keep some GiB of headroom. Torch-free: it reads the config models only.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from kubetron.contract.config import ConfigContainer, GPTModelConfig
from kubetron.contract.errors import ConfigError

GIB = 1024**3
DEFAULT_GPU_MEMORY = 80 * GIB
_UNITS = {"gib": GIB, "gb": 10**9, "mib": 1024**2, "mb": 10**6, "tib": 1024**4, "tb": 10**12, "kib": 1024, "kb": 10**3,
          "b": 1}
FP32 = 4  # bytes
DROPOUT_MASK_BYTES = 1  # CUDA's dropout keeps a bool mask (torch on CPU keeps it in the compute dtype)


def parse_size(text: str, flag: str, bare_unit: int) -> int:
    """'80GiB', '141GB', '500MB' -> bytes (GB = 10^9 and GiB = 2^30 bytes, as transformers reads them); a
    bare number is `bare_unit` bytes each. Anything else: a ConfigError naming `flag`."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    units = {**_UNITS, "": bare_unit}
    if not m or unit not in units or float(m.group(1)) * units[unit] < 1:
        raise ConfigError(flag, f"expected a size like 80GiB, 5GB or 500MB, got {text!r}")
    return int(float(m.group(1)) * units[unit])


def parse_memory(text: str) -> int:
    """'80GiB', '141GB', '80' (GiB) -> bytes."""
    return parse_size(text, "--gpu-memory", bare_unit=GIB)


def derived(*values: int | None) -> tuple[int, ...]:
    """Values `ConfigContainer.derive()` sets (None before it): plan reads derived configs."""
    if None in values:
        raise ValueError("plan needs a derived config: call cfg.derive() or cfg.finalize() first")
    return tuple(v for v in values if v is not None)


# --------------------------------------------------------------------------------------------------
# Shapes and parameters
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Moe:
    """The mixture-of-experts part of the model (model.num_moe_experts and the moe_* keys)."""

    experts: int
    topk: int
    ffn: int  # one expert's MLP hidden size
    shared_ffn: int  # the shared expert's MLP hidden size (0: none)
    pattern: tuple[bool, ...]  # per layer: experts (True) or a dense MLP
    aux_loss: bool  # a load-balancing loss is computed (its scores are kept for backward)

    @classmethod
    def of(cls, m: GPTModelConfig) -> Moe | None:
        experts = m.num_moe_experts
        if experts is None:
            return None
        pattern = tuple(bool(x) for x in m.moe_layer_pattern())  # megatron-core's reading of moe_layer_freq
        (ffn,) = derived(m.moe_ffn_hidden_size or m.ffn_hidden_size)
        return cls(experts=experts, topk=m.moe_router_topk, ffn=ffn,
                   shared_ffn=m.moe_shared_expert_intermediate_size or 0, pattern=pattern,
                   aux_loss=m.moe_router_load_balancing_type != "none" and m.moe_aux_loss_coeff > 0)


@dataclass(frozen=True)
class Shape:
    """The model dimensions plan needs, read from a derived config."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int  # kv_channels
    ffn: int
    vocab: int
    seq: int
    swiglu: bool
    rms: bool
    linear_bias: bool
    qkv_bias: bool
    qk_norm: bool
    rope: bool
    learned_pos: int  # learned absolute position rows (0: none)
    tied: bool
    moe: Moe | None = None  # the experts (None: a dense model)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.groups * self.head_dim

    @property
    def norm(self) -> int:
        """Parameters of one norm of width 1 (RMSNorm: weight; LayerNorm: weight and bias)."""
        return 1 if self.rms else 2

    @classmethod
    def of(cls, cfg: ConfigContainer) -> Shape:
        m = cfg.model
        if m.vocab_size is None:
            raise ConfigError("model.vocab_size", f"plan does not read tokenizer files: set it for "
                                                  f"tokenizer_type {cfg.tokenizer.tokenizer_type}")
        kv_channels = getattr(m, "kv_channels", None)  # the Qwen3 keys, where this version has them
        groups, ffn, max_positions = derived(m.num_query_groups, m.ffn_hidden_size, m.max_position_embeddings)
        return cls(layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads, groups=groups,
                   head_dim=kv_channels or m.hidden_size // m.num_attention_heads, ffn=ffn,
                   vocab=m.vocab_size, seq=m.seq_length, swiglu=m.activation == "swiglu",
                   rms=m.normalization == "RMSNorm", linear_bias=m.add_bias_linear,
                   qkv_bias=m.add_qkv_bias or m.add_bias_linear, qk_norm=bool(getattr(m, "qk_layernorm", False)),
                   rope=m.position_embedding_type == "rope",
                   learned_pos=max_positions if m.position_embedding_type == "learned_absolute" else 0,
                   tied=m.share_embeddings_and_output_weights, moe=Moe.of(m))

    def experts_in(self, layer: int) -> Moe | None:
        """The experts of layer `layer` (None: it has a dense MLP)."""
        return self.moe if self.moe is not None and self.moe.pattern[layer] else None


ATTENTION = ("linear_qkv", "linear_proj")
MLP = ("linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class Count:
    """Parameters as the distributed optimizer shards them: dense ones over the data-parallel group,
    experts over the expert-data-parallel group."""

    dense: int = 0
    expert: int = 0

    def __add__(self, other: Count) -> Count:
        return Count(self.dense + other.dense, self.expert + other.expert)

    @property
    def total(self) -> int:
        return self.dense + self.expert


def linears(s: Shape, ffn: int | None = None) -> dict[str, tuple[int, int, bool]]:
    """{name: (in, out, column-parallel)} of one layer's linears (the LoRA target names); `ffn`: the
    MLP's hidden size (an expert's or the shared expert's; default the dense MLP's)."""
    ffn = s.ffn if ffn is None else ffn
    fc1_out = ffn * (2 if s.swiglu else 1)
    return {"linear_qkv": (s.hidden, s.q + 2 * s.kv, True), "linear_proj": (s.q, s.hidden, False),
            "linear_fc1": (s.hidden, fc1_out, True), "linear_fc2": (ffn, s.hidden, False)}


def _linear_params(s: Shape, names: tuple[str, ...], ffn: int, tp: int) -> int:
    n = 0
    for name in names:
        fan_in, fan_out, column = linears(s, ffn)[name]
        n += fan_in * fan_out // tp
        bias = s.qkv_bias if name == "linear_qkv" else s.linear_bias
        n += (fan_out // tp if column else fan_out) if bias else 0
    return n


def layer_params(s: Shape, layer: int = 0, tp: int = 1, ep: int = 1) -> Count:
    """Layer `layer`'s parameters on one TP rank of one expert-parallel rank. Norms, row-parallel biases
    and the router are replicated; an MoE layer's experts are split over EP ranks (E / ep each) and,
    like the dense linears, over TP ranks (megatron-core's expert TP size defaults to TP); a shared
    expert is a dense MLP."""
    dense = _linear_params(s, ATTENTION, s.ffn, tp) + 2 * s.norm * s.hidden
    dense += 2 * s.norm * s.head_dim if s.qk_norm else 0
    moe = s.experts_in(layer)
    if moe is None:
        return Count(dense + _linear_params(s, MLP, s.ffn, tp))
    dense += moe.experts * s.hidden + (moe.experts if s.linear_bias else 0)  # the router
    dense += _linear_params(s, MLP, moe.shared_ffn, tp) if moe.shared_ffn else 0
    return Count(dense, moe.experts // ep * _linear_params(s, MLP, moe.ffn, tp))


def lora_params(s: Shape, targets: frozenset[str], dim: int, layer: int = 0, tp: int = 1, ep: int = 1) -> Count:
    """Layer `layer`'s adapter parameters on one TP rank: A (dim x in) and B (out x dim); a column-parallel
    linear splits B, a row-parallel one A, like the weight. In an MoE layer each local expert's
    fc1/fc2 (and the shared expert's) has its own adapter; the router has none."""
    def adapters(names: tuple[str, ...], ffn: int) -> int:
        n = 0
        for name in (x for x in names if x in targets):
            fan_in, fan_out, column = linears(s, ffn)[name]
            n += dim * fan_in + dim * fan_out // tp if column else dim * fan_in // tp + dim * fan_out
        return n

    dense = adapters(ATTENTION, s.ffn)
    moe = s.experts_in(layer)
    if moe is None:
        return Count(dense + adapters(MLP, s.ffn))
    dense += adapters(MLP, moe.shared_ffn) if moe.shared_ffn else 0
    return Count(dense, moe.experts // ep * adapters(MLP, moe.ffn))


def total_params(s: Shape) -> dict[str, int]:
    """Whole-model parameter counts: embedding, output layer, layers (of which experts), final norm, total,
    and active: what one token passes through (top-k of each MoE layer's experts; = total when dense)."""
    emb = s.vocab * s.hidden + s.learned_pos * s.hidden
    out = 0 if s.tied else s.vocab * s.hidden
    per_layer = [layer_params(s, i) for i in range(s.layers)]
    layers = sum(c.total for c in per_layer)
    experts = sum(c.expert for c in per_layer)
    final = s.norm * s.hidden
    total = emb + out + layers + final
    idle = experts - experts // s.moe.experts * s.moe.topk if s.moe else 0
    return {"embedding": emb, "output": out, "layers": layers, "experts": experts, "final_norm": final,
            "total": total, "active": total - idle}


# --------------------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind of static memory."""

    weight: int  # bytes per parameter of the model
    grad: int
    main: int  # fp32 main weight (0 when the model is fp32)
    states: int  # optimizer moments
    dp_shards: int  # the distributed optimizer's divisor of main + states (1: not sharded)
    edp_shards: int  # the same for expert parameters: the expert-data-parallel group

    @classmethod
    def of(cls, cfg: ConfigContainer) -> Precision:
        low = cfg.mixed_precision.bf16 or cfg.mixed_precision.fp16
        weight = 2 if low else FP32
        grad = FP32 if (not low or cfg.ddp.grad_reduce_in_fp32) else 2
        o = cfg.optimizer
        states = 2 * FP32 if o.optimizer == "adam" else (FP32 if o.sgd_momentum else 0)
        lay = Layout.of(cfg)
        sharded = cfg.ddp.use_distributed_optimizer
        return cls(weight=weight, grad=grad, main=FP32 if low else 0, states=states,
                   dp_shards=lay.dp if sharded else 1, edp_shards=lay.edp if sharded else 1)

    def optimizer(self, trainable: Count) -> float:
        """fp32 main weights and moments, each kind sharded over its data-parallel group."""
        per = self.main + self.states
        return trainable.dense * per / self.dp_shards + trainable.expert * per / self.edp_shards

    @property
    def activation(self) -> int:
        """Bytes of an activation element (the compute dtype)."""
        return self.weight


@dataclass(frozen=True)
class Layout:
    """The parallel layout and batch of a derived config."""

    tp: int
    pp: int
    dp: int
    sp: bool
    ep: int  # expert-parallel ranks (experts split over them; within the data-parallel ranks)
    edp: int  # expert-data-parallel ranks: world / (tp * ep * pp), expert TP being TP
    micro_batch: int
    micro_batches: int

    @classmethod
    def of(cls, cfg: ConfigContainer) -> Layout:
        m = cfg.model
        dp, micro_batches = derived(cfg.data_parallel_size, cfg.train.num_microbatches)
        ep = m.expert_model_parallel_size
        return cls(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size, dp=dp,
                   sp=m.sequence_parallel, ep=ep, edp=dp // ep, micro_batch=cfg.train.micro_batch_size,
                   micro_batches=micro_batches)


@dataclass(frozen=True)
class Lora:
    """LoRA adapters (peft.scheme lora): the base is frozen, so its linears and norms keep fewer tensors."""

    targets: frozenset[str]
    dim: int

    @classmethod
    def of(cls, cfg: ConfigContainer) -> Lora | None:
        p = cfg.peft
        return cls(frozenset(p.target_modules), p.dim) if p.scheme == "lora" else None

    def keeps_input(self, linear: str) -> bool:
        """A frozen linear keeps no input; its adapter's A keeps one of the same size."""
        return linear in self.targets


@dataclass(frozen=True)
class Recompute:
    """model.recompute_*: which activations the backward pass recomputes instead of keeping."""

    granularity: str | None = None  # None, "selective" (core attention) or "full" (whole layers)
    method: str | None = None  # full: "uniform" (groups of num_layers) or "block" (the first num_layers)
    num_layers: int = 1

    @classmethod
    def of(cls, cfg: ConfigContainer) -> Recompute:
        m = cfg.model
        return cls(m.recompute_granularity, m.recompute_method, m.recompute_num_layers or 1)


FULL_RECOMPUTE = Recompute("full", "uniform", 1)


@dataclass(frozen=True)
class Activations:
    """Bytes one micro-batch saves for backward on one GPU, before any recompute."""

    layers: tuple[float, ...]  # each transformer layer of the stage (an MoE layer's differ from a dense one's)
    layer_input: float  # one layer's input: all a recomputed group keeps
    softmax_stats: float  # one layer's attention log-sum-exp: what selective recompute drops
    first: float  # first stage: token ids, embedding dropout mask
    last: float  # last stage: final norm, fp32 logits, labels

    def kept(self, rc: Recompute) -> tuple[float, float]:
        """(kept at the end of the forward pass, held while the backward pass recomputes a group: the
        groups' inputs plus the largest group's activations)."""
        count, every = len(self.layers), sum(self.layers)
        if rc.granularity is None:
            return every, 0.0
        if rc.granularity == "selective":
            return every - count * self.softmax_stats, 0.0
        n = min(rc.num_layers, count)
        if rc.method == "block":  # the first n layers checkpointed one by one, the rest kept
            return n * self.layer_input + sum(self.layers[n:]), n * self.layer_input + max(self.layers[:n])
        inputs = math.ceil(count / n) * self.layer_input  # uniform: groups of n layers
        return inputs, inputs + max(sum(self.layers[i:i + n]) for i in range(0, count, n))

    def peak(self, in_flight: int, rc: Recompute) -> float:
        """Micro-batches in flight keep their forward activations; the one in its backward pass may
        hold more while it recomputes (the output layer's are released by then)."""
        kept, recomputing = self.kept(rc)
        forward = kept + self.first + self.last
        return (in_flight - 1) * forward + max(forward, recomputing + self.first)


def activations(s: Shape, lay: Layout, e: int, dropout: bool, lora: Lora | None, index: int) -> Activations:
    """What kubetron's layer spec saves per micro-batch on one TP rank of pipeline stage `index`
    (e: the compute dtype's bytes)."""
    tokens = s.seq * lay.micro_batch
    h_split = lay.tp if lay.sp else 1  # h-sized tensors: split by sequence parallelism only
    mask = DROPOUT_MASK_BYTES if dropout else 0
    frozen = lora is not None

    def kept(linear: str) -> int:
        """A linear keeps its input; a frozen one does not, but its adapter's A keeps one of the size."""
        return 1 if lora is None or lora.keeps_input(linear) else 0

    # RMSNorm also keeps its normalized input, for its weight's gradient (none when frozen).
    norm_extra = 1 if s.rms and not frozen else 0
    # layer input, residual after attention, norm outputs (the QKV input; the fc1 input is the MLP's)
    hidden = (2 + kept("linear_qkv") + 2 * norm_extra) * s.hidden * e
    hidden += 2 * (1 if s.rms else 2) * FP32  # the two norms' statistics (fp32)
    hidden += 2 * s.hidden * mask  # dropout after attention and after the MLP
    attn = (s.q + 2 * s.kv) + s.q  # fused QKV output, attention output
    attn += (s.q + s.kv) if s.rope else 0  # q and k after RoPE
    if s.qk_norm:  # the q norm's input (a copy; k's is a view of the QKV output), normalized q and k
        attn += s.q + (0 if frozen else s.q + s.kv)
    attn += len(lora.targets & set(ATTENTION)) * lora.dim if lora else 0  # the adapters' B inputs
    stats = tokens * s.heads * FP32 / lay.tp
    qk_stats = tokens * (s.heads + s.groups) * FP32 / lay.tp if s.qk_norm else 0  # per-head norm statistics
    rope = 4 * s.seq * s.head_dim * e if s.rope else 0  # cos/sin for q and k, per layer, not per sample
    common = tokens * (hidden / h_split + attn * e / lay.tp) + stats + qk_stats + rope
    dense = common + tokens * mlp_activations(s, s.ffn, lay, e, lora, kept)
    moe = common + moe_activations(s, s.moe, lay, e, lora, kept, tokens) if s.moe else 0.0
    per = s.layers // lay.pp
    layers = tuple(moe if s.experts_in(i) else dense for i in range(index * per, (index + 1) * per))
    first_bytes = tokens * ((0 if frozen else 8) + s.hidden * mask / h_split) if index == 0 else 0.0
    last_bytes = 0.0
    if index == lay.pp - 1:  # final norm input (+ output and normalized input, unless frozen), logits, labels
        norm = 1 if frozen else 2 + (1 if s.rms else 0)
        last_bytes = tokens * (norm * s.hidden * e / h_split + s.vocab // lay.tp * FP32 + 8)
    return Activations(layers=layers, layer_input=tokens * s.hidden * e / h_split, softmax_stats=stats,
                       first=first_bytes, last=last_bytes)


def mlp_activations(s: Shape, ffn: int, lay: Layout, e: int, lora: Lora | None, kept, own_input: bool = True) -> float:
    """Bytes per token a dense MLP of hidden size `ffn` saves on one TP rank: its input (the norm output,
    split by sequence parallelism; a shared expert's is the router's), fc1 output (2 ffn with swiglu)
    and the activation's intermediates, the fc2 input, the adapters' B inputs."""
    h_split = lay.tp if lay.sp else 1
    inner = (4 if s.swiglu else 1) * ffn + kept("linear_fc2") * ffn
    inner += len(lora.targets & set(MLP)) * lora.dim if lora else 0
    return own_input * kept("linear_fc1") * s.hidden * e / h_split + inner * e / lay.tp


def moe_activations(s: Shape, moe: Moe, lay: Layout, e: int, lora: Lora | None, kept, tokens: int) -> float:
    """Bytes an MoE layer's MLP saves per micro-batch on one GPU: megatron-core's top-k router, token
    dispatcher and SequentialMLP experts, without token dropping.

    Per token of this rank: the router's input (the norm output), the routing map (bool) and
    probabilities (fp32) over all E experts, the top-k indices and probabilities; with an auxiliary
    load-balancing loss also its scores over all E experts and top-k indices. Per routed copy (each
    token goes to k experts; with balanced routing an EP rank receives `tokens * k` copies, with
    sequence parallelism its tokens / tp, gathered over TP for the TP-split experts): the copy (the
    experts' fc1 input), its index and probability, and the expert MLP's activations, one ffn more
    than a dense MLP's (the probability scales the activation's output before fc2). A shared expert
    is a dense MLP."""
    h_split = lay.tp if lay.sp else 1
    router = s.hidden * e + moe.experts * (1 + FP32) + moe.topk * (8 + FP32)
    router += moe.experts * FP32 + moe.topk * 8 if moe.aux_loss else 0
    inner = (5 if s.swiglu else 2) * moe.ffn + kept("linear_fc2") * moe.ffn
    inner += len(lora.targets & set(MLP)) * lora.dim if lora else 0
    per_copy = kept("linear_fc1") * s.hidden * e + inner * e / lay.tp + 8 + FP32
    shared = mlp_activations(s, moe.shared_ffn, lay, e, lora, kept, own_input=False) if moe.shared_ffn else 0.0
    return tokens * (router / h_split + shared) + tokens * moe.topk * per_copy


@dataclass
class Stage:
    """One pipeline stage on one GPU (bytes)."""

    index: int
    params: int
    expert_params: int
    trainable: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    activations_no_recompute: float
    activations_full_recompute: float
    in_flight: int

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def stage_params(s: Shape, lay: Layout, lora: Lora | None, index: int) -> tuple[Count, Count]:
    """(all, trainable) parameters of pipeline stage `index` on one TP rank of one EP rank."""
    first, last = index == 0, index == lay.pp - 1
    per = s.layers // lay.pp
    layers = range(index * per, (index + 1) * per)
    n = sum((layer_params(s, i, lay.tp, lay.ep) for i in layers), Count())
    emb_rows = s.vocab // lay.tp * s.hidden
    outer = (emb_rows + s.learned_pos * s.hidden) if first else 0
    if last:
        outer += s.norm * s.hidden
        outer += emb_rows if (not s.tied or lay.pp > 1) else 0  # untied output, or the tied copy on the last stage
    n += Count(outer)
    if lora is None:
        return n, n
    adapters = sum((lora_params(s, lora.targets, lora.dim, i, lay.tp, lay.ep) for i in layers), Count())
    return n + adapters, adapters


def plan_stage(s: Shape, cfg: ConfigContainer, lay: Layout, index: int) -> Stage:
    prec, lora = Precision.of(cfg), Lora.of(cfg)
    params, trainable = stage_params(s, lay, lora, index)
    in_flight = min(lay.pp - index, lay.micro_batches)  # 1F1B: stage i holds pp - i micro-batches
    act = activations(s, lay, prec.activation, cfg.model.hidden_dropout > 0, lora, index)
    return Stage(index=index, params=params.total, expert_params=params.expert, trainable=trainable.total,
                 weights=params.total * prec.weight, gradients=trainable.total * prec.grad,
                 optimizer=prec.optimizer(trainable), activations=act.peak(in_flight, Recompute.of(cfg)),
                 activations_no_recompute=act.peak(in_flight, Recompute()),
                 activations_full_recompute=act.peak(in_flight, FULL_RECOMPUTE), in_flight=in_flight)


@dataclass
class Plan:
    world_size: int
    layout: Layout
    parameters: dict[str, int]
    trainable_parameters: int
    stage: Stage  # the most loaded pipeline stage
    gpu_memory: int

    @property
    def fits(self) -> bool:
        return self.stage.total <= self.gpu_memory

    def to_dict(self) -> dict:
        st = self.stage
        return {"world_size": self.world_size, "layout": asdict(self.layout), "parameters": self.parameters,
                "trainable_parameters": self.trainable_parameters,
                "per_gpu_bytes": {"pipeline_stage": st.index, "parameters_on_gpu": st.params,
                                  "expert_parameters_on_gpu": st.expert_params,
                                  "weights": st.weights, "gradients": st.gradients, "optimizer": st.optimizer,
                                  "activations": st.activations,
                                  "activations_no_recompute": st.activations_no_recompute,
                                  "activations_full_recompute": st.activations_full_recompute,
                                  "micro_batches_in_flight": st.in_flight, "total": st.total},
                "gpu_memory_bytes": self.gpu_memory, "fits": self.fits}


def make_plan(cfg: ConfigContainer, world_size: int, gpu_memory: int = DEFAULT_GPU_MEMORY) -> Plan:
    """Derive `cfg` for `world_size` and estimate the memory of its most loaded GPU."""
    cfg.derive(world_size)
    s, lay = Shape.of(cfg), Layout.of(cfg)
    stages = [plan_stage(s, cfg, lay, i) for i in range(lay.pp)]
    worst = max(stages, key=lambda st: st.total)
    counts = total_params(s)
    lora = Lora.of(cfg)
    trainable = (sum(lora_params(s, lora.targets, lora.dim, i).total for i in range(s.layers)) if lora
                 else counts["total"])
    return Plan(world_size=world_size, layout=lay, parameters=counts, trainable_parameters=trainable,
                stage=worst, gpu_memory=gpu_memory)


UNKNOWN_VOCAB = 131072  # rows assumed where the vocabulary is read from tokenizer files (Llama 3's 128256, up)


def snapshot_bytes(cfg: ConfigContainer, world_size: int) -> float:
    """Bytes of one rank's memory snapshot (docs/recovery.md): its share of a sharded checkpoint, the weights
    of the most loaded pipeline stage and their optimizer state (fp32 main weights, moments) divided over the
    data-parallel ranks that hold the same stage. A vocabulary the config leaves to tokenizer files counts as
    UNKNOWN_VOCAB rows."""
    cfg.derive(world_size)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = UNKNOWN_VOCAB
    s, lay, prec, lora = Shape.of(cfg), Layout.of(cfg), Precision.of(cfg), Lora.of(cfg)
    params, trainable = max((stage_params(s, lay, lora, i) for i in range(lay.pp)), key=lambda c: c[0].total)
    return (params.total * prec.weight + trainable.total * (prec.main + prec.states)) / lay.dp


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _b(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _row(label: str, n: float, note: str = "") -> str:
    return f"  {label:<44}{n / GIB:8.2f}   {note}".rstrip()


def format_plan(plan: Plan, cfg: ConfigContainer, nodes: int, gpus_per_node: int) -> str:
    lay, st, p, m = plan.layout, plan.stage, plan.parameters, cfg.model
    s = Shape.of(cfg)
    prec = Precision.of(cfg)
    dtype = cfg.mixed_precision.params_dtype
    optim = f"{cfg.optimizer.optimizer}, " + ("not sharded" if not cfg.ddp.use_distributed_optimizer else
                                              f"distributed over DP {lay.dp}" + (f", experts' over expert DP {lay.edp}"
                                                                                 if s.moe else ""))
    recompute: str = m.recompute_granularity or "off"
    if m.recompute_granularity == "full":
        recompute += f" {m.recompute_method} {m.recompute_num_layers}"
    stage = f"pipeline stage {st.index} of {lay.pp}, " if lay.pp > 1 else ""
    verdict = "fits" if plan.fits else "does NOT fit"
    lines = [
        f"GPUs          {plan.world_size} = {nodes} node(s) x {gpus_per_node}",
        f"layout        TP {lay.tp}, PP {lay.pp}, DP {lay.dp}" + (f", EP {lay.ep}" if s.moe else "") +
        f", sequence parallel {'on' if lay.sp else 'off'}; "
        f"micro-batch {lay.micro_batch} x {m.seq_length} tokens, {lay.micro_batches} micro-batch(es) per step",
        f"parameters    {_b(p['total'])} (embedding {_b(p['embedding'])}, output layer {_b(p['output'])}, "
        f"{m.num_layers} layers {_b(p['layers'])}); trainable {_b(plan.trainable_parameters)}",
        *([f"experts       {s.moe.experts} per MoE layer in {sum(s.moe.pattern)} of {s.layers} layers, top-{s.moe.topk}"
           f" ({_b(p['experts'])} parameters); active per token {_b(p['active'])}"] if s.moe else []),
        f"precision     {dtype} weights, {'fp32' if prec.grad == FP32 else dtype} gradients, optimizer {optim}",
        "",
        f"per-GPU memory estimate, GiB ({stage}{st.in_flight} micro-batch(es) in flight)",
        _row("weights", st.weights, f"({_b(st.params)} parameters on this GPU" +
             (f", {_b(st.expert_params)} of them experts: {s.moe.experts // lay.ep} per MoE layer)" if s.moe else ")")),
        _row("gradients", st.gradients),
        _row("optimizer state", st.optimizer, "(fp32 main weights + moments)" if prec.main else "(moments)"),
        _row(f"activations (recompute {recompute})", st.activations),
        _row("total", st.total),
        _row("activations without recompute", st.activations_no_recompute),
        _row("activations with full recompute", st.activations_full_recompute),
        "",
        f"{verdict} in {plan.gpu_memory / GIB:.0f} GiB per GPU ({st.total / plan.gpu_memory:.0%}); an estimate: "
        "CUDA context, NCCL buffers, fragmentation and transient tensors are not included.",
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Search: the smallest layout that fits
# --------------------------------------------------------------------------------------------------

# cheapest first: recompute costs a forward pass of what it recomputes
RECOMPUTE_CHOICES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("off", ("model.recompute_granularity=null", "model.recompute_method=null", "model.recompute_num_layers=null")),
    ("selective", ("model.recompute_granularity=selective", "model.recompute_method=null",
                   "model.recompute_num_layers=null")),
    ("full", ("model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1")),
)


@dataclass
class Found:
    """The layout `search` found: its GPUs, the overrides that give it, and its plan."""

    nodes: int
    gpus_per_node: int
    recompute: str
    overrides: tuple[str, ...]
    plan: Plan
    cfg: ConfigContainer


def gpu_counts(max_nodes: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """(nodes, GPUs per node), fewest GPUs first: part of one node (powers of two), then whole nodes."""
    part = [(1, g) for g in (1, 2, 4, 8, 16) if g < gpus_per_node and gpus_per_node % g == 0]
    return part + [(n, gpus_per_node) for n in range(1, max_nodes + 1)]


def _layouts(layers: int, world: int, per_node: int):
    """(TP, PP) with TP a power of two within a node and PP dividing the layers, fewest model-parallel ranks
    first (the rest is data-parallel)."""
    pairs = [(tp, pp) for tp in (1, 2, 4, 8, 16) if tp <= per_node and world % tp == 0
             for pp in range(1, layers + 1) if layers % pp == 0 and world % (tp * pp) == 0]
    return sorted(pairs, key=lambda p: (p[0] * p[1], p[1]))


def search(load, counts: list[tuple[int, int]], gpu_memory: int) -> Found | None:
    """The first layout that fits `gpu_memory`, by `counts` of (nodes, GPUs per node) in order (gpu_counts: fewest
    GPUs first), then no recompute before selective before full, then fewest model-parallel ranks.
    `load(overrides)`: the run config with those overrides (a layout a config check refuses, e.g. a global
    batch DP does not divide, is skipped)."""
    layers = load(()).model.num_layers
    for nodes, per_node in counts:
        world = nodes * per_node
        for name, recompute in RECOMPUTE_CHOICES:
            for tp, pp in _layouts(layers, world, per_node):
                overrides = (f"model.tensor_model_parallel_size={tp}", f"model.pipeline_model_parallel_size={pp}",
                             *recompute)
                try:
                    cfg = load(overrides)
                    plan = make_plan(cfg, world, gpu_memory)
                except ConfigError:
                    continue
                if plan.fits:
                    return Found(nodes, per_node, name, overrides, plan, cfg)
    return None


def format_found(found: Found | None, max_nodes: int, gpus_per_node: int, gpu_memory: int) -> str:
    if found is None:
        return (f"no layout fits {gpu_memory / GIB:.0f} GiB per GPU on up to {max_nodes} node(s) x {gpus_per_node} "
                "GPUs (TP up to a node, any PP, recompute off/selective/full)\n")
    lay, st = found.plan.layout, found.plan.stage
    head = (f"smallest layout that fits {gpu_memory / GIB:.0f} GiB per GPU: {found.plan.world_size} GPU(s) "
            f"({found.nodes} node(s) x {found.gpus_per_node}), TP {lay.tp}, PP {lay.pp}, DP {lay.dp}, recompute "
            f"{found.recompute}: {st.total / GIB:.1f} GiB per GPU\n"
            f"overrides: {' '.join(o for o in found.overrides if not o.endswith('=null'))}\n\n")
    return head + format_plan(found.plan, found.cfg, found.nodes, found.gpus_per_node)
