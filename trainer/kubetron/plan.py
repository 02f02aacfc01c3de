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

It is an estimate: the CUDA context, NCCL buffers, allocator fragmentation and transient tensors
(matmul workspaces, the gradients flowing through the backward pass, optimizer temporaries) are not in
it; keep some GiB of headroom. Torch-free: it reads the config models only.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from kubetron.config import ConfigContainer
from kubetron.errors import ConfigError

GIB = 1024**3
DEFAULT_GPU_MEMORY = 80 * GIB
_UNITS = {"": GIB, "gib": GIB, "gb": 10**9, "mib": 1024**2, "mb": 10**6, "tib": 1024**4, "tb": 10**12}
FP32 = 4  # bytes
DROPOUT_MASK_BYTES = 1  # CUDA's dropout keeps a bool mask (torch on CPU keeps it in the compute dtype)


def parse_memory(text: str) -> int:
    """'80GiB', '141GB', '80' (GiB) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError("--gpu-memory", f"expected a size like 80GiB or 141GB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def derived(*values: int | None) -> tuple[int, ...]:
    """Values `ConfigContainer.derive()` sets (None before it): plan reads derived configs."""
    if None in values:
        raise ValueError("plan needs a derived config: call cfg.derive() or cfg.finalize() first")
    return tuple(v for v in values if v is not None)


# --------------------------------------------------------------------------------------------------
# Shapes and parameters
# --------------------------------------------------------------------------------------------------


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
                   tied=m.share_embeddings_and_output_weights)


def linears(s: Shape) -> dict[str, tuple[int, int, bool]]:
    """{name: (in, out, column-parallel)} of one layer's linears (the LoRA target names)."""
    fc1_out = s.ffn * (2 if s.swiglu else 1)
    return {"linear_qkv": (s.hidden, s.q + 2 * s.kv, True), "linear_proj": (s.q, s.hidden, False),
            "linear_fc1": (s.hidden, fc1_out, True), "linear_fc2": (s.ffn, s.hidden, False)}


def layer_params(s: Shape, tp: int = 1) -> int:
    """One transformer layer's parameters on one TP rank (norms and row-parallel biases replicated)."""
    n = 0
    for name, (fan_in, fan_out, column) in linears(s).items():
        n += fan_in * fan_out // tp
        bias = s.qkv_bias if name == "linear_qkv" else s.linear_bias
        n += (fan_out // tp if column else fan_out) if bias else 0
    n += 2 * s.norm * s.hidden
    n += 2 * s.norm * s.head_dim if s.qk_norm else 0
    return n


def lora_params(s: Shape, targets: list[str], dim: int, tp: int = 1) -> int:
    """One layer's adapter parameters on one TP rank: A (dim x in) and B (out x dim); a column-parallel
    linear splits B, a row-parallel one A, like the weight."""
    n = 0
    for name in targets:
        fan_in, fan_out, column = linears(s)[name]
        n += dim * fan_in + dim * fan_out // tp if column else dim * fan_in // tp + dim * fan_out
    return n


def total_params(s: Shape) -> dict[str, int]:
    """Whole-model parameter counts: embedding, output layer, layers, final norm, total."""
    emb = s.vocab * s.hidden + s.learned_pos * s.hidden
    out = 0 if s.tied else s.vocab * s.hidden
    layers = s.layers * layer_params(s)
    final = s.norm * s.hidden
    return {"embedding": emb, "output": out, "layers": layers, "final_norm": final,
            "total": emb + out + layers + final}


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

    @classmethod
    def of(cls, cfg: ConfigContainer) -> Precision:
        low = cfg.mixed_precision.bf16 or cfg.mixed_precision.fp16
        weight = 2 if low else FP32
        grad = FP32 if (not low or cfg.ddp.grad_reduce_in_fp32) else 2
        o = cfg.optimizer
        states = 2 * FP32 if o.optimizer == "adam" else (FP32 if o.sgd_momentum else 0)
        (dp,) = derived(cfg.data_parallel_size)
        shards = dp if cfg.ddp.use_distributed_optimizer else 1
        return cls(weight=weight, grad=grad, main=FP32 if low else 0, states=states, dp_shards=shards)

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
    micro_batch: int
    micro_batches: int

    @classmethod
    def of(cls, cfg: ConfigContainer) -> Layout:
        m = cfg.model
        dp, micro_batches = derived(cfg.data_parallel_size, cfg.train.num_microbatches)
        return cls(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size, dp=dp,
                   sp=m.sequence_parallel, micro_batch=cfg.train.micro_batch_size,
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

    layer: float  # one transformer layer
    layer_input: float  # one layer's input: all a recomputed group keeps
    softmax_stats: float  # one layer's attention log-sum-exp: what selective recompute drops
    first: float  # first stage: token ids, embedding dropout mask
    last: float  # last stage: final norm, fp32 logits, labels

    def kept(self, layers: int, rc: Recompute) -> tuple[float, float]:
        """`layers` layers: (kept at the end of the forward pass, held while the backward pass
        recomputes a group: the groups' inputs plus one group's activations)."""
        if rc.granularity is None:
            return layers * self.layer, 0.0
        if rc.granularity == "selective":
            return layers * (self.layer - self.softmax_stats), 0.0
        n = min(rc.num_layers, layers)
        if rc.method == "block":  # the first n layers checkpointed one by one, the rest kept
            return n * self.layer_input + (layers - n) * self.layer, n * self.layer_input + self.layer
        inputs = math.ceil(layers / n) * self.layer_input  # uniform: groups of n layers
        return inputs, inputs + n * self.layer

    def peak(self, layers: int, in_flight: int, rc: Recompute) -> float:
        """Micro-batches in flight keep their forward activations; the one in its backward pass may
        hold more while it recomputes (the output layer's are released by then)."""
        kept, recomputing = self.kept(layers, rc)
        forward = kept + self.first + self.last
        return (in_flight - 1) * forward + max(forward, recomputing + self.first)


def activations(s: Shape, lay: Layout, e: int, dropout: bool, lora: Lora | None, first: bool,
                last: bool) -> Activations:
    """What kubetron's layer spec saves per micro-batch on one TP rank (e: the compute dtype's bytes)."""
    tokens = s.seq * lay.micro_batch
    h_split = lay.tp if lay.sp else 1  # h-sized tensors: split by sequence parallelism only
    mask = DROPOUT_MASK_BYTES if dropout else 0
    frozen = lora is not None

    def kept(linear: str) -> int:
        """A linear keeps its input; a frozen one does not, but its adapter's A keeps one of the size."""
        return 1 if lora is None or lora.keeps_input(linear) else 0

    # RMSNorm also keeps its normalized input, for its weight's gradient (none when frozen).
    norm_extra = 1 if s.rms and not frozen else 0
    # layer input, residual after attention, norm outputs (the QKV and fc1 inputs)
    hidden = (2 + kept("linear_qkv") + kept("linear_fc1") + 2 * norm_extra) * s.hidden * e
    hidden += 2 * (1 if s.rms else 2) * FP32  # the two norms' statistics (fp32)
    hidden += 2 * s.hidden * mask  # dropout after attention and after the MLP
    attn = (s.q + 2 * s.kv) + s.q  # fused QKV output, attention output
    attn += (s.q + s.kv) if s.rope else 0  # q and k after RoPE
    if s.qk_norm:  # the q norm's input (a copy; k's is a view of the QKV output), normalized q and k
        attn += s.q + (0 if frozen else s.q + s.kv)
    # fc1 output (2 ffn with swiglu) and the activation's intermediates, the fc2 input
    mlp = (4 if s.swiglu else 1) * s.ffn + kept("linear_fc2") * s.ffn
    mlp += len(lora.targets) * lora.dim if lora else 0  # the adapters' B inputs
    stats = tokens * s.heads * FP32 / lay.tp
    qk_stats = tokens * (s.heads + s.groups) * FP32 / lay.tp if s.qk_norm else 0  # per-head norm statistics
    rope = 4 * s.seq * s.head_dim * e if s.rope else 0  # cos/sin for q and k, per layer, not per sample
    layer = tokens * (hidden / h_split + (attn + mlp) * e / lay.tp) + stats + qk_stats + rope
    first_bytes = tokens * ((0 if frozen else 8) + s.hidden * mask / h_split) if first else 0.0
    last_bytes = 0.0
    if last:  # final norm input (+ output and normalized input, unless frozen), logits, labels
        norm = 1 if frozen else 2 + (1 if s.rms else 0)
        last_bytes = tokens * (norm * s.hidden * e / h_split + s.vocab // lay.tp * FP32 + 8)
    return Activations(layer=layer, layer_input=tokens * s.hidden * e / h_split, softmax_stats=stats,
                       first=first_bytes, last=last_bytes)


@dataclass
class Stage:
    """One pipeline stage on one GPU (bytes)."""

    index: int
    params: int
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


def stage_params(s: Shape, lay: Layout, lora: Lora | None, index: int) -> tuple[int, int]:
    """(all, trainable) parameters of pipeline stage `index` on one TP rank."""
    first, last = index == 0, index == lay.pp - 1
    layers = s.layers // lay.pp
    n = layers * layer_params(s, lay.tp)
    emb_rows = s.vocab // lay.tp * s.hidden
    n += (emb_rows + s.learned_pos * s.hidden) if first else 0
    if last:
        n += s.norm * s.hidden
        n += emb_rows if (not s.tied or lay.pp > 1) else 0  # untied output, or the tied copy on the last stage
    if lora is None:
        return n, n
    adapters = layers * lora_params(s, sorted(lora.targets), lora.dim, lay.tp)
    return n + adapters, adapters


def plan_stage(s: Shape, cfg: ConfigContainer, lay: Layout, index: int) -> Stage:
    prec, lora = Precision.of(cfg), Lora.of(cfg)
    params, trainable = stage_params(s, lay, lora, index)
    in_flight = min(lay.pp - index, lay.micro_batches)  # 1F1B: stage i holds pp - i micro-batches
    layers = s.layers // lay.pp
    act = activations(s, lay, prec.activation, cfg.model.hidden_dropout > 0, lora, index == 0, index == lay.pp - 1)
    return Stage(index=index, params=params, trainable=trainable, weights=params * prec.weight,
                 gradients=trainable * prec.grad, optimizer=trainable * (prec.main + prec.states) / prec.dp_shards,
                 activations=act.peak(layers, in_flight, Recompute.of(cfg)),
                 activations_no_recompute=act.peak(layers, in_flight, Recompute()),
                 activations_full_recompute=act.peak(layers, in_flight, FULL_RECOMPUTE), in_flight=in_flight)


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
    trainable = s.layers * lora_params(s, sorted(lora.targets), lora.dim) if lora else counts["total"]
    return Plan(world_size=world_size, layout=lay, parameters=counts, trainable_parameters=trainable,
                stage=worst, gpu_memory=gpu_memory)


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _b(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _row(label: str, n: float, note: str = "") -> str:
    return f"  {label:<44}{n / GIB:8.2f}   {note}".rstrip()


def format_plan(plan: Plan, cfg: ConfigContainer, nodes: int, gpus_per_node: int) -> str:
    lay, st, p, m = plan.layout, plan.stage, plan.parameters, cfg.model
    prec = Precision.of(cfg)
    dtype = cfg.mixed_precision.params_dtype
    optim = (f"{cfg.optimizer.optimizer}, " + ("distributed over DP " + str(lay.dp) if prec.dp_shards > 1
                                                 else "not sharded"))
    recompute: str = m.recompute_granularity or "off"
    if m.recompute_granularity == "full":
        recompute += f" {m.recompute_method} {m.recompute_num_layers}"
    stage = f"pipeline stage {st.index} of {lay.pp}, " if lay.pp > 1 else ""
    verdict = "fits" if plan.fits else "does NOT fit"
    lines = [
        f"GPUs          {plan.world_size} = {nodes} node(s) x {gpus_per_node}",
        f"layout        TP {lay.tp}, PP {lay.pp}, DP {lay.dp}, sequence parallel {'on' if lay.sp else 'off'}; "
        f"micro-batch {lay.micro_batch} x {m.seq_length} tokens, {lay.micro_batches} micro-batch(es) per step",
        f"parameters    {_b(p['total'])} (embedding {_b(p['embedding'])}, output layer {_b(p['output'])}, "
        f"{m.num_layers} layers {_b(p['layers'])}); trainable {_b(plan.trainable_parameters)}",
        f"precision     {dtype} weights, {'fp32' if prec.grad == FP32 else dtype} gradients, optimizer {optim}",
        "",
        f"per-GPU memory estimate, GiB ({stage}{st.in_flight} micro-batch(es) in flight)",
        _row("weights", st.weights, f"({_b(st.params)} parameters on this GPU)"),
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
