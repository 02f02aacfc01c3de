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

import re

import torch

from kubetron.contract.errors import ConfigError
from kubetron.hf.config_map import export_architecture, moe_layer_pattern

_RENAMES = {  # HF name -> canonical name ("{i}" = layer number)
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
    "model.layers.{i}.input_layernorm.weight": "decoder.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "decoder.layers.{i}.pre_mlp_layernorm.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "decoder.layers.{i}.self_attention.linear_proj.weight",
}
_QK_NORMS = {  # with model.qk_layernorm
    "model.layers.{i}.self_attn.q_norm.weight": "decoder.layers.{i}.self_attention.q_layernorm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "decoder.layers.{i}.self_attention.k_layernorm.weight",
}
_MOE_BLOCKS = {  # HF MoE block name, expert gate/up/down projections
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


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


def _layer_names(m: dict) -> dict[str, str]:
    """HF -> canonical names of the per-layer tensors that are only renamed."""
    names = {k: v for k, v in _RENAMES.items() if "{i}" in k}
    return {**names, **_QK_NORMS} if m.get("qk_layernorm") else names


def _mlp_names(m: dict, i: int, moe: bool) -> dict[str, tuple[str, ...]]:
    """Canonical name -> the HF names it is made of (two: [gate; up], concatenated) for layer i's MLP."""
    hf, pre = f"model.layers.{i}", f"decoder.layers.{i}.mlp"
    if not moe:
        return {f"{pre}.linear_fc1.weight": (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"),
                f"{pre}.linear_fc2.weight": (f"{hf}.mlp.down_proj.weight",)}
    block, (gate, up, down) = _MOE_BLOCKS[export_architecture(m)]
    out = {f"{pre}.router.weight": (f"{hf}.{block}.gate.weight",)}
    for e in range(m["num_moe_experts"]):
        src, dst = f"{hf}.{block}.experts.{e}", f"{pre}.experts.local_experts.{e}"
        out[f"{dst}.linear_fc1.weight"] = (f"{src}.{gate}.weight", f"{src}.{up}.weight")
        out[f"{dst}.linear_fc2.weight"] = (f"{src}.{down}.weight",)
    return out


def hf_to_canonical(hf: dict[str, torch.Tensor], m: dict) -> dict[str, torch.Tensor]:
    """Canonical tensors for kubetron's model keys `m` from an HF state dict (names as in safetensors)."""
    out, used = {}, set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ConfigError("HF weights", f"tensor {name} is missing from the *.safetensors files")
        used.add(name)
        return hf[name]

    for src, dst in _RENAMES.items():
        if "{i}" in src or (src == "lm_head.weight" and m["share_embeddings_and_output_weights"]):
            continue
        out[dst] = take(src)
    for i, moe in enumerate(moe_layer_pattern(m)):
        for src, dst in _layer_names(m).items():
            out[dst.format(i=i)] = take(src.format(i=i))
        for dst, parts in _mlp_names(m, i, moe).items():
            out[dst] = torch.cat([take(p) for p in parts], dim=0) if len(parts) > 1 else take(parts[0])
        attn, pre = f"model.layers.{i}.self_attn", f"decoder.layers.{i}"
        out[f"{pre}.self_attention.linear_qkv.weight"] = _fuse_qkv(
            take(f"{attn}.q_proj.weight"), take(f"{attn}.k_proj.weight"), take(f"{attn}.v_proj.weight"), m)
        if m.get("add_qkv_bias"):
            out[f"{pre}.self_attention.linear_qkv.bias"] = _fuse_qkv(
                take(f"{attn}.q_proj.bias"), take(f"{attn}.k_proj.bias"), take(f"{attn}.v_proj.bias"), m)
    # A tied HF checkpoint may still store lm_head (a copy of the embedding); rotary caches are buffers.
    extra = sorted(k for k in hf if k not in used and not k.endswith("rotary_emb.inv_freq")
                   and not (k == "lm_head.weight" and m["share_embeddings_and_output_weights"]))
    if extra:
        raise ConfigError("HF weights", f"tensors this architecture does not have: {', '.join(extra[:3])}")
    return out


def canonical_to_hf(canon: dict[str, torch.Tensor], m: dict) -> dict[str, torch.Tensor]:
    """HF state dict (contiguous tensors, ready for safetensors) from canonical tensors."""
    out = {}
    for src, dst in _RENAMES.items():
        if "{i}" in src or (src == "lm_head.weight" and m["share_embeddings_and_output_weights"]):
            continue
        out[src] = canon[dst]
    for i, moe in enumerate(moe_layer_pattern(m)):
        for src, dst in _layer_names(m).items():
            out[src.format(i=i)] = canon[dst.format(i=i)]
        for name, parts in _mlp_names(m, i, moe).items():
            out.update(zip(parts, canon[name].chunk(len(parts), dim=0), strict=True))
        attn, pre = f"model.layers.{i}.self_attn", f"decoder.layers.{i}"
        q, k, v = split_qkv(canon[f"{pre}.self_attention.linear_qkv.weight"], m)
        out.update({f"{attn}.q_proj.weight": q, f"{attn}.k_proj.weight": k, f"{attn}.v_proj.weight": v})
        if m.get("add_qkv_bias"):
            q, k, v = split_qkv(canon[f"{pre}.self_attention.linear_qkv.bias"], m)
            out.update({f"{attn}.q_proj.bias": q, f"{attn}.k_proj.bias": k, f"{attn}.v_proj.bias": v})
    return {k: v.contiguous() for k, v in out.items()}


def hf_layer_count(names) -> int:
    """Layers present in an HF state dict (for a clear error when config and weights disagree)."""
    return 1 + max((int(mt.group(1)) for n in names if (mt := _HF_LAYER.match(n))), default=-1)
