"""LoRA checkpoints out to Hugging Face: merged weights, or a PEFT adapter directory.

An adapter-only checkpoint (peft.scheme lora) holds, per adapted linear, canonical A (dim x in) and
B (out x dim) under `<linear>.adapter.linear_in.weight` / `.linear_out.weight`; its base is the
checkpoint its common.pt names (`pretrained_checkpoint`: a kubetron checkpoint or an HF directory).
- merge: W' = W + (alpha / dim) * B @ A, computed in fp32, stored in the base weight's dtype
  (kubetron.hf.weights.Merged, tensor by tensor);
- PEFT (`--adapter-only`): adapter_config.json + adapter_model.safetensors under PEFT's names
  (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`, ...). megatron fuses q/k/v and
  gate/up; an adapter on a fused linear is the same as adapters on its parts that share A, with B
  split like the fused weight (convert.py's layout), so the PEFT form is exact. Adapters on MoE experts
  have no PEFT form transformers loads by module name (its experts are fused 3-D parameters): refused,
  the merged export serves them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping

import torch

from kubetron.contract.errors import ConfigError
from kubetron.hf import convert
from kubetron.hf.safetensors_io import write_file, write_files

_A, _B = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention|mlp)\.(linear_\w+)$")
# megatron linear -> the HF modules it covers (PEFT's target_modules)
HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


def adapters(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{canonical linear name: (A, B)} of an adapter-only checkpoint's tensors (only the adapters are read)."""
    return {k[:-len(_A)]: (tensors[k], tensors[k[:-len(_A)] + _B]) for k in tensors if k.endswith(_A)}


def peft_tensors(pairs: dict, m: dict) -> dict[str, torch.Tensor]:
    """PEFT's state dict for the adapters (A shared by the parts of a fused linear, B split)."""
    out = {}
    for linear, (a, b) in pairs.items():
        mt = _LAYER.match(linear)
        if ".mlp.experts." in linear:
            raise ConfigError("--adapter-only", f"adapters on MoE experts ({linear}) have no PEFT form transformers "
                                                "loads: export the merged weights (without --adapter-only)")
        if mt is None:
            raise ConfigError("CKPT", f"adapter on {linear}: not a layer linear export-hf knows")
        i, block, kind = mt.groups()
        prefix = f"base_model.model.model.layers.{i}.{'self_attn' if block == 'self_attention' else 'mlp'}"
        parts: tuple[torch.Tensor, ...]
        if kind == "linear_qkv":
            parts = convert.split_qkv(b, m)
        elif kind == "linear_fc1":
            parts = b.chunk(2, dim=0)
        else:
            parts = (b,)
        for hf, b_part in zip(HF_MODULES[kind], parts, strict=True):
            out[f"{prefix}.{hf}.lora_A.weight"] = a.clone()  # one copy per module (safetensors)
            out[f"{prefix}.{hf}.lora_B.weight"] = b_part.contiguous()
    return out


def peft_config(info: dict, base_name: str) -> dict:
    """adapter_config.json for the checkpoint's `peft` record; `base_name`: the base's HF directory."""
    targets = sorted({hf for t in info["target_modules"] for hf in HF_MODULES[t]})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": info["dim"], "lora_alpha": info["alpha"],
            "lora_dropout": info.get("dropout", 0.0), "target_modules": targets, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
            "base_model_name_or_path": base_name}


def write_peft(out: str, pairs: dict, info: dict, m: dict, base_name: str, files: dict[str, bytes]) -> dict:
    """adapter_model.safetensors, `files` (the tokenizer's, as TRL saves them beside an adapter) and
    adapter_config.json, last."""
    tensors = peft_tensors(pairs, m)  # every check before anything is written
    os.makedirs(out, exist_ok=True)
    if os.path.exists(os.path.join(out, "adapter_config.json")):
        raise ConfigError("OUT", f"{out} already holds an adapter_config.json; give an empty or new directory")
    write_file(os.path.join(out, "adapter_model.safetensors"), tensors)
    write_files(out, files)
    conf = peft_config(info, base_name)
    with open(os.path.join(out, "adapter_config.json"), "w", encoding="utf-8") as f:  # last: marks it complete
        json.dump(conf, f, indent=2)
    return conf
