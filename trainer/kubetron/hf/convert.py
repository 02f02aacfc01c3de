"""HF Llama-family tensors <-> kubetron's canonical tensors (megatron-core local-spec names, TP=1/PP=1).

Most tensors are renamed; two are re-laid-out (both exactly invertible, so import -> export is
bit-exact):
- attention: HF's separate q/k/v projections become megatron's fused `linear_qkv`, grouped by
  query group: for each of the `g` groups, its `heads/g` query heads, then its key head, then its
  value head (rows of `head_dim` each). Qwen2's q/k/v biases are fused the same way.
- MLP: HF's `gate_proj` and `up_proj` become `linear_fc1` = [gate; up] (megatron's SwiGLU layout).
A tied model has no `lm_head.weight` (HF) and no `output_layer.weight` (kubetron). Qwen3's per-head
`q_norm`/`k_norm` are megatron's `q_layernorm`/`k_layernorm` (`model.qk_layernorm`), renamed.
"""

from __future__ import annotations

import re

import torch

from kubetron.errors import ConfigError

_RENAMES = {  # HF name -> canonical name ("{i}" = layer number)
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
    "model.layers.{i}.input_layernorm.weight": "decoder.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "decoder.layers.{i}.pre_mlp_layernorm.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "decoder.layers.{i}.self_attention.linear_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight": "decoder.layers.{i}.mlp.linear_fc2.weight",
}
_QK_NORMS = {  # with model.qk_layernorm
    "model.layers.{i}.self_attn.q_norm.weight": "decoder.layers.{i}.self_attention.q_layernorm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "decoder.layers.{i}.self_attention.k_layernorm.weight",
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


def _split_qkv(qkv: torch.Tensor, m: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    for i in range(m["num_layers"]):
        for src, dst in _layer_names(m).items():
            out[dst.format(i=i)] = take(src.format(i=i))
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        pre = f"decoder.layers.{i}"
        out[f"{pre}.self_attention.linear_qkv.weight"] = _fuse_qkv(
            take(f"{attn}.q_proj.weight"), take(f"{attn}.k_proj.weight"), take(f"{attn}.v_proj.weight"), m)
        if m.get("add_qkv_bias"):
            out[f"{pre}.self_attention.linear_qkv.bias"] = _fuse_qkv(
                take(f"{attn}.q_proj.bias"), take(f"{attn}.k_proj.bias"), take(f"{attn}.v_proj.bias"), m)
        out[f"{pre}.mlp.linear_fc1.weight"] = torch.cat([take(f"{mlp}.gate_proj.weight"),
                                                         take(f"{mlp}.up_proj.weight")], dim=0)
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
    for i in range(m["num_layers"]):
        for src, dst in _layer_names(m).items():
            out[src.format(i=i)] = canon[dst.format(i=i)]
        attn, mlp, pre = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"decoder.layers.{i}"
        q, k, v = _split_qkv(canon[f"{pre}.self_attention.linear_qkv.weight"], m)
        out.update({f"{attn}.q_proj.weight": q, f"{attn}.k_proj.weight": k, f"{attn}.v_proj.weight": v})
        if m.get("add_qkv_bias"):
            q, k, v = _split_qkv(canon[f"{pre}.self_attention.linear_qkv.bias"], m)
            out.update({f"{attn}.q_proj.bias": q, f"{attn}.k_proj.bias": k, f"{attn}.v_proj.bias": v})
        gate, up = canon[f"{pre}.mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[f"{mlp}.gate_proj.weight"], out[f"{mlp}.up_proj.weight"] = gate, up
    return {k: v.contiguous() for k, v in out.items()}


def hf_layer_count(names) -> int:
    """Layers present in an HF state dict (for a clear error when config and weights disagree)."""
    return 1 + max((int(mt.group(1)) for n in names if (mt := _HF_LAYER.match(n))), default=-1)
