"""An HF ``config.json`` of the Llama family <-> kubetron's ``model:`` section (plain dicts, no torch).

What the family shares and kubetron's model expresses: RMSNorm, SwiGLU MLP without biases, RoPE
(rotate-half layout, optionally Llama-3 scaling), grouped-query attention, tied or untied output
layer, any head size (`head_dim` -> `model.kv_channels`), Qwen2's bias on the query/key/value
projection only, Qwen3's per-head query/key RMSNorm (`model.qk_layernorm`), and Mistral's sliding
window (`model.sliding_window`; exported as MistralForCausalLM). Mixture of experts: Qwen3-MoE
(Qwen3's attention; an MoE block on the layers decoder_sparse_step and mlp_only_layers pick, dense
MLPs elsewhere) and Mixtral (Mistral's attention, an MoE block on every layer) -> the `model.moe_*`
keys (see `_moe_section`). Anything else (another rope type, Qwen2/Qwen3's per-layer sliding window,
MLP or attention-output biases, another activation, another architecture, router jitter) is an error
naming the config.json field: converting it silently would give a different model.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kubetron.contract.errors import ConfigError

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                           "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # per-head q/k RMSNorm
_WINDOW_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM")
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def is_hf_dir(path: str | None) -> bool:
    """A local directory holding an HF model: config.json and weights (*.safetensors, or *.bin, which
    reading refuses in one line)."""
    if not path or str(path).startswith("s3://") or not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return "config.json" in names and any(n.endswith((".safetensors", ".bin")) for n in names)


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConfigError("HF_DIR", f"{hf_dir}: no such directory")
    if not os.path.isfile(path):
        raise ConfigError("HF_DIR", f"{hf_dir}: no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}", f"cannot read it as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(path, "expected a JSON object")
    return data


def architecture(hf: dict) -> str:
    """The supported architecture name, or a ConfigError naming what the config declares."""
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError("config.json: architectures", f"{arch!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)})")
        return arch
    mt = hf.get("model_type")
    if mt not in _MODEL_TYPE_TO_ARCH:
        raise ConfigError("config.json: model_type", f"{mt!r} is not supported (supported: "
                          f"{', '.join(_MODEL_TYPE_TO_ARCH)})")
    return _MODEL_TYPE_TO_ARCH[mt]


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, llama3 parameters or None) from the new `rope_parameters` or the legacy keys."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = params if params.get("rope_type", "default") != "default" else None
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling")
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ConfigError("config.json: rope_scaling", f"rope_type {kind!r} is not supported (supported: llama3)")
    return float(theta), {k: scaling[k] for k in _LLAMA3_KEYS if k in scaling}


def _sliding_window(hf: dict, arch: str) -> int | None:
    """Mistral's and Mixtral's window (every layer; HF: key j is seen from query i when i - j < window).
    Qwen2's and Qwen3's are on some layers only (use_sliding_window, max_window_layers; layer_types), and
    Qwen3-MoE's on all or some layers depending on the transformers version: refused."""
    if arch not in _WINDOW_EVERY_LAYER:
        name = arch.removesuffix("ForCausalLM")
        if hf.get("use_sliding_window"):
            raise ConfigError("config.json: use_sliding_window", f"{name}'s sliding window (on the layers from "
                              "max_window_layers on, or on all in some transformers versions) is not supported")
        if "sliding_attention" in (hf.get("layer_types") or []):
            raise ConfigError("config.json: layer_types", f"{name}'s sliding_attention layers are not supported")
    if arch in _WINDOW_EVERY_LAYER and hf.get("sliding_window"):
        return int(hf["sliding_window"])
    return None


def _require(hf: dict, key: str):
    if key not in hf:
        raise ConfigError(f"config.json: {key}", "required")
    return hf[key]


def model_section(hf: dict) -> dict:
    """kubetron's `model:` keys for this HF config (raises ConfigError for what it cannot express)."""
    arch = architecture(hf)
    hidden, heads = int(_require(hf, "hidden_size")), int(_require(hf, "num_attention_heads"))
    head_dim = int(hf.get("head_dim") or hidden // heads)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError("config.json: hidden_act", f"{act!r} is not supported (supported: silu)")
    if hf.get("mlp_bias"):
        raise ConfigError("config.json: mlp_bias", "MLP biases are not supported")
    if hf.get("attention_bias") and arch != "Qwen2ForCausalLM":  # Llama's and Qwen3's bias o_proj too
        raise ConfigError("config.json: attention_bias", "biases on the attention projections (o_proj's included) "
                          "are not supported")
    window = _sliding_window(hf, arch)
    theta, scaling = _rope(hf)
    if theta != int(theta):
        raise ConfigError("config.json: rope_theta", f"{theta} is not a whole number (model.rotary_base is)")
    max_pos = int(_require(hf, "max_position_embeddings"))
    m: dict[str, Any] = {
        "num_layers": int(_require(hf, "num_hidden_layers")),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": int(hf.get("num_key_value_heads") or heads),
        "kv_channels": head_dim if head_dim * heads != hidden else None,
        "qk_layernorm": arch in _QK_NORM,
        "ffn_hidden_size": int(_require(hf, "intermediate_size")),
        "vocab_size": int(_require(hf, "vocab_size")),
        "max_position_embeddings": max_pos,
        "seq_length": min(max_pos, 4096),
        "position_embedding_type": "rope",
        "rotary_base": int(theta),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "activation": "swiglu",
        "add_bias_linear": False,
        "add_qkv_bias": arch == "Qwen2ForCausalLM",
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
        "sliding_window": window,
        "hidden_dropout": 0.0,
        "attention_dropout": float(hf.get("attention_dropout", 0.0)),
        "init_method_std": float(hf.get("initializer_range", 0.02)),
    }
    if scaling is not None:
        m["rope_scaling"] = True
        for k in _LLAMA3_KEYS:
            if k in scaling:
                m[f"rope_scaling_{k}"] = int(scaling[k]) if k == "original_max_position_embeddings" \
                    else float(scaling[k])
    return {**m, **_moe_section(hf, arch, m["num_layers"])}


def _moe_layers(hf: dict, arch: str, layers: int) -> list[int]:
    """1 where the layer has an MoE block (transformers' rule), 0 where a dense MLP."""
    if arch == "MixtralForCausalLM":
        return [1] * layers
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ConfigError("config.json: decoder_sparse_step", f"{step!r} is not a whole number >= 1")
    dense = set(hf.get("mlp_only_layers") or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def _moe_section(hf: dict, arch: str, layers: int) -> dict:
    """The `model.moe_*` keys of Qwen3-MoE and Mixtral ({} for a dense architecture). The router: softmax over
    the experts' logits, top k; Mixtral always and Qwen3-MoE with norm_topk_prob renormalise the k chosen
    (megatron's moe_router_pre_softmax false: softmax over the top-k logits, the same numbers), Qwen3-MoE
    without it keeps them as they are (moe_router_pre_softmax true)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not isinstance(experts, int) or experts < 1:
        raise ConfigError("config.json: num_experts", f"{experts!r}: an MoE model needs at least one expert")
    if hf.get("router_jitter_noise"):
        raise ConfigError("config.json: router_jitter_noise", "router jitter is not supported")
    pattern = _moe_layers(hf, arch, layers)
    if not any(pattern):
        raise ConfigError("config.json: mlp_only_layers", "no layer has an MoE block")
    expert_size = "intermediate_size" if arch == "MixtralForCausalLM" else "moe_intermediate_size"
    topk, pre_softmax = int(_require(hf, "num_experts_per_tok")), arch == "Qwen3MoeForCausalLM" and not hf.get(
        "norm_topk_prob", False)
    if topk == 1 and not pre_softmax:
        raise ConfigError("config.json: num_experts_per_tok", "1 with the chosen probability renormalised (Mixtral, "
                          "Qwen3-MoE's norm_topk_prob) is not supported: the weight is always 1, the router untrained")
    return {
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": int(_require(hf, expert_size)),
        "moe_layer_freq": 1 if all(pattern) else pattern,
        "moe_router_pre_softmax": pre_softmax,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.001)),
    }


def export_architecture(model: dict) -> str:
    """The one HF architecture that has this model's attention and MLP: Qwen3 (q/k norms), Qwen2 (q/k/v
    biases), Mistral (a sliding window) or Llama; with experts Qwen3-MoE (q/k norms) or Mixtral. A
    combination none of them has is refused."""
    features = {"Qwen3ForCausalLM": ("model.qk_layernorm", model.get("qk_layernorm")),
                "Qwen2ForCausalLM": ("model.add_qkv_bias", model.get("add_qkv_bias")),
                "MistralForCausalLM": ("model.sliding_window", model.get("sliding_window"))}
    on = [(arch, key) for arch, (key, value) in features.items() if value]
    if len(on) > 1:
        raise ConfigError(on[1][1], f"export-hf has no architecture with both {on[0][1]} and {on[1][1]}")
    dense = on[0][0] if on else "LlamaForCausalLM"
    if not model.get("num_moe_experts"):
        return dense
    if dense == "Qwen2ForCausalLM":
        raise ConfigError("model.add_qkv_bias", "export-hf has no MoE architecture with q/k/v biases (Qwen3-MoE "
                          "and Mixtral have none)")
    return "Qwen3MoeForCausalLM" if dense == "Qwen3ForCausalLM" else "MixtralForCausalLM"


def moe_layer_pattern(model: dict) -> list[int]:
    """1 where megatron-core builds an MoE block, 0 a dense MLP (model.moe_layer_freq: every k-th layer from
    layer 0, or a 0/1 list; all 0 without model.num_moe_experts)."""
    freq = model.get("moe_layer_freq", 1)
    if not model.get("num_moe_experts"):
        return [0] * model["num_layers"]
    return [int(i % freq == 0) for i in range(model["num_layers"])] if isinstance(freq, int) else list(freq)


def _moe_config(model: dict, arch: str) -> dict:
    """The MoE fields of an exported config.json (what `_moe_section` reads back)."""
    if model.get("moe_shared_expert_intermediate_size"):
        raise ConfigError("model.moe_shared_expert_intermediate_size", f"export-hf: {arch} has no shared experts")
    balancing = model.get("moe_router_load_balancing_type", "aux_loss")
    pattern, experts = moe_layer_pattern(model), model["num_moe_experts"]
    expert_size = model.get("moe_ffn_hidden_size") or model.get("ffn_hidden_size") or 4 * model["hidden_size"]
    out = {"num_experts_per_tok": model["moe_router_topk"], "output_router_logits": False,
           "router_aux_loss_coef": float(model.get("moe_aux_loss_coeff") or 0.0) if balancing != "none" else 0.0}
    if arch == "Qwen3MoeForCausalLM":  # the dense layers: mlp_only_layers (intermediate_size)
        return {**out, "num_experts": experts, "moe_intermediate_size": expert_size, "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i, moe in enumerate(pattern) if not moe],
                "norm_topk_prob": not model.get("moe_router_pre_softmax")}
    if not all(pattern):
        raise ConfigError("model.moe_layer_freq", f"export-hf: {arch} has an MoE block on every layer (moe_layer_freq "
                          "1), this model dense MLPs on some")
    if model.get("moe_router_pre_softmax"):
        raise ConfigError("model.moe_router_pre_softmax", f"export-hf: {arch} renormalises the top-k router "
                          "probabilities (moe_router_pre_softmax false)")
    return {**out, "num_local_experts": experts, "intermediate_size": expert_size, "router_jitter_noise": 0.0}


def hf_config(model: dict, torch_dtype: str = "float32") -> dict:
    """An HF config.json for kubetron's `model:` keys (a dict as `cfg.model.model_dump()` gives)."""
    if model.get("normalization") != "RMSNorm" or model.get("activation") != "swiglu" \
            or model.get("position_embedding_type") != "rope" or model.get("add_bias_linear"):
        raise ConfigError("model", "export-hf needs a Llama-family model: normalization RMSNorm, activation "
                          "swiglu, position_embedding_type rope, add_bias_linear false")
    arch = export_architecture(model)
    window = model.get("sliding_window")
    heads = model["num_attention_heads"]
    out = {
        "architectures": [arch],
        "model_type": SUPPORTED_ARCHITECTURES[arch],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model.get("ffn_hidden_size") or 4 * model["hidden_size"],
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": model.get("num_query_groups") or heads,
        "head_dim": model.get("kv_channels") or model["hidden_size"] // heads,
        "vocab_size": model["vocab_size"],
        "max_position_embeddings": model.get("max_position_embeddings") or model["seq_length"],
        "rms_norm_eps": model["layernorm_epsilon"],
        "hidden_act": "silu",
        "tie_word_embeddings": bool(model["share_embeddings_and_output_weights"]),
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": model.get("init_method_std", 0.02),
        "torch_dtype": torch_dtype,
        "rope_theta": float(model["rotary_base"]),
    }
    if arch in _WINDOW_EVERY_LAYER:
        out["sliding_window"] = window or None
    if arch == "Qwen3ForCausalLM":
        out.update(use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * model["num_layers"])
    if arch in MOE_ARCHITECTURES:
        out.update(_moe_config(model, arch))
    if arch == "Qwen3MoeForCausalLM":
        out.update(use_sliding_window=False, sliding_window=None)
    rope = {"rope_type": "default", "rope_theta": float(model["rotary_base"])}
    if model.get("rope_scaling"):
        llama3 = {k: model[f"rope_scaling_{k}"] for k in _LLAMA3_KEYS}
        out["rope_scaling"] = {"rope_type": "llama3", **llama3}
        rope = {"rope_type": "llama3", "rope_theta": float(model["rotary_base"]), **llama3}
    out["rope_parameters"] = rope  # transformers >= 5 reads this; older ones rope_theta/rope_scaling
    return out
