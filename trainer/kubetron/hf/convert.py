"""HF Llama-family tensors <-> kubetron's canonical tensors (megatron-core local-spec names, TP=1/PP=1).

Most tensors are renamed; two are re-laid-out (both exactly invertible, so import -> export is
bit-exact):
- attention: HF's separate q/k/v projections become megatron's fused `linear_qkv`, grouped by
  query group: for each of the `g` groups, its `heads/g` query heads, then its key head, then its
  value head (rows of `head_dim` each). Qwen2's q/k/v biases are fused the same way.
- MLP: HF's `gate_proj` and `up_proj` become `linear_fc1` = [gate; up] (megatron's SwiGLU layout);
  each expert of an MoE block the same (Qwen3-MoE `mlp.experts.E.{gate,up,down}_proj`, Mixtral
  `block_sparse_moe.experts.E.{w1,w3,w2}`) as `mlp.experts.local_experts.E.linear_fc1/fc2`, and the
  router (`gate`) is `mlp.router`.
A tied model has no `lm_head.weight` (HF) and no `output_layer.weight` (kubetron). Qwen3's per-head
`q_norm`/`k_norm` are megatron's `q_layernorm`/`k_layernorm` (`model.qk_layernorm`), renamed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubetron.contract.errors import ConfigError
from kubetron.hf.config_map import export_architecture, moe_layer_pattern

_MOE_BLOCKS = {  # HF MoE block name, expert gate/up/down projections
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
}


@dataclass(frozen=True)
class Unit:
    """One canonical tensor and the HF tensors it is made of, by `kind`: "same" (renamed), "cat" ([gate; up]
    along dim 0, SwiGLU's fc1) or "qkv" (q, k, v fused per query group)."""

    canonical: str
    hf: tuple[str, ...]
    kind: str = "same"


def _shape(m: dict) -> tuple[int, int, int]:
    heads = m["num_attention_heads"]
    groups = m.get("num_query_groups") or heads
    return heads, groups, m.get("kv_channels") or m["hidden_size"] // heads


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: dict) -> torch.Tensor:
    heads, groups, d = _shape(m)
    rest = q.shape[1:]  # (hidden,) for weights, () for biases
    q = q.reshape(groups, heads // groups * d, *rest)
    k, v = k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, m: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, groups, d = _shape(m)
    rest = qkv.shape[1:]
    per = heads // groups * d
    grouped = qkv.reshape(groups, per + 2 * d, *rest)
    q, k, v = grouped.split([per, d, d], dim=1)
    return (q.reshape(heads * d, *rest).contiguous(), k.reshape(groups * d, *rest).contiguous(),
            v.reshape(groups * d, *rest).contiguous())


def _attention_units(m: dict, i: int) -> list[Unit]:
    hf, pre = f"model.layers.{i}.self_attn", f"decoder.layers.{i}.self_attention"
    out = [Unit(f"{pre}.linear_qkv.weight", tuple(f"{hf}.{p}_proj.weight" for p in "qkv"), "qkv")]
    if m.get("add_qkv_bias"):
        out.append(Unit(f"{pre}.linear_qkv.bias", tuple(f"{hf}.{p}_proj.bias" for p in "qkv"), "qkv"))
    if m.get("qk_layernorm"):
        out += [Unit(f"{pre}.{p}_layernorm.weight", (f"{hf}.{p}_norm.weight",)) for p in "qk"]
    return [*out, Unit(f"{pre}.linear_proj.weight", (f"{hf}.o_proj.weight",))]


def _mlp_units(m: dict, i: int, moe: int) -> list[Unit]:  # moe: 1 for an MoE layer (moe_layer_pattern)
    """Layer i's MLP: a dense SwiGLU, or an MoE block's router and experts."""
    hf, pre = f"model.layers.{i}", f"decoder.layers.{i}.mlp"
    if not moe:
        return [Unit(f"{pre}.linear_fc1.weight", (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"), "cat"),
                Unit(f"{pre}.linear_fc2.weight", (f"{hf}.mlp.down_proj.weight",))]
    block, (gate, up, down) = _MOE_BLOCKS[export_architecture(m)]
    out = [Unit(f"{pre}.router.weight", (f"{hf}.{block}.gate.weight",))]
    for e in range(m["num_moe_experts"]):
        src, dst = f"{hf}.{block}.experts.{e}", f"{pre}.experts.local_experts.{e}"
        out += [Unit(f"{dst}.linear_fc1.weight", (f"{src}.{gate}.weight", f"{src}.{up}.weight"), "cat"),
                Unit(f"{dst}.linear_fc2.weight", (f"{src}.{down}.weight",))]
    return out


def units(m: dict) -> list[Unit]:
    """Every canonical tensor of kubetron's model keys `m` with its HF tensors, in HF's order (embeddings,
    layers, final norm, output layer; a tied model has no `lm_head.weight` and no `output_layer.weight`)."""
    out = [Unit("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i, moe in enumerate(moe_layer_pattern(m)):
        hf, pre = f"model.layers.{i}", f"decoder.layers.{i}"
        out += [Unit(f"{pre}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",)), *_attention_units(m, i),
                Unit(f"{pre}.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",)),
                *_mlp_units(m, i, moe)]
    out.append(Unit("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if not m["share_embeddings_and_output_weights"]:
        out.append(Unit("output_layer.weight", ("lm_head.weight",)))
    return out


def canonical_shape(name: str, m: dict) -> tuple[int, ...]:
    """The shape `m` gives canonical tensor `name` (the HF config's vocabulary, unpadded)."""
    heads, groups, d = _shape(m)
    h, qkv = m["hidden_size"], (heads + 2 * groups) * d
    ffn = (m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"]) if ".experts." in name else m["ffn_hidden_size"]
    shapes = {"word_embeddings.weight": (m["vocab_size"], h), "output_layer.weight": (m["vocab_size"], h),
              "q_layernorm.weight": (d,), "k_layernorm.weight": (d,), "linear_qkv.weight": (qkv, h),
              "linear_qkv.bias": (qkv,), "linear_proj.weight": (h, heads * d),
              "router.weight": (m.get("num_moe_experts") or 0, h), "linear_fc1.weight": (2 * ffn, h),
              "linear_fc2.weight": (h, ffn)}
    return shapes.get(".".join(name.split(".")[-2:]), (h,))  # else a norm over the hidden size


def part_shapes(u: Unit, shape: tuple[int, ...], m: dict) -> list[tuple[int, ...]]:
    """The shapes of u's HF tensors for a canonical tensor of `shape`."""
    if u.kind == "same":
        return [tuple(shape)]
    if u.kind == "cat":
        return [(shape[0] // len(u.hf), *shape[1:])] * len(u.hf)
    heads, groups, d = _shape(m)
    return [(heads * d, *shape[1:]), (groups * d, *shape[1:]), (groups * d, *shape[1:])]


def hf_shapes(m: dict) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of the model whose keys are `m`: what a safetensors file of it must hold."""
    return {name: s for u in units(m) for name, s in zip(u.hf, part_shapes(u, canonical_shape(u.canonical, m), m),
                                                           strict=True)}


def to_canonical(u: Unit, parts: list[torch.Tensor], m: dict) -> torch.Tensor:
    if u.kind == "same":
        return parts[0]
    if u.kind == "cat":
        return torch.cat(parts, dim=0)
    q, k, v = parts
    return _fuse_qkv(q, k, v, m)


def to_hf(u: Unit, t: torch.Tensor, m: dict) -> list[torch.Tensor]:
    """u's HF tensors (contiguous, ready for safetensors) from its canonical tensor."""
    parts = [t] if u.kind == "same" else t.chunk(len(u.hf), dim=0) if u.kind == "cat" else split_qkv(t, m)
    return [p.contiguous() for p in parts]


def is_tolerated_extra(name: str, m: dict) -> bool:
    """An HF tensor that is not a weight of the model but may be in the files: rotary caches (buffers), and a
    tied model's stored copy of the embedding as `lm_head.weight`."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight"
                                                    and m["share_embeddings_and_output_weights"])


def hf_to_canonical(hf: dict[str, torch.Tensor], m: dict) -> dict[str, torch.Tensor]:
    """Canonical tensors for kubetron's model keys `m` from an HF state dict (names as in safetensors)."""
    out = {}
    for u in units(m):
        missing = [p for p in u.hf if p not in hf]
        if missing:
            raise ConfigError("HF weights", f"tensor {missing[0]} is missing from the *.safetensors files")
        out[u.canonical] = to_canonical(u, [hf[p] for p in u.hf], m)
    used = {p for u in units(m) for p in u.hf}
    extra = sorted(k for k in hf if k not in used and not is_tolerated_extra(k, m))
    if extra:
        raise ConfigError("HF weights", f"tensors this architecture does not have: {', '.join(extra[:3])}")
    return out


def canonical_to_hf(canon: dict[str, torch.Tensor], m: dict) -> dict[str, torch.Tensor]:
    """HF state dict (contiguous tensors, ready for safetensors) from canonical tensors."""
    return {name: t for u in units(m) for name, t in zip(u.hf, to_hf(u, canon[u.canonical], m), strict=True)}
