"""An HF ``config.json`` of the Llama family <-> kubetron's ``model:`` section (plain dicts, no torch).

What the family shares and kubetron's model expresses: RMSNorm, SwiGLU MLP without biases, RoPE
(rotate-half layout, optionally Llama-3 scaling), grouped-query attention, tied or untied output
layer, any head size (`head_dim` -> `model.kv_channels`), Qwen2's bias on the query/key/value
projection only, Qwen3's per-head query/key RMSNorm (`model.qk_layernorm`), and Mistral's sliding
window (`model.sliding_window`; exported as MistralForCausalLM). Anything else (another rope type,
Qwen2/Qwen3's per-layer sliding window, MLP or attention-output biases, another activation, another
architecture) is an error naming the config.json field: converting it silently would give a
different model.
"""

from __future__ import annotations

import json
import os

from kubetron.errors import ConfigError

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def is_hf_dir(path: str | None) -> bool:
    """A local directory holding an HF model: config.json and at least one *.safetensors file."""
    if not path or str(path).startswith("s3://") or not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return "config.json" in names and any(n.endswith(".safetensors") for n in names)


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
    """Mistral's window (every layer; HF: key j is seen from query i when i - j < window). Qwen2's and
    Qwen3's are on some layers only (use_sliding_window, max_window_layers; layer_types): refused."""
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        name = arch.removesuffix("ForCausalLM")
        if hf.get("use_sliding_window"):
            raise ConfigError("config.json: use_sliding_window", f"{name}'s sliding window (on the layers from "
                              "max_window_layers on) is not supported")
        if "sliding_attention" in (hf.get("layer_types") or []):
            raise ConfigError("config.json: layer_types", f"{name}'s sliding_attention layers are not supported")
    if arch == "MistralForCausalLM" and hf.get("sliding_window"):
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
    m = {
        "num_layers": int(_require(hf, "num_hidden_layers")),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": int(hf.get("num_key_value_heads") or heads),
        "kv_channels": head_dim if head_dim * heads != hidden else None,
        "qk_layernorm": arch == "Qwen3ForCausalLM",
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
    return m


def _export_architecture(model: dict) -> str:
    """The one HF architecture that has this model's attention: Qwen3 (q/k norms), Qwen2 (q/k/v
    biases), Mistral (a sliding window) or Llama; a combination none of them has is refused."""
    features = {"Qwen3ForCausalLM": ("model.qk_layernorm", model.get("qk_layernorm")),
                "Qwen2ForCausalLM": ("model.add_qkv_bias", model.get("add_qkv_bias")),
                "MistralForCausalLM": ("model.sliding_window", model.get("sliding_window"))}
    on = [(arch, key) for arch, (key, value) in features.items() if value]
    if len(on) > 1:
        raise ConfigError(on[1][1], f"export-hf has no architecture with both {on[0][1]} and {on[1][1]}")
    return on[0][0] if on else "LlamaForCausalLM"


def hf_config(model: dict, torch_dtype: str = "float32") -> dict:
    """An HF config.json for kubetron's `model:` keys (a dict as `cfg.model.model_dump()` gives)."""
    if model.get("normalization") != "RMSNorm" or model.get("activation") != "swiglu" \
            or model.get("position_embedding_type") != "rope" or model.get("add_bias_linear"):
        raise ConfigError("model", "export-hf needs a Llama-family model: normalization RMSNorm, activation "
                          "swiglu, position_embedding_type rope, add_bias_linear false")
    arch = _export_architecture(model)
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
    if arch == "MistralForCausalLM":
        out["sliding_window"] = window or None
    if arch == "Qwen3ForCausalLM":
        out.update(use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * model["num_layers"])
    rope = {"rope_type": "default", "rope_theta": float(model["rotary_base"])}
    if model.get("rope_scaling"):
        llama3 = {k: model[f"rope_scaling_{k}"] for k in _LLAMA3_KEYS}
        out["rope_scaling"] = {"rope_type": "llama3", **llama3}
        rope = {"rope_type": "llama3", "rope_theta": float(model["rotary_base"]), **llama3}
    out["rope_parameters"] = rope  # transformers >= 5 reads this; older ones rope_theta/rope_scaling
    return out
